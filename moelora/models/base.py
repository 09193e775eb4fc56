"""What every served family shares: the pre-norm decoder layer, the embed -> layers -> norm stack,
logits (lm_head or tied embedding), grouped-query attention, and the KV-cache geometry.

Parameter names follow the checkpoints (`model.layers.3.self_attn.o_proj.weight`) except where
we fuse: q/k/v into `qkv_proj`, gate/up into `gate_up_proj` and the routed experts into `mlp.experts.w13` /
`mlp.experts.w2`. A fused Linear declares the checkpoint names of its parts (`part_names`), which the loader
fills it from and adapters target; a family whose checkpoints name things otherwise says so in
`checkpoint_name`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from moelora.core import ForwardBatch, KVCache
from moelora.distributed.comm import all_gather
from moelora.distributed.sharding import even_shard, kv_head_shard, scale, size_of
from moelora.distributed.state import get_parallel
from moelora.kernels.linear import linear
from moelora.layers.attention import Attention
from moelora.layers.embedding import VocabEmbedding
from moelora.layers.linear import Linear
from moelora.layers.norm import RMSNorm
from moelora.layers.rotary import RotaryEmbedding
from moelora.models.config import ModelConfig


@dataclass(frozen=True)
class KVCacheShape:
    num_layers: int
    num_kv_heads: int
    k_head_dim: int
    v_head_dim: int

    def bytes_per_token(self, dtype: torch.dtype) -> int:
        return KVCache.bytes_per_token(self.num_layers, self.num_kv_heads, self.k_head_dim, self.v_head_dim, dtype)


class GQAttention(nn.Module):
    """Grouped-query self-attention: fused q/k/v projection, RoPE, paged attention, o_proj. With
    `head_norm` q and k are RMS-normalised per head before RoPE (Qwen3: q_norm, k_norm); families
    that normalise or clip q/k/v otherwise override `transform_qkv`. The head norms, RoPE and the
    store of k and v into the KV cache are one kernel launch on CUDA (Attention.rotate_and_store).

    Under tensor parallelism each rank holds its share of the query heads and the key/value heads they use
    (one head held by several ranks alike when there are fewer than ranks): q/k/v is column-parallel, o_proj
    row-parallel, and the KV cache holds the rank's heads only."""

    def __init__(self, config: ModelConfig, layer_id: int, head_norm: bool = False):
        super().__init__()
        state, self.head_dim = get_parallel(), config.head_dim
        heads = even_shard(config.num_heads, state.tp_size, state.rank, "the attention heads")
        kv_heads = kv_head_shard(config.num_kv_heads, state.tp_size, state.rank)
        self.num_heads, self.num_kv_heads = size_of(heads), size_of(kv_heads)
        q_size, kv_size = config.num_heads * self.head_dim, config.num_kv_heads * self.head_dim
        kv_rows = scale(kv_heads, self.head_dim)
        self.qkv_proj = Linear(config.hidden_size, (q_size, kv_size, kv_size), bias=config.qkv_bias, layer_id=layer_id,
                               part_names=("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                               parallel="column", out_shards=(scale(heads, self.head_dim), kv_rows, kv_rows))
        self.o_proj = Linear(q_size, config.hidden_size, bias=config.o_bias, part_names=("self_attn.o_proj",),
                             layer_id=layer_id, parallel="row")
        self.head_norm = head_norm
        if head_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(self.head_dim, config.rope_parameters, config.max_position_embeddings)
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim, self.head_dim**-0.5, layer_id)

    def transform_qkv(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [N, Hq * D], k and v [N, Hkv * D], between the projection and RoPE."""
        return q, k, v

    def forward(self, positions: torch.Tensor, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        qkv = self.transform_qkv(*self.qkv_proj(x, batch.lora).split(self.qkv_proj.out_sizes, dim=-1))
        q, k, v = (t.view(x.shape[0], -1, self.head_dim) for t in qkv)
        norms = (self.q_norm, self.k_norm) if self.head_norm else ()
        q = self.attn.rotate_and_store(positions, q, k, v, self.rotary, batch, *norms)
        return self.o_proj(self.attn(q, batch), batch.lora)


class DecoderLayer(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then + mlp(norm(.)). The residual stream is
    carried separately so each norm adds it in (fused add + norm). A family's layer class builds its
    attention and mlp and passes them here."""

    def __init__(self, config: ModelConfig, self_attn: nn.Module, mlp: nn.Module):
        super().__init__()
        self.self_attn, self.mlp = self_attn, mlp
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None,
                batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            hidden, residual = self.input_layernorm(hidden), hidden
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, batch)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden, batch.lora), residual


class DecoderStack(nn.Module):
    def __init__(self, config: ModelConfig, layer_class: type[DecoderLayer]):
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(layer_class(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        hidden, residual = self.embed_tokens(batch.input_ids), None
        for layer in self.layers:
            hidden, residual = layer(batch.positions, hidden, residual, batch)
        return self.norm(hidden, residual)[0]


class CausalLM(nn.Module):
    """A family's model: `forward(batch)` -> final hidden states [N, H]; `compute_logits(hidden)` -> fp32 logits.
    layer_class(config, layer_id) builds the family's decoder layer."""

    def __init__(self, config: ModelConfig, layer_class: type[DecoderLayer]):
        super().__init__()
        if config.hidden_act != "silu":
            raise ValueError(f"hidden_act {config.hidden_act!r} is not supported (the MoE kernels compute SiLU)")
        if config.sliding_window:
            raise ValueError(f"sliding-window attention (sliding_window={config.sliding_window}) is not supported")
        self.config = config
        self.model = DecoderStack(config, layer_class)
        self.dist_state = get_parallel()
        self.lm_head = (None if config.tie_word_embeddings else  # split by vocabulary rows, as the embedding
                        Linear(config.hidden_size, config.vocab_size, parallel="column"))
        self.requires_grad_(False)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        return self.model(batch)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits [N, vocab] on every rank (each computes its vocabulary rows; all-gathered in the model dtype,
        half fp32's bytes for the same values: they are rounded to it first, as transformers does)."""
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return all_gather(self.dist_state, linear(hidden, weight)).float()

    @property
    def kv_cache_shape(self) -> KVCacheShape:
        """This rank's: the key/value heads it holds."""
        attn = self.model.layers[0].self_attn.attn
        return KVCacheShape(len(self.model.layers), attn.num_kv_heads, attn.k_head_dim, attn.v_head_dim)

    def checkpoint_name(self, name: str) -> str | None:
        """A checkpoint tensor's name in this model's naming (fused parts aside), or None for a tensor
        the model deliberately does not use. Families whose checkpoints name things differently override it."""
        if name == "lm_head.weight" and self.lm_head is None:
            return None  # some tied checkpoints store a copy of the embedding; transformers ignores it too
        return name
