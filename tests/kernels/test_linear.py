"""The batch-invariant dense GEMM against torch's linear (Triton in the interpreter on CPU machines,
fp16 and fp32: the interpreter's bf16 tl.dot is not usable)."""
from dataclasses import replace

import pytest
import torch

from moelora.kernels import gemm_tiles
from moelora.kernels import linear as linear_module
from moelora.kernels.gemm_tiles import gemm_block_k
from moelora.kernels.linear import LinearConfig, LoRAEpilogue, default_config, k_splits, linear
from tests.support import rel_tolerance

DTYPES = [torch.float16, torch.float32]
SHRINK = (16, 64)  # the LoRA shrink's BLOCK_M, BLOCK_K in the GEMM's launch (lora_linear's)
CASES = [  # M, N, K: non-powers of two, N = 1 (Qwen2-MoE's shared_expert_gate), K not a multiple of BLOCK_K
    (1, 1, 64),
    (1, 48, 100),
    (3, 130, 70),
    (17, 33, 200),  # M past the decode tile
    (70, 20, 129),
    (130, 300, 96),  # M past BLOCK_M 128
]
CONFIGS = [  # forced tiles: small and large, partial swizzle groups, one stage, K splits in parallel or not
    LinearConfig(16, 16, 3, 4, 1, parallel_splits=True),
    LinearConfig(32, 64, 1, 4, 4),
    LinearConfig(64, 32, 2, 4, 3, parallel_splits=True),
    LinearConfig(128, 256, 8, 8, 3),
]
SPLIT_CASES = [  # M, N, K with K splits (fp16 / fp32): the last one shorter, N < 16, M past the decode tile
    (1, 48, 600),  # 2 / 4 splits
    (3, 20, 1000),  # 4 / 8
    (5, 3, 520),  # 2 / 4 (N = 1 would be a flaky fp32 comparison: a one-element row may cancel to ~0)
    (40, 130, 900),  # 3 / 6
]


def _inputs(m, n, k, dtype, device, gen, bias=True):
    x = torch.randn(m, k, generator=gen).to(device, dtype)
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(device, dtype)
    b = torch.randn(n, generator=gen).to(device, dtype) if bias else None
    return x, w, b


def _check(x, w, b, config=None):
    """Close to torch relative to the size of the summands, |x| |W|^T + |b|, not of the result: a short
    row (N = 1) may cancel to about zero, where a relative error of the result means nothing."""
    got = linear(x, w, b, impl="triton", config=config)
    assert got.dtype == x.dtype and got.shape == (x.shape[0], w.shape[0]) and got.is_contiguous()
    assert torch.isfinite(got).all(), "non-finite outputs (unwritten, poisoned)"
    ref = linear(x, w, b, impl="torch").double()
    scale = x.double().abs() @ w.double().abs().T + (0 if b is None else b.double().abs())
    err = (got.double() - ref).abs() / scale
    assert err.max() <= rel_tolerance(x.dtype, x.device), f"worst error {err.max():.2e} of |x| |W|^T + |b|"
    return got


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_reference(case, dtype, with_bias, device, poison):
    gen = torch.Generator().manual_seed(torch.seed())
    _check(*_inputs(*case, dtype, device, gen, with_bias))


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"{c.block_m}x{c.block_n}g{c.group_m}")
@pytest.mark.parametrize("dtype", DTYPES)
def test_forced_configs(config, dtype, device, poison):
    """Every tile size writes every output element (NaN-poisoned) and agrees with torch; 5 row blocks and
    3 n-tiles of the smallest tile make a partial GROUP_M group."""
    gen = torch.Generator().manual_seed(torch.seed())
    for m, n, k in ((70, 40, 300), (1, 1, 64), (130, 300, 96)):  # 2 K splits (fp16), 1, 1
        _check(*_inputs(m, n, k, dtype, device, gen), config)


