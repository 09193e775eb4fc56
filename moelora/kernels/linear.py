"""Dense projection y = x @ W^T (+ bias) whose rows do not depend on the batch (Triton).

cuBLAS picks its algorithm by the number of rows M (GEMV at M = 1, split-K, other tiles), so a
row's bits change with what it is batched with: one bf16 ulp in a down_proj is enough to flip a
near-tied greedy token between a request run alone and the same request in a batch. This GEMM is
batch invariant by construction: every config has the one BLOCK_K of its dtype (64 for bf16/fp16,
32 for fp32, `gemm_block_k`), there is no split-K, and the K loop always runs from 0 to K in
BLOCK_K steps, accumulating into one fp32 accumulator with `acc += tl.dot(x_tile, w_tile)`. The
configs vary BLOCK_M, BLOCK_N, GROUP_M, num_warps and num_stages with M; none of them changes the
order of a row's sums. The bias is added to the fp32 accumulator before the one rounding to the
output dtype, as cuBLAS's addmm does.

`linear_reference` (torch's nn.functional.linear, i.e. cuBLAS) is the CPU backend and what the
kernel is checked against.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl
from torch import nn

from moelora.kernels.gemm_tiles import gemm_block_k, gemm_loop, grouped_tile

MIN_PROGRAMS = 120  # about one program per SM of an H100 / H200 (132): below it, a smaller tile is tried


@dataclass(frozen=True)
class LinearConfig:
    block_m: int
    block_n: int
    group_m: int
    num_warps: int
    num_stages: int


# candidate tiles by M, largest first; `default_config` takes the first that gives MIN_PROGRAMS programs
_DECODE = (LinearConfig(16, 64, 8, 4, 5), LinearConfig(16, 32, 8, 4, 5), LinearConfig(16, 16, 8, 4, 5))
_SMALL = (LinearConfig(32, 64, 8, 4, 4), LinearConfig(32, 32, 8, 4, 4), LinearConfig(32, 16, 8, 4, 4))
_MEDIUM = (LinearConfig(64, 128, 8, 4, 4), LinearConfig(64, 64, 8, 4, 4), LinearConfig(64, 32, 8, 4, 4))
_LARGE = (LinearConfig(128, 256, 8, 8, 3), LinearConfig(128, 128, 8, 8, 4), LinearConfig(64, 128, 8, 4, 4))


def default_config(M: int, N: int) -> LinearConfig:
    """Tiles for M rows and N output columns (K and the dtype do not change the choice; BLOCK_K is
    the dtype's, not the config's).

    Up to 256 rows (decode: M <= 16, BLOCK_M 16) the GEMM is bound by reading W, so the tile is the
    widest that still gives about one program per SM (o_proj's N = 2048 at decode: 16 columns);
    from BLOCK_M 64 tl.dot is a Hopper wgmma. Prefill (M > 256) is bound by the tensor cores: 128 x 256 or
    128 x 128 tiles with 8 warps and GROUP_M 8 for L2 reuse of W, as Triton's matmul tutorial has
    them on Hopper, while they still fill the SMs."""
    candidates = _DECODE if M <= 16 else _SMALL if M <= 32 else _MEDIUM if M <= 256 else _LARGE
    narrow_n = max(16, triton.next_power_of_2(N))  # tl.dot needs 16; a tile wider than N only reads masks
    tiles = [replace(c, block_n=min(c.block_n, narrow_n)) for c in candidates]
    return next((c for c in tiles if triton.cdiv(M, c.block_m) * triton.cdiv(N, c.block_n) >= MIN_PROGRAMS), tiles[-1])


# ----------------------------------------------------------------------------------- Triton


@triton.jit
def _linear_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, stride_xm,
                   HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   GROUP_M: tl.constexpr):
    """y[m-tile, n-tile] = x[m-tile] @ W[n-tile]^T (+ b); W and y contiguous, offsets in int64
    (prefill logits: M * N > 2^31)."""
    pid_m, pid_n = grouped_tile(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask, n_mask = offs_m < M, offs_n < N
    x_ptrs = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm + offs_k[None, :]
    w_ptrs = w_ptr + offs_n.to(tl.int64)[None, :] * K + offs_k[:, None]
    acc, _ = gemm_loop(x_ptrs, m_mask, K, w_ptrs, w_ptrs, n_mask, False, BLOCK_M, BLOCK_N, BLOCK_K)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    y_ptrs = y_ptr + offs_m.to(tl.int64)[:, None] * N + offs_n[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def linear_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  config: LinearConfig | None = None) -> torch.Tensor:
    (M, K), N = x.shape, weight.shape[0]
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0 or N == 0:
        return y
    cfg = config or default_config(M, N)
    grid = (triton.cdiv(M, cfg.block_m) * triton.cdiv(N, cfg.block_n),)
    _linear_kernel[grid](
        x, weight, weight if bias is None else bias, y, M, N, K, x.stride(0),  # HAS_BIAS=False never reads b
        HAS_BIAS=bias is not None, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=gemm_block_k(x.dtype),
        GROUP_M=cfg.group_m, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return y


# ------------------------------------------------------------------------------------ torch


def linear_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """torch's linear (cuBLAS on CUDA): the CPU backend; on a GPU its rows depend on the batch."""
    return nn.functional.linear(x, weight, bias)


# ------------------------------------------------------------------------------ entry point


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
           impl: str = "auto", config: LinearConfig | None = None) -> torch.Tensor:
    """y [M, N] = x [M, K] @ weight [N, K]^T (+ bias [N]), a new contiguous tensor in x's dtype with
    fp32 accumulation. x's rows may be strided (last dimension contiguous); weight and bias are
    contiguous. impl: "triton", "torch" or "auto" (triton on CUDA)."""
    _check_inputs(x, weight, bias)
    if impl == "auto":
        impl = "triton" if x.is_cuda else "torch"
    if impl == "torch":
        return linear_reference(x, weight, bias)
    if impl == "triton":
        return linear_triton(x, weight, bias, config)
    raise ValueError(f"impl must be 'auto', 'triton' or 'torch', got {impl!r}")


def _check_inputs(x, weight, bias) -> None:
    """Shape and dtype checks only: nothing here reads device memory (CUDA-graph safe)."""
    if x.dim() != 2 or x.stride(-1) != 1 or not x.is_floating_point():
        raise ValueError(f"x must be floating point [M, K] and contiguous in its last dimension, got {x.dtype} "
                         f"{tuple(x.shape)} with strides {x.stride()}")
    if weight.dim() != 2 or weight.shape[1] != x.shape[1] or not weight.is_contiguous():
        raise ValueError(f"weight must be contiguous [N, {x.shape[1]}] for x {tuple(x.shape)}, got shape "
                         f"{tuple(weight.shape)} with strides {weight.stride()}")
    if bias is not None and (bias.shape != weight.shape[:1] or not bias.is_contiguous()):
        raise ValueError(f"bias must be contiguous of shape ({weight.shape[0]},) for weight {tuple(weight.shape)}, "
                         f"got {tuple(bias.shape)}")
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and (t.dtype != x.dtype or t.device != x.device):
            raise ValueError(f"{name} must have x's dtype {x.dtype} and device {x.device}, got {t.dtype} on {t.device}")
