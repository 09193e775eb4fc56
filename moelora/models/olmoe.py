"""OLMoE: grouped-query attention with RMSNorm over the whole q and k projections (not per head)
and optional clipping of q/k/v to [-clip_qkv, clip_qkv]; every layer MoE, no shared expert.

Under tensor parallelism the norm needs the whole projection: q and k are all-gathered, normalised and
cut back to the rank's heads (the same rows, so the same bits, as at one rank). RoPE and the KV-cache
store then run fused as in every GQAttention, without the per-head norm."""
from __future__ import annotations

import torch

from moelora.distributed.comm import all_gather
from moelora.distributed.state import get_parallel
from moelora.layers.moe.layer import MoE
from moelora.layers.norm import RMSNorm
from moelora.models.base import CausalLM, DecoderLayer, GQAttention
from moelora.models.config import ModelConfig


class OlmoeAttention(GQAttention):
    def __init__(self, config: ModelConfig, layer_id: int):
        super().__init__(config, layer_id)
        q_size, kv_size = self.qkv_proj.full_out_sizes[:2]
        self.q_norm = RMSNorm(q_size, config.rms_norm_eps)
        self.k_norm = RMSNorm(kv_size, config.rms_norm_eps)
        self.clip_qkv = config.clip_qkv
        self.dist_state = get_parallel()

    def transform_qkv(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k = (self._normed(x, norm, part) for x, norm, part in ((q, self.q_norm, 0), (k, self.k_norm, 1)))
        if self.clip_qkv is not None:
            q, k, v = (t.clamp(-self.clip_qkv, self.clip_qkv) for t in (q, k, v))
        return q, k, v

    def _normed(self, x: torch.Tensor, norm: RMSNorm, part: int) -> torch.Tensor:
        """norm over the whole projection of part `part` (0: q, 1: k), of which x holds this rank's rows."""
        full, rows = self.qkv_proj.full_out_sizes[part], self.qkv_proj.out_shards[part]
        if x.shape[-1] == full:
            return norm(x)
        shards = all_gather(self.dist_state, x).split(x.shape[-1], dim=-1)
        copies = len(shards) * x.shape[-1] // full  # ranks holding the same key/value heads
        return norm(torch.cat(shards[::copies], dim=-1))[:, rows]


class OlmoeDecoderLayer(DecoderLayer):
    def __init__(self, config: ModelConfig, layer_id: int):
        mlp = MoE(config.hidden_size, config.moe_intermediate_size, config.num_experts, config.topk, layer_id,
                  backend=config.moe_backend)
        super().__init__(config, OlmoeAttention(config, layer_id), mlp)


class OlmoeForCausalLM(CausalLM):
    def __init__(self, config: ModelConfig):
        super().__init__(config, OlmoeDecoderLayer)
