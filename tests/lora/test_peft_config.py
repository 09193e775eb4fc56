"""Every field of the installed PEFT's LoraConfig is decided: served as PEFT computes it, of no effect on what the
adapter computes, or refused with an error naming the field; a field at PEFT's default always loads."""
import dataclasses
from pathlib import Path

import pytest
from peft import LoraConfig

from lora_builders import assert_deltas_equal, canonical_deltas, edit_config, peft_adapter, tiny_config, tiny_model
from moelora.lora import AdapterError, load_adapter

# Read and applied as PEFT does: r, lora_alpha (their defaults), fan_in_fan_out, velora_config, monteclora_config
# and the patterns in test_peft_formats.py, the module choice below; peft_type must be LORA (test_adapter_validation)
# and peft_version decides the orientation of 3D experts where their shapes do not (test_hand_formats).
SERVED = {"r", "lora_alpha", "use_rslora", "rank_pattern", "alpha_pattern", "target_modules", "target_parameters",
          "exclude_modules", "layers_to_transform", "layers_pattern", "fan_in_fan_out", "velora_config",
          "monteclora_config", "peft_type", "peft_version"}

# Of no effect on what the adapter computes (metadata, training, initializations that leave the base weights alone,
# options of refused features), each with a value other than its default
NO_EFFECT = {
    "task_type": "CAUSAL_LM", "auto_mapping": {"base_model_class": "Qwen3MoeForCausalLM"},
    "base_model_name_or_path": "Qwen/Qwen3-30B-A3B", "revision": "main", "inference_mode": False,
    "lora_dropout": 0.1,
    "bias": "all",  # the base biases it trains are saved with the adapter and refused as tensors (test_peft_formats)
    "eva_config": {"rho": 1.0}, "corda_config": {"corda_method": "kpm"}, "lora_ga_config": {"direction": "ArBr"},
    "loftq_config": {"loftq_bits": 4},  # PEFT drops it but with init_lora_weights='loftq', which is refused
    "qalora_group_size": 32,  # read only with use_qalora, which is refused
    "megatron_config": {"tensor_model_parallel_size": 2}, "megatron_core": "my_megatron.core",  # Megatron's layers
    "runtime_config": {"ephemeral_gpu_offload": True},  # not saved by PEFT
    "ensure_weight_tying": True,  # ties adapters of tied embed_tokens / lm_head, which are refused
}

# Refused (moelora/lora/config.py), each with a value that turns it on
REFUSED = {
    "use_dora": True, "lora_bias": True, "modules_to_save": ["lm_head"], "trainable_token_indices": [3, 5],
    "alora_invocation_tokens": [3, 5], "layer_replication": [[0, 2], [1, 2]],
    "init_lora_weights": "pissa",  # only initializations that change the base weights: see test_adapter_validation
    "use_qalora": True, "use_bdlora": {"target_modules_bd_a": ["q_proj"], "nblocks": 2}, "kasa_config": {},
    "arrow_config": {"top_k": 2},
}

PEFT_FIELDS = {f.name: f for f in dataclasses.fields(LoraConfig)}


def test_every_lora_config_field_is_decided():
    """A PEFT upgrade that adds a field fails here until the field is decided above (and refused in config.py if
    it changes what the adapter computes)."""
    decided = [*SERVED, *NO_EFFECT, *REFUSED]
    assert len(decided) == len(set(decided)), "a field is decided twice"
    assert set(PEFT_FIELDS) - set(decided) == set(), "fields of LoraConfig not decided"
    assert set(decided) - set(PEFT_FIELDS) == set(), "decided fields LoraConfig no longer has"


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """A PEFT adapter on attention and the fused experts, and what its merge adds to each weight."""
    path = tmp_path_factory.mktemp("plain")
    config = tiny_config("qwen3_moe")
    expected = peft_adapter(tiny_model(config), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"],
                                                           target_parameters=["mlp.experts.gate_up_proj"]), path)
    return path, config, expected


def _copy(plain: tuple, tmp_path: Path, **fields) -> Path:
    """The plain adapter in tmp_path with `fields` set in its adapter_config.json."""
    path, _, _ = plain
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        (tmp_path / name).write_bytes((path / name).read_bytes())
    edit_config(tmp_path, **fields)
    return tmp_path


@pytest.mark.parametrize("field", sorted(REFUSED))
def test_refused_field_is_named(field, plain, tmp_path):
    with pytest.raises(AdapterError) as e:
        load_adapter(_copy(plain, tmp_path, **{field: REFUSED[field]}), plain[1])
    assert f"adapter_config.json: not served: {field}" in str(e.value), str(e.value)


@pytest.mark.parametrize("field", sorted(REFUSED))
def test_refused_field_at_peft_default_loads(field, plain, tmp_path):
    """use_dora: false, use_bdlora: null, ... as PEFT writes them into every adapter_config.json."""
    spec = PEFT_FIELDS[field]
    default = spec.default_factory() if spec.default is dataclasses.MISSING else spec.default
    adapter = load_adapter(_copy(plain, tmp_path, **{field: default}), plain[1])
    assert_deltas_equal(canonical_deltas(adapter), plain[2])


@pytest.mark.parametrize("field", sorted(NO_EFFECT))
def test_field_of_no_effect_loads(field, plain, tmp_path):
    adapter = load_adapter(_copy(plain, tmp_path, **{field: NO_EFFECT[field]}), plain[1])
    assert_deltas_equal(canonical_deltas(adapter), plain[2])


def test_module_choice(tmp_path):
    """exclude_modules, layers_to_transform and layers_pattern choose the modules PEFT adapts: the file holds
    exactly those, and their deltas are PEFT's."""
    config = tiny_config("qwen3_moe")
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj"], layers_to_transform=[1],
                      layers_pattern="layers", exclude_modules=["model.layers.1.self_attn.k_proj"])
    expected = peft_adapter(tiny_model(config), lora, tmp_path)
    adapter = load_adapter(tmp_path, config)
    assert_deltas_equal(canonical_deltas(adapter), expected)
    assert {layer: sorted(lora.modules) for layer, lora in adapter.layers.items()} == {
        1: ["self_attn.q_proj", "self_attn.v_proj"]}
