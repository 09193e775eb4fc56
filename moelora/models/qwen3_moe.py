"""Qwen3-MoE: grouped-query attention with per-head RMSNorm on q and k; MoE layers except those in
mlp_only_layers or off the decoder_sparse_step grid, which are dense MLPs; no shared expert."""
from __future__ import annotations

import torch
from transformers import PretrainedConfig

from moelora.core import TopKConfig
from moelora.layers.mlp import MLP
from moelora.layers.moe.layer import MoE
from moelora.layers.norm import RMSNorm
from moelora.models.base import CausalLM, DecoderLayer, GQAttention
from moelora.models.qwen2_moe import is_moe_layer


class Qwen3MoeAttention(GQAttention):
    def __init__(self, config: PretrainedConfig, layer_id: int):
        super().__init__(config, layer_id, qkv_bias=config.attention_bias, o_bias=config.attention_bias)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def transform_qkv(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        n = q.shape[0]
        return self.q_norm(q.view(n, -1, self.head_dim)), self.k_norm(k.view(n, -1, self.head_dim)), v


class Qwen3MoeForCausalLM(CausalLM):
    def __init__(self, config: PretrainedConfig):
        topk = TopKConfig(top_k=config.num_experts_per_tok, renormalize=config.norm_topk_prob)

        def make_layer(i: int) -> DecoderLayer:
            if is_moe_layer(config, i):
                mlp = MoE(config.hidden_size, config.moe_intermediate_size, config.num_experts, topk, i)
            else:
                mlp = MLP(config.hidden_size, config.intermediate_size, "mlp", i)
            return DecoderLayer(Qwen3MoeAttention(config, i), mlp, config.hidden_size, config.rms_norm_eps)

        super().__init__(config, make_layer)
