"""Sums in a fixed order: the top-k sum of each token's expert outputs (in the down kernel's tail with pair
blocks, a launch of its own with aligned blocks: the same order, so the same bits), and the LoRA partials
(shrink K splits, down-shrink parts) summed once per row at large batches."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from moelora.kernels.fused_moe.config import REDUCE_PROGRAMS
from moelora.kernels.fused_moe.tiles import sum_partials
from moelora.kernels.gemm_tiles import arrive
from moelora.kernels.pdl import pdl_launch, wait_for_previous_kernel


@triton.jit
def token_experts(topk_ids_ptr, tok, tok_ok, top_k, TOP_K_P: tl.constexpr):
    """Each token's top-k expert ids, a tuple of TOP_K_P tensors shaped as tok (-1 past top_k and for tokens not in
    tok_ok): the loads in flight together, and each j's ids a tensor of its own (no column to pick out)."""
    ids = ()
    for j in tl.static_range(TOP_K_P):
        j_ok = tok_ok & (tl.zeros_like(tok) + j < top_k)
        ids = ids + (tl.load(topk_ids_ptr + tok * top_k + j, mask=j_ok, other=-1),)
    return ids


@triton.jit
def num_valid_experts(ids, num_experts, TOP_K_P: tl.constexpr):
    """How many of each token's top-k experts (token_experts) are in [0, E) (the others live on other ranks)."""
    count = tl.zeros_like(ids[0])
    for j in tl.static_range(TOP_K_P):
        count += ((ids[j] >= 0) & (ids[j] < num_experts)).to(tl.int32)
    return count


@triton.jit
def prepare_topk_sum(pid, topk_ids_ptr, counter_ptr, y_ptr, num_tokens, top_k, num_experts, num_n_down, H,
                      stride_yt, tokens_per_program, TOP_K_P: tl.constexpr):
    """Run by every gate_up GEMM program `pid` for its share of the tokens, before the down kernel: zero the
    tokens' arrival counters, and write y = 0 for tokens with no valid expert (no down program sees them)."""
    BLOCK_T: tl.constexpr = 16
    BLOCK: tl.constexpr = 128
    t_lo = pid * tokens_per_program
    t_hi = tl.minimum(t_lo + tokens_per_program, num_tokens)
    for t0 in range(t_lo, t_hi, BLOCK_T):
        tok = t0 + tl.arange(0, BLOCK_T)
        tok_ok = tok < t_hi
        for n0 in range(0, num_n_down, BLOCK):
            offs = n0 + tl.arange(0, BLOCK)
            tl.store(counter_ptr + tok[:, None] * num_n_down + offs[None, :], tl.zeros((BLOCK_T, BLOCK), tl.int32),
                     mask=tok_ok[:, None] & (offs < num_n_down)[None, :])
        ids = token_experts(topk_ids_ptr, tok, tok_ok, top_k, TOP_K_P)
        empty = tok_ok & (num_valid_experts(ids, num_experts, TOP_K_P) == 0)
        if tl.max(empty.to(tl.int32), axis=0) > 0:
            for h0 in range(0, H, BLOCK):
                offs = h0 + tl.arange(0, BLOCK)
                tl.store(y_ptr + tok.to(tl.int64)[:, None] * stride_yt + offs[None, :],
                         tl.zeros((BLOCK_T, BLOCK), y_ptr.dtype.element_ty), mask=empty[:, None] & (offs < H)[None, :])


@triton.jit
def sum_topk(out_ptr, ids, tok, tok_ok, offs_n, n_mask, top_k, num_experts, stride_ot,
             TOP_K_P: tl.constexpr, CACHE: tl.constexpr):
    """sum_j o[t*k+j, offs_n] over each token's valid experts (ids: token_experts), in j order from an fp32 zero: the
    one top-k sum of both paths (sum_topk_if_last, moe_sum_kernel), so they give the same bits. Unrolled: the k
    loads are in flight together."""
    total = tl.zeros((tok.shape[0], offs_n.shape[0]), dtype=tl.float32)
    for j in tl.static_range(TOP_K_P):
        ok = tok_ok & (ids[j] >= 0) & (ids[j] < num_experts)
        o_ptrs = out_ptr + (tok * top_k + j).to(tl.int64)[:, None] * stride_ot + offs_n[None, :]
        total += tl.load(o_ptrs, mask=ok[:, None] & n_mask[None, :], other=0.0, cache_modifier=CACHE).to(tl.float32)
    return total


@triton.jit
def sum_topk_if_last(out_ptr, y_ptr, counter_ptr, ids, pair, row_ok, pid_n, num_n, offs_n, n_mask,
                     top_k, num_experts, stride_ot, stride_yt, TOP_K_P: tl.constexpr):
    """After this program stored its rows of o: y[t, n-tile] = the top-k sum, for the tokens t whose last
    pair on this n-tile this program finished (a counter per (token, n-tile) counts the pairs done). ids: the rows'
    tokens' token_experts, loaded before (their round trip off the chain that ends the layer)."""
    tok = pair // top_k
    num_valid = num_valid_experts(ids, num_experts, TOP_K_P)
    last = row_ok & (arrive(counter_ptr + tok * num_n + pid_n, row_ok) == num_valid - 1)
    if tl.max(last.to(tl.int32), axis=0) > 0:
        total = sum_topk(out_ptr, ids, tok, last, offs_n, n_mask, top_k, num_experts, stride_ot, TOP_K_P, ".cg")
        y_ptrs = y_ptr + tok.to(tl.int64)[:, None] * stride_yt + offs_n[None, :]
        tl.store(y_ptrs, total.to(y_ptr.dtype.element_ty), mask=last[:, None] & n_mask[None, :])


