"""Fused MoE with per-expert LoRA of many adapters in one batch.

    y[t] = sum_j w[t,j] * down_e( silu(gate_e(x[t])) * up_e(x[t]) ),  e = ids[t, j]
    gate_e(x) = x Wg_e^T + (x Ag_se^T) Bg_se^T,  s = slot of token t (likewise up, down)

Grouped GEMMs over blocks from `moe_align` (one expert and one adapter slot per block):

    _shrink_kernel:  xa[p]  = x A_g^T, x A_u^T            K-split partials, LoRA blocks only
    _gate_up_kernel: h[p]   = silu(x Wg^T + xa_g Bg^T) * (x Wu^T + xa_u Bu^T)
    _down_kernel:    o[p]   = w[p] * (h Wd^T + (h Ad^T) Bd^T)  the shrink h Ad^T in the main loop
    _moe_sum_kernel: y[t]   = sum_j o[t*k+j]  over valid experts, in a fixed order (deterministic)

LoRA deltas are added to the fp32 accumulators (before SiLU for gate/up, before the routing weight
for down). (slot, expert) pairs of rank 0 (adapter does not cover the expert) read nothing, and the
rank tile follows the largest rank in use. Blocks without an adapter run the plain GEMM, so their
rows are bit-identical to a run without LoRA.

`fused_moe_reference` is the plain-torch version of the whole thing and the CPU backend.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from moelora.kernels.lora_tiles import LORA_RANK_CHUNK, rank_tile, shrink_k_range
from moelora.kernels.moe_align import moe_align
from moelora.layers.moe.topk import TopKOutput


@dataclass
class ExpertLoRA:
    """Per-expert LoRA weights of every GPU slot for one MoE layer; scaling is folded into B.

    a_gate/a_up [S, E, R, H], b_gate/b_up [S, E, I, R], a_down [S, E, R, I], b_down [S, E, H, R],
    ranks [3, S, E] int32: real rank of (gate, up, down) for each (slot, expert); 0 = not covered.
    """

    a_gate: torch.Tensor
    b_gate: torch.Tensor
    a_up: torch.Tensor
    b_up: torch.Tensor
    a_down: torch.Tensor
    b_down: torch.Tensor
    ranks: torch.Tensor
    max_rank_in_use: int | None = None  # host-side bound on `ranks` (largest loaded adapter); sizes the
    #                                     kernels' rank tile, which defaults to the buffers' max_rank

    @property
    def num_slots(self) -> int:
        return self.a_gate.shape[0]

    def validate(self, num_experts: int, hidden: int, inter: int, dtype: torch.dtype) -> None:
        slots, max_rank = self.a_gate.shape[0], self.a_gate.shape[2]
        expected = {
            "a_gate": (slots, num_experts, max_rank, hidden), "b_gate": (slots, num_experts, inter, max_rank),
            "a_up": (slots, num_experts, max_rank, hidden), "b_up": (slots, num_experts, inter, max_rank),
            "a_down": (slots, num_experts, max_rank, inter), "b_down": (slots, num_experts, hidden, max_rank),
        }
        for name, shape in expected.items():
            t = getattr(self, name)
            if tuple(t.shape) != shape:
                raise ValueError(f"ExpertLoRA.{name} has shape {tuple(t.shape)}, expected {shape}")
            if t.dtype != dtype:
                raise ValueError(f"ExpertLoRA.{name} has dtype {t.dtype}, expected {dtype} (the activations' dtype)")
            if not t.is_contiguous():
                raise ValueError(f"ExpertLoRA.{name} must be contiguous")
        if tuple(self.ranks.shape) != (3, slots, num_experts) or self.ranks.dtype != torch.int32:
            raise ValueError(
                f"ExpertLoRA.ranks must be int32 of shape (3, {slots}, {num_experts}), "
                f"got {self.ranks.dtype} {tuple(self.ranks.shape)}"
            )


@dataclass(frozen=True)
class MoEKernelConfig:
    block_m: int
    block_n_gate_up: int
    block_n_down: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int
    shrink_splits: int = 1  # K-splits of the gate/up LoRA shrink: parallelism when blocks are few


def default_config(num_pairs: int, num_experts: int, dtype: torch.dtype) -> MoEKernelConfig:
    """Tile sizes by rows per expert. block_k never changes with the batch, so a row's
    accumulation order, and hence its result, does not depend on what it is batched with."""
    block_k = 32 if dtype == torch.float32 else 64
    rows_per_expert = num_pairs / num_experts
    if rows_per_expert <= 16:
        return MoEKernelConfig(16, 64, 128, block_k, 8, 4, 4, shrink_splits=8)
    if rows_per_expert <= 96:
        return MoEKernelConfig(32, 64, 128, block_k, 8, 4, 4, shrink_splits=4)
    return MoEKernelConfig(64, 128, 128, block_k, 8, 4, 4)


# ----------------------------------------------------------------------------------- Triton


@triton.jit
def _block_info(sorted_ids_ptr, block_expert_ptr, block_slot_ptr, num_rows_ptr, num_pairs, N,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """Map this program to (block, n-tile); GROUP_M consecutive blocks (usually one expert's
    slots) walk the n-tiles together so they share weight tiles through L2."""
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, BLOCK_N)
    num_m = tl.num_programs(0) // num_n
    first_m = pid // (GROUP_M * num_n) * GROUP_M
    group_size = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * num_n)) % group_size
    pid_n = (pid % (GROUP_M * num_n)) // group_size
    in_use = pid_m * BLOCK_M < tl.load(num_rows_ptr)
    pair = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    expert = tl.load(block_expert_ptr + pid_m)
    slot = tl.load(block_slot_ptr + pid_m)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    return in_use, expert, slot, pair, pair < num_pairs, offs_n, offs_n < N


@triton.jit
def _lora_rank(ranks_ptr, proj, slot, expert, num_slots, num_experts):
    """Real rank of projection `proj` for (slot, expert); 0 for a block without an adapter."""
    rank = tl.load(ranks_ptr + (proj * num_slots + tl.maximum(slot, 0)) * num_experts + expert)
    return tl.where(slot >= 0, rank, 0)


@triton.jit
def _gemm_loop(in_ptrs, row_ok, K, w1_ptrs, w2_ptrs, n_mask, a1_ptrs, a2_ptrs, a1_mask, a2_mask,
               DUAL: tl.constexpr, SHRINK: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr):
    """acc_i = in @ W_i^T over K, and with SHRINK the LoRA shrink xa_i = in @ A_i^T in the same
    pass over `in` (one stream; two when DUAL: gate and up)."""
    offs_k = tl.arange(0, BLOCK_K)
    acc1 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    xa1 = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    xa2 = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = (k0 + offs_k < K)[:, None]
        xt = tl.load(in_ptrs + k0, mask=row_ok[:, None] & k_mask.T, other=0.0)
        acc1 += tl.dot(xt, tl.load(w1_ptrs + k0, mask=k_mask & n_mask[None, :], other=0.0))
        if DUAL:
            acc2 += tl.dot(xt, tl.load(w2_ptrs + k0, mask=k_mask & n_mask[None, :], other=0.0))
        if SHRINK:
            xa1 += tl.dot(xt, tl.load(a1_ptrs + k0, mask=k_mask & a1_mask, other=0.0))
            if DUAL:
                xa2 += tl.dot(xt, tl.load(a2_ptrs + k0, mask=k_mask & a2_mask, other=0.0))
    return acc1, acc2, xa1, xa2


@triton.jit
def _lora_expand(acc, xa, b_ptr, stride_bn, offs_n, n_mask, rank, BLOCK_R: tl.constexpr):
    """acc += xa[:, :rank] @ B[offs_n, :rank]^T (xa rounded to the weights' dtype, as PEFT does)."""
    offs_r = tl.arange(0, BLOCK_R)
    bt = tl.load(b_ptr + offs_n[None, :] * stride_bn + offs_r[:, None],
                 mask=(offs_r[:, None] < rank) & n_mask[None, :], other=0.0)
    return acc + tl.dot(xa.to(bt.dtype), bt)


@triton.jit
def _gemm_with_lora(in_ptrs, row_ok, K, w_ptrs, n_mask, offs_n, a_ptrs, b_ptr, stride_bn, rank,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr):
    """One-stream `_gemm_loop` plus the LoRA delta of this block's (slot, expert), its shrink in the
    same pass; the plain loop when the block has no adapter or it does not cover the expert."""
    offs_r = tl.arange(0, BLOCK_R)
    if rank > 0:
        acc, _, xa, _ = _gemm_loop(in_ptrs, row_ok, K, w_ptrs, w_ptrs, n_mask, a_ptrs, a_ptrs, offs_r[None, :] < rank,
                                   offs_r[None, :] < rank, False, True, BLOCK_M, BLOCK_N, BLOCK_K, BLOCK_R)
        acc = _lora_expand(acc, xa, b_ptr, stride_bn, offs_n, n_mask, rank, BLOCK_R)
    else:
        acc, _, _, _ = _gemm_loop(in_ptrs, row_ok, K, w_ptrs, w_ptrs, n_mask, a_ptrs, a_ptrs, n_mask[None, :],
                                  n_mask[None, :], False, False, BLOCK_M, BLOCK_N, BLOCK_K, BLOCK_R)
    return acc


@triton.jit
def _shrink_kernel(
    x_ptr, xa_ptr, sorted_ids_ptr, block_expert_ptr, block_slot_ptr, num_rows_ptr, ranks_ptr, ag_ptr, au_ptr,
    num_pairs, top_k, H, num_slots, num_experts, stride_xt, stride_ae, stride_ar,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, SPLITS: tl.constexpr,
):
    """xa[p, proj, split] = x[p] @ A_proj[:, split's K range]^T for the rows of one block, for gate
    (proj 0) or up (proj 1). The gate_up GEMM sums the splits in a fixed order (deterministic)."""
    pid_m, proj, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    if pid_m * BLOCK_M >= tl.load(num_rows_ptr):
        return
    e = tl.load(block_expert_ptr + pid_m)
    s = tl.load(block_slot_ptr + pid_m)
    rank = _lora_rank(ranks_ptr, proj, s, e, num_slots, num_experts)
    if rank == 0:
        return
    pair = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    row_ok = pair < num_pairs
    offs_k = tl.arange(0, BLOCK_K)
    offs_r = tl.arange(0, BLOCK_R)
    a_ptr = ag_ptr
    if proj == 1:
        a_ptr = au_ptr
    a_ptrs = a_ptr + (s * num_experts + e).to(tl.int64) * stride_ae + offs_r[None, :] * stride_ar + offs_k[:, None]
    x_ptrs = x_ptr + (pair // top_k).to(tl.int64)[:, None] * stride_xt + offs_k[None, :]
    k_per_split = tl.cdiv(tl.cdiv(H, SPLITS), BLOCK_K) * BLOCK_K
    k_lo = split * k_per_split
    xa = shrink_k_range(x_ptrs, a_ptrs, row_ok, rank, k_lo, tl.minimum(H, k_lo + k_per_split),
                        BLOCK_M, BLOCK_K, BLOCK_R)
    xa_ptrs = xa_ptr + ((pair.to(tl.int64) * 2 + proj) * SPLITS + split)[:, None] * BLOCK_R + offs_r[None, :]
    tl.store(xa_ptrs, xa, mask=row_ok[:, None])


@triton.jit
def _sum_splits(xa_ptr, pair, row_ok, proj, SPLITS: tl.constexpr, BLOCK_R: tl.constexpr):
    """The gate (proj 0) or up (proj 1) shrink of each row: its K-split partials summed in order."""
    offs_r = tl.arange(0, BLOCK_R)
    base = xa_ptr + ((pair.to(tl.int64) * 2 + proj) * SPLITS)[:, None] * BLOCK_R + offs_r[None, :]
    xa = tl.load(base, mask=row_ok[:, None], other=0.0)
    for split in tl.static_range(1, SPLITS):
        xa += tl.load(base + split * BLOCK_R, mask=row_ok[:, None], other=0.0)
    return xa


@triton.jit
def _gate_up_kernel(
    x_ptr, w_ptr, h_ptr, sorted_ids_ptr, block_expert_ptr, block_slot_ptr, num_rows_ptr,
    ranks_ptr, xa_ptr, bg_ptr, bu_ptr,
    num_pairs, top_k, H, I, num_slots, num_experts,
    stride_xt, stride_we, stride_wn, stride_ht, stride_be, stride_bn,
    HAS_LORA: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, BLOCK_R: tl.constexpr, SPLITS: tl.constexpr,
):
    """h[p] = silu(x Wg^T + LoRA_g) * (x Wu^T + LoRA_u) for the pairs p of one block."""
    in_use, e, s, pair, row_ok, offs_n, n_mask = _block_info(sorted_ids_ptr, block_expert_ptr, block_slot_ptr,
                                                            num_rows_ptr, num_pairs, I, BLOCK_M, BLOCK_N, GROUP_M)
    if not in_use:
        return
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + (pair // top_k).to(tl.int64)[:, None] * stride_xt + offs_k[None, :]
    wg_ptrs = w_ptr + e.to(tl.int64) * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None]
    wu_ptrs = wg_ptrs + I * stride_wn
    acc_g, acc_u, _, _ = _gemm_loop(x_ptrs, row_ok, H, wg_ptrs, wu_ptrs, n_mask, wg_ptrs, wu_ptrs, n_mask[None, :],
                                    n_mask[None, :], True, False, BLOCK_M, BLOCK_N, BLOCK_K, BLOCK_R)
    if HAS_LORA:  # constexpr: without it the LoRA path is not compiled at all
        rank_g = _lora_rank(ranks_ptr, 0, s, e, num_slots, num_experts)
        rank_u = _lora_rank(ranks_ptr, 1, s, e, num_slots, num_experts)
        if rank_g + rank_u > 0:  # the shrink x @ A^T came from _shrink_kernel (only where rank > 0)
            se = (s * num_experts + e).to(tl.int64)  # LoRA buffers are contiguous [S, E, ...]
            zeros = tl.zeros((BLOCK_M,), dtype=tl.int32)  # vector form of the rank test, for the masks
            acc_g = _lora_expand(acc_g, _sum_splits(xa_ptr, pair, row_ok & (zeros < rank_g), 0, SPLITS, BLOCK_R),
                                 bg_ptr + se * stride_be, stride_bn, offs_n, n_mask, rank_g, BLOCK_R)
            acc_u = _lora_expand(acc_u, _sum_splits(xa_ptr, pair, row_ok & (zeros < rank_u), 1, SPLITS, BLOCK_R),
                                 bu_ptr + se * stride_be, stride_bn, offs_n, n_mask, rank_u, BLOCK_R)
    h = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
    h_ptrs = h_ptr + pair.to(tl.int64)[:, None] * stride_ht + offs_n[None, :]
    tl.store(h_ptrs, h.to(h_ptr.dtype.element_ty), mask=row_ok[:, None] & n_mask[None, :])


@triton.jit
def _down_kernel(
    h_ptr, w_ptr, out_ptr, topk_weights_ptr, sorted_ids_ptr, block_expert_ptr, block_slot_ptr, num_rows_ptr,
    ranks_ptr, a_ptr, b_ptr,
    num_pairs, H, I, num_slots, num_experts,
    stride_ht, stride_we, stride_wn, stride_ot, stride_ae, stride_ar, stride_be, stride_bn,
    HAS_LORA: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, BLOCK_R: tl.constexpr,
):
    """out[p] = w[p] * (h[p] Wd^T + LoRA_d) for the pairs p of one block; the down shrink runs in the
    main loop (its extra cost is BLOCK_R / BLOCK_N of the tile)."""
    in_use, e, s, pair, row_ok, offs_n, n_mask = _block_info(sorted_ids_ptr, block_expert_ptr, block_slot_ptr,
                                                            num_rows_ptr, num_pairs, H, BLOCK_M, BLOCK_N, GROUP_M)
    if not in_use:
        return
    offs_k = tl.arange(0, BLOCK_K)
    offs_r = tl.arange(0, BLOCK_R)
    h_ptrs = h_ptr + pair.to(tl.int64)[:, None] * stride_ht + offs_k[None, :]
    w_ptrs = w_ptr + e.to(tl.int64) * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None]
    if HAS_LORA:
        se = (tl.maximum(s, 0) * num_experts + e).to(tl.int64)
        a_ptrs = a_ptr + se * stride_ae + offs_r[None, :] * stride_ar + offs_k[:, None]
        acc = _gemm_with_lora(h_ptrs, row_ok, I, w_ptrs, n_mask, offs_n, a_ptrs, b_ptr + se * stride_be, stride_bn,
                              _lora_rank(ranks_ptr, 2, s, e, num_slots, num_experts),
                              BLOCK_M, BLOCK_N, BLOCK_K, BLOCK_R)
    else:
        acc, _, _, _ = _gemm_loop(h_ptrs, row_ok, I, w_ptrs, w_ptrs, n_mask, w_ptrs, w_ptrs, n_mask[None, :],
                                  n_mask[None, :], False, False, BLOCK_M, BLOCK_N, BLOCK_K, BLOCK_R)
    acc = acc * tl.load(topk_weights_ptr + pair, mask=row_ok, other=0.0)[:, None]
    out_ptrs = out_ptr + pair.to(tl.int64)[:, None] * stride_ot + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & n_mask[None, :])


