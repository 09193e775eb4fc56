"""RMSNorm as transformers computes it: normalise in fp32, round to the input dtype, then scale."""
from __future__ import annotations

import torch
from torch import nn

from moelora.kernels.rms_norm import rms_norm


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """norm(x); with `residual`, the decoder's add-then-norm: returns (norm(x + residual), x + residual).
        One Triton kernel on CUDA, the torch reference elsewhere."""
        return rms_norm(x, self.weight, self.eps, residual)
