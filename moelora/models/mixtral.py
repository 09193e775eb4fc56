"""Mixtral: grouped-query attention, every layer MoE (softmax top-k, renormalised), no shared expert.
Hub checkpoints name the block `block_sparse_moe` and the expert projections w1 (gate), w3 (up),
w2 (down); transformers v5 names them like the other families, which is what we use."""
from __future__ import annotations

import re

from moelora.layers.moe.layer import MoE
from moelora.models.base import CausalLM, DecoderLayer, GQAttention
from moelora.models.config import ModelConfig

_EXPERT_PROJ = re.compile(r"(\.mlp\.experts\.\d+)\.w([123])\.")
_PROJ_NAMES = {"1": "gate_proj", "2": "down_proj", "3": "up_proj"}


class MixtralDecoderLayer(DecoderLayer):
    def __init__(self, config: ModelConfig, layer_id: int):
        mlp = MoE(config.hidden_size, config.moe_intermediate_size, config.num_experts, config.topk, layer_id,
                  backend=config.moe_backend)
        super().__init__(config, GQAttention(config, layer_id), mlp)


class MixtralForCausalLM(CausalLM):
    def __init__(self, config: ModelConfig):
        super().__init__(config, MixtralDecoderLayer)

    def checkpoint_name(self, name: str) -> str | None:
        name = _EXPERT_PROJ.sub(lambda m: f"{m[1]}.{_PROJ_NAMES[m[2]]}.", name.replace(".block_sparse_moe.", ".mlp."))
        return super().checkpoint_name(name)
