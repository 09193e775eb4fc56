"""Rotary position embedding, with the rope_parameters of transformers v5 ("default", "linear", and
"yarn" as DeepSeek uses it: mscale / mscale_all_dim). The math follows transformers'
modeling_rope_utils so that logits match it."""
from __future__ import annotations

import math

import torch
from torch import nn

from moelora.kernels.rotary import rotary_embedding

ROPE_TYPES = ("default", "linear", "yarn")  # rope_parameters' rope_type values served


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_frequencies(head_dim: int, rope_parameters: dict, max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [head_dim / 2] (fp32) and the factor cos and sin are multiplied by."""
    base, rope_type = rope_parameters["rope_theta"], rope_parameters.get("rope_type", "default")
    pos_freqs = base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    inv_freq = 1.0 / pos_freqs
    if rope_type == "default":
        return inv_freq, 1.0
    if rope_type == "linear":
        return inv_freq / rope_parameters["factor"], 1.0
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"rope_type {rope_type!r} is not supported ({', '.join(ROPE_TYPES)})")

    original_max = rope_parameters["original_max_position_embeddings"]
    factor = rope_parameters.get("factor") or max_position_embeddings / original_max
    attention_factor = rope_parameters.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = rope_parameters.get("mscale"), rope_parameters.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor)
    beta_fast, beta_slow = rope_parameters.get("beta_fast") or 32, rope_parameters.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:  # the dimension that turns `rotations` times over original_max
        return head_dim * math.log(original_max / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rope_parameters.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    # Fast-turning dimensions keep their frequency (extrapolate), slow ones are divided by `factor`.
    extrapolate = 1 - ramp
    return 1.0 / (factor * pos_freqs) * (1 - extrapolate) + inv_freq * extrapolate, float(attention_factor)


def softmax_scale_factor(rope_parameters: dict) -> float:
    """DeepSeek's attention multiplies the softmax scale by mscale(factor, mscale_all_dim)^2 under yarn."""
    if rope_parameters.get("rope_type", "default") == "default" or not rope_parameters.get("mscale_all_dim"):
        return 1.0
    return _yarn_mscale(rope_parameters["factor"], rope_parameters["mscale_all_dim"]) ** 2


class RotaryEmbedding(nn.Module):
    """Rotates q and k by their tokens' positions. `interleaved`: the checkpoint pairs dimensions
    (0, 1), (2, 3), ... (DeepSeek); they are regrouped into halves, which leaves q.k unchanged."""

    def __init__(self, head_dim: int, rope_parameters: dict, max_position_embeddings: int, interleaved: bool = False):
        super().__init__()
        inv_freq, self.scale = rope_frequencies(head_dim, rope_parameters, max_position_embeddings)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.interleaved = interleaved

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [N], q [N, Hq, D], k [N, Hk, D] -> rotated q, k (new tensors; the Triton kernel on CUDA)."""
        return rotary_embedding(positions, q, k, self.inv_freq, self.scale, self.interleaved)
