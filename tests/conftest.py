"""Test setup: Triton runs in its interpreter on machines without a GPU (set before triton loads)."""
import os

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

