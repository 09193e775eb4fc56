"""Tiny transformers checkpoints of every served family (a few layers, hidden 64, non-power-of-two
intermediate sizes) and their reference logits, for comparing our models with transformers."""
from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn
from transformers import PretrainedConfig
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from tests.support import tiny_config, tiny_model

_SHAPE = dict(vocab_size=96, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
              initializer_range=0.1)  # weights large enough that routing and logits are far from uniform
OVERRIDES = {
    "qwen3_moe": dict(num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=3, moe_intermediate_size=24,
                      intermediate_size=40, mlp_only_layers=[1], norm_topk_prob=True),
    "qwen2_moe": dict(num_hidden_layers=4, num_key_value_heads=2, num_experts=6, num_experts_per_tok=2,
                      moe_intermediate_size=20, intermediate_size=36, shared_expert_intermediate_size=44,
                      decoder_sparse_step=2),  # layers 1 and 3 sparse; norm_topk_prob off
    "mixtral": dict(num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2, intermediate_size=40),
    "olmoe": dict(num_key_value_heads=4, num_experts=8, num_experts_per_tok=3, intermediate_size=40,
                  clip_qkv=1.5),  # clips a few q/k/v values
    "deepseek_v2": dict(num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=24, qk_nope_head_dim=12, qk_rope_head_dim=8,
                        v_head_dim=12, n_routed_experts=8, num_experts_per_tok=3, n_shared_experts=2, moe_intermediate_size=24,
                        intermediate_size=40, first_k_dense_replace=1, topk_method="group_limited_greedy", n_group=4,
                        topk_group=2, routed_scaling_factor=1.5, max_position_embeddings=128,
                        rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=32,
                                             mscale=0.707, mscale_all_dim=0.707, beta_fast=32, beta_slow=1)),
    "deepseek_v3": dict(num_key_value_heads=4, q_lora_rank=20, kv_lora_rank=24, qk_nope_head_dim=12, qk_rope_head_dim=8,
                        v_head_dim=12, n_routed_experts=8, num_experts_per_tok=3, n_shared_experts=1, moe_intermediate_size=24,
                        intermediate_size=40, first_k_dense_replace=1, n_group=4, topk_group=2, norm_topk_prob=True,
                        routed_scaling_factor=2.5, max_position_embeddings=128,
                        rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=40.0, original_max_position_embeddings=32,
                                             mscale=1.0, mscale_all_dim=0.8, beta_fast=32, beta_slow=1)),
}
FAMILIES = tuple(OVERRIDES)


def family_config(family: str, **overrides) -> PretrainedConfig:
    config = tiny_config(family, **{**_SHAPE, **OVERRIDES[family], **overrides})
    config.architectures = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config.model_type]]  # as save_pretrained writes it
    return config


def hf_model(config: PretrainedConfig) -> nn.Module:
    """The fp32 transformers model every test of `config` compares with (same weights each call)."""
    model = tiny_model(config, seed=0)
    with torch.no_grad():
        for module in model.modules():
            if hasattr(module, "e_score_correction_bias"):  # zero at init: make it change the choice of experts
                module.e_score_correction_bias.normal_(0.0, 0.1)
    return model


def with_deltas(model: nn.Module, deltas: dict[str, torch.Tensor]) -> nn.Module:
    """`model` with merged LoRA deltas (from moelora.testing.peft_adapter) added to its weights."""
    state = model.state_dict()
    model.load_state_dict({k: v + deltas[k] if k in deltas else v for k, v in state.items()})
    return model


@torch.no_grad()
def hf_logits(model: nn.Module, sequences: list[list[int]]) -> list[torch.Tensor]:
    return [model(torch.tensor([seq])).logits[0].float() for seq in sequences]


def assert_logprobs_close(got: torch.Tensor, want: torch.Tensor, what: str, atol: float = 1e-4) -> None:
    err = (got.log_softmax(-1) - want.log_softmax(-1)).abs().max().item()
    assert err <= atol, f"{what}: log-probs differ by up to {err:.2e} (> {atol:.0e})"


