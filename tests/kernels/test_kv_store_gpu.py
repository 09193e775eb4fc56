"""The KV-cache store at real shapes in bf16 on a GPU (scripts/gpu_check.sh); skipped on CPU machines."""
import pytest
import torch

from moelora.core import KVCache
from moelora.kernels import kv_store
from moelora.kernels.kv_store import store_kv

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

SLOTS = 5000
SHAPES = ((4, 128, 128), (1, 192, 128), (16, 192, 128))  # kv heads, Dk, Dv: Qwen3-30B-A3B, MLA, DeepSeek-V2-Lite


def _inputs(tokens, heads, k_dim, v_dim, gen, dtype=torch.bfloat16):
    """k contiguous (as RoPE returns it), v a column slice of a wider projection output (row stride > heads * Dv)."""
    k = torch.randn(tokens, heads, k_dim, generator=gen, device="cuda").to(dtype)
    wide = torch.randn(tokens, heads * (k_dim + v_dim), generator=gen, device="cuda").to(dtype)
    v = wide[:, heads * k_dim:].view(tokens, heads, v_dim)
    loc = torch.randperm(SLOTS, generator=gen, device="cuda")[:tokens]
    return loc, k, v


def _stores(loc, k, v, heads, k_dim, v_dim):
    """(triton caches, torch caches) after storing into NaN-filled bf16 caches."""
    results = []
    for impl in ("triton", "torch"):
        caches = [torch.full((SLOTS, heads, d), float("nan"), dtype=torch.bfloat16, device="cuda")
                  for d in (k_dim, v_dim)]
        store_kv(*caches, loc, k, v, impl=impl)
        results.append(caches)
    return results


def _assert_same_bits(got, ref):
    for name, g, r in zip("kv", got, ref):
        assert torch.equal(g.view(torch.int16), r.view(torch.int16)), f"{name} cache differs from torch's"


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("tokens", [1, 7, 4096])
def test_matches_reference(shape, tokens):
    gen = torch.Generator("cuda").manual_seed(torch.seed())
    loc, k, v = _inputs(tokens, *shape, gen)
    _assert_same_bits(*_stores(loc.to(torch.int32), k, v, *shape))
    _assert_same_bits(*_stores(loc, k, v, *shape))


def test_fp32_rounds_to_nearest_bf16():
    gen = torch.Generator("cuda").manual_seed(torch.seed())
    loc, k, v = _inputs(300, *SHAPES[0], gen, torch.float32)
    _assert_same_bits(*_stores(loc, k, v, *SHAPES[0]))


def test_replays_in_a_cuda_graph():
    """Captured once, replayed on new slots and values written into the captured tensors."""
    gen = torch.Generator("cuda").manual_seed(torch.seed())
    loc, k, v = _inputs(64, *SHAPES[0], gen)
    caches = [torch.zeros(SLOTS, 4, 128, dtype=torch.bfloat16, device="cuda") for _ in range(2)]
    store_kv(*caches, loc, k, v)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        store_kv(*caches, loc, k, v)
    new_loc, new_k, new_v = _inputs(64, *SHAPES[0], gen)
    loc.copy_(new_loc), k.copy_(new_k), v.copy_(new_v)
    expected = [c.clone() for c in caches]
    store_kv(*expected, new_loc, new_k, new_v, impl="torch")
    graph.replay()
    _assert_same_bits(caches, expected)


def test_a_layers_cache_store_runs_the_kernel_on_cuda(monkeypatch):
    """What the attention layer calls with one layer's buffers of the KV cache."""
    calls = []
    monkeypatch.setattr(kv_store, "store_kv_triton", lambda *args: calls.append(args))
    cache = KVCache(2, 16, 4, 128, 128, 1, 8, torch.bfloat16, "cuda")
    loc, k, v = torch.tensor([3, 9], device="cuda"), *(torch.randn(2, 4, 128, device="cuda") for _ in range(2))
    store_kv(cache.k[1], cache.v[1], loc, k, v)
    assert len(calls) == 1 and calls[0][0] is cache.k[1] and calls[0][1] is cache.v[1]
