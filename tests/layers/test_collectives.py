"""The layers' tensor-parallel sum over 3 and 4 gloo ranks: each element is the ranks' values added in rank order
(values chosen so that other orders round otherwise), by either exchange (one all-gather, or an all-to-all of
chunks then an all-gather), so a row's bits do not depend on the rows sent with it."""
import functools

import pytest
import torch

from moelora.distributed.state import ParallelState, get_parallel
from moelora.kernels.sum_in_order import sum_in_order_reference
from moelora.layers import collectives
from tests.distributed.ranks import run_ranks

HIDDEN = 24


def _shares(rank: int, rows: int, dtype: torch.dtype) -> torch.Tensor:
    """Rank r's share of `rows` rows: large values of alternating sign on ranks 0 and 2 and small ones on the
    others, so that the sum's roundings depend on its order."""
    gen = torch.Generator().manual_seed(1000 * rank + rows)
    scale = 2.0**12 * (-1) ** rank if rank % 2 == 0 else 1.0
    return (torch.randn(rows, HIDDEN, generator=gen) * scale + torch.rand(rows, HIDDEN, generator=gen)).to(dtype)


def _sums(dtype: torch.dtype, device: str = "cpu") -> dict:
    """On each rank: the sum of 5 rows and of row 3 alone, by each path and by the layers' all_reduce; on a GPU
    also all_reduce replayed from a CUDA graph."""
    state = get_parallel()
    device = f"cuda:{state.rank}" if device == "cuda" else device

    def shares(rows: slice = slice(None)) -> torch.Tensor:
        return _shares(state.rank, 5, dtype)[rows].contiguous().to(device)
    out = {}
    for name, fn in (("gathered", collectives.gathered_sum), ("split", collectives.split_sum),
                     ("all_reduce", collectives.all_reduce)):
        out[name] = fn(state, shares())
        out[name + "_row"] = fn(state, shares(slice(3, 4)))
    out["strided"] = collectives.all_reduce(state, shares().t())  # not contiguous
    out["3d"] = collectives.all_reduce(state, shares().view(5, 2, HIDDEN // 2))
    if device != "cpu":
        x = shares()
        collectives.all_reduce(state, x.clone())  # the communicators and kernels ready before the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            collectives.all_reduce(state, x)
        x.copy_(shares())
        graph.replay()
        out["graph"] = x
    return {name: t.cpu() for name, t in out.items()}


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    torch.cuda.device_count() < 4, reason="needs 4 CUDA devices")])])
@pytest.mark.parametrize("world", [3, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_rank_sums_in_rank_order(world, dtype, device):
    """On GPUs over NCCL, whose own all-reduce of more than two ranks gives no such order, and from a CUDA graph."""
    results = run_ranks(world, _sums, dtype, device, cuda=device == "cuda")
    want = sum_in_order_reference(torch.stack([_shares(r, 5, dtype) for r in range(world)]),
                                  torch.empty(5, HIDDEN, dtype=dtype))
    # what the check tells apart: fp32 sums in another order; bf16 sums rounded at each addition (as NCCL adds)
    other = sum_in_order_reference(torch.stack([_shares(r, 5, dtype) for r in reversed(range(world))]),
                                   torch.empty(5, HIDDEN, dtype=dtype)) if dtype == torch.float32 else \
        functools.reduce(torch.add, [_shares(r, 5, dtype) for r in range(world)])
    assert not torch.equal(want, other), "the shares do not tell the sums apart"
    for rank, got in enumerate(results):
        for name in ("gathered", "split", "all_reduce"):
            assert torch.equal(got[name], want), f"rank {rank}, {name}: not the rank-order sum"
            assert torch.equal(got[name + "_row"], want[3:4]), f"rank {rank}, {name}: a row alone sums otherwise"
        assert torch.equal(got["strided"], want.t()), f"rank {rank}: a strided tensor"
        assert torch.equal(got["3d"], want.view(5, 2, HIDDEN // 2)), f"rank {rank}: a 3-D tensor"
        if device == "cuda":
            assert torch.equal(got["graph"], want), f"rank {rank}: replayed from a CUDA graph"


def test_large_tensors_are_split(monkeypatch):
    """The split path past SPLIT_MIN_SAVED_BYTES (and for a tensor whose elements split evenly), the gather below."""
    calls = []
    for name in ("gathered_sum", "split_sum"):
        monkeypatch.setattr(collectives, name, lambda state, x, name=name: calls.append(name) or x)
    state = ParallelState(0, 4)
    small = torch.empty(1, 1024, dtype=torch.bfloat16)  # 2 KB
    large = torch.empty(8192, 1024, dtype=torch.bfloat16)  # 16 MB: 12 MB saved at 4 ranks
    odd = torch.empty(8191, 1023, dtype=torch.bfloat16)  # elements not a multiple of 4
    for x in (small, large, odd):
        collectives.all_reduce(state, x)
    assert calls == ["gathered_sum", "split_sum", "gathered_sum"]
