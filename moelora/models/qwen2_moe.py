"""Qwen2-MoE: grouped-query attention with bias on q/k/v; MoE layers with a shared expert that every
token goes through, scaled by sigmoid(shared_expert_gate(x)); layers in mlp_only_layers or off the
decoder_sparse_step grid are dense MLPs."""
from __future__ import annotations

from transformers import PretrainedConfig

from moelora.core import TopKConfig
from moelora.layers.mlp import MLP
from moelora.layers.moe.layer import MoE
from moelora.models.base import CausalLM, DecoderLayer, GQAttention


def is_moe_layer(config: PretrainedConfig, layer_id: int) -> bool:
    """Which layers are sparse, in Qwen2-MoE and Qwen3-MoE."""
    return (layer_id not in (config.mlp_only_layers or []) and config.num_experts > 0
            and (layer_id + 1) % config.decoder_sparse_step == 0)


class Qwen2MoeForCausalLM(CausalLM):
    def __init__(self, config: PretrainedConfig):
        topk = TopKConfig(top_k=config.num_experts_per_tok, renormalize=config.norm_topk_prob)

        def make_layer(i: int) -> DecoderLayer:
            if is_moe_layer(config, i):
                shared = MLP(config.hidden_size, config.shared_expert_intermediate_size, "mlp.shared_expert", i)
                mlp = MoE(config.hidden_size, config.moe_intermediate_size, config.num_experts, topk, i,
                          shared_experts=shared, shared_expert_gate=True)
            else:
                mlp = MLP(config.hidden_size, config.intermediate_size, "mlp", i)
            # transformers before v5 has no qkv_bias field: q/k/v always had a bias
            attention = GQAttention(config, i, qkv_bias=getattr(config, "qkv_bias", True))
            return DecoderLayer(attention, mlp, config.hidden_size, config.rms_norm_eps)

        super().__init__(config, make_layer)
