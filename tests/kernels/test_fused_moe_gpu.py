"""Real model shapes in bf16 on a GPU (scripts/gpu_check.sh); skipped on CPU machines."""
import dataclasses

import pytest
import torch

from moelora.kernels.fused_moe import config as fm_config
from moelora.kernels.fused_moe import launcher
from moelora.kernels.fused_moe import default_config, fused_moe
from tests.support import (assert_gpu_finishes, assert_rows_close, random_expert_lora, random_moe_weights,
                           random_topk, record_compiles, rel_tolerance)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

SHAPES = {  # hidden, intermediate, experts, top_k
    "qwen3-30b-a3b": (2048, 768, 128, 8),
    "mixtral-8x7b": (4096, 14336, 8, 2),
    "deepseek-v2-lite": (2048, 1408, 64, 6),
}
SLOT_RANKS = [4, 8, 16, 64]


def _layer(shape, tokens, gen):
    hidden, inter, experts, top_k = SHAPES[shape]
    dtype, device = torch.bfloat16, "cuda"
    x = torch.randn(tokens, hidden, generator=gen, device=device).to(dtype)
    w13, w2 = random_moe_weights(experts, hidden, inter, dtype, device, gen)
    topk = random_topk(tokens, experts, top_k, device, gen)
    ids = torch.where(torch.rand(topk.ids.shape, generator=gen, device=device) < 0.1, -1, topk.ids).contiguous()
    lora = random_expert_lora(len(SLOT_RANKS), experts, hidden, inter, SLOT_RANKS, dtype, device,
                              coverage=0.7, poison_unused=True, generator=gen)
    slots = torch.randint(-1, len(SLOT_RANKS), (tokens,), generator=gen, device=device, dtype=torch.int32)
    return x, w13, w2, topk._replace(ids=ids), lora, slots


# 1: pair blocks; 32: the shrink per pair; 150 and 300: the segment shrink beside blocks of 16 and 32 rows (Qwen3);
# 2048: its tiles of 64 rows (Qwen3, DeepSeek) and 128 (Mixtral's prefill row)
@pytest.mark.parametrize("tokens", [1, 32, 150, 300, 2048])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_real_shape_matches_reference(shape, tokens, poison):
    gen = torch.Generator("cuda").manual_seed(torch.seed())
    x, w13, w2, topk, lora, slots = _layer(shape, tokens, gen)
    got = fused_moe(x, w13, w2, topk, lora, slots)
    ref = fused_moe(x, w13, w2, topk, lora, slots, impl="torch")
    assert_rows_close(got, ref, rel_tolerance(torch.bfloat16, "cuda"), f"{shape} T={tokens}")
    base = fused_moe(x, w13, w2, topk)
    no_adapter = slots < 0
    assert torch.equal(got[no_adapter], base[no_adapter])


def test_token_counts_of_one_tile_share_a_compile(monkeypatch, poison):
    """Token and pair counts are no specialisation of the kernels (kernels/__init__.py): 3, 5, 8 and 16 tokens of
    top-6 routing, one tile class, with LoRA, compile each kernel once, although the counts fall on both sides of
    Triton's integer specialisation (18, 30 pairs; 48, 96 pairs and 16 tokens are multiples of 16). 72 experts: a
    layer of this test's own, so that the first batch compiles."""
    gen = torch.Generator("cuda").manual_seed(torch.seed())
    hidden, inter, experts, top_k = 1024, 256, 72, 6
    counts = (3, 5, 8, 16)
    assert {n * top_k % 16 == 0 for n in counts} == {True, False} and 16 in counts
    w13, w2 = random_moe_weights(experts, hidden, inter, torch.bfloat16, "cuda", gen)
    lora = random_expert_lora(len(SLOT_RANKS), experts, hidden, inter, SLOT_RANKS, torch.bfloat16, "cuda",
                              generator=gen)
    compiled = record_compiles(monkeypatch)
    for tokens in counts:
        assert default_config(tokens, top_k, experts, torch.bfloat16, lora=True) == \
            default_config(counts[0], top_k, experts, torch.bfloat16, lora=True)
        x = torch.randn(tokens, hidden, generator=gen, device="cuda").to(torch.bfloat16)
        slots = torch.arange(tokens, device="cuda", dtype=torch.int32) % len(SLOT_RANKS)
        fused_moe(x, w13, w2, random_topk(tokens, experts, top_k, "cuda", gen), lora, slots)
        if tokens == counts[0]:
            first = sorted(compiled)
    assert first and sorted(compiled) == first, f"at {counts[0]} tokens: {first}; at {counts}: {sorted(compiled)}"


