"""What a base model's config says each LoRA-able module looks like: (in, out) of every linear
projection per decoder layer, and the routed experts' shapes. Module names follow transformers
v5 (`mlp.experts` fused, `mlp.gate` router), relative to the decoder layer."""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from transformers import AutoConfig, PretrainedConfig

from moelora.lora.errors import AdapterError, missing_file

EXPERT_PROJECTIONS = ("gate", "up", "down")

# Adapters trained on implementations with fused projections: one A, B rows split over the parts.
FUSED_MODULES = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


@dataclass(frozen=True)
class ModelShapes:
    model_type: str
    num_layers: int
    hidden_size: int
    num_experts: int
    moe_intermediate_size: int
    moe_layers: frozenset[int]
    modules: tuple[dict[str, tuple[int, int]], ...]  # per layer: module name -> (in_features, out_features)
    vocab_size: int  # rows of the embedding: token ids an adapter's added_tokens.json may use
    # the served tokenizer's added (special) tokens, content -> id, from its directory's tokenizer files; None
    # when there are none (or shapes from a config object): then only the ids can be checked
    added_tokens: dict[str, int] | None = None

    def expert_shape(self, projection: str) -> tuple[int, int]:
        """(in, out) of one routed expert's gate, up or down projection."""
        h, i = self.hidden_size, self.moe_intermediate_size
        return (i, h) if projection == "down" else (h, i)


def load_model_shapes(model: str | Path | PretrainedConfig, tokenizer: str | Path | None = None) -> ModelShapes:
    """Shapes from a transformers config object or a local model directory (config.json); the added tokens from the
    tokenizer directory the model is served with (default: the model directory)."""
    config = model if isinstance(model, PretrainedConfig) else _read_config(Path(model))
    family = _FAMILIES.get(config.model_type)
    if family is None:
        raise AdapterError(f"model_type {config.model_type!r} is not served (supported: {', '.join(sorted(_FAMILIES))})")
    try:
        shapes = family(config)
    except (ArithmeticError, TypeError, AttributeError) as e:  # fields a model cannot have (0 heads, a str)
        raise AdapterError(f"the model's config cannot be a model: {type(e).__name__}: {e}") from None
    if isinstance(model, PretrainedConfig):
        return shapes
    return dataclasses.replace(shapes, added_tokens=_tokenizer_added_tokens(Path(tokenizer or model)))


def format_ranges(indices) -> str:
    """'0-3, 5, 7-9' for a set of layer or expert indices."""
    runs: list[list[int]] = []
    for i in sorted(indices):
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ", ".join(f"{lo}-{hi}" if hi > lo else str(lo) for lo, hi in runs) or "none"


