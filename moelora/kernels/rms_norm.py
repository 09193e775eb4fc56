"""RMSNorm (optionally fused with the residual add) in one Triton kernel, as transformers computes it:

    s   = x + residual                    rounded to x's dtype (only with a residual)
    h   = s * rsqrt(mean(s^2) + eps)      in fp32, rounded to x's dtype
    out = weight * h                      in fp32, rounded to promote_types(weight, x)

x is [..., D] with the last dimension contiguous; the leading dimensions are read through their
strides, so the per-head q/k norm of a column slice of the fused qkv output (q.view(n, heads, D),
row stride != heads * D) needs no copy. One program per row and block of heads normalises a
[BLOCK_H, BLOCK_D] tile held in registers: x is read once, with no second pass over memory, and
BLOCK_D = next power of two of D covers every hidden size we serve (7168 at most) up to MAX_D.

The tile and the warps depend on D alone (`launch_config`), not on the batch or the number of
heads: the order of a row's fp32 sum of squares follows from them, so a row's result does not
depend on what it is batched with, and kernels/rope_kv_store.py, which normalises q's and k's heads
in tiles of the same shape and warps with the same pieces (`load_rows`, `inv_rms`, `rms_scaled`),
gets the same bits as this kernel.

The outputs are new contiguous tensors, not written in place into x and residual (vLLM's
fused_add_rms_norm): that would save no memory traffic, only an allocation, and would make the
GPU path overwrite its inputs where the torch path does not.

`rms_norm_reference` is the plain-torch version and the CPU backend.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from moelora.kernels.pdl import pdl_launch, wait_for_previous_kernel

MAX_D = 16384  # register tile limit: 16 warps x 32 lanes x 32 fp32 values
TILE = 512  # elements per warp: 16 fp32 values a lane; rows shorter than a warp's tile share one (head_dim 128: 4)


# ----------------------------------------------------------------------------------- Triton


@triton.jit
def load_rows(x_ptr, offs_h, num_heads, stride_h, D, BLOCK_D: tl.constexpr):
    """The [BLOCK_H, BLOCK_D] tile of heads offs_h of one row (x_ptr at the row), 0 past D and num_heads."""
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h < num_heads)[:, None] & (offs_d < D)[None, :]
    return tl.load(x_ptr + offs_h[:, None] * stride_h + offs_d[None, :], mask=mask, other=0.0)


@triton.jit
def inv_rms(h, D, eps):
    """1 / sqrt(mean(h^2) + eps) of each row of the fp32 tile h [BLOCK_H, BLOCK_D] (zeros past D)."""
    return tl.math.rsqrt(tl.sum(h * h, axis=1) / D + eps)


@triton.jit
def rms_scaled(h, inv, w, dtype: tl.constexpr):
    """weight * (h * inv) in fp32, h * inv rounded to `dtype` (x's) first, as transformers rounds it;
    h [BLOCK_H, n] (fp32), inv [BLOCK_H], w [n] (fp32): whole rows or any columns of them."""
    return w[None, :] * (h * inv[:, None]).to(dtype).to(tl.float32)


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, sum_ptr, num_heads, D, eps,
    stride_xr, stride_xh, stride_rr, stride_rh,
    HAS_RESIDUAL: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    PDL: tl.constexpr,
):
    """out[row, heads of this program] (and sum_ptr, with a residual): outputs contiguous [rows, heads, D]."""
    wait_for_previous_kernel(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h < num_heads)[:, None] & (offs_d < D)[None, :]
    s = load_rows(x_ptr + row * stride_xr, offs_h, num_heads, stride_xh, D, BLOCK_D)
    out_offs = (row * num_heads + offs_h[:, None]) * D + offs_d[None, :]
    if HAS_RESIDUAL:
        r = load_rows(res_ptr + row * stride_rr, offs_h, num_heads, stride_rh, D, BLOCK_D)
        s = (s.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(sum_ptr + out_offs, s, mask=mask)
    h = s.to(tl.float32)
    w = tl.load(w_ptr + offs_d, mask=offs_d < D, other=0.0).to(tl.float32)
    out = rms_scaled(h, inv_rms(h, D, eps), w, x_ptr.dtype.element_ty)
    tl.store(out_ptr + out_offs, out.to(out_ptr.dtype.element_ty), mask=mask)


def launch_config(dim: int) -> tuple[int, int, int]:
    """BLOCK_H, BLOCK_D and num_warps for rows of `dim`, whatever their number of heads: 16 fp32 values a
    lane, TILE elements a warp (several heads share one below TILE)."""
    block_d = triton.next_power_of_2(dim)
    block_h = max(1, TILE // block_d)
    return block_h, block_d, min(16, block_h * block_d // TILE)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float,
                    residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    dim = x.shape[-1]
    if dim > MAX_D:
        raise ValueError(f"x: the Triton RMSNorm handles rows of up to {MAX_D} elements, got shape {tuple(x.shape)}")
    # [rows, heads, D] views; a 4D+ x whose leading dimensions do not merge is copied (no caller has one)
    x3 = x.reshape(-1, *x.shape[-2:]) if x.dim() > 2 else x.view(-1, 1, dim)
    rows, heads = x3.shape[:2]
    out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    if residual is None:  # HAS_RESIDUAL=False never reads or writes these
        res3, summed, res_strides = x3, out, (0, 0)
    else:
        res3, summed = residual.reshape(x3.shape), torch.empty(x.shape, dtype=x.dtype, device=x.device)
        res_strides = res3.stride()[:2]
    block_h, block_d, num_warps = launch_config(dim)
    if out.numel():
        _rms_norm_kernel[(rows, triton.cdiv(heads, block_h))](
            x3, res3, weight, out, summed, heads, dim, eps, *x3.stride()[:2], *res_strides,
            HAS_RESIDUAL=residual is not None, BLOCK_H=block_h, BLOCK_D=block_d, num_warps=num_warps,
            **pdl_launch(x.device),
        )
    return out if residual is None else (out, summed)


# ------------------------------------------------------------------------------------ torch


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float,
                       residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """transformers' RMSNorm, op for op: the CPU backend and what the kernel must match."""
    if residual is not None:
        x = residual = x + residual
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    out = weight * h.to(x.dtype)
    return out if residual is None else (out, residual)


# ------------------------------------------------------------------------------ entry point


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None, *,
             impl: str = "auto") -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """norm(x) [..., D] scaled by weight [D]; with `residual` (x's shape and dtype) the decoder's
    add-then-norm, returning (norm(x + residual), x + residual). impl: "triton", "torch" or "auto"
    (triton on CUDA)."""
    _check_inputs(x, weight, residual)
    if impl == "auto":
        impl = "triton" if x.is_cuda else "torch"
    if impl == "torch":
        return rms_norm_reference(x, weight, eps, residual)
    if impl == "triton":
        return rms_norm_triton(x, weight, eps, residual)
    raise ValueError(f"impl must be 'auto', 'triton' or 'torch', got {impl!r}")


def _check_inputs(x, weight, residual) -> None:
    """Shape and dtype checks only: nothing here reads device memory (CUDA-graph safe)."""
    if x.dim() == 0 or x.stride(-1) != 1 or not x.is_floating_point():
        raise ValueError(f"x must be floating point [..., D] and contiguous in its last dimension, got {x.dtype} "
                         f"{tuple(x.shape)} with strides {x.stride()}")
    if weight.shape != x.shape[-1:] or not weight.is_floating_point() or not weight.is_contiguous():
        raise ValueError(f"weight must be contiguous floating point of shape ({x.shape[-1]},) for x {tuple(x.shape)}, "
                         f"got {weight.dtype} {tuple(weight.shape)}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype or residual.stride(-1) != 1):
        raise ValueError(f"residual must be {x.dtype} of x's shape {tuple(x.shape)}, contiguous in its last "
                         f"dimension, got {residual.dtype} {tuple(residual.shape)}")
