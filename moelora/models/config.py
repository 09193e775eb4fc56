"""ModelConfig: a checkpoint's config.json read once, every family's field names normalised to one.

The families name the same things differently (num_experts / num_local_experts / n_routed_experts; the
experts' width as moe_intermediate_size or intermediate_size; which layers are MoE by mlp_only_layers and
decoder_sparse_step, first_k_dense_replace, or all of them; routing by norm_topk_prob, topk_method, n_group,
scoring_func...). `ModelConfig.from_hf` reads each family's names in one place, so model files, the loader
and the engine read one set of fields and never a transformers config.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, PretrainedConfig

from moelora.core import TopKConfig


@dataclass(frozen=True)
class MLAConfig:
    """DeepSeek's multi-head latent attention: q directly (q_lora_rank None) or through a bottleneck; keys
    and values from one latent of kv_lora_rank plus a rotary key part shared by all heads."""
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool


@dataclass(frozen=True)
class ModelConfig:
    architectures: tuple[str, ...]
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    max_position_embeddings: int
    rope_parameters: dict[str, Any]
    hidden_act: str
    sliding_window: int | None
    saved_dtype: torch.dtype | None  # the checkpoint's dtype (config.json "dtype" / "torch_dtype"), if named
    # attention (grouped-query; DeepSeek's MLA in `mla`)
    num_heads: int
    num_kv_heads: int
    head_dim: int
    qkv_bias: bool
    o_bias: bool
    clip_qkv: float | None  # OLMoE: q, k, v clamped to [-clip_qkv, clip_qkv]
    mla: MLAConfig | None
    # dense MLP layers (those not in moe_layers)
    intermediate_size: int
    # routed experts
    num_experts: int
    moe_intermediate_size: int
    moe_layers: frozenset[int]
    topk: TopKConfig
    correction_bias: bool  # DeepSeek-V3's e_score_correction_bias
    shared_expert_intermediate_size: int  # 0: no shared experts
    # how the routed experts run (a serving option, not the checkpoint's): see layers/moe/runner.py
    moe_backend: str = "auto"

    @classmethod
    def from_pretrained(cls, model_path: str | Path, **options: Any) -> ModelConfig:
        return cls.from_hf(AutoConfig.from_pretrained(model_path), **options)

    @classmethod
    def from_hf(cls, hf: PretrainedConfig, **options: Any) -> ModelConfig:
        """options: the serving options (moe_backend)."""
        family = _FAMILIES.get(hf.model_type)
        if family is None:
            raise ValueError(f"model_type {hf.model_type!r} is not served (supported: {', '.join(sorted(_FAMILIES))})")
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        common = dict(
            architectures=tuple(hf.architectures or ()), model_type=hf.model_type, vocab_size=hf.vocab_size,
            hidden_size=hf.hidden_size, num_layers=hf.num_hidden_layers, rms_norm_eps=hf.rms_norm_eps,
            tie_word_embeddings=bool(hf.tie_word_embeddings), max_position_embeddings=hf.max_position_embeddings,
            rope_parameters=hf.rope_parameters, hidden_act=hf.hidden_act,
            sliding_window=getattr(hf, "sliding_window", None), saved_dtype=_saved_dtype(hf),
            num_heads=hf.num_attention_heads, num_kv_heads=getattr(hf, "num_key_value_heads", hf.num_attention_heads),
            head_dim=head_dim, qkv_bias=bool(getattr(hf, "attention_bias", False)),
            o_bias=bool(getattr(hf, "attention_bias", False)), clip_qkv=None, mla=None,
            intermediate_size=hf.intermediate_size, correction_bias=False, shared_expert_intermediate_size=0)
        return replace(cls(**{**common, **family(hf)}), **options)


def _saved_dtype(hf: PretrainedConfig) -> torch.dtype | None:
    saved = getattr(hf, "dtype", None) or getattr(hf, "torch_dtype", None)
    return getattr(torch, saved) if isinstance(saved, str) else saved


def _qwen_moe(hf: PretrainedConfig) -> dict[str, Any]:
    """Qwen2-MoE and Qwen3-MoE: MoE layers except those in mlp_only_layers or off the decoder_sparse_step grid;
    Qwen2-MoE adds a gated shared expert and (transformers before v5 had no qkv_bias field) q/k/v biases."""
    fields = dict(num_experts=hf.num_experts, moe_intermediate_size=hf.moe_intermediate_size,
                  moe_layers=frozenset(i for i in range(hf.num_hidden_layers)
                                       if i not in (hf.mlp_only_layers or []) and hf.num_experts > 0
                                       and (i + 1) % hf.decoder_sparse_step == 0),
                  topk=TopKConfig(top_k=hf.num_experts_per_tok, renormalize=hf.norm_topk_prob))
    if hf.model_type == "qwen2_moe":
        fields.update(qkv_bias=getattr(hf, "qkv_bias", True), o_bias=False,
                      shared_expert_intermediate_size=hf.shared_expert_intermediate_size)
    return fields


def _mixtral(hf: PretrainedConfig) -> dict[str, Any]:
    """Every layer MoE; intermediate_size is the expert's; the top-k weights always renormalised."""
    return dict(num_experts=hf.num_local_experts, moe_intermediate_size=hf.intermediate_size,
                moe_layers=frozenset(range(hf.num_hidden_layers)),
                topk=TopKConfig(top_k=hf.num_experts_per_tok, renormalize=True))


def _olmoe(hf: PretrainedConfig) -> dict[str, Any]:
    return dict(num_experts=hf.num_experts, moe_intermediate_size=hf.intermediate_size,
                moe_layers=frozenset(range(hf.num_hidden_layers)), clip_qkv=hf.clip_qkv,
                topk=TopKConfig(top_k=hf.num_experts_per_tok, renormalize=hf.norm_topk_prob))


def _deepseek(hf: PretrainedConfig) -> dict[str, Any]:
    """The first first_k_dense_replace layers dense. Routing: V2 softmax (grouped for topk_method
    "group_limited_greedy"); V3 sigmoid with e_score_correction_bias and groups scored by their two best
    experts. Both multiply the weights by routed_scaling_factor."""
    v3 = hf.model_type == "deepseek_v3"
    grouped = v3 or hf.topk_method == "group_limited_greedy"
    topk = TopKConfig(top_k=hf.num_experts_per_tok, renormalize=bool(hf.norm_topk_prob),
                      scoring="sigmoid" if v3 else "softmax", num_expert_group=hf.n_group if grouped else None,
                      topk_group=hf.topk_group if grouped else None, routed_scaling_factor=hf.routed_scaling_factor)
    mla = MLAConfig(hf.q_lora_rank, hf.kv_lora_rank, hf.qk_nope_head_dim, hf.qk_rope_head_dim, hf.v_head_dim,
                    rope_interleave=getattr(hf, "rope_interleave", True))  # V2: always interleaved
    return dict(num_experts=hf.n_routed_experts, moe_intermediate_size=hf.moe_intermediate_size,
                moe_layers=frozenset(range(hf.first_k_dense_replace, hf.num_hidden_layers)), topk=topk,
                correction_bias=v3, mla=mla,
                shared_expert_intermediate_size=hf.moe_intermediate_size * (hf.n_shared_experts or 0))


_FAMILIES = {"qwen3_moe": _qwen_moe, "qwen2_moe": _qwen_moe, "mixtral": _mixtral, "olmoe": _olmoe,
             "deepseek_v2": _deepseek, "deepseek_v3": _deepseek}
