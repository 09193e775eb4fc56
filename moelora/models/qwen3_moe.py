"""Qwen3-MoE: grouped-query attention with per-head RMSNorm on q and k; MoE layers except those in
mlp_only_layers or off the decoder_sparse_step grid (config.moe_layers), which are dense MLPs; no
shared expert."""
from __future__ import annotations

import torch

from moelora.layers.mlp import MLP
from moelora.layers.moe.layer import MoE
from moelora.layers.norm import RMSNorm
from moelora.models.base import CausalLM, DecoderLayer, GQAttention
from moelora.models.config import ModelConfig


class Qwen3MoeAttention(GQAttention):
    def __init__(self, config: ModelConfig, layer_id: int):
        super().__init__(config, layer_id)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def transform_qkv(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        n = q.shape[0]
        return self.q_norm(q.view(n, -1, self.head_dim)), self.k_norm(k.view(n, -1, self.head_dim)), v


class Qwen3MoeDecoderLayer(DecoderLayer):
    def __init__(self, config: ModelConfig, layer_id: int):
        if layer_id in config.moe_layers:
            mlp = MoE(config.hidden_size, config.moe_intermediate_size, config.num_experts, config.topk, layer_id,
                      backend=config.moe_backend)
        else:
            mlp = MLP(config.hidden_size, config.intermediate_size, "mlp", layer_id)
        super().__init__(config, Qwen3MoeAttention(config, layer_id), mlp)


class Qwen3MoeForCausalLM(CausalLM):
    def __init__(self, config: ModelConfig):
        super().__init__(config, Qwen3MoeDecoderLayer)