@triton.jit
def moe_sum_kernel(out_ptr, topk_ids_ptr, y_ptr, H, top_k, num_experts, stride_ot, stride_yt,
                    TOP_K_P: tl.constexpr, BLOCK_H: tl.constexpr, PDL: tl.constexpr):
    """y[t] = the top-k sum of o (sum_topk), one token and BLOCK_H columns a program."""
    wait_for_previous_kernel(PDL)
    tok = tl.program_id(0) + tl.zeros((1,), dtype=tl.int32)
    offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = offs < H
    ids = token_experts(topk_ids_ptr, tok, tok >= 0, top_k, TOP_K_P)
    total = sum_topk(out_ptr, ids, tok, tok >= 0, offs, mask, top_k, num_experts, stride_ot, TOP_K_P, "")
    tl.store(y_ptr + tok.to(tl.int64)[:, None] * stride_yt + offs[None, :], total.to(y_ptr.dtype.element_ty),
             mask=mask[None, :])


@triton.jit(do_not_specialize=["num_rows"])  # row counts: kernels/__init__.py
def reduce_partials_kernel(part_ptr, out_ptr, token_slots_ptr, topk_ids_ptr, ranks_ptr, num_rows, rows_per_pair,
                            top_k, proj_lo, num_parts, num_slots, num_experts,
                            BLOCK_ROWS: tl.constexpr, BLOCK_R: tl.constexpr, PARTS: tl.constexpr, PDL: tl.constexpr):
    """out[row, :rank] = sum_partials of part[row, :num_parts, :rank], where rank is the row's real rank (row
    p * rows_per_pair + j holds projection proj_lo + j of pair p); the epilogues then read one part instead
    of every (block, n-tile) program summing them all again. Rows of uncovered pairs and the columns past a
    row's rank are neither read nor written: the epilogues do not read them."""
    wait_for_previous_kernel(PDL)
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    row_ok = rows < num_rows
    pair = rows // rows_per_pair
    slot = tl.load(token_slots_ptr + pair // top_k, mask=row_ok, other=-1)
    e = tl.load(topk_ids_ptr + pair, mask=row_ok, other=-1)
    has = row_ok & (slot >= 0) & (slot < num_slots) & (e >= 0) & (e < num_experts)
    proj = proj_lo + rows % rows_per_pair
    rank = tl.load(ranks_ptr + (proj * num_slots + slot) * num_experts + e, mask=has, other=0)
    has = has & (rank > 0)
    total = sum_partials(part_ptr, rows, has, rank[:, None], num_parts * BLOCK_R, num_parts, BLOCK_R, BLOCK_R,
                         PARTS, "")
    offs_r = tl.arange(0, BLOCK_R)
    out_ptrs = out_ptr + rows.to(tl.int64)[:, None] * BLOCK_R + offs_r[None, :]
    tl.store(out_ptrs, total, mask=has[:, None] & (offs_r[None, :] < rank[:, None]))


def reduce_partials(parts: torch.Tensor, topk_ids: torch.Tensor, token_slots: torch.Tensor, ranks: torch.Tensor,
                    proj_lo: int, once: bool) -> tuple[torch.Tensor, int]:
    """parts [pairs * J, P, R] (row p * J + j: projection proj_lo + j of pair p, J = 1 or 2) summed per row into
    [rows, 1, R] when `once` (large batches), in the columns below each row's rank (ranks [3, S, E]: per
    projection, slot and expert); returns the buffer the GEMMs read and its number of parts."""
    rows, num_parts, block_r = parts.shape
    if num_parts == 1 or not once:
        return parts, num_parts
    num_slots, num_experts = ranks.shape[1:]
    out = torch.empty(rows, 1, block_r, dtype=torch.float32, device=parts.device)
    # each row's sum is a chain of dependent adds, so: many programs (about REDUCE_PROGRAMS), each with
    # few rows and many loads in flight (the sum's order, hence its bits, does not depend on either)
    block_rows = min(64, triton.next_power_of_2(triton.cdiv(rows, REDUCE_PROGRAMS)))
    reduce_partials_kernel[(triton.cdiv(rows, block_rows),)](
        parts, out, token_slots, topk_ids, ranks, rows, rows // topk_ids.numel(), topk_ids.shape[1], proj_lo,
        num_parts, num_slots, num_experts,
        BLOCK_ROWS=block_rows, BLOCK_R=block_r, PARTS=min(32, triton.next_power_of_2(num_parts)),
        num_warps=max(1, min(4, block_rows * block_r // 128)), **pdl_launch(parts.device))
    return out, 1
