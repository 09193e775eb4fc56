"""Qwen3-MoE: grouped-query attention with per-head RMSNorm on q and k (GQAttention's head_norm);
MoE layers except those in mlp_only_layers or off the decoder_sparse_step grid (config.moe_layers),
which are dense MLPs; no shared expert."""
from __future__ import annotations

from moelora.layers.mlp import MLP
from moelora.layers.moe.layer import MoE
from moelora.models.base import CausalLM, DecoderLayer, GQAttention
from moelora.models.config import ModelConfig


class Qwen3MoeDecoderLayer(DecoderLayer):
    def __init__(self, config: ModelConfig, layer_id: int):
        if layer_id in config.moe_layers:
            mlp = MoE(config.hidden_size, config.moe_intermediate_size, config.num_experts, config.topk, layer_id,
                      backend=config.moe_backend)
        else:
            mlp = MLP(config.hidden_size, config.intermediate_size, "mlp", layer_id)
        super().__init__(config, GQAttention(config, layer_id, head_norm=True), mlp)


class Qwen3MoeForCausalLM(CausalLM):
    def __init__(self, config: ModelConfig):
        super().__init__(config, Qwen3MoeDecoderLayer)
