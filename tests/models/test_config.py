"""ModelConfig: every family's config.json read into one set of fields."""
import re

import pytest
import torch

from moelora.core import TopKConfig
from moelora.layers.moe.runner import Runner
from moelora.lora.model_shapes import load_model_shapes
from moelora.models.config import ModelConfig
from moelora.models.loader import build_model
from tests.models.families import FAMILIES, family_config


@pytest.mark.parametrize("family", FAMILIES)
def test_the_model_and_the_adapter_checker_read_the_config_alike(family):
    """lora/model_shapes.py reads config.json for checking adapters, ModelConfig for building models: they
    must agree on the experts, their width and which layers are MoE."""
    hf = family_config(family)
    config, shapes = ModelConfig.from_hf(hf), load_model_shapes(hf)
    assert (config.num_experts, config.moe_intermediate_size, config.moe_layers, config.num_layers) == \
        (shapes.num_experts, shapes.moe_intermediate_size, shapes.moe_layers, shapes.num_layers)
    assert config.hidden_size == shapes.hidden_size and config.vocab_size == hf.vocab_size


def test_family_field_names_are_normalised():
    mixtral = ModelConfig.from_hf(family_config("mixtral"))
    assert mixtral.num_experts == 8 and mixtral.moe_intermediate_size == 40 and mixtral.topk == TopKConfig(2, True)
    qwen2 = ModelConfig.from_hf(family_config("qwen2_moe"))
    assert qwen2.moe_layers == {1, 3} and qwen2.shared_expert_intermediate_size == 44 and qwen2.qkv_bias
    v2, v3 = ModelConfig.from_hf(family_config("deepseek_v2")), ModelConfig.from_hf(family_config("deepseek_v3"))
    assert v2.topk == TopKConfig(3, False, "softmax", 4, 2, 1.5) and not v2.correction_bias
    assert v3.topk == TopKConfig(3, True, "sigmoid", 4, 2, 2.5) and v3.correction_bias
    assert v3.shared_expert_intermediate_size == 24 and v3.mla.q_lora_rank == 20 and v2.mla.q_lora_rank is None
    assert ModelConfig.from_hf(family_config("olmoe")).clip_qkv == 1.5


def test_unknown_family_and_the_moe_backend_option():
    hf = family_config("qwen3_moe")
    model = build_model(ModelConfig.from_hf(hf, moe_backend="torch"), torch.float32, "meta")
    assert {m.backend for m in model.modules() if isinstance(m, Runner)} == {"torch"}
    hf.model_type = "llama"
    with pytest.raises(ValueError, match="model_type 'llama' is not served"):
        ModelConfig.from_hf(hf)


@pytest.mark.parametrize("family, field, value, message", [
    ("qwen2_moe", "shared_expert_intermediate_size", -5, "shared_expert_intermediate_size must be an int >= 0, got -5"),
    ("deepseek_v3", "n_shared_experts", -1, "n_shared_experts must be an int >= 0, got -1"),
    ("deepseek_v3", "qk_rope_head_dim", 3, "qk_rope_head_dim must be even (rotary embedding turns pairs of "
                                           "dimensions)"),
    ("deepseek_v2", "routed_scaling_factor", float("nan"),
     "routed_scaling_factor must be a finite number > 0, got nan"),
    ("olmoe", "clip_qkv", 0.0, "clip_qkv must be a finite number > 0, got 0.0"),
])
def test_family_fields_that_cannot_be_a_model(family, field, value, message):
    """Each once sized a tensor below zero, failed every request at its first step, or made every logit NaN."""
    hf = family_config(family)
    setattr(hf, field, value)
    with pytest.raises(ValueError, match=re.escape(message)):
        ModelConfig.from_hf(hf)


def test_yarn_needs_its_original_context_length():
    hf = family_config("deepseek_v3")
    hf.rope_parameters = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}
    with pytest.raises(ValueError, match="rope_parameters.original_max_position_embeddings must be an int >= 1"):
        ModelConfig.from_hf(hf)