def _tokenizer_added_tokens(model_dir: Path) -> dict[str, int] | None:
    """content -> id of the tokenizer's added tokens: tokenizer_config.json's added_tokens_decoder (transformers
    >= 4.34 writes it), else tokenizer.json's added_tokens; None without either file."""
    try:
        config = json.loads((model_dir / "tokenizer_config.json").read_bytes())
        return {token["content"]: int(i) for i, token in config["added_tokens_decoder"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        pass
    try:
        tokenizer = json.loads((model_dir / "tokenizer.json").read_bytes())
        return {token["content"]: int(token["id"]) for token in tokenizer["added_tokens"]}
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _read_config(model_dir: Path) -> PretrainedConfig:
    if not (model_dir / "config.json").is_file():
        error = missing_file(model_dir, "config.json", "a local model directory")
        raise AdapterError(f"{error} (--model takes a local model directory)")
    try:
        return AutoConfig.from_pretrained(model_dir)
    except OSError:
        raise
    except Exception as e:  # transformers' and its libraries' errors of a malformed config.json
        raise AdapterError(f"{model_dir / 'config.json'}: {e}") from None


def _mlp(prefix: str, hidden: int, inter: int) -> dict[str, tuple[int, int]]:
    return {f"{prefix}.gate_proj": (hidden, inter), f"{prefix}.up_proj": (hidden, inter), f"{prefix}.down_proj": (inter, hidden)}


def _gqa_attention(c: PretrainedConfig) -> dict[str, tuple[int, int]]:
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    q, kv = c.num_attention_heads * head_dim, c.num_key_value_heads * head_dim
    return {"self_attn.q_proj": (c.hidden_size, q), "self_attn.k_proj": (c.hidden_size, kv),
            "self_attn.v_proj": (c.hidden_size, kv), "self_attn.o_proj": (q, c.hidden_size)}


def _mla_attention(c: PretrainedConfig) -> dict[str, tuple[int, int]]:
    """DeepSeek multi-head latent attention: q directly or through a q_lora_rank bottleneck."""
    h, heads = c.hidden_size, c.num_attention_heads
    qk_head = c.qk_nope_head_dim + c.qk_rope_head_dim
    shapes = {
        "self_attn.kv_a_proj_with_mqa": (h, c.kv_lora_rank + c.qk_rope_head_dim),
        "self_attn.kv_b_proj": (c.kv_lora_rank, heads * (c.qk_nope_head_dim + c.v_head_dim)),
        "self_attn.o_proj": (heads * c.v_head_dim, h),
    }
    if c.q_lora_rank is None:
        shapes["self_attn.q_proj"] = (h, heads * qk_head)
    else:
        shapes["self_attn.q_a_proj"] = (h, c.q_lora_rank)
        shapes["self_attn.q_b_proj"] = (c.q_lora_rank, heads * qk_head)
    return shapes


def _build(c: PretrainedConfig, attention: dict, num_experts: int, moe_inter: int, moe_layers: set[int],
           moe_extra: dict, dense_inter: int) -> ModelShapes:
    """Every layer has `attention`; MoE layers a router plus `moe_extra` (shared experts), dense layers an MLP."""
    h = c.hidden_size
    layers = []
    for layer in range(c.num_hidden_layers):
        modules = dict(attention)
        if layer in moe_layers:
            modules["mlp.gate"] = (h, num_experts)
            modules.update(moe_extra)
        else:
            modules.update(_mlp("mlp", h, dense_inter))
        layers.append(modules)
    return ModelShapes(c.model_type, c.num_hidden_layers, h, num_experts, moe_inter, frozenset(moe_layers), tuple(layers),
                       c.vocab_size)


def _qwen_moe(c: PretrainedConfig) -> ModelShapes:
    moe_layers = {i for i in range(c.num_hidden_layers)
                  if i not in (c.mlp_only_layers or []) and c.num_experts > 0 and (i + 1) % c.decoder_sparse_step == 0}
    shared = {}
    if getattr(c, "shared_expert_intermediate_size", 0):  # Qwen2-MoE: a gated shared expert
        shared = _mlp("mlp.shared_expert", c.hidden_size, c.shared_expert_intermediate_size)
        shared["mlp.shared_expert_gate"] = (c.hidden_size, 1)
    return _build(c, _gqa_attention(c), c.num_experts, c.moe_intermediate_size, moe_layers, shared, c.intermediate_size)


def _all_moe(c: PretrainedConfig) -> ModelShapes:
    """Mixtral and OLMoE: every layer is MoE and intermediate_size is the expert's."""
    return _build(c, _gqa_attention(c), c.num_local_experts, c.intermediate_size, set(range(c.num_hidden_layers)),
                  {}, c.intermediate_size)


def _deepseek(c: PretrainedConfig) -> ModelShapes:
    moe_layers = set(range(c.first_k_dense_replace, c.num_hidden_layers))
    shared = _mlp("mlp.shared_experts", c.hidden_size, c.moe_intermediate_size * c.n_shared_experts) if c.n_shared_experts else {}
    return _build(c, _mla_attention(c), c.n_routed_experts, c.moe_intermediate_size, moe_layers, shared, c.intermediate_size)


_FAMILIES = {
    "qwen3_moe": _qwen_moe,
    "qwen2_moe": _qwen_moe,
    "mixtral": _all_moe,
    "olmoe": _all_moe,
    "deepseek_v2": _deepseek,
    "deepseek_v3": _deepseek,
}
