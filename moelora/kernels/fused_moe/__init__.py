"""Fused MoE with per-expert LoRA of many adapters in one batch.

    y[t] = sum_j w[t,j] * down_e( silu(gate_e(x[t])) * up_e(x[t]) ),  e = ids[t, j]
    gate_e(x) = x Wg_e^T + (x Ag_se^T) Bg_se^T,  s = slot of token t (likewise up, down)

Grouped GEMMs over blocks from `moe_align` (one expert per block, rows ordered by adapter slot), or,
for a few pairs, over one block per (token, expert) pair, which needs no alignment launch:

    shrink_kernel:   xa[p]    = x A_g^T, x A_u^T          K-split partials, rows with an adapter only, a
                     program per (expert, slot) segment of the aligned rows (at some tiles a launch per rank
                     tile); for a few pairs a program per (pair, split) in the alignment's launch, or with a
                     block per pair in the first programs of the gate_up launch, whose epilogues wait on a ready
                     count per pair
    gate_up_kernel:  h[p]     = silu(x Wg^T + xa_g Bg^T) * (x Wu^T + xa_u Bu^T)
                     hd[p, n] = h[p, part n] Ad[:, part n]^T   down shrink, one part per 64 columns of I
                     (not with config.down_shrink_launch: down_shrink_kernel sums them per segment after it)
    down_kernel:     o[p]     = w[p] * (h Wd^T + (sum_n hd[p, n]) Bd^T); with a block per pair also
                     y[t] = sum_j o[t*k+j] by the program that finishes t's last pair (fresh in L2)
    moe_sum_kernel:  the same y[t] (same order, same bits) for aligned blocks: a sum in the down kernel's
                     tail would stall its SM on rows long gone from L2
    reduce_partials_kernel: at large batches, the partials of xa and hd summed once per row before
                     the GEMMs read them (same order as the GEMMs' own sum, so the same bits)

An expert's weights are read once per block whatever adapters its rows use; the LoRA epilogues
loop over the few slots present in the block. LoRA deltas are added to the fp32 accumulators
(before SiLU for gate/up, before the routing weight for down). (slot, expert) pairs of rank 0
(adapter does not cover the expert) read nothing, and each block's rank tile is the smallest of 16, 32,
..., the slot buffers' tile that holds the ranks of its rows' (slot, expert) pairs, picked on the device.
Rows without an adapter get the plain GEMM plus exactly zero, so they are bit-identical to a run
without LoRA, and every partial sum is in a fixed order, so a row's result does not depend on what it
is batched with (nor on its block's rank tile: the columns past its rank add exact zeros).

`fused_moe_reference` is the plain-torch version of the whole thing and the CPU backend.

The package, one job a file: config.py (MoEKernelConfig and the tile table), tiles.py (the block/LoRA tile
helpers the kernels share), shrink.py, gemm.py (gate_up and down), reduction.py (top-k sum, partial sums),
launcher.py (`fused_moe_triton`: the path and the launches), reference.py (`fused_moe_reference`), and here
the entry point `fused_moe`.
"""
from __future__ import annotations

import torch

from moelora.core import ExpertLoRASlots, TopKOutput
from moelora.kernels.fused_moe.config import MoEKernelConfig, default_config
from moelora.kernels.fused_moe.launcher import fused_moe_triton
from moelora.kernels.fused_moe.reference import fused_moe_reference

__all__ = ["MoEKernelConfig", "default_config", "fused_moe", "fused_moe_reference", "fused_moe_triton"]


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk: TopKOutput,
    lora: ExpertLoRASlots | None = None,
    token_slots: torch.Tensor | None = None,
    *,
    impl: str = "auto",
    config: MoEKernelConfig | None = None,
) -> torch.Tensor:
    """MoE block output y [T, H] for x [T, H], w13 [E, 2I, H] (gate rows then up rows),
    w2 [E, H, I], routing `topk`, and optionally the per-expert LoRA of the slots named by
    token_slots [T] int32 (-1: no adapter). impl: "triton", "torch" or "auto" (triton on CUDA)."""
    _check_inputs(x, w13, w2, topk, lora, token_slots)
    if impl == "auto":
        impl = "triton" if x.is_cuda else "torch"
    if impl == "torch":
        return fused_moe_reference(x, w13, w2, topk, lora, token_slots)
    if impl == "triton":
        return fused_moe_triton(x, w13, w2, topk, lora, token_slots, config)
    raise ValueError(f"impl must be 'auto', 'triton' or 'torch', got {impl!r}")


def _check_inputs(x, w13, w2, topk, lora, token_slots) -> None:
    """Shape and dtype checks only: nothing here reads device memory (CUDA-graph safe)."""
    if x.dim() != 2 or not x.is_contiguous():
        raise ValueError(f"x must be a contiguous [tokens, hidden] tensor, got shape {tuple(x.shape)}")
    num_tokens, hidden = x.shape
    if w13.dim() != 3 or w2.dim() != 3:
        raise ValueError(f"w13 must be [E, 2I, H] and w2 [E, H, I], got {tuple(w13.shape)} and {tuple(w2.shape)}")
    num_experts, hidden2, inter = w2.shape
    if tuple(w13.shape) != (num_experts, 2 * inter, hidden) or hidden2 != hidden:
        raise ValueError(f"w13 {tuple(w13.shape)} and w2 {tuple(w2.shape)} do not fit x {tuple(x.shape)}: "
                         f"expected w13 ({num_experts}, {2 * inter}, {hidden}) and w2 ({num_experts}, {hidden}, {inter})")
    for name, w in (("w13", w13), ("w2", w2)):
        if w.dtype != x.dtype or w.stride(-1) != 1:
            raise ValueError(f"{name} must have x's dtype {x.dtype} and be contiguous in its last dimension")
    weights, ids = topk
    if ids.dim() != 2 or ids.shape[0] != num_tokens or ids.dtype != torch.int32 or not ids.is_contiguous():
        raise ValueError(f"topk ids must be contiguous int32 [{num_tokens}, k], got {ids.dtype} {tuple(ids.shape)}")
    if weights.shape != ids.shape or weights.dtype != torch.float32 or not weights.is_contiguous():
        raise ValueError(f"topk weights must be contiguous float32 {tuple(ids.shape)}, got {weights.dtype} {tuple(weights.shape)}")
    if lora is not None:
        lora.validate(num_experts, hidden, inter, x.dtype)
        if token_slots is None or token_slots.shape != (num_tokens,) or token_slots.dtype != torch.int32:
            got = None if token_slots is None else (token_slots.dtype, tuple(token_slots.shape))
            raise ValueError(f"with lora, token_slots must be int32 of shape ({num_tokens},), got {got}")
