"""The sum of a few partial results of one shape (the tensor-parallel ranks' shares of a projection's output) in a
fixed order: part 0 + part 1 + ... added in fp32, rounded once to the output's dtype, in one Triton kernel.

Every element's sum is the same whatever the tensor's size, so a row's result does not depend on the rows beside it.
NCCL's all-reduce gives no such promise past two ranks: which rank an element's sum starts from follows the
message's chunking (its size, algorithm and channels), so the same row would round differently in a batch of 3
(eager) and in a CUDA graph padded to 4, or alone. layers/collectives.py gathers the ranks' shares and sums them here.

layers/moe/all_to_all.py sums a token's partial sums from the ranks of its experts here too. Strided parts (a
transposed view) sum over a middle dimension. Nothing reads device memory on the host and the grid depends on shapes
only, so it is captured in CUDA graphs.
`sum_in_order_reference` is the torch version and the CPU backend."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from moelora.kernels.pdl import pdl_launch, wait_for_previous_kernel

BLOCK = 1024  # columns per program


@triton.jit(do_not_specialize=["stride_p", "stride_r"])  # scalars, not constants: their int64 products below
def _sum_in_order_kernel(parts_ptr, out_ptr, C, stride_p, stride_r, PARTS: tl.constexpr, BLOCK: tl.constexpr,
                         PDL: tl.constexpr):
    """out[r, c] = parts[0, r, c] + parts[1, r, c] + ..., for row r = program 0 and BLOCK columns a program."""
    wait_for_previous_kernel(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < C
    src = parts_ptr + row * stride_r + cols
    total = tl.load(src, mask=mask).to(tl.float32)
    for p in tl.static_range(1, PARTS):
        total += tl.load(src + stride_p.to(tl.int64) * p, mask=mask).to(tl.float32)
    tl.store(out_ptr + row * C + cols, total.to(out_ptr.dtype.element_ty), mask=mask)


def sum_in_order_triton(parts: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    if out.numel():
        parts3 = parts if parts.dim() == 3 else parts[:, None]
        rows, cols = parts3.shape[1:]
        _sum_in_order_kernel[(rows, triton.cdiv(cols, BLOCK))](parts3, out, cols, parts3.stride(0), parts3.stride(1),
                                                              PARTS=parts.shape[0], BLOCK=BLOCK, num_warps=4,
                                                              **pdl_launch(out.device))
    return out


def sum_in_order_reference(parts: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """The kernel's sums, one part at a time: what it must match bit for bit."""
    total = parts[0].to(torch.float32, copy=True)
    for part in parts[1:]:
        total += part.float()
    return out.copy_(total)


def sum_in_order(parts: torch.Tensor, out: torch.Tensor, impl: str = "auto") -> torch.Tensor:
    """out = parts[0] + parts[1] + ... (in that order, in fp32, rounded once to out's dtype); returns out.
    parts [P, C] or [P, R, C] of any floating dtype and any strides but a unit one along C (a transposed view
    sums a middle dimension); out contiguous [C] or [R, C], on parts' device.
    impl: "triton", "torch" or "auto" (triton on CUDA)."""
    if parts.dim() not in (2, 3) or parts.shape[0] < 1 or parts.shape[1:] != out.shape or parts.stride(-1) != 1 \
            or not out.is_contiguous() or parts.device != out.device or not parts.is_floating_point() \
            or not out.is_floating_point():
        raise ValueError(f"parts must be floating point [P, *{tuple(out.shape)}] (P >= 1, the last dimension of "
                         f"unit stride) on {out.device} for contiguous floating point out [C] or [R, C], got parts "
                         f"{parts.dtype} {tuple(parts.shape)} of strides {parts.stride()} on {parts.device} and out "
                         f"{out.dtype} {tuple(out.shape)} (contiguous: {out.is_contiguous()})")
    if impl == "auto":
        impl = "triton" if out.is_cuda else "torch"
    if impl == "torch":
        return sum_in_order_reference(parts, out)
    if impl == "triton":
        return sum_in_order_triton(parts, out)
    raise ValueError(f"impl must be 'auto', 'triton' or 'torch', got {impl!r}")