@pytest.mark.parametrize("shape", list(SHAPES))
def test_row_does_not_depend_on_batch(shape, poison):
    """A token's output is the same alone (decode tiles) and inside a large batch (prefill tiles)."""
    gen = torch.Generator("cuda").manual_seed(torch.seed())
    x, w13, w2, topk, lora, slots = _layer(shape, 1024, gen)
    batch, base_batch = fused_moe(x, w13, w2, topk, lora, slots), fused_moe(x, w13, w2, topk)
    for t in (0, 1, 2, 517, 1023):
        topk_t = topk._replace(weights=topk.weights[t:t + 1], ids=topk.ids[t:t + 1])
        alone = fused_moe(x[t:t + 1], w13, w2, topk_t, lora, slots[t:t + 1])
        assert torch.equal(alone[0], batch[t]), f"token {t} (slot {int(slots[t])}) differs alone vs in the batch"
        assert torch.equal(fused_moe(x[t:t + 1], w13, w2, topk_t)[0], base_batch[t]), f"token {t} base differs"


@pytest.mark.parametrize("tokens", [1, 32, 300, 2048])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_copy_engine_and_pointer_loads_give_the_same_bits(shape, tokens, poison):
    """The experts' weights through the copy engine (TMA, on Hopper) or by pointers: the same bits on each row of
    the tile table (pair blocks, 16-, 32- or 64-row blocks, prefill tiles), with LoRA and without."""
    gen = torch.Generator("cuda").manual_seed(torch.seed())
    x, w13, w2, topk, lora, slots = _layer(shape, tokens, gen)
    for adapters in ((lora, slots), ()):
        cfg = default_config(tokens, topk.ids.shape[1], w2.shape[0], x.dtype, lora=bool(adapters))
        got = fused_moe(x, w13, w2, topk, *adapters, config=dataclasses.replace(cfg, tma=True))
        pointers = fused_moe(x, w13, w2, topk, *adapters, config=dataclasses.replace(cfg, tma=False))
        assert torch.equal(got, pointers), f"{shape} T={tokens} LoRA: {bool(adapters)}"


@pytest.mark.parametrize("shape", list(SHAPES))
def test_prefill_tiles_agree(shape, poison):
    """Prefill tiles run the blocks at most half full as half tiles (64 of 128 rows), and with LoRA the down
    shrink in a launch of its own: bit for bit what full tiles give, and the down shrink in the gate_up epilogue,
    in 128- and 64-column gate_up tiles (two parts a tile or one; 1024 tokens: most blocks at most half full,
    some more)."""
    gen = torch.Generator("cuda").manual_seed(torch.seed())
    x, w13, w2, topk, lora, slots = _layer(shape, 1024, gen)
    for with_lora in (False, True):
        cfg = default_config(1 << 20, topk.ids.shape[1], w2.shape[0], x.dtype, lora=with_lora)
        assert cfg.half_tiles and cfg.block_m == 128 and cfg.down_shrink_launch  # without LoRA: not used
        adapters = (lora, slots) if with_lora else ()
        got = fused_moe(x, w13, w2, topk, *adapters, config=cfg)
        others = [dataclasses.replace(cfg, half_tiles=False)]
        if with_lora:
            others += [dataclasses.replace(cfg, down_shrink_launch=False),
                       dataclasses.replace(cfg, down_shrink_launch=False, block_n_gate_up=192 - cfg.block_n_gate_up,
                                           num_warps=4, num_stages=3)]
        for other in others:
            assert torch.equal(got, fused_moe(x, w13, w2, topk, *adapters, config=other)), f"{shape} {other}"


@pytest.mark.parametrize("shape", list(SHAPES))
def test_serial_shrink_agrees(shape, poison):
    """On the rank-16 tile, from MoEKernelConfig.serial_shrink_min_pairs (Qwen3 at 2048 tokens by default), a segment
    shrink program adds its K splits up itself: bit for bit the split programs' partials that reduce_partials sums,
    with adapters of ranks 4-16 on 70% of the experts (NaN wherever a kernel must not read)."""
    gen = torch.Generator("cuda").manual_seed(torch.seed())
    hidden, inter, experts, top_k = SHAPES[shape]
    x, w13, w2, topk, _, _ = _layer(shape, 2048, gen)
    ranks = [4, 8, 16, 16]
    lora = random_expert_lora(len(ranks), experts, hidden, inter, ranks, torch.bfloat16, "cuda", coverage=0.7,
                              poison_unused=True, generator=gen)
    slots = torch.randint(-1, len(ranks), (x.shape[0],), generator=gen, device="cuda", dtype=torch.int32)
    cfg = default_config(x.shape[0], top_k, experts, x.dtype, lora=True)
    serial, split = (dataclasses.replace(cfg, serial_shrink_min_pairs=n) for n in (0, 10**9))
    num_pairs = x.shape[0] * top_k
    assert fm_config.serial_shrink(serial, num_pairs, 16) and not fm_config.serial_shrink(split, num_pairs, 16)
    assert fm_config.serial_shrink(cfg, num_pairs, 16) == (shape == "qwen3-30b-a3b")  # 16384 pairs: the default's
    got = fused_moe(x, w13, w2, topk, lora, slots, config=serial)
    assert torch.equal(got, fused_moe(x, w13, w2, topk, lora, slots, config=split)), shape
    ref = fused_moe(x, w13, w2, topk, lora, slots, impl="torch")
    assert_rows_close(got, ref, rel_tolerance(torch.bfloat16, "cuda"), shape)


