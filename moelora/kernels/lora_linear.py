"""A dense linear layer with the LoRA deltas of many adapters, one adapter slot per token.

A layer's output may be split into parts (a fused q/k/v projection: three parts), each adapted by
its own module of the adapter: for token n in slot s and part p with out rows [o_p, o_p + n_p),

    y[n, o_p : o_p + n_p] = W[o_p : o_p + n_p] @ x[n] + B[s, o_p : o_p + n_p, :r] @ (A[s, p, :r] @ x[n]),
    r = ranks[s, p]

The shrink and the GEMM with the expand in its epilogue:

    shrink          xa[n, p] = round(x[n] @ A[s, p]^T) over blocks of tokens of one slot (`moe_align` with the
                    slots as experts sorts the tokens by slot on the GPU, no host synchronisation), so each A tile
                    is read once per block; K in splits of split_k whose fp32 sums are added in split order and
                    rounded once to the weights' dtype (as PEFT's shrink output is); parts of rank 0 and blocks
                    without an adapter read nothing. Up to FUSED_SHRINK_MAX_TOKENS tokens the first programs of
                    the GEMM's launch, one per (block of 16 tokens, part, K split), the last split to arrive
                    adding them up (`shrink_linear_block`; a launch of its own costs a decode step more than its
                    work). Above, where the GEMM's prefill tiles (8 warps, deep pipelines) would hold the shrink's
                    programs to their occupancy, a launch of its own: where K is short and the blocks fill the
                    SMs (`serial_shrink`), one program per block of 16 to 64 tokens and chunk of the parts' columns
                    side by side, its splits one after the other (`_serial_shrink_kernel`: x read once for every
                    part, no partials in memory); else the split programs (`_split_shrink_kernel`), whose serial
                    K loop would be the launch's time. The same bits every way
    linear's GEMM   y = x @ W^T with the expand in its epilogue (`add_linear_lora`): each output tile adds
                    xa @ B[s, :r, tile] of its rows' slots before the bias and the one rounding, so the delta
                    costs no launch and no pass over y of its own

The K splits are fixed (not chosen by the batch; the blocks' rows and the shrink's kernel are, and change no sum's
order) and the epilogue adds a row's products from its own slot only, so a token's output is the same bits whatever
it is batched with; rows of tokens without an adapter are the plain GEMM's bits.

`lora_linear_reference` (the delta in plain torch) with torch's linear is the CPU backend.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from moelora.core import LinearLoRASlots
from moelora.kernels.gemm_tiles import zeroed_counters
from moelora.kernels.linear import (LinearConfig, LinearLoRA, LinearShrink, check_linear_inputs, linear_reference,
                                    linear_triton)
from moelora.kernels.lora_tiles import end_of_split, rank_tile, shrink_linear_block
from moelora.kernels.moe_align import AlignedBlocks, moe_align
from moelora.kernels.pdl import pdl_launch, wait_for_previous_kernel


SHRINK_COUNTERS = 8192  # arrival counters per device, one per (block, part): 16-token blocks of 40k tokens, 3 parts
FUSED_SHRINK_MAX_TOKENS = 256  # up to here the shrink runs in the GEMM's launch (linear's parallel-split sizes)
PREFILL_SHRINK_PROGRAMS = 128  # the shrink's launch of its own: about a program per SM of an H100 / H200 (132)
# the serial shrink's K loop at most (K = 2048 in bf16): with o_proj's 64 steps it took 2-4x the split programs'
# time at 2048-4096 tokens on an H100 (benchmarks/RESULTS.md, session 50)
SERIAL_SHRINK_MAX_STEPS = 32


@dataclass(frozen=True)
class LoRALinearConfig:
    block_m: int = 16  # tokens of one slot per block (the alignment's block size) where the GEMM's launch shrinks
    block_k: int = 64
    split_k: int = 256  # input columns per K split (a multiple of block_k): parallelism for small batches
    num_warps: int = 4
    num_stages: int = 2
    linear: LinearConfig | None = None  # the base GEMM's tiles (default: linear's choice for the shape)
    # the shrink in a launch of its own (batches above FUSED_SHRINK_MAX_TOKENS): its blocks' tokens at most
    # (`slot_block_rows`); the serial kernel's columns of the parts side by side a program at most, pipeline stages
    prefill_block_m: int = 64
    prefill_block_c: int = 64
    prefill_stages: int = 4


# ----------------------------------------------------------------------------------- Triton


@triton.jit(do_not_specialize=["num_tokens"])  # row counts: kernels/__init__.py
def _split_shrink_kernel(
    x_ptr, a_ptr, ranks_ptr, part_ptr, xa_ptr, count_ptr, sorted_ids_ptr, block_slot_ptr,
    num_tokens, K, stride_xt, stride_as, stride_ap, stride_ar,
    P: tl.constexpr, SPLITS: tl.constexpr, SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
    PDL: tl.constexpr,
):
    """The shrink in a launch of its own, as the GEMM's launch runs it: program (block, part, split) in one
    dimension (`shrink_linear_block`)."""
    wait_for_previous_kernel(PDL)
    shrink_linear_block(tl.program_id(0), x_ptr, a_ptr, ranks_ptr, part_ptr, xa_ptr, count_ptr, sorted_ids_ptr,
                        block_slot_ptr, num_tokens, K, stride_xt, stride_as, stride_ap, stride_ar,
                        P, SPLITS, SPLIT_K, BLOCK_M, BLOCK_K, BLOCK_R)


@triton.jit(do_not_specialize=["num_tokens"])  # row counts: kernels/__init__.py
def _serial_shrink_kernel(
    x_ptr, a_ptr, ranks_ptr, xa_ptr, sorted_ids_ptr, block_slot_ptr,
    num_tokens, K, stride_xt, stride_as, stride_ap, stride_ar,
    P: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr, PDL: tl.constexpr,
):
    """The shrink in a launch of its own: program (block, chunk) writes xa[n, :, :] for the BLOCK_M tokens of one
    block of `align_tokens_by_slot`, columns chunk * BLOCK_C.. of the P parts' BLOCK_R columns side by side, so
    one dot reads x once for every part. K in splits of SPLIT_K as `shrink_linear_block` has them, each summed from
    its own zero and added to the total at its end: the bits of that function's programs, in one program. xa is
    zero past each part's rank (A is not read there); blocks of no slot (-1) read and write nothing."""
    wait_for_previous_kernel(PDL)
    block = tl.program_id(0)
    slot = tl.load(block_slot_ptr + block)
    if slot >= 0:
        tokens = tl.load(sorted_ids_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
        row_ok = tokens < num_tokens
        cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        col_part, col_ok = cols // BLOCK_R, cols < P * BLOCK_R
        rank = tl.load(ranks_ptr + slot * P + col_part, mask=col_ok, other=0)
        a_ok = (cols % BLOCK_R < rank)[None, :]
        offs_k = tl.arange(0, BLOCK_K)
        x_ptrs = x_ptr + tokens.to(tl.int64)[:, None] * stride_xt + offs_k[None, :]
        a_ptrs = (a_ptr + slot.to(tl.int64) * stride_as + (col_part * stride_ap + cols % BLOCK_R * stride_ar)[None, :]
                  + offs_k[:, None])
        xa = tl.zeros((BLOCK_M, BLOCK_C), dtype=tl.float32)
        split = tl.zeros((BLOCK_M, BLOCK_C), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_ok = k0 + offs_k < K
            xt = tl.load(x_ptrs + k0, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            split += tl.dot(xt, tl.load(a_ptrs + k0, mask=k_ok[:, None] & a_ok, other=0.0))
            xa, split = end_of_split(xa, split, k0, K, SPLIT_K, BLOCK_K)
        out_ptrs = xa_ptr + tokens.to(tl.int64)[:, None] * (P * BLOCK_R) + cols[None, :]
        tl.store(out_ptrs, xa.to(xa_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def slot_block_rows(num_tokens: int, config: LoRALinearConfig | None = None) -> int:
    """The rows of `align_tokens_by_slot`'s blocks for a batch of num_tokens, the shrink's BLOCK_M: in the GEMM's
    launch config.block_m; in a launch of its own the most rows, up to config.prefill_block_m, that still give
    PREFILL_SHRINK_PROGRAMS blocks (a block's program reads each A tile once for all its rows; a step's layers share
    the blocks, so the split programs run on them too), else block_m."""
    cfg = config or LoRALinearConfig()
    if num_tokens <= FUSED_SHRINK_MAX_TOKENS:
        return cfg.block_m
    rows = cfg.prefill_block_m
    while rows > cfg.block_m and num_tokens // rows < PREFILL_SHRINK_PROGRAMS:
        rows //= 2
    return rows


def serial_shrink(num_tokens: int, in_features: int, config: LoRALinearConfig | None = None) -> bool:
    """Whether the shrink of num_tokens tokens runs its K splits one after the other in a program
    (`_serial_shrink_kernel`): in a launch of its own, with 16-token blocks enough for PREFILL_SHRINK_PROGRAMS
    programs and a K loop of at most SERIAL_SHRINK_MAX_STEPS steps."""
    cfg = config or LoRALinearConfig()
    return (num_tokens > FUSED_SHRINK_MAX_TOKENS and num_tokens >= PREFILL_SHRINK_PROGRAMS * cfg.block_m
            and triton.cdiv(in_features, cfg.block_k) <= SERIAL_SHRINK_MAX_STEPS)


def align_tokens_by_slot(token_slots: torch.Tensor, num_slots: int, block_m: int | None = None) -> AlignedBlocks:
    """Tokens grouped by adapter slot into blocks of block_m rows (default: `slot_block_rows` of the batch):
    moe_align with the slots as the experts, so `block_expert` is each block's slot and tokens of slot -1 (or
    outside [0, num_slots)) are left out. The same for every LoRA layer of a step: compute it once and pass it."""
    block_m = block_m or slot_block_rows(token_slots.numel())
    return moe_align(token_slots.view(-1, 1), None, num_slots, 0, block_m)


_counters: dict[torch.device, torch.Tensor] = {}


def lora_linear_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, lora: LinearLoRASlots,
                       out_sizes: tuple[int, ...], token_slots: torch.Tensor, blocks: AlignedBlocks | None = None,
                       config: LoRALinearConfig | None = None) -> torch.Tensor:
    cfg = config or LoRALinearConfig()
    (num_tokens, in_features), num_parts = x.shape, len(out_sizes)
    if num_tokens == 0:
        return linear_triton(x, weight, bias, cfg.linear)
    if cfg.split_k % cfg.block_k:
        raise ValueError(f"split_k {cfg.split_k} must be a multiple of block_k {cfg.block_k}: a K step in two splits")
    block_m = slot_block_rows(num_tokens, cfg)
    if blocks is None:
        blocks = align_tokens_by_slot(token_slots, lora.num_slots, block_m)
    elif blocks.block_m != block_m:
        raise ValueError(f"blocks were aligned to {blocks.block_m} rows, the shrink of {num_tokens} tokens uses "
                         f"{block_m} (slot_block_rows)")
    block_r = rank_tile(lora.max_rank_in_use or lora.a.shape[2])
    num_blocks = blocks.block_expert.numel()
    # rows of tokens without an adapter are never written, nor read by the GEMM's epilogue
    xa = torch.empty(num_tokens, num_parts, block_r, dtype=lora.b.dtype, device=x.device)
    shrink = None
    if serial_shrink(num_tokens, in_features, cfg):
        block_c = min(cfg.prefill_block_c, triton.next_power_of_2(num_parts) * block_r)
        _serial_shrink_kernel[(num_blocks, triton.cdiv(num_parts * block_r, block_c))](
            x, lora.a, lora.ranks, xa, blocks.sorted_ids, blocks.block_expert,
            num_tokens, in_features, x.stride(0), *lora.a.stride()[:3],
            P=num_parts, SPLIT_K=cfg.split_k, BLOCK_M=block_m, BLOCK_K=cfg.block_k, BLOCK_R=block_r, BLOCK_C=block_c,
            num_warps=cfg.num_warps, num_stages=cfg.prefill_stages, **pdl_launch(x.device),
        )
    else:
        splits = triton.cdiv(in_features, cfg.split_k)
        if splits > 1 and num_blocks * num_parts > SHRINK_COUNTERS:
            raise ValueError(f"{num_blocks} blocks of {num_parts} parts: more than the {SHRINK_COUNTERS} shrink "
                             "counters")
        part = torch.empty(num_tokens, num_parts, splits, block_r, dtype=torch.float32, device=x.device) \
            if splits > 1 else xa
        counters = zeroed_counters(_counters, SHRINK_COUNTERS, x.device, "LoRA shrink K splits") if splits > 1 else xa
        if num_tokens <= FUSED_SHRINK_MAX_TOKENS:  # the GEMM's launch runs it
            shrink = LinearShrink(lora.a, part, counters, blocks.sorted_ids, blocks.block_expert, splits, cfg.split_k,
                                  block_m, cfg.block_k)
        else:
            _split_shrink_kernel[(num_blocks * num_parts * splits,)](
                x, lora.a, lora.ranks, part, xa, counters, blocks.sorted_ids, blocks.block_expert,
                num_tokens, in_features, x.stride(0), *lora.a.stride()[:3],
                P=num_parts, SPLITS=splits, SPLIT_K=cfg.split_k, BLOCK_M=block_m, BLOCK_K=cfg.block_k,
                BLOCK_R=block_r, num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_launch(x.device),
            )
    bounds = tuple(sum(out_sizes[:p]) for p in range(num_parts + 1))
    return linear_triton(x, weight, bias, cfg.linear, LinearLoRA(xa, lora.b, lora.ranks, token_slots, bounds, shrink))


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


def lora_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, lora: LinearLoRASlots,
                out_sizes: tuple[int, ...], token_slots: torch.Tensor, *, blocks: AlignedBlocks | None = None,
                impl: str = "auto", config: LoRALinearConfig | None = None) -> torch.Tensor:
    """y [N, out] = x [N, in] @ weight^T (+ bias) plus, for each token of an adapter slot (token_slots [N]
    int32; -1 or out of range: none), its LoRA delta, summed in fp32 before the one rounding to x's dtype;
    rows of tokens without an adapter are linear(x, weight, bias)'s bits. blocks: align_tokens_by_slot(
    token_slots, ...) computed once per step. impl: "triton", "torch" or "auto" (triton on CUDA)."""
    check_linear_inputs(x, weight, bias)
    _check_inputs(x, lora, out_sizes, token_slots, weight)
    if impl == "auto":
        impl = "triton" if x.is_cuda else "torch"
    if impl == "torch":
        delta = lora_linear_reference(x, lora, out_sizes, token_slots)
        return _add_reference(linear_reference(x, weight, bias), delta, token_slots, lora.num_slots)
    if impl == "triton":
        return lora_linear_triton(x, weight, bias, lora, out_sizes, token_slots, blocks, config)
    raise ValueError(f"impl must be 'auto', 'triton' or 'torch', got {impl!r}")


def _check_inputs(x, lora, out_sizes, token_slots, weight) -> None:
    """The LoRA inputs' shapes and dtypes (x's and weight's: check_linear_inputs); nothing here reads device
    memory (CUDA-graph safe)."""
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
    if weight.shape[0] != n_out:
        raise ValueError(f"weight has {weight.shape[0]} output rows, the out sizes {tuple(out_sizes)} add up to {n_out}")
