"""Write the new tokens' keys and values into the paged KV cache in one Triton kernel.

torch's `cache[loc] = k` is an index-put: two kernel launches a layer in every forward step (keys,
then values), more when k or v needs a dtype conversion. Here one launch does both: program (t, h)
reads token t's heads of block h from k and v through their token and head strides (column slices
of the fused qkv output, MLA's per-head split, an expanded head: no copy), converts them to the
cache dtype and stores them at slot loc[t]. The caches must be contiguous [slots, heads, D] (as
KVCache allocates them); k and v need a contiguous last dimension, else the Triton path copies
them first (no caller has one). Dk and Dv may differ and need not be powers of two (masked).

Nothing reads device memory on the host and the grid depends on shapes only, so it is captured in
CUDA graphs. Unlike torch's index-put, slots are not bounds-checked (that would need a device
assert); as with it, tokens that share a slot (the padded rows of a graph batch all write slot 0)
leave one of their values there.

`store_kv_reference` is the torch version and the CPU backend. kernels/rope_kv_store.py stores the
values of GQA layers with `copy_heads` too, in the launch that rotates their keys.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from moelora.kernels.pdl import pdl_launch, wait_for_previous_kernel

TILE = 4096  # elements per program at most, of the wider of k and v: several heads share one when D is small


# ----------------------------------------------------------------------------------- Triton


@triton.jit
def copy_heads(src_ptr, dst_ptr, t, slot, offs_h, num_heads, stride_t, stride_h,
               D: tl.constexpr, BLOCK_D: tl.constexpr):
    """dst[slot, offs_h, :] = src[t, offs_h, :] in dst's dtype; dst is contiguous [slots, num_heads, D]."""
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h < num_heads)[:, None] & (offs_d < D)[None, :]
    x = tl.load(src_ptr + t * stride_t + offs_h[:, None] * stride_h + offs_d[None, :], mask=mask)
    tl.store(dst_ptr + (slot * num_heads + offs_h[:, None]) * D + offs_d[None, :],
             x.to(dst_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _store_kv_kernel(
    k_cache_ptr, v_cache_ptr, loc_ptr, k_ptr, v_ptr, num_heads, stride_kt, stride_kh, stride_vt, stride_vh,
    DK: tl.constexpr, DV: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_previous_kernel(PDL)
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(loc_ptr + t).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    copy_heads(k_ptr, k_cache_ptr, t, slot, offs_h, num_heads, stride_kt, stride_kh, DK, BLOCK_DK)
    copy_heads(v_ptr, v_cache_ptr, t, slot, offs_h, num_heads, stride_vt, stride_vh, DV, BLOCK_DV)


def launch_config(heads: int, k_dim: int, v_dim: int) -> tuple[int, int, int, int]:
    """BLOCK_H, BLOCK_DK, BLOCK_DV and num_warps: 8 values of the wider tile per lane, 8 warps at most."""
    block_dk, block_dv = triton.next_power_of_2(k_dim), triton.next_power_of_2(v_dim)
    block_d = max(block_dk, block_dv)
    block_h = min(triton.next_power_of_2(heads), max(1, TILE // block_d))
    return block_h, block_dk, block_dv, min(8, max(1, block_h * block_d // 256))


def store_kv_triton(k_cache: torch.Tensor, v_cache: torch.Tensor, loc: torch.Tensor, k: torch.Tensor,
                    v: torch.Tensor) -> None:
    k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (k, v))
    (_, heads, k_dim), v_dim = k_cache.shape, v_cache.shape[-1]
    block_h, block_dk, block_dv, num_warps = launch_config(heads, k_dim, v_dim)
    if loc.numel():
        _store_kv_kernel[(loc.numel(), triton.cdiv(heads, block_h))](
            k_cache, v_cache, loc, k, v, heads, *k.stride()[:2], *v.stride()[:2],
            DK=k_dim, DV=v_dim, BLOCK_H=block_h, BLOCK_DK=block_dk, BLOCK_DV=block_dv, num_warps=num_warps,
            **pdl_launch(k.device),
        )


# ------------------------------------------------------------------------------------ torch


def store_kv_reference(k_cache: torch.Tensor, v_cache: torch.Tensor, loc: torch.Tensor, k: torch.Tensor,
                       v: torch.Tensor) -> None:
    """The index-put: the CPU backend and what the kernel must match bit for bit."""
    k_cache[loc] = k.to(k_cache.dtype)
    v_cache[loc] = v.to(v_cache.dtype)


# ------------------------------------------------------------------------------ entry point


def store_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             impl: str = "auto") -> None:
    """k_cache[loc] = k and v_cache[loc] = v, in the caches' dtype. k_cache [slots, heads, Dk] and v_cache
    [slots, heads, Dv] contiguous, loc [N] int32 or int64, k [N, heads, Dk], v [N, heads, Dv].
    impl: "triton", "torch" or "auto" (triton on CUDA)."""
    check_kv_store_inputs(k_cache, v_cache, loc, k, v)
    if impl == "auto":
        impl = "triton" if k_cache.is_cuda else "torch"
    if impl == "torch":
        store_kv_reference(k_cache, v_cache, loc, k, v)
    elif impl == "triton":
        store_kv_triton(k_cache, v_cache, loc, k, v)
    else:
        raise ValueError(f"impl must be 'auto', 'triton' or 'torch', got {impl!r}")


def check_kv_store_inputs(k_cache, v_cache, loc, k, v) -> None:
    """Shapes, dtypes and devices only: nothing here reads device memory (CUDA-graph safe)."""
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if cache.dim() != 3 or not cache.is_contiguous() or not cache.is_floating_point():
            raise ValueError(f"{name} must be contiguous floating point [slots, heads, D], got {cache.dtype} "
                             f"{tuple(cache.shape)} with strides {cache.stride()}")
    if v_cache.shape[:2] != k_cache.shape[:2] or v_cache.device != k_cache.device:
        raise ValueError(f"v_cache {tuple(v_cache.shape)} on {v_cache.device} must have the slots and heads of "
                         f"k_cache {tuple(k_cache.shape)} on {k_cache.device}")
    if loc.dim() != 1 or loc.dtype not in (torch.int32, torch.int64) or loc.device != k_cache.device:
        raise ValueError(f"loc must be [N] int32 or int64 on {k_cache.device}, got {loc.dtype} {tuple(loc.shape)} "
                         f"on {loc.device}")
    for name, x, cache in (("k", k, k_cache), ("v", v, v_cache)):
        expected = (loc.shape[0], *cache.shape[1:])
        if x.shape != expected or not x.is_floating_point() or x.device != cache.device:
            raise ValueError(f"{name} must be floating point of shape {expected} on {cache.device} for loc "
                             f"{tuple(loc.shape)} and {name}_cache {tuple(cache.shape)}, got {x.dtype} "
                             f"{tuple(x.shape)} on {x.device}")