@triton.jit
def _moe_sum_kernel(out_ptr, topk_ids_ptr, y_ptr, H, num_experts, stride_ot, stride_yt,
                    TOP_K: tl.constexpr, BLOCK_H: tl.constexpr):
    t = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = offs < H
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        e = tl.load(topk_ids_ptr + t * TOP_K + j)
        if (e >= 0) & (e < num_experts):
            row = out_ptr + (t * TOP_K + j).to(tl.int64) * stride_ot
            acc += tl.load(row + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + t.to(tl.int64) * stride_yt + offs, acc.to(y_ptr.dtype.element_ty), mask=mask)


def fused_moe_triton(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk: TopKOutput,
    lora: ExpertLoRA | None = None,
    token_slots: torch.Tensor | None = None,
    config: MoEKernelConfig | None = None,
) -> torch.Tensor:
    num_tokens, hidden = x.shape
    num_experts, inter = w2.shape[0], w2.shape[2]
    top_k = topk.ids.shape[1]
    num_pairs = num_tokens * top_k
    cfg = config or default_config(num_pairs, num_experts, x.dtype)
    num_slots = lora.num_slots if lora is not None else 0
    blocks = moe_align(topk.ids, token_slots if lora is not None else None, num_experts, num_slots, cfg.block_m)
    num_m = blocks.block_expert.numel()

    h = torch.empty(num_pairs, inter, dtype=x.dtype, device=x.device)
    out = torch.empty(num_pairs, hidden, dtype=x.dtype, device=x.device)
    y = torch.empty_like(x)
    common = dict(HAS_LORA=lora is not None, BLOCK_M=cfg.block_m, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
                  num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if lora is None:  # HAS_LORA=False never reads these
        xa = bg = bu = ad = bd = w13
        ranks = blocks.num_rows
        block_r, b_strides, ad_strides, bd_strides = LORA_RANK_CHUNK, (0, 0), (0, 0), (0, 0)
    else:
        bg, bu, ad, bd, ranks = lora.b_gate, lora.b_up, lora.a_down, lora.b_down, lora.ranks
        block_r = rank_tile(lora.max_rank_in_use or lora.a_gate.shape[2])
        b_strides, ad_strides, bd_strides = bg.stride()[1:3], ad.stride()[1:3], bd.stride()[1:3]
        xa = torch.empty(num_pairs, 2, cfg.shrink_splits, block_r, dtype=torch.float32, device=x.device)
        _shrink_kernel[(num_m, 2, cfg.shrink_splits)](
            x, xa, blocks.sorted_ids, blocks.block_expert, blocks.block_slot, blocks.num_rows, ranks,
            lora.a_gate, lora.a_up, num_pairs, top_k, hidden, num_slots, num_experts,
            x.stride(0), lora.a_gate.stride(1), lora.a_gate.stride(2),
            BLOCK_M=cfg.block_m, BLOCK_K=cfg.block_k, BLOCK_R=block_r, SPLITS=cfg.shrink_splits, num_warps=4,
        )
    _gate_up_kernel[(num_m * triton.cdiv(inter, cfg.block_n_gate_up),)](
        x, w13, h, blocks.sorted_ids, blocks.block_expert, blocks.block_slot, blocks.num_rows,
        ranks, xa, bg, bu,
        num_pairs, top_k, hidden, inter, num_slots, num_experts,
        x.stride(0), w13.stride(0), w13.stride(1), h.stride(0), *b_strides,
        BLOCK_N=cfg.block_n_gate_up, BLOCK_R=block_r, SPLITS=cfg.shrink_splits, **common,
    )
    _down_kernel[(num_m * triton.cdiv(hidden, cfg.block_n_down),)](
        h, w2, out, topk.weights, blocks.sorted_ids, blocks.block_expert, blocks.block_slot, blocks.num_rows,
        ranks, ad, bd,
        num_pairs, hidden, inter, num_slots, num_experts,
        h.stride(0), w2.stride(0), w2.stride(1), out.stride(0), *ad_strides, *bd_strides,
        BLOCK_N=cfg.block_n_down, BLOCK_R=block_r, **common,
    )
    block_h = min(1024, triton.next_power_of_2(hidden))
    _moe_sum_kernel[(num_tokens, triton.cdiv(hidden, block_h))](
        out, topk.ids, y, hidden, num_experts, out.stride(0), y.stride(0), TOP_K=top_k, BLOCK_H=block_h,
    )
    return y


# ------------------------------------------------------------------------------------ torch


def _lora_delta_reference(inp: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """(inp A^T) B^T in fp32, rounding the shrink to the weights' dtype as the kernel does."""
    return (inp @ a.float().T).to(a.dtype).float() @ b.float().T


def fused_moe_reference(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk: TopKOutput,
    lora: ExpertLoRA | None = None,
    token_slots: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain torch: loop over the experts (and slots) present; fp32 math, dtype at the same points
    as the kernels (h, the shrink result, and each weighted expert output)."""
    num_tokens, hidden = x.shape
    num_experts, inter = w2.shape[0], w2.shape[2]
    top_k = topk.ids.shape[1]
    experts = topk.ids.flatten().long()
    weights = topk.weights.flatten().float()
    tokens = torch.arange(num_tokens, device=x.device).repeat_interleave(top_k)
    valid = (experts >= 0) & (experts < num_experts)
    slots = None
    if lora is not None:
        slots = token_slots.long()[tokens]
        slots = torch.where((slots >= 0) & (slots < lora.num_slots), slots, -1)

    pair_out = torch.zeros(num_tokens * top_k, hidden, dtype=torch.float32, device=x.device)
    for e in experts[valid].unique().tolist():
        pairs = torch.nonzero(valid & (experts == e)).flatten()
        xe = x[tokens[pairs]].float()
        gate = xe @ w13[e, :inter].float().T
        up = xe @ w13[e, inter:].float().T
        lora_rows = []
        if lora is not None:
            for s in slots[pairs].unique().tolist():
                if s >= 0:
                    lora_rows.append((s, torch.nonzero(slots[pairs] == s).flatten()))
        for s, rows in lora_rows:
            rg, ru = int(lora.ranks[0, s, e]), int(lora.ranks[1, s, e])
            gate[rows] += _lora_delta_reference(xe[rows], lora.a_gate[s, e, :rg], lora.b_gate[s, e, :, :rg])
            up[rows] += _lora_delta_reference(xe[rows], lora.a_up[s, e, :ru], lora.b_up[s, e, :, :ru])
        h = (torch.nn.functional.silu(gate) * up).to(x.dtype).float()
        out = h @ w2[e].float().T
        for s, rows in lora_rows:
            rd = int(lora.ranks[2, s, e])
            out[rows] += _lora_delta_reference(h[rows], lora.a_down[s, e, :rd], lora.b_down[s, e, :, :rd])
        pair_out[pairs] = (out * weights[pairs, None]).to(x.dtype).float()
    return pair_out.view(num_tokens, top_k, hidden).sum(dim=1).to(x.dtype)


# ------------------------------------------------------------------------------ entry point


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk: TopKOutput,
    lora: ExpertLoRA | None = None,
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