def _bits(t):
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("case", SPLIT_CASES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_parallel_and_serial_splits_give_the_same_bits(case, dtype, with_bias, device, poison):
    """The same tile with its K splits in parallel programs (partials added by the last to arrive) and one
    after the other in one program: bit for bit, close to torch, and the arrival counters back at zero."""
    gen = torch.Generator().manual_seed(torch.seed())
    x, w, b = _inputs(*case, dtype, device, gen, with_bias)
    assert k_splits(case[1], case[2], dtype)[0] > 1
    cfg = default_config(case[0], case[1])
    parallel = _check(x, w, b, replace(cfg, parallel_splits=True))
    serial = _check(x, w, b, replace(cfg, parallel_splits=False))
    assert torch.equal(_bits(parallel), _bits(serial))
    assert not linear_module._counters[x.device].any()


@pytest.mark.parametrize("dtype", DTYPES)
def test_split_rows_do_not_depend_on_the_batch(dtype, device, poison):
    """Bit for bit: rows of a split shape alone, in batches on the decode, small and medium tiles (splits in
    parallel) and in one on prefill tiles (splits one after the other), and moved within their batch."""
    gen = torch.Generator().manual_seed(torch.seed())
    x, w, b = _inputs(300, 24, 520, dtype, device, gen)
    assert k_splits(24, 520, dtype)[0] > 1
    full = _check(x, w, b)
    assert not default_config(len(x), 24).parallel_splits
    for m in (1, 5, 17, 33, 257):
        assert default_config(m, 24).parallel_splits == (m <= 256)
        assert torch.equal(_bits(linear(x[:m], w, b, impl="triton")), _bits(full[:m])), f"a batch of {m}"
        moved = linear(x[:m].roll(m // 2 + 1, 0), w, b, impl="triton")
        assert torch.equal(_bits(moved), _bits(full[:m].roll(m // 2 + 1, 0))), f"rows moved in a batch of {m}"
    for i in (0, 150, 299):
        assert torch.equal(_bits(linear(x[i:i + 1], w, b, impl="triton")[0]), _bits(full[i])), f"row {i} alone"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_k_splits_rule(dtype):
    """S of (N, K, dtype) alone: whole BLOCK_K steps, at least four a split, about 512 programs on 16-column
    tiles; one split from N = 4097 or where K has fewer than 8 BLOCK_K steps. Qwen3-30B-A3B's router
    (N 128, K 2048) has 8 (fp16/bf16), o_proj (2048, 4096) 4, qkv (5120, 2048) and lm_head 1."""
    block_k = gemm_block_k(dtype)
    for n in (1, 20, 128, 2048, 4096, 4097, 5120, 151936):
        for k in (1, 100, 7 * block_k, 7 * block_k + 1, 2048, 4096, 10944):
            splits, split_k = k_splits(n, k, dtype)
            assert split_k % block_k == 0 and (splits - 1) * split_k < k <= splits * split_k, (n, k)
            assert splits == 1 or (split_k >= 4 * block_k and -(-n // 16) * splits <= 512), (n, k)
            assert (splits > 1) == (n <= 4096 and k > 7 * block_k), (n, k)
    if dtype != torch.float32:
        assert [k_splits(n, k, dtype)[0] for k, n in ((2048, 128), (4096, 2048), (2048, 5120))] == [8, 4, 1]


def test_decode_tiles_of_one_split_shapes_pipeline_deeper():
    """Up to 32 rows a shape without K splits keeps more W tiles in flight; with splits, or above, not."""
    for m in (1, 16, 32, 33, 4096):
        assert (default_config(m, 5120, splits=1).num_stages == linear_module.ONE_SPLIT_STAGES) == (m <= 32)
        assert default_config(m, 2048, splits=4).num_stages < linear_module.ONE_SPLIT_STAGES


def test_parallel_splits_past_the_counters(device):
    x = torch.randn(1040, 512, dtype=torch.float16, device=device)
    w = torch.randn(1024, 512, dtype=torch.float16, device=device)
    with pytest.raises(ValueError, match=r"parallel K splits on 4160 tiles .*: more than the 4096 counters"):
        linear(x, w, impl="triton", config=LinearConfig(16, 16, 8, 4, 1, parallel_splits=True))


@pytest.mark.parametrize("dtype", DTYPES)
def test_strided_rows(dtype, device, poison):
    """x as a column slice of a wider tensor (rows longer than K): read through its row stride, no copy."""
    gen = torch.Generator().manual_seed(torch.seed())
    wide, w, b = _inputs(9, 50, 300, dtype, device, gen)
    x = wide[:, 120:220]
    assert x.stride(0) == 300
    got = _check(x, w[:, :100].contiguous(), b)
    assert torch.equal(got, linear(x.contiguous(), w[:, :100].contiguous(), b, impl="triton"))


def test_bias_is_added_before_the_one_rounding(device):
    """x.w = 1 + 2^-11 + 2^-13 and bias 2^-11: once rounded, 1 + 2^-10; rounded before the bias too, the
    sum would land on a tie and round to 1 + 2^-9."""
    x = torch.tensor([[1.0, 2.0**-11, 2.0**-13]], dtype=torch.float16, device=device)
    w = torch.ones(1, 3, dtype=torch.float16, device=device)
    y = linear(x, w, torch.tensor([2.0**-11], dtype=torch.float16, device=device), impl="triton")
    assert y.item() == 1 + 2.0**-10


def test_empty(device):
    x = torch.randn(0, 64, dtype=torch.float16, device=device)
    w = torch.randn(32, 64, dtype=torch.float16, device=device)
    assert linear(x, w, impl="triton").shape == (0, 32)
    assert linear(w, w[:0], impl="triton").shape == (32, 0)


def test_default_config_tiles():
    """tl.dot's 16-wide minimum for narrow N; decode tiles narrow enough to give o_proj (N = 2048)
    about one program per SM; prefill on 128-row tiles."""
    assert default_config(1, 1).block_n == 16 and default_config(1, 5120).block_m == 16
    assert default_config(1, 2048).block_n == 16 and default_config(1, 151936).block_n == 64
    assert default_config(4096, 5120).block_m == 128


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_bad_inputs_name_the_tensor(impl, device):
    x = torch.randn(4, 64, device=device, dtype=torch.float16)
    w = torch.randn(32, 64, device=device, dtype=torch.float16)
    with pytest.raises(ValueError, match=r"x must be .*\[M, K\].*\(2, 2, 64\)"):
        linear(x.view(2, 2, 64), w, impl=impl)
    with pytest.raises(ValueError, match=r"x must be .*contiguous in its last dimension.*\(64, 4\)"):
        linear(x.t(), w, impl=impl)
    with pytest.raises(ValueError, match=r"weight must be contiguous \[N, 64\] .*\(4, 64\).*\(32, 48\)"):
        linear(x, w[:, :48], impl=impl)
    with pytest.raises(ValueError, match=r"weight must be contiguous .*\(64, 32\) with strides \(1, 64\)"):
        linear(x[:, :32], w.t(), impl=impl)
    with pytest.raises(ValueError, match=r"bias must be .*\(32,\) .*\(16,\)"):
        linear(x, w, w[0, :16], impl=impl)
    with pytest.raises(ValueError, match=r"weight must have x's dtype torch.float16 .*torch.float32"):
        linear(x, w.float(), impl=impl)
    with pytest.raises(ValueError, match=r"impl must be"):
        linear(x, w, impl="cublas")


def test_prefill_tiles_of_serial_splits_hold_two_accumulators():
    """128 x 256 prefill tiles, but 128 x 128 where the K splits run in series (the running sum and the split's),
    with a LoRA epilogue (8 slots of rank tile 16) or without."""
    eight_16 = LoRAEpilogue(8, 16, None)
    assert (default_config(8192, 2048, 4).block_n, default_config(8192, 2048, 4, eight_16).block_n) == (128, 128)
    assert default_config(8192, 5120, 1).block_n == default_config(8192, 5120, 1, eight_16).block_n == 256
    assert default_config(16, 2048, 4, LoRAEpilogue(8, 16, SHRINK)) == default_config(16, 2048, 4)  # decode


@pytest.mark.parametrize("m", [1, 32, 200, 8192])
@pytest.mark.parametrize("n, splits", [(5120, 1), (2048, 4)])
def test_many_slots_of_a_large_rank_keep_the_tile(m, n, splits):
    """8 and 32 slots of rank 64 (512 and 2048 stacked rows, more than one dot of them all holds in a Hopper
    program's shared memory on most tiles): the tile of 8 rank-16 slots, its epilogue in chunks of slots that fit
    (tests/kernels/test_compile_sm90.py holds the bound against the compiler's)."""
    shrink = SHRINK if m <= 256 else None  # in the GEMM's launch
    tile = default_config(m, n, splits, LoRAEpilogue(8, 16, shrink))
    for slots in (8, 32):
        lora = LoRAEpilogue(slots, 64, shrink)
        assert default_config(m, n, splits, lora) == tile
        chunk, b_early = linear_module.lora_epilogue_plan(tile, lora)
        assert slots % chunk == 0 and linear_module._lora_epilogue_fits(tile, chunk * 64, b_early), (slots, chunk)
        assert not b_early or chunk == slots


def test_an_epilogue_chunks_slots_only_where_one_dot_would_not_fit():
    """One dot with B loaded before the shrink's wait where it fits; else one dot loaded after it (a wgmma tile
    holds early-loaded B twice: session 48's H100 run, 8 slots of rank 64 on the 64 x 128 tile at 200 rows, 320 KiB);
    else chunks, also where one dot's rows at rank tile 64 and more would spill registers (LORA_DOT_MAX_ROWS,
    LORA_DOT_ELEMENTS / BLOCK_N: 128 rows on 128 columns, 64 on 256; the smaller rank tiles keep their one dot); a
    rank tile of which not even one slot fits in shared memory moves to a smaller tile, and past every tile is an
    error."""
    decode, medium, prefill = default_config(1, 5120, 1), default_config(200, 5120, 1), default_config(8192, 5120, 1)
    assert (decode.block_n, medium.block_n, prefill.block_n) == (32, 128, 256)
    plan = linear_module.lora_epilogue_plan
    assert plan(decode, LoRAEpilogue(8, 64, SHRINK)) == (8, True)  # 512 rows
    # B loaded early is held twice but on 32-row tiles (Triton 3.6, the 16 x 64 decode tile: 294912 B for 1024 rows)
    fits = linear_module._lora_epilogue_fits
    assert not fits(replace(decode, block_n=64), 1024, True) and fits(decode, 1024, False)
    assert fits(replace(decode, block_m=32, block_n=64), 1024, True)
    assert plan(decode, LoRAEpilogue(8, 128, SHRINK)) == (4, False)
    assert plan(medium, LoRAEpilogue(8, 16, SHRINK)) == (8, True)
    assert plan(medium, LoRAEpilogue(8, 64, SHRINK)) == (2, False)
    assert plan(prefill, LoRAEpilogue(8, 32, None)) == (8, False)
    assert plan(prefill, LoRAEpilogue(8, 64, None)) == (1, False)
    assert plan(prefill, LoRAEpilogue(8, 128, None)) == (1, False)  # one slot is the least a dot takes
    assert plan(prefill, LoRAEpilogue(8, 512, None)) is None
    assert default_config(8192, 5120, 1, LoRAEpilogue(8, 512, None)).block_m == 64
    with pytest.raises(ValueError, match="no GEMM tile holds a LoRA epilogue of rank tile 4096"):
        default_config(16, 2048, 4, LoRAEpilogue(8, 4096, SHRINK))


def test_the_shrinks_pipeline_in_the_launch_fits_in_shared_memory():
    """The shrink's programs in the GEMM's launch pipeline their x and A tiles over the launch's stages: a rank tile
    of 256 at decode's 8 stages would take 7 x (256 + 16) x 64 x 2 = 243712 B (found by a review, compiled for sm_90);
    the launch runs fewer stages there, and all of them without the shrink or with small rank tiles."""
    decode = default_config(1, 5120, 1)
    assert decode.num_stages == linear_module.ONE_SPLIT_STAGES
    for rank_tile, stages in ((16, decode.num_stages), (128, decode.num_stages), (256, 6), (512, 3)):
        cfg, _, _ = linear_module.lora_launch_config(decode, LoRAEpilogue(1, rank_tile, SHRINK))
        assert cfg.num_stages == stages and stages * (rank_tile + 16) * 64 * 2 <= linear_module.SMEM_BYTES
        assert linear_module.lora_launch_config(decode, LoRAEpilogue(1, rank_tile, None))[0] == decode


TMA_CASES = [  # M, N, K with K x 2 bytes 16-byte aligned (the copy engine's rule): tiles past M, N and K read zeros
    (300, 130, 72),  # one split, K past its last BLOCK_K
    (257, 24, 520),  # 2 / 4 K splits (fp16 / fp32), the last a short one
    (600, 300, 96),  # several m- and n-tiles
    (100, 96, 200),  # a medium tile (up to PARALLEL_SPLITS_MAX_M rows) of a shape with one K split
]


@pytest.fixture
def descriptors(monkeypatch):
    """Each copy-engine descriptor linear makes (None where it can not), in order."""
    made, real = [], linear_module.tma_descriptor
    monkeypatch.setattr(linear_module, "tma_descriptor", lambda t, block: made.append(real(t, block)) or made[-1])
    return made


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("case", TMA_CASES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_tiles_load_through_the_copy_engine(case, dtype, with_bias, device, poison, descriptors):
    """Prefill and medium tiles whose K splits run in series load x and W through descriptors where the device has
    the copy engine (the CPU's interpreter emulates it): every output written, close to torch, and the bits of the
    same tile loading by pointers."""
    gen = torch.Generator().manual_seed(torch.seed())
    x, w, b = _inputs(*case, dtype, device, gen, with_bias)
    splits = k_splits(case[1], case[2], dtype)[0]
    cfg = default_config(case[0], case[1], splits)
    assert cfg.tma and not (cfg.parallel_splits and splits > 1)
    engine = gemm_tiles.has_copy_engine(x.device)
    for config in (cfg, LinearConfig(64, 32, 2, 4, 3, tma=True)):  # the default tile, and a partial GROUP_M group
        descriptors.clear()
        got = _check(x, w, b, config)
        assert len(descriptors) == 2 and (None not in descriptors) == engine, config
        assert torch.equal(_bits(got), _bits(linear(x, w, b, impl="triton", config=replace(config, tma=False))))


def test_tiles_that_can_not_take_the_copy_engine_load_by_pointers(device, poison, descriptors):
    """The copy engine reads tensors whose start and row stride are 16-byte aligned: a column slice starting at an
    odd column, or W with rows of an odd length, load by pointers (the same bits as a contiguous x); decode tiles
    and parallel K splits always do."""
    gen = torch.Generator().manual_seed(torch.seed())
    wide, w, b = _inputs(300, 64, 200, torch.float16, device, gen)
    cfg = default_config(300, 64)
    engine = gemm_tiles.has_copy_engine(wide.device)
    for x in (wide[:, 8:72], wide[:, 9:73], wide[:, :99]):
        descriptors.clear()
        narrow_w = w[:, :x.shape[1]].contiguous()
        got = _check(x, narrow_w, b, cfg)
        aligned = x.data_ptr() % 16 == 0 and x.shape[1] % 8 == 0
        assert len(descriptors) == 2 and (None not in descriptors) == (aligned and engine), \
            (x.storage_offset(), x.shape)
        assert torch.equal(got, linear(x.contiguous(), narrow_w, b, impl="triton"))
    x, w, b = _inputs(16, 24, 520, torch.float16, device, gen)
    descriptors.clear()
    _check(x, w, b)  # a decode tile
    _check(x, w, b, replace(default_config(16, 24), tma=True))  # its 2 K splits in parallel programs
    assert descriptors == []
