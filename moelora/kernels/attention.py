"""Attention of a step's new tokens over the paged KV cache (see engine/forward_batch.py): causal,
grouped-query (Hq a multiple of Hkv), key and value head sizes may differ (MLA stores per-head
keys of qk_nope + qk_rope and values of v_head_dim). The new tokens' keys and values are already
in the cache when it runs, so one function serves prefill, chunked prefill and decode.

Triton kernels (fp32 accumulation, softmax in exp2 with log2(e) folded into the scale):

    _extend_kernel:          prefill / chunked prefill, one program per (q head, entry of the step's query-block
                             table: a sequence's BLOCK_M queries), streaming the sequence's keys up to the
                             block's last query (causal)
    _decode_partial_kernel:  decode (one new token per sequence), split-K (flash-decoding): one program per
                             (sequence, kv head, split) for all q heads of the group; partial max/sum/output
    _decode_reduce_kernel:   combines a sequence's splits in a fixed order

Grids come from host-side bounds (batch size, token count, `max_kv_splits`), never from lengths
read back from the device, so no step synchronises and every step can be captured in a CUDA graph.
The extend grid covers the step's query blocks (`extend_blocks`: a table built on the device once a
step, bounded by the token and sequence counts), not sequences x the longest extend's blocks: a
step of one long prompt beside short ones, or a prompt graph padded to its size, launches no
programs that find no queries. A sequence's result (bitwise) does not depend on the batch it is in:
its query blocks and a decode split's size follow its own lengths only.

`attention_reference` is the plain-torch version and the CPU backend.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from moelora.kernels.pdl import pdl_launch, wait_for_previous_kernel

DEFAULT_MAX_KV_SPLITS = 32  # decode: fixed per engine so CUDA graphs can be reused across lengths
# decode splits the reduce loads before combining them: up to 512 keys in one round trip (8 registers a split and
# thread of its one warp at 128-wide heads)
REDUCE_SPLITS_A_ROUND = 8


@dataclass(frozen=True)
class AttentionConfig:
    block_m: int  # extend: queries per program
    block_n: int  # extend: keys per tile
    decode_block_n: int  # decode: keys per tile; a split is a whole number of tiles
    num_warps: int  # extend
    num_stages: int  # extend
    decode_num_warps: int = 4
    decode_num_stages: int = 2


def default_config(k_head_dim: int, dtype: torch.dtype) -> AttentionConfig:
    """Tiles by head size and dtype only (never by the batch); the extend tiles are the fastest of
    `benchmarks/bench_attention.py --sweep` on an H200 (benchmarks/RESULTS.md)."""
    if dtype == torch.float32:
        return AttentionConfig(32, 32, 32, 4, 1, decode_num_stages=1)
    if k_head_dim <= 128:
        return AttentionConfig(128, 64, 64, 4, 3)
    return AttentionConfig(64, 64, 64, 4, 2)


def _head_blocks(dim: int) -> tuple[int, int]:
    """Split a head size into a power-of-two part and a padded rest, e.g. 192 = 128 + 64, 24 = 16 + (8 -> 16),
    so MLA's 192-wide keys take 192 and not 256 columns of the QK^T dot."""
    main = max(16, 1 << (dim.bit_length() - 1))
    rest = dim - main
    return main, 0 if rest <= 0 else max(16, triton.next_power_of_2(rest))


# ----------------------------------------------------------------------------------- Triton


