"""Mixtral: grouped-query attention, every layer MoE (softmax top-k, renormalised), no shared expert.
Hub checkpoints name the block `block_sparse_moe` and the expert projections w1 (gate), w3 (up),
w2 (down); transformers v5 names them like the other families, which is what we use."""
from __future__ import annotations

import re

from transformers import PretrainedConfig

from moelora.core import TopKConfig
from moelora.layers.moe.layer import MoE
from moelora.models.base import CausalLM, DecoderLayer, GQAttention

_EXPERT_PROJ = re.compile(r"(\.mlp\.experts\.\d+)\.w([123])\.")
_PROJ_NAMES = {"1": "gate_proj", "2": "down_proj", "3": "up_proj"}


class MixtralForCausalLM(CausalLM):
    def __init__(self, config: PretrainedConfig):
        topk = TopKConfig(top_k=config.num_experts_per_tok, renormalize=True)

        def make_layer(i: int) -> DecoderLayer:
            mlp = MoE(config.hidden_size, config.intermediate_size, config.num_local_experts, topk, i)
            return DecoderLayer(GQAttention(config, i), mlp, config.hidden_size, config.rms_norm_eps)

        super().__init__(config, make_layer)

    def checkpoint_name(self, name: str) -> str | None:
        name = _EXPERT_PROJ.sub(lambda m: f"{m[1]}.{_PROJ_NAMES[m[2]]}.", name.replace(".block_sparse_moe.", ".mlp."))
        return super().checkpoint_name(name)
