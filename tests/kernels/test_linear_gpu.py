"""The dense GEMM in bf16 at real model shapes on a GPU (scripts/gpu_check.sh): torch's answer within a
bf16 tolerance, and every row the same bits whatever the batch, with K splits in parallel programs or one
after the other. Skipped on CPU machines, but for the checks that the batch sizes below cover several
tiles and both ways of running K splits."""
from dataclasses import replace

import pytest
import torch

from moelora.kernels import gemm_tiles
from moelora.kernels import linear as linear_module
from moelora.kernels.linear import default_config, k_splits, linear
from tests.support import assert_rows_close, record_compiles, rel_tolerance

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

SHAPES = {  # in features K, out features N
    "qwen3 qkv": (2048, 5120),
    "qwen3 o": (4096, 2048),
    "qwen3 router": (2048, 128),
    "qwen3 lm_head": (2048, 151936),
    "dsv2-lite mlp gate_up": (2048, 2 * 10944),
    "dsv2-lite mlp down": (10944, 2048),
    "qwen2 shared_expert_gate": (2048, 1),
}
BATCH_SIZES = (1, 2, 3, 7, 16, 33, 100, 1000, 4097)
SPLIT_SHAPES = ["qwen3 o", "qwen3 router", "dsv2-lite mlp down", "qwen2 shared_expert_gate"]  # more than one K split


def _weights(shape, gen, bias=False):
    k, n = SHAPES[shape]
    w = (torch.randn(n, k, generator=gen, device="cuda") / k**0.5).to(torch.bfloat16)
    return w, (torch.randn(n, generator=gen, device="cuda").to(torch.bfloat16) if bias else None)


def _x(rows, shape, gen):
    return torch.randn(rows, SHAPES[shape][0], generator=gen, device="cuda").to(torch.bfloat16)


@needs_cuda
@pytest.mark.parametrize("tokens", [1, 7, 300, 4096])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_real_shapes_match_torch(shape, tokens, poison):
    gen = torch.Generator("cuda").manual_seed(torch.seed())
    w, b = _weights(shape, gen, bias=shape == "qwen3 qkv")  # Qwen2-MoE's qkv has a bias
    x = _x(tokens, shape, gen)
    got, expected = linear(x, w, b), linear(x, w, b, impl="torch")
    # a row of one sum near 0 can differ by more than 2 eps of itself from the order of its adds alone (a shape of
    # one output column failed so at 4096 tokens against cuBLAS): narrow outputs compare each column over the tokens
    if got.shape[1] < 16:
        got, expected = got.T, expected.T
    assert_rows_close(got, expected, rel_tolerance(torch.bfloat16, "cuda"), f"{shape} M={tokens}")


