"""ModelConfig: a checkpoint's config.json read once, every family's field names normalised to one.

The families name the same things differently (num_experts / num_local_experts / n_routed_experts; the
experts' width as moe_intermediate_size or intermediate_size; which layers are MoE by mlp_only_layers and
decoder_sparse_step, first_k_dense_replace, or all of them; routing by norm_topk_prob, topk_method, n_group,
scoring_func...). `ModelConfig.from_hf` reads each family's names in one place, so model files, the loader
and the engine read one set of fields and never a transformers config.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, PretrainedConfig

from moelora.core import TopKConfig
from moelora.layers.rotary import ROPE_TYPES


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
        """ValueError naming config.json and its field where transformers cannot read it or its values cannot be a
        model (transformers' own errors of such values are of several types, some of them its libraries')."""
        where = Path(model_path) / "config.json"
        try:
            hf = AutoConfig.from_pretrained(model_path)
        except OSError:
            raise
        except Exception as e:
            raise ValueError(f"{where}: {_dtype_problem(where) or e}") from None
        try:
            return cls.from_hf(hf, **options)
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None

    @classmethod
    def from_hf(cls, hf: PretrainedConfig, **options: Any) -> ModelConfig:
        """options: the serving options (moe_backend). ValueError names the field whose value cannot be a model."""
        family = _FAMILIES.get(hf.model_type)
        if family is None:
            raise ValueError(f"model_type {hf.model_type!r} is not served (supported: {', '.join(sorted(_FAMILIES))})")
        _check_common(hf)
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
        config = replace(cls(**{**common, **family(hf)}), **options)
        _check_experts(config)
        return config


def _positive(hf: PretrainedConfig, *names: str, least: int = 1) -> None:
    for name in names:
        value = getattr(hf, name, None)
        if not isinstance(value, int) or isinstance(value, bool) or value < least:
            raise ValueError(f"{name} must be an int >= {least}, got {value!r}")


def _finite(value: Any, name: str, above: float = 0.0) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value <= above:
        raise ValueError(f"{name} must be a finite number > {above:g}, got {value!r}")


def _check_common(hf: PretrainedConfig) -> None:
    """The fields every family reads, before anything divides by them or sizes a tensor with them."""
    quantization = getattr(hf, "quantization_config", None)
    if quantization:
        method = quantization.get("quant_method") if isinstance(quantization, dict) else quantization
        raise ValueError(f"quantization_config (quant_method {method!r}): quantized checkpoints are not served")
    if not isinstance(hf.architectures or [], (list, tuple)):
        raise ValueError(f"architectures must be a list of class names, got {hf.architectures!r}")
    _positive(hf, "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")
    _positive(hf, "max_position_embeddings", least=2)  # a prompt token and one to generate
    for name in ("num_key_value_heads", "head_dim"):
        if getattr(hf, name, None) is not None:
            _positive(hf, name)
    kv_heads = getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads
    if hf.num_attention_heads % kv_heads:
        raise ValueError(f"num_attention_heads ({hf.num_attention_heads}) must be a multiple of num_key_value_heads "
                         f"({kv_heads})")
    _finite(hf.rms_norm_eps, "rms_norm_eps")
    _check_rope(hf.rope_parameters)
    _saved_dtype(hf)


def _check_rope(rope: Any) -> None:
    """The rope_parameters layers/rotary.py reads (a zero or negative theta or factor makes every logit NaN)."""
    if not isinstance(rope, dict):
        raise ValueError(f"rope_parameters must be an object, got {rope!r}")
    _finite(rope.get("rope_theta"), "rope_parameters.rope_theta")
    rope_type = rope.get("rope_type", "default")
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"rope_parameters.rope_type {rope_type!r} is not supported ({', '.join(ROPE_TYPES)})")
    if rope_type == "linear":
        _finite(rope.get("factor"), "rope_parameters.factor")
    if rope_type != "yarn":
        return
    original = rope.get("original_max_position_embeddings")
    if not isinstance(original, int) or isinstance(original, bool) or original < 1:
        raise ValueError(f"rope_parameters.original_max_position_embeddings must be an int >= 1, got {original!r}")
    for name in ("factor", "attention_factor", "mscale", "mscale_all_dim", "beta_fast", "beta_slow"):
        if rope.get(name) is not None:
            _finite(rope[name], f"rope_parameters.{name}")


def _check_experts(config: ModelConfig) -> None:
    """The routed experts and their routing: what every MoE layer's TopK and Runner take as given."""
    if not config.moe_layers:
        return
    for name in ("num_experts", "moe_intermediate_size"):
        if not isinstance(getattr(config, name), int) or getattr(config, name) < 1:
            raise ValueError(f"the routed experts' {name} must be >= 1 where layers are MoE, got {getattr(config, name)}")
    topk, experts = config.topk, config.num_experts
    if not isinstance(topk.top_k, int) or not 1 <= topk.top_k <= experts:
        raise ValueError(f"num_experts_per_tok must be in [1, {experts}] (the routed experts), got {topk.top_k!r}")
    groups = topk.num_expert_group
    if groups is not None:
        if not isinstance(groups, int) or groups < 1 or experts % groups:
            raise ValueError(f"n_group must divide the {experts} routed experts, got {groups!r}")
        if not isinstance(topk.topk_group, int) or not 1 <= topk.topk_group <= groups:
            raise ValueError(f"topk_group must be in [1, n_group={groups}], got {topk.topk_group!r}")
        if topk.top_k > topk.topk_group * (experts // groups):
            raise ValueError(f"num_experts_per_tok ({topk.top_k}) must be at most the experts of topk_group "
                             f"({topk.topk_group}) groups of {experts // groups}")


def _saved_dtype(hf: PretrainedConfig) -> torch.dtype | None:
    saved = getattr(hf, "dtype", None) or getattr(hf, "torch_dtype", None)
    return None if saved is None else _floating_dtype(saved)


def _floating_dtype(saved: Any) -> torch.dtype:
    dtype = getattr(torch, saved, None) if isinstance(saved, str) else saved
    if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ValueError(f"dtype (torch_dtype) must name a floating-point torch dtype, got {saved!r}")
    return dtype


def _dtype_problem(where: Path) -> str | None:
    """What is wrong with config.json's dtype, where transformers could not read the file: its error of a dtype
    torch does not have ("module 'torch' has no attribute 'foo'") names neither the field nor the value."""
    try:
        raw = json.loads(where.read_text())
    except (OSError, ValueError):
        return None
    for field in ("dtype", "torch_dtype"):
        if isinstance(raw, dict) and raw.get(field) is not None:
            try:
                _floating_dtype(raw[field])
            except ValueError as e:
                return str(e)
    return None


def _qwen_moe(hf: PretrainedConfig) -> dict[str, Any]:
    """Qwen2-MoE and Qwen3-MoE: MoE layers except those in mlp_only_layers or off the decoder_sparse_step grid;
    Qwen2-MoE adds a gated shared expert and (transformers before v5 had no qkv_bias field) q/k/v biases."""
    _positive(hf, "decoder_sparse_step")
    fields = dict(num_experts=hf.num_experts, moe_intermediate_size=hf.moe_intermediate_size,
                  moe_layers=frozenset(i for i in range(hf.num_hidden_layers)
                                       if i not in (hf.mlp_only_layers or []) and hf.num_experts > 0
                                       and (i + 1) % hf.decoder_sparse_step == 0),
                  topk=TopKConfig(top_k=hf.num_experts_per_tok, renormalize=hf.norm_topk_prob))
    if hf.model_type == "qwen2_moe":
        _positive(hf, "shared_expert_intermediate_size", least=0)
        fields.update(qkv_bias=getattr(hf, "qkv_bias", True), o_bias=False,
                      shared_expert_intermediate_size=hf.shared_expert_intermediate_size)
    return fields


def _mixtral(hf: PretrainedConfig) -> dict[str, Any]:
    """Every layer MoE; intermediate_size is the expert's; the top-k weights always renormalised."""
    return dict(num_experts=hf.num_local_experts, moe_intermediate_size=hf.intermediate_size,
                moe_layers=frozenset(range(hf.num_hidden_layers)),
                topk=TopKConfig(top_k=hf.num_experts_per_tok, renormalize=True))


def _olmoe(hf: PretrainedConfig) -> dict[str, Any]:
    if hf.clip_qkv is not None:
        _finite(hf.clip_qkv, "clip_qkv")
    return dict(num_experts=hf.num_experts, moe_intermediate_size=hf.intermediate_size,
                moe_layers=frozenset(range(hf.num_hidden_layers)), clip_qkv=hf.clip_qkv,
                topk=TopKConfig(top_k=hf.num_experts_per_tok, renormalize=hf.norm_topk_prob))


def _deepseek(hf: PretrainedConfig) -> dict[str, Any]:
    """The first first_k_dense_replace layers dense. Routing: V2 softmax (grouped for topk_method
    "group_limited_greedy"); V3 sigmoid with e_score_correction_bias and groups scored by their two best
    experts. Both multiply the weights by routed_scaling_factor."""
    _positive(hf, "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
    _positive(hf, "first_k_dense_replace", least=0)
    if hf.q_lora_rank is not None:
        _positive(hf, "q_lora_rank")
    if hf.qk_rope_head_dim % 2:
        raise ValueError(f"qk_rope_head_dim must be even (rotary embedding turns pairs of dimensions), got "
                         f"{hf.qk_rope_head_dim}")
    if hf.n_shared_experts is not None:
        _positive(hf, "n_shared_experts", least=0)
    _finite(hf.routed_scaling_factor, "routed_scaling_factor")
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