@triton.jit
def _attend_tile(acc, m_i, l_i, q, q_pe, tok_ptr, n0, n_end, q_pos, k_ptr, v_ptr, stride_ks, stride_vs, qk_scale,
                 DK: tl.constexpr, DV: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DPE: tl.constexpr, BLOCK_DV: tl.constexpr):
    """One online-softmax step over the keys [n0, n0 + BLOCK_N) below n_end of one kv head (k_ptr,
    v_ptr point at it); with CAUSAL, query row i sees keys at positions <= q_pos[i]. Without MASKED
    (a tile below n_end that every row sees) no key is masked."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    n_ok = offs_n < n_end if MASKED else tl.full((BLOCK_N,), 1, tl.int1)
    slot = tl.load(tok_ptr + offs_n, mask=n_ok, other=0).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    k = tl.load(k_ptr + slot[None, :] * stride_ks + offs_d[:, None], mask=n_ok[None, :] & (offs_d < DK)[:, None],
                other=0.0)
    qk = tl.dot(q, k)
    if BLOCK_DPE > 0:
        offs_pe = BLOCK_D + tl.arange(0, BLOCK_DPE)
        k_pe = tl.load(k_ptr + slot[None, :] * stride_ks + offs_pe[:, None],
                       mask=n_ok[None, :] & (offs_pe < DK)[:, None], other=0.0)
        qk += tl.dot(q_pe, k_pe)
    if MASKED:
        visible = n_ok[None, :]
        if CAUSAL:
            visible = visible & (offs_n[None, :] <= q_pos[:, None])
        qk = tl.where(visible, qk, float("-inf"))
    # every row sees a key in the first tile it processes, so m_new is finite and no inf - inf occurs; the
    # scale (> 0) applies to the row maximum, so each score takes it in one multiply-add with the subtraction
    m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(qk * qk_scale - m_new[:, None])
    offs_dv = tl.arange(0, BLOCK_DV)
    v = tl.load(v_ptr + slot[:, None] * stride_vs + offs_dv[None, :], mask=n_ok[:, None] & (offs_dv < DV)[None, :],
                other=0.0)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
    return acc, m_new, l_i * alpha + tl.sum(p, 1)


@triton.jit
def _load_q(q_ptr, rows_ok, DK: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DPE: tl.constexpr):
    """q_ptr [rows, 1] points at each row's head; returns the head split as _head_blocks says."""
    offs_d = tl.arange(0, BLOCK_D)
    q = tl.load(q_ptr + offs_d[None, :], mask=rows_ok[:, None] & (offs_d < DK)[None, :], other=0.0)
    q_pe = q  # unused without BLOCK_DPE
    if BLOCK_DPE > 0:
        offs_pe = BLOCK_D + tl.arange(0, BLOCK_DPE)
        q_pe = tl.load(q_ptr + offs_pe[None, :], mask=rows_ok[:, None] & (offs_pe < DK)[None, :], other=0.0)
    return q, q_pe


# the per-sequence arrays are read a scalar at a time, and a mixed step passes them from its first prompt row on
# (ForwardBatch.extend_rows): specialised on 16-byte alignment, the number of decode rows before it would pick the
# compiled variant, one the start's warm-up (no decode rows) never compiled
@triton.jit(do_not_specialize_on_alignment=["req_pool_ptr", "seq_lens_ptr", "extend_lens_ptr", "extend_starts_ptr"])
def _extend_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, req_to_token_ptr, req_pool_ptr, seq_lens_ptr, extend_lens_ptr, extend_starts_ptr,
    blocks_ptr, stride_qt, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_ot, stride_oh, stride_req,
    qk_scale, group, num_q_heads,
    DK: tl.constexpr, DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_DPE: tl.constexpr, BLOCK_DV: tl.constexpr,
    PDL: tl.constexpr,
):
    """Queries [m0, m0 + BLOCK_M) of one sequence's new tokens, one q head: program p takes head p % heads of entry
    p // heads of the step's block table (ExtendBlocks: (sequence, m0 / BLOCK_M), -1 past its blocks). One grid
    axis: the second and third hold at most 65535 programs."""
    wait_for_previous_kernel(PDL)
    head, entry = tl.program_id(0) % num_q_heads, tl.program_id(0) // num_q_heads
    seq = tl.load(blocks_ptr + 2 * entry)
    if seq < 0:
        return
    m0 = tl.load(blocks_ptr + 2 * entry + 1) * BLOCK_M
    extend_len = tl.load(extend_lens_ptr + seq)
    seq_len = tl.load(seq_lens_ptr + seq)
    prefix = seq_len - extend_len
    offs_m = m0 + tl.arange(0, BLOCK_M)
    m_ok = offs_m < extend_len
    tokens = (tl.load(extend_starts_ptr + seq) + offs_m).to(tl.int64)
    q, q_pe = _load_q(q_ptr + tokens[:, None] * stride_qt + head * stride_qh, m_ok, DK, BLOCK_D, BLOCK_DPE)
    kv_head = head // group
    k_head, v_head = k_ptr + kv_head * stride_kh, v_ptr + kv_head * stride_vh
    tok_ptr = req_to_token_ptr + tl.load(req_pool_ptr + seq).to(tl.int64) * stride_req
    q_pos = prefix + offs_m
    acc = tl.zeros((BLOCK_M, BLOCK_DV), dtype=tl.float32)
    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    # keys before the block's first query are visible to all its rows: no causal mask there
    full_end = (prefix + m0) // BLOCK_N * BLOCK_N
    for n0 in range(0, full_end, BLOCK_N):
        acc, m_i, l_i = _attend_tile(acc, m_i, l_i, q, q_pe, tok_ptr, n0, seq_len, q_pos, k_head, v_head,
                                     stride_ks, stride_vs, qk_scale, DK, DV, False, False, BLOCK_N, BLOCK_D,
                                     BLOCK_DPE, BLOCK_DV)
    for n0 in range(full_end, tl.minimum(seq_len, prefix + m0 + BLOCK_M), BLOCK_N):
        acc, m_i, l_i = _attend_tile(acc, m_i, l_i, q, q_pe, tok_ptr, n0, seq_len, q_pos, k_head, v_head,
                                     stride_ks, stride_vs, qk_scale, DK, DV, True, True, BLOCK_N, BLOCK_D,
                                     BLOCK_DPE, BLOCK_DV)
    offs_dv = tl.arange(0, BLOCK_DV)
    out_ptrs = out_ptr + tokens[:, None] * stride_ot + head * stride_oh + offs_dv[None, :]
    tl.store(out_ptrs, (acc / l_i[:, None]).to(out_ptr.dtype.element_ty),
             mask=m_ok[:, None] & (offs_dv < DV)[None, :])


