"""The pieces of gemm_tiles on their own: the kernels' results test them too, but a partial skipped, added twice or
out of order there shows only as a wrong low bit in some rows."""
import pytest
import torch
import triton
import triton.language as tl

from moelora.kernels.gemm_tiles import SUM_ROUND_ELEMENTS, loads_a_round, sum_loads_in_order


@triton.jit
def _sum_kernel(part_ptr, out_ptr, rows, n, stride_p, ROWS: tl.constexpr, COLS: tl.constexpr, ROUND: tl.constexpr):
    """out[:rows] = the sum in order of part[0..n) [rows, COLS] (parts stride_p elements apart), ROUND loads a round."""
    offs = tl.arange(0, ROWS)[:, None] * COLS + tl.arange(0, COLS)[None, :]
    mask = (tl.arange(0, ROWS) < rows)[:, None]
    tl.store(out_ptr + offs, sum_loads_in_order(part_ptr + offs, stride_p, mask, n, ROUND), mask=mask)


@pytest.mark.parametrize("n, round_", [(1, 1), (5, 8), (8, 8), (13, 4), (20, 32), (33, 16)])
def test_sum_loads_in_order_adds_each_partial_once_in_order(n, round_, device, poison):
    """Partials of a wide range of magnitudes, so that any other order or a partial skipped or added twice changes
    the bits: the sum equals ((0 + p0) + p1) + ... in fp32, whatever the loads a round; masked rows are 0."""
    rows, cols = 16, 16
    gen = torch.Generator().manual_seed(n * 100 + round_)
    parts = torch.randn(n, rows, cols, generator=gen) * torch.logspace(-6, 6, n).view(n, 1, 1)
    parts = parts.to(device)
    expected = torch.zeros(rows, cols, device=device)
    for p in parts:
        expected += p
    out = torch.empty(rows, cols, device=device)  # NaN (poison)
    _sum_kernel[(1,)](parts, out, rows - 3, n, rows * cols, ROWS=rows, COLS=cols, ROUND=round_)
    assert torch.equal(out[:rows - 3], expected[:rows - 3])
    assert out[rows - 3:].isnan().all(), "masked rows are not stored"


def test_loads_a_round_keeps_a_rounds_elements_in_bounds():
    assert loads_a_round(16, 16 * 16) == 16  # o_proj's 16 shrink splits at decode: one round
    assert loads_a_round(100, 16 * 16) == SUM_ROUND_ELEMENTS // 256
    assert loads_a_round(4, 64 * 256) == 1  # a tile past the round's elements: one at a time