TOP = 5  # log-probs compared at the reference's most likely tokens of each position
# Share of positions allowed past the rounding tolerance: where two experts' router scores nearly
# tie, bf16 rounding can pick the other one for a token, an O(1) change of that layer's output that
# no rounding bound covers (and that reaches later positions through attention). The CPU engine in
# bf16 shows it at up to 1 position in 10 on these models; another adapter's log-probs are off everywhere.
MAX_OFF = 0.25


def bf16_tolerance(reference: list[torch.Tensor], num_layers: int, ulps_per_layer: float = 4) -> float:
    """The largest log-prob error that bf16 rounding explains. Each layer adds to the residual stream
    a few values rounded to bf16 (the normed inputs and outputs of attention and of the MoE block),
    each off by up to one ulp, 2^-8 of its size: about 4 ulps per layer (`ulps_per_layer`: more where
    a run rounds more, or where two bf16 runs are compared). Rounding errors of different
    layers are independent and add like a random walk, so the final hidden state is off by
    ulps_per_layer * 2^-8 * sqrt(L) of its size, and the logits by that share of their scale (the largest
    |logit - mean logit| of the reference). A log-prob is a logit minus the log-sum-exp; both move,
    hence twice that. The CPU engine in bf16 is off by a tenth of it at the median position (0.5-2
    ulps of the logits' scale), another adapter's log-probs by 7-20 times it."""
    scale = max((r - r.mean(-1, keepdim=True)).abs().max().item() for r in reference)
    return 2 * ulps_per_layer * 2.0**-8 * math.sqrt(num_layers) * scale


def share_off(got: list[torch.Tensor], want: list[torch.Tensor], tol: float) -> float:
    """Share of positions where a log-prob of one of want's TOP tokens is off by more than tol."""
    errors = []
    for g, w in zip(got, want):
        top = w.topk(TOP, dim=-1).indices
        errors.append((g.gather(1, top) - w.gather(1, top)).abs().amax(-1))
    return (torch.cat(errors) > tol).float().mean().item()


def per_expert_layout(state: dict[str, torch.Tensor], mixtral_names: bool = False) -> dict[str, torch.Tensor]:
    """transformers v5 state dict (experts fused as gate_up_proj / down_proj) -> the hub's per-expert
    tensors (`mlp.experts.<e>.gate_proj.weight`, Mixtral `block_sparse_moe.experts.<e>.w1.weight`)."""
    gate, up, down = ("w1", "w3", "w2") if mixtral_names else ("gate_proj", "up_proj", "down_proj")
    out = {}
    for name, t in state.items():
        moe = name.replace(".mlp.", ".block_sparse_moe.") if mixtral_names and ".mlp." in name else name
        if name.endswith(".mlp.experts.gate_up_proj"):
            prefix, inter = moe.removesuffix("gate_up_proj"), t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{prefix}{e}.{gate}.weight"], out[f"{prefix}{e}.{up}.weight"] = t[e, :inter], t[e, inter:]
        elif name.endswith(".mlp.experts.down_proj"):
            for e in range(t.shape[0]):
                out[f"{moe.removesuffix('down_proj')}{e}.{down}.weight"] = t[e]
        else:
            out[moe] = t
    return out


def write_sharded(state: dict[str, torch.Tensor], config: PretrainedConfig, path: Path, num_shards: int = 3) -> Path:
    """config.json + model-0000i-of-0000n.safetensors + model.safetensors.index.json, as the hub shards."""
    config.save_pretrained(path)
    names = sorted(state)
    weight_map = {}
    for i in range(num_shards):
        file = f"model-{i + 1:05d}-of-{num_shards:05d}.safetensors"
        part = names[i::num_shards]
        save_file({k: state[k].contiguous() for k in part}, path / file)
        weight_map.update(dict.fromkeys(part, file))
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return path
