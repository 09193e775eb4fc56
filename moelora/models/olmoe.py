"""OLMoE: grouped-query attention with RMSNorm over the whole q and k projections (not per head)
and optional clipping of q/k/v to [-clip_qkv, clip_qkv]; every layer MoE, no shared expert."""
from __future__ import annotations

import torch

from moelora.layers.moe.layer import MoE
from moelora.layers.norm import RMSNorm
from moelora.models.base import CausalLM, DecoderLayer, GQAttention
from moelora.models.config import ModelConfig


class OlmoeAttention(GQAttention):
    def __init__(self, config: ModelConfig, layer_id: int):
        super().__init__(config, layer_id)
        q_size, kv_size = self.qkv_proj.out_sizes[:2]
        self.q_norm = RMSNorm(q_size, config.rms_norm_eps)
        self.k_norm = RMSNorm(kv_size, config.rms_norm_eps)
        self.clip_qkv = config.clip_qkv

    def transform_qkv(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k = self.q_norm(q), self.k_norm(k)
        if self.clip_qkv is not None:
            q, k, v = (t.clamp(-self.clip_qkv, self.clip_qkv) for t in (q, k, v))
        return q, k, v


class OlmoeDecoderLayer(DecoderLayer):
    def __init__(self, config: ModelConfig, layer_id: int):
        mlp = MoE(config.hidden_size, config.moe_intermediate_size, config.num_experts, config.topk, layer_id,
                  backend=config.moe_backend)
        super().__init__(config, OlmoeAttention(config, layer_id), mlp)


class OlmoeForCausalLM(CausalLM):
    def __init__(self, config: ModelConfig):
        super().__init__(config, OlmoeDecoderLayer)
