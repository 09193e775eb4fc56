"""Rotary position embedding of q [N, Hq, D] and k [N, Hk, D] in one launch.

For token n at position p and i < D/2: f_i = p * inv_freq[i] (fp32), c_i = cos(f_i) * scale and
s_i = sin(f_i) * scale rounded to q's dtype, then in q's dtype

    out[:, i] = x1_i * c_i - x2_i * s_i,   out[:, D/2 + i] = x2_i * c_i + x1_i * s_i

with (x1, x2) the two halves of a head, or (interleaved, DeepSeek) its even and odd dimensions: the
output is then in half-split order, which leaves q.k unchanged as long as q and k are both rotated.

_rotary_kernel: one program per token for all its q and k heads. cos/sin are computed from the
positions on the fly (no cache to size, any position works); every product and sum is rounded to
the dtype as torch's elementwise ops round it, so the result matches the torch code, not just the
math. q and k may be strided views (e.g. of a fused qkv output) with a contiguous last dimension;
the results are new contiguous tensors. kernels/rope_kv_store.py rotates with the same pieces
(`cos_sin`, `load_halves`, `rotate`, `store_halves`), in the launch that stores the keys.

`rotary_embedding_reference` is the plain-torch version and the CPU backend.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from moelora.kernels.pdl import pdl_launch, wait_for_previous_kernel


@triton.jit
def _round_mul(a, b, dtype: tl.constexpr):
    """a * b rounded to `dtype` and widened again: one elementwise torch op in that dtype."""
    return (a * b).to(dtype).to(tl.float32)


@triton.jit
def cos_sin(positions_ptr, inv_freq_ptr, t, scale, offs_f, f_mask, dtype: tl.constexpr):
    """cos and sin [1, BLOCK_F] of token t's angles, times `scale`, rounded to `dtype` (as fp32 values)."""
    freqs = tl.load(positions_ptr + t).to(tl.float32) * tl.load(inv_freq_ptr + offs_f, mask=f_mask, other=0.0)
    cos = (tl.cos(freqs) * scale).to(dtype).to(tl.float32)[None, :]
    sin = (tl.sin(freqs) * scale).to(dtype).to(tl.float32)[None, :]
    return cos, sin


@triton.jit
def load_halves(ptrs, offs_f, mask, HALF: tl.constexpr, INTERLEAVED: tl.constexpr):
    """(x[i], x[D/2 + i]) at offs_f of the heads at ptrs, in fp32; interleaved, the pairs (x[2i], x[2i + 1])."""
    if INTERLEAVED:
        first, second = ptrs + 2 * offs_f, ptrs + 2 * offs_f + 1
    else:
        first, second = ptrs + offs_f, ptrs + HALF + offs_f
    return (tl.load(first, mask=mask, other=0.0).to(tl.float32),
            tl.load(second, mask=mask, other=0.0).to(tl.float32))


@triton.jit
def rotate(x1, x2, cos, sin, dtype: tl.constexpr):
    """The rotated halves, each product and sum rounded to `dtype` as torch's elementwise ops round them."""
    out1 = _round_mul(x1, cos, dtype) - _round_mul(x2, sin, dtype)
    out2 = _round_mul(x2, cos, dtype) + _round_mul(x1, sin, dtype)
    return out1.to(dtype), out2.to(dtype)


@triton.jit
def store_halves(ptrs, out1, out2, mask, HALF: tl.constexpr):
    """out1 and out2 to the first and second halves of contiguous heads (ptrs at their column offs_f), in
    the destination's dtype."""
    tl.store(ptrs, out1.to(ptrs.dtype.element_ty), mask=mask)
    tl.store(ptrs + HALF, out2.to(ptrs.dtype.element_ty), mask=mask)


@triton.jit
def _rotate_heads(x_ptr, out_ptr, stride_h, num_heads, cos, sin, offs_f, f_mask,
                  HALF: tl.constexpr, INTERLEAVED: tl.constexpr, BLOCK_H: tl.constexpr):
    """Rotates the num_heads heads of one token: x_ptr/out_ptr point at its first head."""
    heads = tl.arange(0, BLOCK_H)
    mask = (heads < num_heads)[:, None] & f_mask[None, :]
    x1, x2 = load_halves(x_ptr + heads[:, None] * stride_h, offs_f[None, :], mask, HALF, INTERLEAVED)
    out1, out2 = rotate(x1, x2, cos, sin, out_ptr.dtype.element_ty)
    store_halves(out_ptr + heads[:, None] * (2 * HALF) + offs_f[None, :], out1, out2, mask, HALF)