@triton.jit
def _split_len(seq_len, max_splits, BLOCK_N: tl.constexpr):
    """Keys per decode split: whole tiles, at least one, from the sequence's own length only."""
    return tl.maximum(tl.cdiv(tl.cdiv(seq_len, max_splits), BLOCK_N), 1) * BLOCK_N


@triton.jit
def _decode_partial_kernel(
    q_ptr, k_ptr, v_ptr, mid_o_ptr, mid_lse_ptr, req_to_token_ptr, req_pool_ptr, seq_lens_ptr, extend_starts_ptr,
    stride_qt, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_req, num_q_heads, max_splits,
    qk_scale, group,
    DK: tl.constexpr, DV: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_DPE: tl.constexpr, BLOCK_DV: tl.constexpr,
    PDL: tl.constexpr,
):
    """Split `split` of one sequence's keys for the q heads of one kv head: the split's softmax-normalised
    output and its log2-sum-exp2 (mid_o [B, Hq, max_splits, DV], mid_lse [B, Hq, max_splits])."""
    wait_for_previous_kernel(PDL)
    seq, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    # beside seq_len's load, not after it: one round trip for the three
    token = tl.load(extend_starts_ptr + seq).to(tl.int64)
    tok_ptr = req_to_token_ptr + tl.load(req_pool_ptr + seq).to(tl.int64) * stride_req
    split_len = _split_len(seq_len, max_splits, BLOCK_N)
    start = split * split_len
    if start >= seq_len:
        return
    end = tl.minimum(start + split_len, seq_len)
    offs_h = tl.arange(0, BLOCK_H)
    h_ok = offs_h < group
    heads = kv_head * group + offs_h
    q, q_pe = _load_q(q_ptr + token * stride_qt + heads[:, None] * stride_qh, h_ok, DK, BLOCK_D, BLOCK_DPE)
    acc = tl.zeros((BLOCK_H, BLOCK_DV), dtype=tl.float32)
    m_i = tl.full((BLOCK_H,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for n0 in range(start, end, BLOCK_N):
        acc, m_i, l_i = _attend_tile(acc, m_i, l_i, q, q_pe, tok_ptr, n0, end, m_i, k_ptr + kv_head * stride_kh,
                                     v_ptr + kv_head * stride_vh, stride_ks, stride_vs, qk_scale, DK, DV, True,
                                     False, BLOCK_N, BLOCK_D, BLOCK_DPE, BLOCK_DV)
    mid = (seq * num_q_heads + heads).to(tl.int64) * max_splits + split
    offs_dv = tl.arange(0, BLOCK_DV)
    tl.store(mid_o_ptr + mid[:, None] * DV + offs_dv[None, :], acc / l_i[:, None],
             mask=h_ok[:, None] & (offs_dv < DV)[None, :])
    tl.store(mid_lse_ptr + mid, m_i + tl.log2(l_i), mask=h_ok)


@triton.jit
def _decode_reduce_kernel(
    mid_o_ptr, mid_lse_ptr, out_ptr, seq_lens_ptr, extend_starts_ptr, num_q_heads, max_splits, stride_ot, stride_oh,
    DV: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DV: tl.constexpr, ROUND: tl.constexpr,
    PDL: tl.constexpr,
):
    """out = the splits' outputs weighted by their share of the softmax sum, splits in order. The splits' partials
    load ROUND at a time before the round's first combine (a split past the sequence's loads -inf and zeros, which
    leave the sums as they were): a round trip to L2 a round, not one a split."""
    wait_for_previous_kernel(PDL)
    seq, head = tl.program_id(0), tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + seq)
    token = tl.load(extend_starts_ptr + seq).to(tl.int64)  # beside seq_len's load: no round trip of its own
    num_splits = tl.cdiv(seq_len, _split_len(seq_len, max_splits, BLOCK_N))
    offs = tl.arange(0, BLOCK_DV)
    mid = (seq * num_q_heads + head).to(tl.int64) * max_splits
    acc = tl.zeros((BLOCK_DV,), dtype=tl.float32)
    m = tl.full((1,), float("-inf"), dtype=tl.float32)
    total = tl.zeros((1,), dtype=tl.float32)
    one = tl.zeros((1,), dtype=tl.int32)  # the split index as a tensor: the interpreter masks with tensors
    for s0 in range(0, num_splits, ROUND):
        lses, outs = (), ()
        for i in tl.static_range(ROUND):
            split = s0 + i
            lses = lses + (tl.load(mid_lse_ptr + mid + split + one, mask=one + split < num_splits,
                                   other=float("-inf")),)
            outs = outs + (tl.load(mid_o_ptr + (mid + split) * DV + offs,
                                   mask=(offs < DV) & (offs * 0 + split < num_splits), other=0.0),)
        for i in tl.static_range(ROUND):
            m_new = tl.maximum(m, lses[i])
            alpha, weight = tl.exp2(m - m_new), tl.exp2(lses[i] - m_new)
            acc = acc * alpha + weight * outs[i]
            total = total * alpha + weight
            m = m_new
    out = acc / tl.maximum(total, 1e-30)  # an empty sequence (padding row of a CUDA graph) gives 0
    tl.store(out_ptr + token * stride_ot + head * stride_oh + offs, out.to(out_ptr.dtype.element_ty), mask=offs < DV)


def _launch_common(q, k_cache, v_cache, scale: float) -> dict:
    block_d, block_dpe = _head_blocks(k_cache.shape[-1])
    return dict(qk_scale=scale * math.log2(math.e), group=q.shape[1] // k_cache.shape[1],
                DK=k_cache.shape[-1], DV=v_cache.shape[-1], BLOCK_D=block_d, BLOCK_DPE=block_dpe,
                BLOCK_DV=max(16, triton.next_power_of_2(v_cache.shape[-1])))


@dataclass(frozen=True)
class ExtendBlocks:
    """A step's query blocks, the extend kernel's grid: entries [B, 2] int32, each (sequence, block index from its
    first new token), -1 past the step's blocks. Ordered by each block's place from its sequence's end, then by
    sequence: every sequence's last block first (the ones that see the most keys start first, the short ones fill
    the SMs at the end). B bounds the count from host-side sizes."""
    entries: torch.Tensor
    block_m: int


def extend_blocks(q: torch.Tensor, k_cache: torch.Tensor, extend_lens: torch.Tensor,
                  config: AttentionConfig | None = None) -> ExtendBlocks:
    """The block table of the sequences extend_lens [S] whose new tokens are among q's N rows, on `config`'s
    query blocks (default: attention's tiles for these heads): a few device ops, no sync (graph-safe). One table
    serves every layer of a step."""
    block_m = (config or default_config(k_cache.shape[-1], q.dtype)).block_m
    num_seqs, num_tokens = extend_lens.shape[0], q.shape[0]
    levels = triton.cdiv(num_tokens, block_m)  # no sequence has more blocks than the step's tokens fill
    bound = min(num_seqs * levels, (num_tokens + num_seqs * (block_m - 1)) // block_m)
    counts = (extend_lens + block_m - 1) // block_m
    from_end = torch.arange(levels, dtype=torch.int32, device=q.device)[:, None]
    real = (from_end < counts).flatten()  # [levels * S]: every sequence's last block, then the ones before ...
    seqs = torch.arange(num_seqs, dtype=torch.int32, device=q.device).expand(levels, num_seqs)
    pairs = torch.stack([seqs, counts - 1 - from_end], -1).flatten(0, 1)  # (sequence, block) of each, real or not
    pairs = torch.cat([pairs, pairs.new_full((1, 2), -1)])  # index levels * S: past the last real one
    # entry p is the (p + 1)-th real pair: the first index whose running count of real pairs reaches p + 1
    return ExtendBlocks(pairs[torch.searchsorted(real.cumsum(0), torch.arange(1, bound + 1, device=q.device))],
                        block_m)


def attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, req_to_token: torch.Tensor,
                     req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, extend_lens: torch.Tensor,
                     extend_starts: torch.Tensor, scale: float, *, is_decode: bool, blocks: ExtendBlocks | None = None,
                     max_kv_splits: int = DEFAULT_MAX_KV_SPLITS, config: AttentionConfig | None = None,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """Launches the kernels; every grid size comes from host-side shapes and bounds. blocks: the extend table
    (extend_blocks on the same config; None: built here)."""
    num_seqs, (num_tokens, num_q_heads, _) = seq_lens.shape[0], q.shape
    cfg = config or default_config(k_cache.shape[-1], q.dtype)
    common, pdl = _launch_common(q, k_cache, v_cache, scale), pdl_launch(q.device)
    if out is None:
        out = torch.empty(num_tokens, num_q_heads, v_cache.shape[-1], dtype=q.dtype, device=q.device)
    strides = (*q.stride()[:2], *k_cache.stride()[:2], *v_cache.stride()[:2])
    if not is_decode:
        if blocks is None:
            blocks = extend_blocks(q, k_cache, extend_lens, cfg)
        if blocks.block_m != cfg.block_m:
            raise ValueError(f"the extend block table is on query blocks of {blocks.block_m}, the tiles' are "
                             f"{cfg.block_m}: build it with extend_blocks on the same config")
        _extend_kernel[(num_q_heads * blocks.entries.shape[0],)](
            q, k_cache, v_cache, out, req_to_token, req_pool_indices, seq_lens, extend_lens, extend_starts,
            blocks.entries, *strides, *out.stride()[:2], req_to_token.stride(0), **common, num_q_heads=num_q_heads,
            BLOCK_M=cfg.block_m,
            BLOCK_N=cfg.block_n, num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl)
        return out
    mid_o = torch.empty(num_seqs, num_q_heads, max_kv_splits, v_cache.shape[-1], dtype=torch.float32, device=q.device)
    mid_lse = torch.empty(num_seqs, num_q_heads, max_kv_splits, dtype=torch.float32, device=q.device)
    _decode_partial_kernel[(num_seqs, k_cache.shape[1], max_kv_splits)](
        q, k_cache, v_cache, mid_o, mid_lse, req_to_token, req_pool_indices, seq_lens, extend_starts,
        *strides, req_to_token.stride(0), num_q_heads, max_kv_splits, **common,
        BLOCK_N=cfg.decode_block_n, BLOCK_H=max(16, triton.next_power_of_2(common["group"])),
        num_warps=cfg.decode_num_warps, num_stages=cfg.decode_num_stages, **pdl,
    )
    _decode_reduce_kernel[(num_seqs, num_q_heads)](
        mid_o, mid_lse, out, seq_lens, extend_starts, num_q_heads, max_kv_splits, *out.stride()[:2],
        DV=common["DV"], BLOCK_N=cfg.decode_block_n, BLOCK_DV=common["BLOCK_DV"],
        ROUND=min(REDUCE_SPLITS_A_ROUND, triton.next_power_of_2(max_kv_splits)), num_warps=1, **pdl,
    )
    return out


# ------------------------------------------------------------------------------------ torch


def attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, req_to_token: torch.Tensor,
                        req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, extend_lens: torch.Tensor,
                        extend_starts: torch.Tensor, scale: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """q [N, Hq, Dk], k_cache [slots, Hkv, Dk], v_cache [slots, Hkv, Dv] -> [N, Hq, Dv] in q's dtype."""
    if out is None:
        out = torch.zeros(q.shape[0], q.shape[1], v_cache.shape[-1], dtype=q.dtype, device=q.device)
    group = q.shape[1] // k_cache.shape[1]
    for row, total, new, start in zip(req_pool_indices.tolist(), seq_lens.tolist(), extend_lens.tolist(),
                                      extend_starts.tolist()):
        slots = req_to_token[row, :total].long()
        k = k_cache[slots].float().repeat_interleave(group, dim=1)  # [L, Hq, Dk]
        v = v_cache[slots].float().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[start:start + new].float(), k) * scale
        query_pos = torch.arange(total - new, total, device=q.device)[:, None]
        scores.masked_fill_(torch.arange(total, device=q.device)[None, :] > query_pos, float("-inf"))
        out[start:start + new] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).to(q.dtype)
    return out


