"""Test setup: Triton runs in its interpreter on machines without a GPU (set before triton loads)."""
import os

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def device() -> str:
    return DEVICE


@pytest.fixture
def poison(monkeypatch):
    """Every torch.empty / empty_like returns NaN (floats) or a huge value (ints), so an output
    element that a kernel forgets to write fails the comparison instead of passing as zero."""
    real_empty, real_empty_like = torch.empty, torch.empty_like

    def fill(t):
        if t.is_floating_point():
            return t.fill_(float("nan"))
        if t.dtype != torch.bool:
            return t.fill_(torch.iinfo(t.dtype).max // 3)
        return t

    monkeypatch.setattr(torch, "empty", lambda *a, **k: fill(real_empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: fill(real_empty_like(*a, **k)))


@pytest.fixture(autouse=True, scope="session")
def _row_independent_interpreter_dot():
    """On the CPU interpreter, compute tl.dot so that an output row's bits do not depend on the row's index in
    the tile. The interpreter's tl.dot is np.matmul, i.e. the host's BLAS sgemm, which sums a row in an order
    that depends on the row's index (which micro-kernel or edge case of the CPU's OpenBLAS build covers it,
    so it differs between machines): the same row at another index of a block differs by about an fp32 ulp,
    and the bit-for-bit checks of the kernel tests (base rows with and without LoRA, a row alone or in a
    batch, tiles and blockings agreeing) failed on some CPUs alone. A GPU MMA computes every row of a tile
    alike; the checks exist for that. Here each element is a sum over k in one order, the same for every
    row, and nothing else is changed. On a GPU this fixture does nothing."""
    if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1":
        yield
        return
    from triton.runtime import interpreter
    real_dot = interpreter.InterpreterBuilder.create_dot

    def create_dot(self, a, b, d, *args):
        if a.data.ndim != 2 or b.data.ndim != 2 or a.dtype.primitive_bitwidth == 8:
            return real_dot(self, a, b, d, *args)
        acc = d.data.dtype  # fp32: products of fp16 inputs are exact in it
        # operands made C-contiguous first: numpy's sum follows its operands' memory layout, and a transposed operand
        # (a tile loaded through a descriptor, then .T) would otherwise sum in another order
        a_data, b_data = np.ascontiguousarray(a.data, dtype=acc), np.ascontiguousarray(b.data, dtype=acc)
        out = (a_data[:, :, None] * b_data[None, :, :]).sum(axis=1, dtype=acc)
        return interpreter.TensorHandle(out + d.data, d.dtype.scalar)

    interpreter.InterpreterBuilder.create_dot = create_dot  # for the session: a test's own monkeypatch
    yield                                                    # fixture then still tears down first
    interpreter.InterpreterBuilder.create_dot = real_dot