@triton.jit
def _rotary_kernel(
    positions_ptr, inv_freq_ptr, q_ptr, k_ptr, q_out_ptr, k_out_ptr, scale,
    stride_qt, stride_qh, stride_kt, stride_kh, num_q_heads, num_k_heads,
    HALF: tl.constexpr, BLOCK_F: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_previous_kernel(PDL)
    t = tl.program_id(0).to(tl.int64)
    offs_f = tl.arange(0, BLOCK_F)
    f_mask = offs_f < HALF
    cos, sin = cos_sin(positions_ptr, inv_freq_ptr, t, scale, offs_f, f_mask, q_out_ptr.dtype.element_ty)
    _rotate_heads(q_ptr + t * stride_qt, q_out_ptr + t * num_q_heads * (2 * HALF), stride_qh, num_q_heads,
                  cos, sin, offs_f, f_mask, HALF, INTERLEAVED, BLOCK_HQ)
    _rotate_heads(k_ptr + t * stride_kt, k_out_ptr + t * num_k_heads * (2 * HALF), stride_kh, num_k_heads,
                  cos, sin, offs_f, f_mask, HALF, INTERLEAVED, BLOCK_HK)


def rotary_embedding_triton(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, inv_freq: torch.Tensor,
                            scale: float, interleaved: bool) -> tuple[torch.Tensor, torch.Tensor]:
    num_tokens, num_q_heads, head_dim = q.shape
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if num_tokens == 0:
        return q_out, k_out
    half = head_dim // 2
    _rotary_kernel[(num_tokens,)](
        positions, inv_freq, q, k, q_out, k_out, scale, *q.stride()[:2], *k.stride()[:2], num_q_heads, k.shape[1],
        HALF=half, BLOCK_F=triton.next_power_of_2(half), BLOCK_HQ=triton.next_power_of_2(num_q_heads),
        BLOCK_HK=triton.next_power_of_2(k.shape[1]), INTERLEAVED=interleaved, num_warps=4, **pdl_launch(q.device),
    )
    return q_out, k_out


# ------------------------------------------------------------------------------------ torch


def rotary_embedding_reference(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, inv_freq: torch.Tensor,
                               scale: float, interleaved: bool) -> tuple[torch.Tensor, torch.Tensor]:
    freqs = positions[:, None].float() * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)[:, None]
    cos, sin = (emb.cos() * scale).to(q.dtype), (emb.sin() * scale).to(q.dtype)
    return _rotate_reference(q, cos, sin, interleaved), _rotate_reference(k, cos, sin, interleaved)


def _rotate_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    if interleaved:
        x = torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


# ------------------------------------------------------------------------------ entry point


def rotary_embedding(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, inv_freq: torch.Tensor,
                     scale: float = 1.0, interleaved: bool = False, *,
                     impl: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """positions [N] (integers), q [N, Hq, D], k [N, Hk, D] (same dtype, last dimension contiguous),
    inv_freq [D/2] (fp32), cos and sin multiplied by `scale` -> rotated (q, k), in the half-split order
    even when `interleaved`. impl: "triton", "torch" or "auto" (triton on CUDA)."""
    check_rotary_inputs(positions, q, k, inv_freq)
    if impl == "auto":
        impl = "triton" if q.is_cuda else "torch"
    if impl == "torch":
        return rotary_embedding_reference(positions, q, k, inv_freq, scale, interleaved)
    if impl == "triton":
        return rotary_embedding_triton(positions, q, k, inv_freq, scale, interleaved)
    raise ValueError(f"impl must be 'auto', 'triton' or 'torch', got {impl!r}")


def check_rotary_inputs(positions, q, k, inv_freq) -> None:
    """Shape and dtype checks only: nothing here reads device memory (CUDA-graph safe)."""
    if q.dim() != 3 or k.dim() != 3 or k.shape[0] != q.shape[0] or k.shape[2] != q.shape[2]:
        raise ValueError(f"q and k must be [tokens, heads, head_dim] with the same tokens and head_dim, "
                         f"got {tuple(q.shape)} and {tuple(k.shape)}")
    head_dim = q.shape[2]
    if head_dim % 2 or q.dtype != k.dtype or q.stride(2) != 1 or k.stride(2) != 1:
        raise ValueError(f"q and k need an even head_dim, one dtype and a contiguous last dimension, got head_dim "
                         f"{head_dim}, {q.dtype} and {k.dtype}, last strides {q.stride(2)} and {k.stride(2)}")
    if positions.shape != (q.shape[0],) or positions.is_floating_point() or not positions.is_contiguous():
        raise ValueError(f"positions must be contiguous integers of shape ({q.shape[0]},), got {positions.dtype} "
                         f"{tuple(positions.shape)}")
    if inv_freq.shape != (head_dim // 2,) or not inv_freq.is_contiguous():
        raise ValueError(f"inv_freq must be contiguous of shape ({head_dim // 2},), got {tuple(inv_freq.shape)}")
