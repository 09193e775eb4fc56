"""Qwen2-MoE: grouped-query attention with bias on q/k/v; MoE layers with a shared expert that every
token goes through, scaled by sigmoid(shared_expert_gate(x)); layers in mlp_only_layers or off the
decoder_sparse_step grid (config.moe_layers) are dense MLPs."""
from __future__ import annotations

from moelora.layers.mlp import MLP
from moelora.layers.moe.layer import MoE
from moelora.models.base import CausalLM, DecoderLayer, GQAttention
from moelora.models.config import ModelConfig


class Qwen2MoeDecoderLayer(DecoderLayer):
    def __init__(self, config: ModelConfig, layer_id: int):
        if layer_id in config.moe_layers:
            shared = MLP(config.hidden_size, config.shared_expert_intermediate_size, "mlp.shared_expert", layer_id,
                         reduce_output=False)
            mlp = MoE(config.hidden_size, config.moe_intermediate_size, config.num_experts, config.topk, layer_id,
                      shared_experts=shared, shared_expert_gate=True, backend=config.moe_backend)
        else:
            mlp = MLP(config.hidden_size, config.intermediate_size, "mlp", layer_id)
        super().__init__(config, GQAttention(config, layer_id), mlp)


class Qwen2MoeForCausalLM(CausalLM):
    def __init__(self, config: ModelConfig):
        super().__init__(config, Qwen2MoeDecoderLayer)
