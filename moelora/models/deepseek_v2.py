"""DeepSeek-V2 and -V3.

Attention is multi-head latent attention (MLA): q comes straight from the hidden state or through a
q_lora_rank bottleneck (q_a_proj, RMSNorm, q_b_proj); keys and values come from one latent of
kv_lora_rank (kv_a_proj_with_mqa, RMSNorm, kv_b_proj) plus a rotary key part shared by all heads.
We decompress per head and cache keys [qk_nope + qk_rope] and values [v_head_dim]. RoPE pairs
interleaved dimensions (V2 always, V3 with rope_interleave); yarn also scales the softmax.

The first first_k_dense_replace layers are dense MLPs, the rest MoE with shared experts.
Routing: V2 softmax (grouped for topk_method "group_limited_greedy"); V3 sigmoid with
e_score_correction_bias and groups scored by their two best experts. Both multiply the weights by
routed_scaling_factor.
"""
from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig

from moelora.core import ForwardBatch, TopKConfig
from moelora.layers.attention import Attention
from moelora.layers.linear import Linear
from moelora.layers.mlp import MLP
from moelora.layers.moe.layer import MoE
from moelora.layers.norm import RMSNorm
from moelora.layers.rotary import RotaryEmbedding, softmax_scale_factor
from moelora.models.base import CausalLM, DecoderLayer


class MLAttention(nn.Module):
    def __init__(self, config: PretrainedConfig, layer_id: int):
        super().__init__()
        hidden, self.num_heads = config.hidden_size, config.num_attention_heads
        self.nope_dim, self.rope_dim, self.v_dim = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        self.kv_lora_rank, self.q_lora_rank = config.kv_lora_rank, config.q_lora_rank
        qk_dim = self.nope_dim + self.rope_dim

        def linear(name: str, d_in: int, d_out: int, bias: bool = False) -> Linear:
            return Linear(d_in, d_out, bias=bias, lora_names=(f"self_attn.{name}",), layer_id=layer_id)

        if self.q_lora_rank is None:
            self.q_proj = linear("q_proj", hidden, self.num_heads * qk_dim)
        else:
            self.q_a_proj = linear("q_a_proj", hidden, self.q_lora_rank, config.attention_bias)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank)  # transformers uses the default eps here
            self.q_b_proj = linear("q_b_proj", self.q_lora_rank, self.num_heads * qk_dim)
        self.kv_a_proj_with_mqa = linear("kv_a_proj_with_mqa", hidden, self.kv_lora_rank + self.rope_dim,
                                         config.attention_bias)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank)
        self.kv_b_proj = linear("kv_b_proj", self.kv_lora_rank, self.num_heads * (self.nope_dim + self.v_dim))
        self.o_proj = linear("o_proj", self.num_heads * self.v_dim, hidden, config.attention_bias)
        self.rotary = RotaryEmbedding(self.rope_dim, config.rope_parameters, config.max_position_embeddings,
                                      interleaved=getattr(config, "rope_interleave", True))  # V2: always
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
        return self.o_proj(self.attn(q, k, v, batch), lora)


class DeepseekV2ForCausalLM(CausalLM):
    def __init__(self, config: PretrainedConfig):
        topk, correction_bias = self.routing(config)

        def make_layer(i: int) -> DecoderLayer:
            if i < config.first_k_dense_replace:
                mlp = MLP(config.hidden_size, config.intermediate_size, "mlp", i)
            else:
                shared = None
                if config.n_shared_experts:
                    shared = MLP(config.hidden_size, config.moe_intermediate_size * config.n_shared_experts,
                                 "mlp.shared_experts", i)
                mlp = MoE(config.hidden_size, config.moe_intermediate_size, config.n_routed_experts, topk, i,
                          shared_experts=shared, correction_bias=correction_bias)
            return DecoderLayer(MLAttention(config, i), mlp, config.hidden_size, config.rms_norm_eps)

        super().__init__(config, make_layer)

    @staticmethod
    def routing(config: PretrainedConfig) -> tuple[TopKConfig, bool]:
        """(top-k config, whether the router has an e_score_correction_bias)."""
        grouped = config.topk_method == "group_limited_greedy"
        return TopKConfig(top_k=config.num_experts_per_tok, renormalize=bool(config.norm_topk_prob),
                          num_expert_group=config.n_group if grouped else None,
                          topk_group=config.topk_group if grouped else None,
                          routed_scaling_factor=config.routed_scaling_factor), False


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    @staticmethod
    def routing(config: PretrainedConfig) -> tuple[TopKConfig, bool]:
        return TopKConfig(top_k=config.num_experts_per_tok, renormalize=bool(config.norm_topk_prob), scoring="sigmoid",
                          num_expert_group=config.n_group, topk_group=config.topk_group,
                          routed_scaling_factor=config.routed_scaling_factor), True

    def checkpoint_name(self, name: str) -> str | None:
        parts = name.split(".")
        if name.startswith("model.layers.") and int(parts[2]) >= self.config.num_hidden_layers:
            return None  # multi-token-prediction layers after the last decoder layer: not used for decoding
        return super().checkpoint_name(name)