@needs_cuda
@pytest.mark.parametrize("shape", list(SHAPES))
def test_rows_do_not_depend_on_the_batch(shape, poison):
    """Bit for bit: each row of x[:M] as in the largest batch, alone (M = 1), and moved to other
    positions in its batch, for batch sizes that run on different tiles."""
    gen = torch.Generator("cuda").manual_seed(torch.seed())
    w, b = _weights(shape, gen, bias=shape == "qwen3 qkv")
    x = _x(max(BATCH_SIZES), shape, gen)
    full = linear(x, w, b)
    for m in BATCH_SIZES:
        assert torch.equal(linear(x[:m], w, b), full[:m]), f"{shape}: a batch of {m} differs from one of {len(x)}"
        shift = m // 2 + 1
        moved = linear(x[:m].roll(shift, 0), w, b)
        assert torch.equal(moved, full[:m].roll(shift, 0)), f"{shape}: rows moved in a batch of {m} differ"
        for i in {0, m // 2, m - 1}:
            assert torch.equal(linear(x[i:i + 1], w, b)[0], full[i]), f"{shape}: row {i} alone differs from the batch"


@needs_cuda
def test_row_counts_of_one_tile_share_a_compile(monkeypatch):
    """The row count is no specialisation of the kernel (kernels/__init__.py): batches of 1 to 16 rows, all on the
    decode tile, run one compiled kernel. A shape of this test's own, so that the first batch compiles."""
    gen = torch.Generator("cuda").manual_seed(torch.seed())
    w = torch.randn(336, 1040, generator=gen, device="cuda").to(torch.bfloat16)
    x = torch.randn(16, 1040, generator=gen, device="cuda").to(torch.bfloat16)
    splits, _ = k_splits(336, 1040, torch.bfloat16)
    compiled = record_compiles(monkeypatch)
    for m in (1, 2, 3, 5, 16):
        assert default_config(m, 336, splits) == default_config(1, 336, splits)
        linear(x[:m], w)
    assert compiled == ["_linear_kernel"], compiled


@needs_cuda
def test_strided_rows_are_not_copied_and_match(poison):
    """o_proj input as a column slice of a wider tensor: same bits as the contiguous copy."""
    gen = torch.Generator("cuda").manual_seed(torch.seed())
    w, _ = _weights("qwen3 o", gen)
    wide = torch.randn(33, 5000, generator=gen, device="cuda").to(torch.bfloat16)
    assert torch.equal(linear(wide[:, 500:4596], w), linear(wide[:, 500:4596].contiguous(), w))


@needs_cuda
def test_logits_past_int32_offsets(poison):
    """lm_head output of more than 2^31 elements: the last rows land where they belong."""
    gen = torch.Generator("cuda").manual_seed(torch.seed())
    w, _ = _weights("qwen3 lm_head", gen)
    rows = 2**31 // w.shape[0] + 64
    x = _x(rows, "qwen3 lm_head", gen)
    y = linear(x, w)
    for i in (0, rows - 65, rows - 1):
        assert torch.equal(y[i], linear(x[i:i + 1], w)[0]), f"row {i} of {rows}"
    assert_rows_close(y[-3:], linear(x[-3:], w, impl="torch"), rel_tolerance(torch.bfloat16, "cuda"))


@needs_cuda
@pytest.mark.parametrize("shape", ["qwen3 qkv", "qwen3 o", "qwen3 router"])
def test_replays_in_a_cuda_graph(shape):
    """Captured once, replayed on new values written into the captured input (decode steps are graphs);
    parallel K splits (o, router) find their arrival counters back at zero at every replay."""
    gen = torch.Generator("cuda").manual_seed(torch.seed())
    w, b = _weights(shape, gen, bias=True)
    x = _x(8, shape, gen)
    linear(x, w, b)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = linear(x, w, b)
    for _ in range(3):
        x.copy_(_x(8, shape, gen))
        graph.replay()
        assert torch.equal(y, linear(x, w, b))


@needs_cuda
@pytest.mark.parametrize("shape", SPLIT_SHAPES)
def test_parallel_and_serial_splits_give_the_same_bits(shape, poison):
    """Each tile's K splits in parallel programs (the last to arrive adds the partials) and one after the
    other in one program: the same bits, launch after launch (a race in the arrival counting would show
    as a differing launch), and the counters back at zero. (test_real_shapes_match_torch checks both ways
    against torch: M = 1 and 7 run the splits in parallel, 300 and 4096 one after the other.)"""
    gen = torch.Generator("cuda").manual_seed(torch.seed())
    w, b = _weights(shape, gen, bias=True)
    for m in (1, 7, 16, 100, 256):
        x, cfg = _x(m, shape, gen), default_config(m, w.shape[0])
        serial = linear(x, w, b, config=replace(cfg, parallel_splits=False)).view(torch.int16)
        for _ in range(20):
            parallel = linear(x, w, b, config=replace(cfg, parallel_splits=True)).view(torch.int16)
            assert torch.equal(parallel, serial), f"{shape} M={m}"
    assert not linear_module._counters[torch.device("cuda", torch.cuda.current_device())].any()


@needs_cuda
@pytest.mark.parametrize("shape", list(SHAPES))
def test_copy_engine_and_pointer_loads_give_the_same_bits(shape, poison):
    """Prefill tiles load x and W through the copy engine (TMA) on Hopper, others by pointers: the same bits, with
    and without K splits in series, in a whole tile table's rows of prefill tiles; x's rows strided too."""
    if not gemm_tiles.has_copy_engine(torch.device("cuda")):
        pytest.skip("no copy engine (TMA) on this GPU")
    gen = torch.Generator("cuda").manual_seed(torch.seed())
    w, b = _weights(shape, gen, bias=shape == "qwen3 qkv")
    for m in (300, 1000, 4097):
        cfg = default_config(m, w.shape[0], k_splits(w.shape[0], w.shape[1], torch.bfloat16)[0])
        assert cfg.tma, cfg
        x = _x(m, shape, gen)
        wide = torch.cat([x, x[:, :64]], dim=1)[:, :x.shape[1]]  # rows 64 elements further apart
        pointers = linear(x, w, b, config=replace(cfg, tma=False)).view(torch.int16)
        assert torch.equal(linear(x, w, b).view(torch.int16), pointers), f"{shape} M={m}"
        assert torch.equal(linear(wide, w, b).view(torch.int16), pointers), f"{shape} M={m}, strided rows"


def test_split_shapes_run_both_ways():
    """The shapes above with K splits: in parallel at some batch sizes, serial at others (the invariance
    test then compares the two); the wide ones have none."""
    for shape, (k, n) in SHAPES.items():
        assert (k_splits(n, k, torch.bfloat16)[0] > 1) == (shape in SPLIT_SHAPES), shape
    for shape in SPLIT_SHAPES:
        assert {default_config(m, SHAPES[shape][1]).parallel_splits for m in BATCH_SIZES} == {True, False}


@pytest.mark.parametrize("shape", [s for s in SHAPES if SHAPES[s][1] >= 2048])
def test_batch_sizes_cover_several_tiles(shape):
    """The invariance test above compares mma.sync tiles (BLOCK_M 16) with wgmma ones (64, 128)."""
    n = SHAPES[shape][1]
    configs = {default_config(m, n) for m in BATCH_SIZES}
    assert len(configs) >= 3 and {c.block_m for c in configs} == {16, 64, 128}, configs


@needs_cuda
def test_linear_layer_runs_the_kernel(monkeypatch):
    from moelora.kernels import linear as linear_module
    from moelora.layers.linear import Linear

    calls = []
    real = linear_module.linear_triton
    monkeypatch.setattr(linear_module, "linear_triton", lambda *args: calls.append(args) or real(*args))
    layer = Linear(64, 32, bias=True).to("cuda", torch.bfloat16)
    layer(torch.randn(3, 64, device="cuda", dtype=torch.bfloat16))
    assert len(calls) == 1 and calls[0][1] is layer.weight and calls[0][2] is layer.bias
