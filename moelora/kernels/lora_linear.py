"""LoRA deltas of many adapters on a dense linear layer, one adapter slot per token.

A layer's output may be split into parts (a fused q/k/v projection: three parts), each adapted by
its own module of the adapter: for token n in slot s and part p with out rows [o_p, o_p + n_p),

    y[n, o_p : o_p + n_p] += B[s, o_p : o_p + n_p, :r] @ (A[s, p, :r] @ x[n]),  r = ranks[s, p]

Triton kernels over blocks of BLOCK_M tokens of one slot (`moe_align` with the slots as experts sorts
the tokens by slot on the GPU, no host synchronisation), so each A and B tile is read once per
block, not once per token:

    _shrink_kernel:  xa[n, p, split] = x[n, split's K range] @ A[s, p]^T    fp32, one program per
                     (block, part, K split); parts of rank 0 and blocks without an adapter read nothing
    _expand_kernel:  y[n, tile] (+)= sum_p xa[n, p] @ B[s, tile ∩ part p]^T  the K-split partials summed in
                     a fixed order; writes the fp32 delta, or adds it in place into the layer output

BLOCK_M and the K split are fixed (not chosen by the batch), so a token's delta is the same bits
whatever it is batched with; in place, rows of tokens without an adapter are never written.

`lora_linear_reference` is the plain-torch version and the CPU backend.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from moelora.core import LinearLoRASlots
from moelora.kernels.lora_tiles import rank_tile, shrink_k_range
from moelora.kernels.moe_align import AlignedBlocks, moe_align


@dataclass(frozen=True)
class LoRALinearConfig:
    block_m: int = 16  # tokens of one slot per block; also the alignment's block size
    block_n: int = 128  # output columns per expand program
    block_k: int = 64
    split_k: int = 256  # input columns per shrink program: parallelism for small batches
    num_warps: int = 4
    num_stages: int = 2


# ----------------------------------------------------------------------------------- Triton


@triton.jit
def _block_tokens(sorted_ids_ptr, block_slot_ptr, num_tokens, BLOCK_M: tl.constexpr):
    """This program's block: its slot (-1: no adapter, or past the rows in use), tokens and their mask."""
    block = tl.program_id(0)
    slot = tl.load(block_slot_ptr + block)
    tokens = tl.load(sorted_ids_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
    return slot, tokens, tokens < num_tokens


@triton.jit
def _shrink_kernel(
    x_ptr, a_ptr, ranks_ptr, xa_ptr, sorted_ids_ptr, block_slot_ptr,
    num_tokens, K, stride_xt, stride_as, stride_ap, stride_ar,
    P: tl.constexpr, SPLITS: tl.constexpr, SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
):
    """xa[n, part, split, :] = x[n, K range of split] @ A[slot, part, :rank, same range]^T for one block."""
    part, split = tl.program_id(1), tl.program_id(2)
    slot, tokens, row_ok = _block_tokens(sorted_ids_ptr, block_slot_ptr, num_tokens, BLOCK_M)
    if slot < 0:
        return
    rank = tl.load(ranks_ptr + slot * P + part)
    if rank == 0:
        return
    offs_k = tl.arange(0, BLOCK_K)
    offs_r = tl.arange(0, BLOCK_R)
    x_ptrs = x_ptr + tokens.to(tl.int64)[:, None] * stride_xt + offs_k[None, :]
    a_ptrs = a_ptr + slot.to(tl.int64) * stride_as + part * stride_ap + offs_r[None, :] * stride_ar + offs_k[:, None]
    k_lo = split * SPLIT_K
    xa = shrink_k_range(x_ptrs, a_ptrs, row_ok, rank, k_lo, tl.minimum(K, k_lo + SPLIT_K), BLOCK_M, BLOCK_K, BLOCK_R)
    xa_ptrs = xa_ptr + ((tokens.to(tl.int64) * P + part) * SPLITS + split)[:, None] * BLOCK_R + offs_r[None, :]
    tl.store(xa_ptrs, xa, mask=row_ok[:, None])


@triton.jit
def _expand_kernel(
    xa_ptr, b_ptr, ranks_ptr, out_ptr, sorted_ids_ptr, block_slot_ptr,
    num_tokens, N, stride_bs, stride_br, stride_ot,
    PART_BOUNDS: tl.constexpr, SPLITS: tl.constexpr, ADD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
):
    """out[n, tile] = delta (ADD: out + delta, in out's dtype) for the tokens of one block; a tile may
    straddle parts, each column takes its own part's B."""
    slot, tokens, row_ok = _block_tokens(sorted_ids_ptr, block_slot_ptr, num_tokens, BLOCK_M)
    if slot < 0:
        return
    n0 = tl.program_id(1) * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_r = tl.arange(0, BLOCK_R)
    b_ptrs = b_ptr + slot.to(tl.int64) * stride_bs + offs_r[:, None] * stride_br + offs_n[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    P: tl.constexpr = len(PART_BOUNDS) - 1
    for p in tl.static_range(P):
        lo, hi = PART_BOUNDS[p], PART_BOUNDS[p + 1]
        rank = tl.load(ranks_ptr + slot * P + p)
        if (rank > 0) & (n0 < hi) & (n0 + BLOCK_N > lo):
            xa_ptrs = xa_ptr + ((tokens.to(tl.int64) * P + p) * SPLITS)[:, None] * BLOCK_R + offs_r[None, :]
            xa = tl.load(xa_ptrs, mask=row_ok[:, None], other=0.0)
            for split in tl.static_range(1, SPLITS):
                xa += tl.load(xa_ptrs + split * BLOCK_R, mask=row_ok[:, None], other=0.0)
            bt = tl.load(b_ptrs, mask=(offs_r < rank)[:, None] & ((offs_n >= lo) & (offs_n < hi))[None, :], other=0.0)
            acc += tl.dot(xa.to(bt.dtype), bt)  # the shrink rounded to the weights' dtype, as PEFT does
    out_ptrs = out_ptr + tokens.to(tl.int64)[:, None] * stride_ot + offs_n[None, :]
    mask = row_ok[:, None] & (offs_n < N)[None, :]
    if ADD:
        acc += tl.load(out_ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def align_tokens_by_slot(token_slots: torch.Tensor, num_slots: int,
                         block_m: int = LoRALinearConfig.block_m) -> AlignedBlocks:
    """Tokens grouped by adapter slot into block_m-row blocks: moe_align with the slots as the experts,
    so `block_expert` is each block's slot and tokens of slot -1 (or outside [0, num_slots)) are left
    out. The same for every LoRA layer of a step: compute it once and pass it."""
    return moe_align(token_slots.view(-1, 1), None, num_slots, 0, block_m)


def lora_linear_triton(x: torch.Tensor, lora: LinearLoRASlots, out_sizes: tuple[int, ...], token_slots: torch.Tensor,
                       out: torch.Tensor | None = None, blocks: AlignedBlocks | None = None,
                       config: LoRALinearConfig | None = None) -> torch.Tensor:
    cfg = config or LoRALinearConfig()
    (num_tokens, in_features), num_parts, n_out = x.shape, len(out_sizes), sum(out_sizes)
    target = out if out is not None else torch.zeros(num_tokens, n_out, dtype=torch.float32, device=x.device)
    if num_tokens == 0:
        return target
    if blocks is None:
        blocks = align_tokens_by_slot(token_slots, lora.num_slots, cfg.block_m)
    elif blocks.block_m != cfg.block_m:
        raise ValueError(f"blocks were aligned to {blocks.block_m} rows, the kernels use {cfg.block_m}")
    num_blocks = blocks.block_expert.numel()
    block_r = rank_tile(lora.max_rank_in_use or lora.a.shape[2])
    splits = triton.cdiv(in_features, cfg.split_k)
    xa = torch.empty(num_tokens, num_parts, splits, block_r, dtype=torch.float32, device=x.device)
    launch = dict(BLOCK_M=cfg.block_m, BLOCK_R=block_r, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    _shrink_kernel[(num_blocks, num_parts, splits)](
        x, lora.a, lora.ranks, xa, blocks.sorted_ids, blocks.block_expert,
        num_tokens, in_features, x.stride(0), *lora.a.stride()[:3],
        P=num_parts, SPLITS=splits, SPLIT_K=cfg.split_k, BLOCK_K=cfg.block_k, **launch,
    )
    _expand_kernel[(num_blocks, triton.cdiv(n_out, cfg.block_n))](
        xa, lora.b, lora.ranks, target, blocks.sorted_ids, blocks.block_expert,
        num_tokens, n_out, *lora.b.stride()[:2], target.stride(0),
        PART_BOUNDS=tuple(sum(out_sizes[:p]) for p in range(num_parts + 1)), SPLITS=splits, ADD=out is not None,
        BLOCK_N=cfg.block_n, **launch,
    )
    return target


# ------------------------------------------------------------------------------------ torch


def lora_linear_reference(x: torch.Tensor, lora: LinearLoRASlots, out_sizes: tuple[int, ...],
                          token_slots: torch.Tensor) -> torch.Tensor:
    """x [N, in] -> the LoRA delta [N, out] in fp32 (zero for tokens of slot -1 or outside the slots);
    reads only the first ranks[s, p] rows of A and of B^T."""
    delta = torch.zeros(x.shape[0], lora.b.shape[2], dtype=torch.float32, device=x.device)
    offsets = [sum(out_sizes[:p]) for p in range(len(out_sizes))]
    for slot in token_slots.unique().tolist():
        if not 0 <= slot < lora.num_slots:
            continue
        rows = (token_slots == slot).nonzero().squeeze(1)
        for p, (offset, size, rank) in enumerate(zip(offsets, out_sizes, lora.ranks[slot].tolist())):
            xa = x[rows].float() @ lora.a[slot, p, :rank].float().T
            delta[rows, offset:offset + size] = xa @ lora.b[slot, :rank, offset:offset + size].float()
    return delta


def _add_reference(out: torch.Tensor, delta: torch.Tensor, token_slots: torch.Tensor, num_slots: int) -> torch.Tensor:
    """out[rows with an adapter] = out + delta in fp32, rounded to out's dtype; other rows untouched."""
    rows = ((token_slots >= 0) & (token_slots < num_slots)).nonzero().squeeze(1)
    out[rows] = (out[rows].float() + delta[rows]).to(out.dtype)
    return out


# ------------------------------------------------------------------------------ entry point


def lora_linear(x: torch.Tensor, lora: LinearLoRASlots, out_sizes: tuple[int, ...], token_slots: torch.Tensor, *,
                out: torch.Tensor | None = None, blocks: AlignedBlocks | None = None, impl: str = "auto",
                config: LoRALinearConfig | None = None) -> torch.Tensor:
    """The fp32 LoRA delta [N, out] of x [N, in] for token_slots [N] int32 (-1: no adapter); with
    `out` (the layer output [N, out]) the delta is added in place instead, in fp32 and rounded to out's
    dtype, rows of tokens without an adapter left bit for bit as they were, and out is returned.
    blocks: align_tokens_by_slot(token_slots, ...) computed once per step. impl: "triton", "torch" or
    "auto" (triton on CUDA)."""
    _check_inputs(x, lora, out_sizes, token_slots, out)
    if impl == "auto":
        impl = "triton" if x.is_cuda else "torch"
    if impl == "torch":
        delta = lora_linear_reference(x, lora, out_sizes, token_slots)
        return delta if out is None else _add_reference(out, delta, token_slots, lora.num_slots)
    if impl == "triton":
        return lora_linear_triton(x, lora, out_sizes, token_slots, out, blocks, config)
    raise ValueError(f"impl must be 'auto', 'triton' or 'torch', got {impl!r}")


def _check_inputs(x, lora, out_sizes, token_slots, out) -> None:
    """Shape and dtype checks only: nothing here reads device memory (CUDA-graph safe)."""
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"x must be [tokens, in] and contiguous in its last dimension, got {tuple(x.shape)}")
    (num_tokens, in_features), n_out = x.shape, sum(out_sizes)
    slots, parts, rank = lora.a.shape[:3]
    expected = {"a": (slots, len(out_sizes), rank, in_features), "b": (slots, rank, n_out)}
    for name, shape in expected.items():
        t = getattr(lora, name)
        if tuple(t.shape) != shape or t.dtype != x.dtype or not t.is_contiguous():
            raise ValueError(f"LinearLoRASlots.{name} must be contiguous {x.dtype} of shape {shape} for x "
                             f"{tuple(x.shape)} and out sizes {tuple(out_sizes)}, got {t.dtype} {tuple(t.shape)}")
    if tuple(lora.ranks.shape) != (slots, parts) or lora.ranks.dtype != torch.int32 or not lora.ranks.is_contiguous():
        raise ValueError(f"LinearLoRASlots.ranks must be contiguous int32 of shape ({slots}, {parts}), "
                         f"got {lora.ranks.dtype} {tuple(lora.ranks.shape)}")
    if token_slots.shape != (num_tokens,) or token_slots.dtype != torch.int32:
        raise ValueError(f"token_slots must be int32 of shape ({num_tokens},), got {token_slots.dtype} "
                         f"{tuple(token_slots.shape)}")
    if out is not None and (out.shape != (num_tokens, n_out) or out.stride(1) != 1):
        raise ValueError(f"out must be [{num_tokens}, {n_out}] and contiguous in its last dimension, "
                         f"got {tuple(out.shape)}")