# ------------------------------------------------------------------------------ entry point


def attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, req_to_token: torch.Tensor,
              req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, extend_lens: torch.Tensor,
              extend_starts: torch.Tensor, scale: float, *, is_decode: bool = False, blocks: ExtendBlocks | None = None,
              max_kv_splits: int = DEFAULT_MAX_KV_SPLITS, impl: str = "auto",
              config: AttentionConfig | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Entry point; no device read on the Triton path. is_decode (every extend_len is 1, from ForwardBatch) picks
    the split-K decode kernels; blocks: the extend kernel's block table (`extend_blocks`, made once a step for every
    layer; None: built in this call). impl: "triton", "torch" or "auto" (triton on CUDA). out [N, Hq, Dv]: written at
    the given sequences' tokens only and returned (a step that runs its decode and its extend sequences in two calls
    fills one output); default a new tensor."""
    _check_inputs(q, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, extend_lens, extend_starts)
    if out is not None and (out.shape != (q.shape[0], q.shape[1], v_cache.shape[-1]) or out.dtype != q.dtype
                            or not out.is_contiguous()):
        raise ValueError(f"out must be contiguous {q.dtype} of shape {(q.shape[0], q.shape[1], v_cache.shape[-1])}, "
                         f"got {out.dtype} {tuple(out.shape)}")
    if impl == "auto":
        impl = "triton" if q.is_cuda else "torch"
    if impl == "torch":
        return attention_reference(q, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, extend_lens,
                                   extend_starts, scale, out)
    if impl != "triton":
        raise ValueError(f"impl must be 'auto', 'triton' or 'torch', got {impl!r}")
    if q.shape[0] == 0:
        return q.new_zeros(0, q.shape[1], v_cache.shape[-1]) if out is None else out
    return attention_triton(q, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, extend_lens,
                            extend_starts, scale, is_decode=is_decode, blocks=blocks,
                            max_kv_splits=max_kv_splits, config=config, out=out)


def _check_inputs(q, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, extend_lens, extend_starts) -> None:
    """Shape and dtype checks only: nothing here reads device memory (CUDA-graph safe)."""
    if q.dim() != 3 or k_cache.dim() != 3 or v_cache.dim() != 3:
        raise ValueError(f"q [N, Hq, Dk], k_cache [slots, Hkv, Dk], v_cache [slots, Hkv, Dv] expected, got "
                         f"{tuple(q.shape)}, {tuple(k_cache.shape)}, {tuple(v_cache.shape)}")
    (_, num_q_heads, k_dim), (_, num_kv_heads, _) = q.shape, k_cache.shape
    if k_cache.shape[2] != k_dim or v_cache.shape[:2] != k_cache.shape[:2] or num_q_heads % num_kv_heads:
        raise ValueError(f"q {tuple(q.shape)}, k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} do "
                         "not fit: same key head size, same slots and kv heads, Hq a multiple of Hkv")
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dtype != q.dtype or t.stride(-1) != 1:
            raise ValueError(f"{name} must have q's dtype {q.dtype} and be contiguous in its last dimension")
    if req_to_token.dim() != 2 or req_to_token.dtype != torch.int32 or req_to_token.stride(1) != 1:
        raise ValueError(f"req_to_token must be int32 [max_reqs, max_context], got {req_to_token.dtype} "
                         f"{tuple(req_to_token.shape)}")
    batch = seq_lens.shape
    for name, t in (("req_pool_indices", req_pool_indices), ("seq_lens", seq_lens), ("extend_lens", extend_lens),
                    ("extend_starts", extend_starts)):
        if t.dtype != torch.int32 or t.dim() != 1 or t.shape != batch or not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous int32 of shape {tuple(batch)}, got {t.dtype} {tuple(t.shape)}")
