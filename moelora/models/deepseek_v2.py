"""DeepSeek-V2 and -V3.

Attention is multi-head latent attention (MLA): q comes straight from the hidden state or through a
q_lora_rank bottleneck (q_a_proj, RMSNorm, q_b_proj); keys and values come from one latent of
kv_lora_rank (kv_a_proj_with_mqa, RMSNorm, kv_b_proj) plus a rotary key part shared by all heads.
We decompress per head and cache keys [qk_nope + qk_rope] and values [v_head_dim]. RoPE pairs
interleaved dimensions (V2 always, V3 with rope_interleave); yarn also scales the softmax.

The first first_k_dense_replace layers are dense MLPs, the rest MoE with shared experts (config.moe_layers).
Routing (config.topk, normalised in models/config.py): V2 softmax, grouped for topk_method
"group_limited_greedy"; V3 sigmoid with e_score_correction_bias and groups scored by their two best experts.
Both multiply the weights by routed_scaling_factor.
"""
from __future__ import annotations

import torch
from torch import nn

from moelora.core import ForwardBatch
from moelora.distributed.sharding import even_shard, size_of
from moelora.distributed.state import get_parallel
from moelora.layers.attention import Attention
from moelora.layers.linear import Linear, Parallel
from moelora.layers.mlp import MLP
from moelora.layers.moe.layer import MoE
from moelora.layers.norm import RMSNorm
from moelora.layers.rotary import RotaryEmbedding, softmax_scale_factor
from moelora.models.base import CausalLM, DecoderLayer
from moelora.models.config import ModelConfig


class MLAttention(nn.Module):
    """Under tensor parallelism each rank holds its share of the heads: q_proj / q_b_proj and kv_b_proj are
    column-parallel by heads, o_proj row-parallel; the low-rank q_a_proj and kv_a_proj_with_mqa (and their
    norms) are replicated."""

    def __init__(self, config: ModelConfig, layer_id: int):
        super().__init__()
        mla, hidden, state = config.mla, config.hidden_size, get_parallel()
        self.num_heads = size_of(even_shard(config.num_heads, state.tp_size, state.rank, "the attention heads"))
        self.nope_dim, self.rope_dim, self.v_dim = mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.v_head_dim
        self.kv_lora_rank, self.q_lora_rank = mla.kv_lora_rank, mla.q_lora_rank
        qk_dim, heads = self.nope_dim + self.rope_dim, config.num_heads

        def linear(name: str, d_in: int, d_out: int, bias: bool = False, parallel: Parallel = "replicated") -> Linear:
            return Linear(d_in, d_out, bias=bias, part_names=(f"self_attn.{name}",), layer_id=layer_id,
                          parallel=parallel)

        if self.q_lora_rank is None:
            self.q_proj = linear("q_proj", hidden, heads * qk_dim, parallel="column")
        else:
            self.q_a_proj = linear("q_a_proj", hidden, self.q_lora_rank, config.qkv_bias)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank)  # transformers uses the default eps here
            self.q_b_proj = linear("q_b_proj", self.q_lora_rank, heads * qk_dim, parallel="column")
        self.kv_a_proj_with_mqa = linear("kv_a_proj_with_mqa", hidden, self.kv_lora_rank + self.rope_dim,
                                         config.qkv_bias)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank)
        self.kv_b_proj = linear("kv_b_proj", self.kv_lora_rank, heads * (self.nope_dim + self.v_dim), parallel="column")
        self.o_proj = linear("o_proj", heads * self.v_dim, hidden, config.o_bias, parallel="row")
        self.rotary = RotaryEmbedding(self.rope_dim, config.rope_parameters, config.max_position_embeddings,
                                      interleaved=mla.rope_interleave)
        scale = qk_dim**-0.5 * softmax_scale_factor(config.rope_parameters)
        self.attn = Attention(self.num_heads, self.num_heads, qk_dim, self.v_dim, scale, layer_id)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        lora, n = batch.lora, x.shape[0]
        if self.q_lora_rank is None:
            q = self.q_proj(x, lora)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x, lora)), lora)
        q_nope, q_rope = q.view(n, self.num_heads, -1).split([self.nope_dim, self.rope_dim], dim=-1)
        latent, k_rope = self.kv_a_proj_with_mqa(x, lora).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(latent), lora).view(n, self.num_heads, -1)
        k_nope, v = kv.split([self.nope_dim, self.v_dim], dim=-1)
        q_rope, k_rope = self.rotary(positions, q_rope, k_rope.unsqueeze(1))
        q = torch.cat([q_nope, q_rope], dim=-1)
        k = torch.cat([k_nope, k_rope.expand(-1, self.num_heads, -1)], dim=-1)
        self.attn.store(k, v, batch)
        return self.o_proj(self.attn(q, batch), lora)


class DeepseekV2DecoderLayer(DecoderLayer):
    def __init__(self, config: ModelConfig, layer_id: int):
        if layer_id in config.moe_layers:
            shared = None
            if config.shared_expert_intermediate_size:
                shared = MLP(config.hidden_size, config.shared_expert_intermediate_size, "mlp.shared_experts", layer_id,
                             reduce_output=False)
            mlp = MoE(config.hidden_size, config.moe_intermediate_size, config.num_experts, config.topk, layer_id,
                      shared_experts=shared, correction_bias=config.correction_bias, backend=config.moe_backend)
        else:
            mlp = MLP(config.hidden_size, config.intermediate_size, "mlp", layer_id)
        super().__init__(config, MLAttention(config, layer_id), mlp)


class DeepseekV2ForCausalLM(CausalLM):
    def __init__(self, config: ModelConfig):
        super().__init__(config, DeepseekV2DecoderLayer)


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    """V2's model with V3's routing (config.topk, config.correction_bias)."""

    def checkpoint_name(self, name: str) -> str | None:
        parts = name.split(".")
        if name.startswith("model.layers.") and int(parts[2]) >= self.config.num_layers:
            return None  # multi-token-prediction layers after the last decoder layer: not used for decoding
        return super().checkpoint_name(name)
