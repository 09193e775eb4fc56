"""A grouped-query attention layer's work between the qkv projection and attention, in one launch:
the per-head RMSNorm of q and k (Qwen3; optional), RoPE on both, and the store of the keys and
values into the paged KV cache.

Unfused that is four small kernels a layer (q norm, k norm, rotary, store_kv: 192 launches a decode
step of a 48-layer model), each costing more to launch than to run. The result is bit for bit the
unfused chain's, rms_norm -> rotary_embedding -> store_kv, because the kernel is built from those
kernels' own pieces (kernels/rms_norm.py, kernels/rotary.py, kernels/kv_store.py) and rounds at
the same places:

    q, k = norm(q), norm(k)     per head: rms_norm's rounding chain (fp32, x's dtype, promote_types(w, x))
    q, k = rotary(q, k)         in that dtype, cos/sin computed from the positions
    k_cache[loc], v_cache[loc] = k, v    converted to the cache dtype

Program (t, b) handles token t's heads of part b, one block of heads after the other (one block a part
at decode sizes, up to eight at prefill's, `head_blocks_per_program`): the first parts are q's, written
rotated to a new contiguous [N, Hq, D] tensor; the others k's, rotated into k_cache at slot loc[t], with
the same heads of v copied into v_cache. A block is a tile of rms_norm's `launch_config(D)`, which
depends on D alone: the norm sums each head's squares in a tile of the same shape and warps, with the
same load, as _rms_norm_kernel does, hence in the same order (tests/kernels/test_compile_sm90.py checks
the layouts of 16-bit activations on sm_90; with fp32 activations Triton (3.9) lays this kernel's tile
out differently, 8 values a thread against 4, so there the sums of squares, and an fp32 result, may
differ from the chain's by an ulp); it then normalises the two halves of each head (elementwise, the
same bits as the whole row) and rotates them.

q, k and v may be strided views (column slices of the fused qkv output) with a contiguous last
dimension; the caches are contiguous [slots, Hkv, D] (KVCache). No host code reads device memory
and the grid depends on shapes only: CUDA-graph safe. As with store_kv, slots are not
bounds-checked, and tokens that share a slot leave one of their values there.

`rope_store_kv_reference` is the composition of the three torch references and the CPU backend.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from moelora.kernels.kv_store import check_kv_store_inputs, copy_heads, store_kv_reference
from moelora.kernels.pdl import pdl_launch, wait_for_previous_kernel
from moelora.kernels.rms_norm import inv_rms, launch_config, load_rows, rms_norm_reference, rms_scaled
from moelora.kernels.rotary import (check_rotary_inputs, cos_sin, load_halves, rotary_embedding_reference, rotate,
                                    store_halves)

HeadNorm = tuple[torch.Tensor, float]  # an RMSNorm over each head: weight [D], eps
PROGRAMS = 2048  # head_blocks_per_program: about this many programs once a launch has more head tiles
MAX_HEAD_BLOCKS = 8


# ----------------------------------------------------------------------------------- Triton


@triton.jit
def _rotated_heads(x_ptr, w_ptr, offs_h, num_heads, stride_h, head_dim, eps, cos, sin, offs_f, f_mask,
                   HALF: tl.constexpr, HAS_NORM: tl.constexpr, INTERLEAVED: tl.constexpr,
                   BLOCK_D: tl.constexpr, dtype: tl.constexpr):
    """Heads offs_h of one token (x_ptr at the token), normalised when HAS_NORM, then rotated: the two
    halves in `dtype` (as fp32 values) and their mask."""
    mask = (offs_h < num_heads)[:, None] & f_mask[None, :]
    x1, x2 = load_halves(x_ptr + offs_h[:, None] * stride_h, offs_f[None, :], mask, HALF, INTERLEAVED)
    if HAS_NORM:
        # head_dim is a runtime value, as _rms_norm_kernel's D: the same division
        inv = inv_rms(load_rows(x_ptr, offs_h, num_heads, stride_h, head_dim, BLOCK_D).to(tl.float32), head_dim, eps)
        w1, w2 = load_halves(w_ptr, offs_f, f_mask, HALF, INTERLEAVED)
        x1 = rms_scaled(x1, inv, w1, x_ptr.dtype.element_ty).to(dtype).to(tl.float32)
        x2 = rms_scaled(x2, inv, w2, x_ptr.dtype.element_ty).to(dtype).to(tl.float32)
    out1, out2 = rotate(x1, x2, cos, sin, dtype)
    return out1, out2, mask


@triton.jit
def _rope_kv_store_kernel(
    positions_ptr, inv_freq_ptr, q_ptr, k_ptr, v_ptr, q_w_ptr, k_w_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr,
    loc_ptr, scale, q_eps, k_eps, head_dim, num_q_heads, num_kv_heads,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    HALF: tl.constexpr, HAS_NORM: tl.constexpr, INTERLEAVED: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_F: tl.constexpr, HEAD_BLOCKS: tl.constexpr,
    PDL: tl.constexpr,
):
    """Token t's q heads (program (t, b) for the first parts b) or k and v heads (the other parts), HEAD_BLOCKS
    tiles of BLOCK_H heads a part, one tile at a time: the same bits whatever HEAD_BLOCKS is."""
    wait_for_previous_kernel(PDL)
    t = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    q_blocks, kv_blocks = tl.cdiv(num_q_heads, BLOCK_H), tl.cdiv(num_kv_heads, BLOCK_H)
    q_parts = tl.cdiv(q_blocks, HEAD_BLOCKS)
    dtype: tl.constexpr = q_out_ptr.dtype.element_ty  # q's, or the norm's promote_types(weight, q)
    offs_f = tl.arange(0, BLOCK_F)
    f_mask = offs_f < HALF
    cos, sin = cos_sin(positions_ptr, inv_freq_ptr, t, scale, offs_f, f_mask, dtype)
    if part < q_parts:
        for block in range(part * HEAD_BLOCKS, tl.minimum((part + 1) * HEAD_BLOCKS, q_blocks)):
            offs_h = block * BLOCK_H + tl.arange(0, BLOCK_H)
            out1, out2, mask = _rotated_heads(q_ptr + t * stride_qt, q_w_ptr, offs_h, num_q_heads, stride_qh,
                                              head_dim, q_eps, cos, sin, offs_f, f_mask, HALF, HAS_NORM, INTERLEAVED,
                                              BLOCK_D, dtype)
            out_ptrs = q_out_ptr + (t * num_q_heads + offs_h[:, None]) * (2 * HALF) + offs_f[None, :]
            store_halves(out_ptrs, out1, out2, mask, HALF)
    else:
        slot = tl.load(loc_ptr + t).to(tl.int64)
        first = (part - q_parts) * HEAD_BLOCKS
        for block in range(first, tl.minimum(first + HEAD_BLOCKS, kv_blocks)):
            offs_h = block * BLOCK_H + tl.arange(0, BLOCK_H)
            out1, out2, mask = _rotated_heads(k_ptr + t * stride_kt, k_w_ptr, offs_h, num_kv_heads, stride_kh,
                                              head_dim, k_eps, cos, sin, offs_f, f_mask, HALF, HAS_NORM, INTERLEAVED,
                                              BLOCK_D, dtype)
            cache_ptrs = k_cache_ptr + (slot * num_kv_heads + offs_h[:, None]) * (2 * HALF) + offs_f[None, :]
            store_halves(cache_ptrs, out1, out2, mask, HALF)
            copy_heads(v_ptr, v_cache_ptr, t, slot, offs_h, num_kv_heads, stride_vt, stride_vh, 2 * HALF, BLOCK_D)


def head_blocks_per_program(tiles: int) -> int:
    """How many of a launch's head `tiles` (all tokens') each program loops over: one up to PROGRAMS tiles
    (decode), then as many as keep about PROGRAMS programs. At prefill sizes, programs of one tile spent their
    time starting and ending, not moving bytes (benchmarks/bench_norm_rope.py)."""
    return max(1, min(MAX_HEAD_BLOCKS, tiles // PROGRAMS))


def rope_store_kv_triton(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         k_cache: torch.Tensor, v_cache: torch.Tensor, loc: torch.Tensor, inv_freq: torch.Tensor,
                         scale: float, interleaved: bool, q_norm: HeadNorm | None,
                         k_norm: HeadNorm | None, *, head_blocks: int | None = None) -> torch.Tensor:
    """head_blocks: head tiles a program loops over, default `head_blocks_per_program` of the launch's tiles
    (benchmarks sweep it; the bits do not change)."""
    num_tokens, num_q_heads, head_dim = q.shape
    dtype = q.dtype if q_norm is None else torch.promote_types(q_norm[0].dtype, q.dtype)
    q_out = torch.empty(q.shape, dtype=dtype, device=q.device)
    if num_tokens == 0:
        return q_out
    # HAS_NORM=False never reads the weights
    (q_w, q_eps), (k_w, k_eps) = ((q, 0.0), (k, 0.0)) if q_norm is None else (q_norm, k_norm)
    block_h, block_d, num_warps = launch_config(head_dim)  # rms_norm's tile: the same sums of squares
    half, num_kv_heads = head_dim // 2, k.shape[1]
    q_blocks, kv_blocks = triton.cdiv(num_q_heads, block_h), triton.cdiv(num_kv_heads, block_h)
    per_program = min(head_blocks or head_blocks_per_program(num_tokens * (q_blocks + kv_blocks)), q_blocks)
    _rope_kv_store_kernel[(num_tokens, triton.cdiv(q_blocks, per_program) + triton.cdiv(kv_blocks, per_program))](
        positions, inv_freq, q, k, v, q_w, k_w, q_out, k_cache, v_cache, loc, scale, q_eps, k_eps, head_dim,
        num_q_heads, num_kv_heads, *q.stride()[:2], *k.stride()[:2], *v.stride()[:2],
        HALF=half, HAS_NORM=q_norm is not None, INTERLEAVED=interleaved, BLOCK_H=block_h, BLOCK_D=block_d,
        BLOCK_F=triton.next_power_of_2(half), HEAD_BLOCKS=per_program, num_warps=num_warps, **pdl_launch(q.device),
    )
    return q_out


# ------------------------------------------------------------------------------------ torch


def rope_store_kv_reference(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            k_cache: torch.Tensor, v_cache: torch.Tensor, loc: torch.Tensor, inv_freq: torch.Tensor,
                            scale: float, interleaved: bool, q_norm: HeadNorm | None,
                            k_norm: HeadNorm | None) -> torch.Tensor:
    """The unfused chain of torch references: the CPU backend and what the kernel must match."""
    if q_norm is not None:
        q, k = rms_norm_reference(q, *q_norm), rms_norm_reference(k, *k_norm)
    q, k = rotary_embedding_reference(positions, q, k, inv_freq, scale, interleaved)
    store_kv_reference(k_cache, v_cache, loc, k, v)
    return q


# ------------------------------------------------------------------------------ entry point


def rope_store_kv(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  k_cache: torch.Tensor, v_cache: torch.Tensor, loc: torch.Tensor, inv_freq: torch.Tensor,
                  scale: float = 1.0, interleaved: bool = False, q_norm: HeadNorm | None = None,
                  k_norm: HeadNorm | None = None, *, impl: str = "auto") -> torch.Tensor:
    """Rotated q, a new contiguous [N, Hq, D]; rotated k and v stored at k_cache[loc] and v_cache[loc].

    positions [N] (integers), q [N, Hq, D], k and v [N, Hkv, D] (one dtype for q and k, last dimension
    contiguous), k_cache and v_cache contiguous [slots, Hkv, D], loc [N] int32 or int64, inv_freq [D/2]
    (fp32), cos and sin multiplied by `scale`; `interleaved` as in rotary_embedding. q_norm and k_norm,
    both or neither: (weight [D], eps) of an RMSNorm over each head before RoPE; the rotated q and k are
    then in promote_types(weight, q). impl: "triton", "torch" or "auto" (triton on CUDA)."""
    _check_inputs(positions, q, k, v, k_cache, v_cache, loc, inv_freq, q_norm, k_norm)
    if impl == "auto":
        impl = "triton" if q.is_cuda else "torch"
    args = (positions, q, k, v, k_cache, v_cache, loc, inv_freq, scale, interleaved, q_norm, k_norm)
    if impl == "torch":
        return rope_store_kv_reference(*args)
    if impl == "triton":
        return rope_store_kv_triton(*args)
    raise ValueError(f"impl must be 'auto', 'triton' or 'torch', got {impl!r}")


def _check_inputs(positions, q, k, v, k_cache, v_cache, loc, inv_freq, q_norm, k_norm) -> None:
    """Shapes, dtypes and devices only: nothing here reads device memory (CUDA-graph safe)."""
    check_rotary_inputs(positions, q, k, inv_freq)
    check_kv_store_inputs(k_cache, v_cache, loc, k, v)
    head_dim = q.shape[2]
    if v.shape[2] != head_dim or v.stride(2) != 1:
        raise ValueError(f"v must have q's head_dim {head_dim} and a contiguous last dimension, got shape "
                         f"{tuple(v.shape)} with strides {v.stride()}")
    for name, t in (("q", q), ("positions", positions), ("inv_freq", inv_freq)):
        if t.device != k_cache.device:
            raise ValueError(f"{name} {tuple(t.shape)} must be on k_cache's device {k_cache.device}, got {t.device}")
    if (q_norm is None) != (k_norm is None):
        raise ValueError("q_norm and k_norm go together: pass both or neither")
    if q_norm is None:
        return
    for name, (weight, _) in (("q_norm", q_norm), ("k_norm", k_norm)):
        if (weight.shape != (head_dim,) or not weight.is_contiguous() or not weight.is_floating_point()
                or weight.dtype != q_norm[0].dtype or weight.device != q.device):
            raise ValueError(f"{name}'s weight must be contiguous floating point of shape ({head_dim},) for q "
                             f"{tuple(q.shape)}, with q_norm's dtype {q_norm[0].dtype}, on {q.device}, got "
                             f"{weight.dtype} {tuple(weight.shape)} on {weight.device}")