@pytest.mark.parametrize("shape", list(SHAPES))
def test_down_shrink_launch_agrees_on_64_row_tiles(shape, poison):
    """At 128 pairs an expert (the 64-row tiles' row) the down shrink in a launch of its own (Qwen3's default) is
    bit for bit what the gate_up epilogue's parts give (the others'), and a token alone (decode tiles) gets the
    bits it gets in the batch."""
    gen = torch.Generator("cuda").manual_seed(torch.seed())
    _, _, experts, top_k = SHAPES[shape]
    x, w13, w2, topk, lora, slots = _layer(shape, 128 * experts // top_k, gen)
    cfg = default_config(x.shape[0], top_k, experts, x.dtype, lora=True)
    assert cfg.block_m == 64 and cfg.down_shrink_launch == (shape == "qwen3-30b-a3b")
    got = fused_moe(x, w13, w2, topk, lora, slots)
    for launch in (False, True):
        other = fused_moe(x, w13, w2, topk, lora, slots, config=dataclasses.replace(cfg, down_shrink_launch=launch))
        assert torch.equal(got, other), f"{shape} down_shrink_launch={launch}"
    for t in (0, 1, x.shape[0] - 1):
        topk_t = topk._replace(weights=topk.weights[t:t + 1], ids=topk.ids[t:t + 1])
        alone = fused_moe(x[t:t + 1], w13, w2, topk_t, lora, slots[t:t + 1])
        assert torch.equal(alone[0], got[t]), f"token {t} (slot {int(slots[t])}) differs alone vs in the batch"


@pytest.mark.parametrize("tokens", [1, 2])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_pair_blocks_shrink_in_gate_up_has_no_race(shape, tokens, poison):
    """With pair blocks the gate/up shrink runs in the gate_up launch and the GEMM programs wait on a ready
    counter per pair; a missed wait or a counter not back at 0 shows up as an occasional mismatch against
    aligned blocks (the shrink in a launch of its own), a waiter that misses the arrivals as a launch that never
    ends. 50 calls, then 10 replays of a CUDA graph of one on fresh inputs, each bit for bit."""
    gen = torch.Generator("cuda").manual_seed(torch.seed())
    x, w13, w2, topk, lora, _ = _layer(shape, tokens, gen)
    slots = torch.randint(0, len(SLOT_RANKS), (tokens,), generator=gen, device="cuda", dtype=torch.int32)
    cfg = default_config(tokens, topk.ids.shape[1], w2.shape[0], x.dtype, lora=True)
    assert cfg.pair_blocks
    aligned_cfg = dataclasses.replace(cfg, pair_blocks=False)
    expected = fused_moe(x, w13, w2, topk, lora, slots, config=aligned_cfg)
    outs = [fused_moe(x, w13, w2, topk, lora, slots, config=cfg) for _ in range(50)]
    assert_gpu_finishes(60, f"{shape} T={tokens}: 50 calls with the shrink in gate_up")
    for i, out in enumerate(outs):
        assert torch.equal(out, expected), f"call {i}"
    ready = launcher._ready[x.device]
    torch.cuda.synchronize()
    assert not ready.any(), "ready counters not back at 0"

    stream = torch.cuda.Stream()  # warm-up on a side stream, as torch.cuda.graphs asks
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fused_moe(x, w13, w2, topk, lora, slots, config=cfg)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = fused_moe(x, w13, w2, topk, lora, slots, config=cfg)
    for i in range(10):
        x.copy_(torch.randn(x.shape, generator=gen, device="cuda").to(x.dtype))
        graph.replay()
        assert_gpu_finishes(60, f"{shape} T={tokens}: replay {i}")
        assert torch.equal(y, fused_moe(x, w13, w2, topk, lora, slots, config=aligned_cfg)), f"replay {i}"
    torch.cuda.synchronize()
    assert not ready.any(), "ready counters not back at 0 after the replays"
