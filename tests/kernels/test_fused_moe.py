import dataclasses
import os

import pytest
import torch

from moelora.core import ExpertLoRASlots, TopKOutput
from moelora.kernels import gemm_tiles
from moelora.kernels.fused_moe import gemm, launcher
from moelora.kernels.fused_moe import MoEKernelConfig, default_config, fused_moe
from moelora.kernels.fused_moe.config import down_sum_parts
from moelora.kernels.pdl import pdl_launch
from tests.support import assert_rows_close, random_expert_lora, random_moe_weights, random_topk, rel_tolerance

DTYPES = [torch.bfloat16, torch.float16] if torch.cuda.is_available() else [torch.float16, torch.float32]
SHAPES = [  # tokens, hidden, inter, experts, top_k
    (1, 64, 32, 4, 2),
    (37, 80, 56, 6, 3),  # non-powers of two; T*k > BLOCK_M
    (20, 48, 40, 9, 4),
    (70, 48, 40, 9, 4),  # T*k > pair_shrink_max_pairs: shrink per segment, after the alignment
    (90, 48, 40, 6, 4),  # 60 rows an expert: the base MoE on 128-row blocks as half tiles, LoRA on 32-row ones
]
SLOT_RANKS = [4, 8, 16, 64]  # rank tile 64
SMALL_RANKS = [16, 4, 16, 8, 12, 16]  # rank tile 16; six slots, so blocks hold runs of several slots


def _case(tokens, hidden, inter, experts, top_k, dtype, device, coverage=0.7, slot_ranks=SLOT_RANKS):
    gen = torch.Generator(device).manual_seed(torch.seed())
    x = torch.randn(tokens, hidden, generator=gen, device=device).to(dtype)
    w13, w2 = random_moe_weights(experts, hidden, inter, dtype, device, gen)
    weights, ids = random_topk(tokens, experts, top_k, device, gen)
    drop = torch.rand(tokens, top_k, generator=gen, device=device) < 0.15
    ids = torch.where(drop, -1, ids)  # expert on another rank
    far = torch.rand(tokens, top_k, generator=gen, device=device) < 0.05
    ids = torch.where(far, experts + 7, ids)  # out of range: must never be indexed
    lora = random_expert_lora(len(slot_ranks), experts, hidden, inter, slot_ranks, dtype, device,
                              coverage=coverage, poison_unused=True, generator=gen)
    # token 0 (the T = 1 case) is routed, to an expert its adapter (the last slot) covers if there is one
    covered = (lora.ranks[:, len(slot_ranks) - 1].sum(0) > 0).nonzero().flatten()
    ids[0, 0] = covered[0] if covered.numel() else 0
    # a mixed batch: every slot, base tokens (-1) and an out-of-range slot (treated as base)
    slots = torch.randint(-1, len(slot_ranks), (tokens,), generator=gen, device=device, dtype=torch.int32)
    slots[0] = len(slot_ranks) - 1  # token 0 has the last slot's adapter (the largest rank)
    if tokens > 3:
        slots[1], slots[2] = -1, len(slot_ranks) + 2
        ids[3] = -1  # no expert on this rank: y must be 0
    ids = ids.contiguous()
    return x, w13, w2, TopKOutput(weights, ids), lora, slots


def _naive(x, w13, w2, topk, lora: ExpertLoRASlots | None, slots):
    """Independent float64 formula, one (token, expert) pair at a time."""
    inter = w2.shape[2]
    y = torch.zeros(x.shape, dtype=torch.float64)
    x, w13, w2 = x.cpu().double(), w13.cpu().double(), w2.cpu().double()
    for t in range(x.shape[0]):
        for j in range(topk.ids.shape[1]):
            e = int(topk.ids[t, j])
            if not 0 <= e < w2.shape[0]:
                continue
            gate, up = w13[e, :inter] @ x[t], w13[e, inter:] @ x[t]
            s = -1 if lora is None else int(slots[t])
            use_lora = lora is not None and 0 <= s < lora.num_slots
            if use_lora:
                rg, ru, rd = (int(r) for r in lora.ranks[:, s, e])
                gate = gate + lora.b_gate[s, e, :rg].T.cpu().double() @ (lora.a_gate[s, e, :rg].cpu().double() @ x[t])
                up = up + lora.b_up[s, e, :ru].T.cpu().double() @ (lora.a_up[s, e, :ru].cpu().double() @ x[t])
            h = torch.nn.functional.silu(gate) * up
            out = w2[e] @ h
            if use_lora:
                out = out + lora.b_down[s, e, :rd].T.cpu().double() @ (lora.a_down[s, e, :rd].cpu().double() @ h)
            y[t] += float(topk.weights[t, j]) * out
    return y


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_reference_matches_naive_formula(shape, dtype, device):
    x, w13, w2, topk, lora, slots = _case(*shape, dtype, device)
    got = fused_moe(x, w13, w2, topk, lora, slots, impl="torch")
    assert_rows_close(got.cpu(), _naive(x, w13, w2, topk, lora, slots), 2 * rel_tolerance(dtype, "cpu"), "reference")


@pytest.mark.parametrize("shape, slot_ranks", [(s, SLOT_RANKS) for s in SHAPES] + [(SHAPES[1], SMALL_RANKS),
                                                                                  (SHAPES[3], SMALL_RANKS)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_matches_reference_mixed_adapters(shape, slot_ranks, dtype, device, poison):
    x, w13, w2, topk, lora, slots = _case(*shape, dtype, device, slot_ranks=slot_ranks)
    got = fused_moe(x, w13, w2, topk, lora, slots, impl="triton")
    ref = fused_moe(x, w13, w2, topk, lora, slots, impl="torch")
    assert_rows_close(got, ref, rel_tolerance(dtype, device), "triton vs torch, with LoRA")

    base = fused_moe(x, w13, w2, topk, impl="triton")
    assert_rows_close(base, fused_moe(x, w13, w2, topk, impl="torch"), rel_tolerance(dtype, device), "base")
    no_adapter = (slots < 0) | (slots >= lora.num_slots)
    assert torch.equal(got[no_adapter], base[no_adapter]), "tokens without an adapter must get the base result bit for bit"
    # tokens routed to at least one expert their adapter covers (coverage is random: at T=1 the token's
    # experts may all be uncovered, and then it rightly gets the base result)
    in_range = (topk.ids >= 0) & (topk.ids < w2.shape[0])
    covered = lora.ranks.sum(0)[slots.clamp(0, lora.num_slots - 1).long()[:, None], topk.ids.clamp(0, w2.shape[0] - 1).long()] > 0
    adapted = (in_range & covered).any(-1) & ~no_adapter
    changed = (got != base).any(-1)
    assert adapted.any() and changed[adapted].float().mean() > 0.5, "LoRA was not applied"


@pytest.mark.parametrize("shape", SHAPES[:3] + SHAPES[4:])  # (the segment shrink's shape adds no GEMM load)
@pytest.mark.parametrize("dtype", DTYPES)
def test_weights_through_the_copy_engine_give_the_pointer_loads_bits(shape, dtype, device, poison, monkeypatch):
    """Where the device has the copy engine (the CPU's interpreter emulates it) the GEMMs read the experts' weights
    through descriptors, the gathered rows by pointers: with LoRA and without, the bits of the same tiles loading by
    pointers (MoEKernelConfig.tma False). The tile table takes it on aligned blocks, not on pair blocks (T <= 2)."""
    made, real = [], launcher.tma_descriptor
    monkeypatch.setattr(launcher, "tma_descriptor", lambda t, block: made.append(real(t, block)) or made[-1])
    x, w13, w2, topk, lora, slots = _case(*shape, dtype, device)
    for adapters in ((lora, slots), ()):
        cfg = default_config(x.shape[0], topk.ids.shape[1], w2.shape[0], dtype, lora=bool(adapters))
        assert cfg.tma == (not cfg.pair_blocks)
        cfg = dataclasses.replace(cfg, tma=True)
        made.clear()
        got = fused_moe(x, w13, w2, topk, *adapters, impl="triton", config=cfg)
        assert len(made) == 2 and (None not in made) == gemm_tiles.has_copy_engine(x.device)
        made.clear()
        pointers = fused_moe(x, w13, w2, topk, *adapters, impl="triton", config=dataclasses.replace(cfg, tma=False))
        assert made == [] and torch.equal(got, pointers), f"LoRA: {bool(adapters)}"


@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_block_sizes_agree(dtype, device, poison):
    """A row's result must not depend on the tiles the batch size picks (block_m, the n tiles, half tiles
    for blocks at most half full, pipelined loops over a block's slots); block_k is fixed because it sets the
    order of a row's sums."""
    x, w13, w2, topk, lora, slots = _case(45, 72, 40, 5, 2, dtype, device, slot_ranks=SMALL_RANKS)
    k = 32 if dtype == torch.float32 else 64
    outs = [fused_moe(x, w13, w2, topk, lora, slots, impl="triton",
                      config=MoEKernelConfig(bm, 64, bn, k, g, 4, 2))
            for bm, bn, g in ((16, 32, 1), (32, 64, 4), (64, 16, 8))]
    outs += [fused_moe(x, w13, w2, topk, lora, slots, impl="triton", config=cfg)
             for cfg in (MoEKernelConfig(32, 64, 64, k, 4, 4, 2, half_tiles=True),
                         MoEKernelConfig(32, 128, 64, k, 4, 4, 2),
                         MoEKernelConfig(16, 64, 32, k, 4, 4, 2, slot_stages=3))]
    assert_rows_close(outs[0], fused_moe(x, w13, w2, topk, lora, slots, impl="torch"), rel_tolerance(dtype, device))
    assert torch.equal(outs[0][3], torch.zeros_like(outs[0][3])), "a token with no expert on this rank gets 0"
    for other in outs[1:]:
        assert torch.equal(outs[0], other)
    # a block per pair (a program each, so the first tokens only: their rows are the batch's bits)
    first = TopKOutput(topk.weights[:6].contiguous(), topk.ids[:6].contiguous())
    pairs = fused_moe(x[:6], w13, w2, first, lora, slots[:6], impl="triton",
                      config=MoEKernelConfig(16, 64, 32, k, 4, 4, 2, pair_blocks=True))
    assert torch.equal(outs[0][:6], pairs)


@pytest.mark.parametrize("dtype", DTYPES)
def test_base_tiles_agree(dtype, device, poison):
    """Without LoRA nothing sums over the gate_up n tile, so it may follow the batch too (as may the
    blocking: aligned or a block per pair); the rows must not change."""
    x, w13, w2, topk, _, _ = _case(45, 72, 40, 5, 2, dtype, device)
    k = 32 if dtype == torch.float32 else 64
    outs = [fused_moe(x, w13, w2, topk, impl="triton", config=MoEKernelConfig(bm, bn1, bn2, k, 8, w, 2, pair, half))
            for bm, bn1, bn2, w, pair, half in ((16, 32, 32, 4, True, False), (16, 64, 64, 4, False, False),
                                                (32, 128, 64, 8, False, False), (32, 64, 32, 4, False, True))]
    assert_rows_close(outs[0], fused_moe(x, w13, w2, topk, impl="torch"), rel_tolerance(dtype, device))
    for other in outs[1:]:
        assert torch.equal(outs[0], other)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gate_up_tile_of_two_down_shrink_parts(dtype, device, poison):
    """With LoRA a 128-column gate_up tile computes two 64-column down-shrink parts (the last one partly
    past I here): bit for bit what 64-column tiles give; other widths are refused."""
    x, w13, w2, topk, lora, slots = _case(19, 72, 200, 5, 2, dtype, device, slot_ranks=SMALL_RANKS)
    k = 32 if dtype == torch.float32 else 64
    narrow, wide = (fused_moe(x, w13, w2, topk, lora, slots, impl="triton",
                              config=MoEKernelConfig(16, bn, 32, k, 4, 4, 2)) for bn in (64, 128))
    assert_rows_close(narrow, fused_moe(x, w13, w2, topk, lora, slots, impl="torch"), rel_tolerance(dtype, device))
    assert torch.equal(narrow, wide)
    with pytest.raises(ValueError, match="with LoRA the gate_up n tile must be 64 or 128 columns"):
        fused_moe(x, w13, w2, topk, lora, slots, impl="triton", config=MoEKernelConfig(16, 32, 32, k, 4, 4, 2))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("pair_shrink", [True, False])
def test_partials_summed_once_equal_partials_summed_per_program(dtype, pair_shrink, device, poison):
    """Large batches sum the shrink's K-split and down-shrink partials once per row before the GEMMs read
    them, and a segment shrink's program adds its K splits up itself; the bits must equal every program summing
    them itself (2 K splits, the second a short one, 4 down-shrink parts here), with the shrink per pair or per
    segment."""
    x, w13, w2, topk, lora, slots = _case(19, 600, 200, 5, 2, dtype, device, slot_ranks=SMALL_RANKS)
    cfg = dataclasses.replace(default_config(19, 2, 5, dtype, lora=True),
                              pair_shrink_max_pairs=10**6 if pair_shrink else 0)
    per_program = fused_moe(x, w13, w2, topk, lora, slots, impl="triton",
                            config=dataclasses.replace(cfg, reduce_partials_min_pairs=10**9,
                                                       serial_shrink_min_pairs=10**9))
    once = fused_moe(x, w13, w2, topk, lora, slots, impl="triton",
                     config=dataclasses.replace(cfg, reduce_partials_min_pairs=0, serial_shrink_min_pairs=10**9))
    serial = fused_moe(x, w13, w2, topk, lora, slots, impl="triton",
                       config=dataclasses.replace(cfg, reduce_partials_min_pairs=0, serial_shrink_min_pairs=0))
    assert torch.equal(per_program, once) and torch.equal(per_program, serial)
    assert_rows_close(once, fused_moe(x, w13, w2, topk, lora, slots, impl="torch"), rel_tolerance(dtype, device))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("slot_ranks,shrink_rows,segment_rows", [(SLOT_RANKS, 16, 64), (SMALL_RANKS, 16, 16),
                                                                  (SMALL_RANKS, 64, 64)])
def test_down_shrink_launch_equals_down_shrink_in_gate_up(dtype, slot_ranks, shrink_rows, segment_rows, device,
                                                          poison):
    """The down shrink per segment in a launch of its own (prefill tiles) gives the bits of the gate_up epilogue's
    parts, summed once per row or by every down program: four parts of I (the last one partly past it), keys of
    every rank tile, projections covered on their own (keys with down LoRA only, or none), pieces of a key in
    one tile or in several."""
    x, w13, w2, topk, lora, slots = _case(70, 48, 200, 5, 3, dtype, device, slot_ranks=slot_ranks)
    cfg = dataclasses.replace(default_config(70, 3, 5, dtype, lora=True), pair_shrink_max_pairs=0,
                              shrink_rows=shrink_rows, segment_rows=segment_rows)
    # a key with down LoRA alone and one without it (the buffers past a rank hold NaN: nothing new is read)
    down_only, no_down = (lora.ranks[2] > 0).nonzero()[:2].tolist()
    lora.ranks[:2, down_only[0], down_only[1]] = 0
    lora.ranks[2, no_down[0], no_down[1]] = 0
    launch, summed_once, per_program = (
        fused_moe(x, w13, w2, topk, lora, slots, impl="triton", config=dataclasses.replace(cfg, **changes))
        for changes in (dict(down_shrink_launch=True), dict(reduce_partials_min_pairs=0),
                        dict(reduce_partials_min_pairs=10**9)))
    # past rank 16 the variants' dots differ in shape: one dot over a rank tile (summed per program: the down LoRA on
    # the block's rank tile) or 16-rank steps (the others), and the down shrink's rank columns in a tile (launch) or
    # in steps. The GPU's tensor cores add a dot's ranks 16 at a time into the accumulator whatever its shape (the
    # same bits: test_fused_moe_gpu); the interpreter's numpy matmul rounds by the shape
    for other in (summed_once, per_program):
        if os.environ.get("TRITON_INTERPRET") == "1" and max(slot_ranks) > 16:
            assert_rows_close(other, launch, rel_tolerance(dtype, device))
        else:
            assert torch.equal(launch, other)
    assert_rows_close(launch, fused_moe(x, w13, w2, topk, lora, slots, impl="torch"), rel_tolerance(dtype, device))


@pytest.mark.parametrize("dtype", DTYPES[:1])
@pytest.mark.parametrize("slot_ranks", [SMALL_RANKS, SLOT_RANKS])
def test_many_down_shrink_parts_a_round_give_the_bits_of_a_sum_per_row(dtype, slot_ranks, device, poison):
    """Past SUM_PARTS down-shrink parts (I of 20 parts here, the last one partly past it) the down epilogue loads
    more of them a round (32 at rank tile 16, 16 at 32, 8 at 64, config.down_sum_parts): the bits of the parts summed
    once per row (reduce_partials) and of the down shrink's launch."""
    assert [down_sum_parts(16, 20), down_sum_parts(32, 20), down_sum_parts(16, 224), down_sum_parts(64, 20),
            down_sum_parts(16, 4)] == [32, 16, 32, 8, 8]
    x, w13, w2, topk, lora, slots = _case(9, 32, 20 * 64 - 24, 4, 2, dtype, device, slot_ranks=slot_ranks)
    cfg = default_config(9, 2, 4, dtype, lora=True)
    assert cfg.block_m == 16 and not cfg.pair_blocks
    per_program, summed_once, launch = (
        fused_moe(x, w13, w2, topk, lora, slots, impl="triton", config=dataclasses.replace(cfg, **changes))
        for changes in (dict(reduce_partials_min_pairs=10**9), dict(reduce_partials_min_pairs=0),
                        dict(pair_shrink_max_pairs=0, down_shrink_launch=True)))
    for other in (summed_once, launch):  # (past rank 16 the interpreter rounds by the dots' shapes: see above)
        if os.environ.get("TRITON_INTERPRET") == "1" and max(slot_ranks) > 16:
            assert_rows_close(per_program, other, rel_tolerance(dtype, device))
        else:
            assert torch.equal(per_program, other)
    assert_rows_close(per_program, fused_moe(x, w13, w2, topk, lora, slots, impl="torch"), rel_tolerance(dtype, device))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shrink_warps,shrink_stages,shrink_rows,segment_rows", [(2, 4, 16, 64), (4, 3, 64, 64),
                                                                                (4, 3, 16, 8)])
@pytest.mark.parametrize("one_slot", [False, True])
def test_shrink_per_pair_equals_shrink_per_segment(dtype, shrink_warps, shrink_stages, shrink_rows, segment_rows,
                                                  one_slot, device, poison):
    """Small batches shrink per pair inside the alignment's launch, large ones per (expert, slot) segment (on the
    warps, stages and tiles of the decode rows, of the 64-row row, and in pieces shorter than a key): a row's bits
    must not depend on which one its batch size picks. With one slot for every token (24 rows a key on average)
    a piece of 64 rows runs longer than a tile of 16, and pieces of 8 cut each key into several."""
    x, w13, w2, topk, lora, slots = _case(60, 72, 40, 5, 2, dtype, device, slot_ranks=SMALL_RANKS)
    if one_slot:
        slots = torch.zeros_like(slots)
    cfg = dataclasses.replace(default_config(60, 2, 5, dtype, lora=True), shrink_rows=shrink_rows,
                              segment_rows=segment_rows)
    per_segment = fused_moe(x, w13, w2, topk, lora, slots, impl="triton",
                            config=dataclasses.replace(cfg, pair_shrink_max_pairs=0, shrink_num_warps=shrink_warps,
                                                       shrink_num_stages=shrink_stages))
    per_pair = fused_moe(x, w13, w2, topk, lora, slots, impl="triton",
                         config=dataclasses.replace(cfg, pair_shrink_max_pairs=10**6))
    assert torch.equal(per_segment, per_pair)
    assert_rows_close(per_pair, fused_moe(x, w13, w2, topk, lora, slots, impl="torch"), rel_tolerance(dtype, device))


@pytest.mark.parametrize("dtype", DTYPES)
def test_shrink_launch_per_rank_tile_equals_one_launch(dtype, device, poison):
    """The segment shrink as a launch per rank tile (each launch the segments whose ranks take its tile) writes the
    bits of one launch over every tile, and of the shrink per pair; experts hold slots of all three tiles (ranks 4
    to 64)."""
    x, w13, w2, topk, lora, slots = _case(70, 48, 40, 5, 3, dtype, device, coverage=1.0)
    cfg = dataclasses.replace(default_config(70, 3, 5, dtype, lora=True), pair_shrink_max_pairs=0)
    per_tile, one, per_pair = (
        fused_moe(x, w13, w2, topk, lora, slots, impl="triton", config=dataclasses.replace(cfg, **changes))
        for changes in (dict(shrink_per_rank_tile=True), dict(shrink_per_rank_tile=False),
                        dict(pair_shrink_max_pairs=10**6)))
    assert torch.equal(per_tile, one) and torch.equal(per_tile, per_pair)
    assert_rows_close(per_tile, fused_moe(x, w13, w2, topk, lora, slots, impl="torch"), rel_tolerance(dtype, device))
    base = fused_moe(x, w13, w2, topk, impl="triton", config=cfg)
    assert not torch.equal(per_tile[slots >= 0], base[slots >= 0]), "LoRA was not applied"


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_rows_off_16_bytes_take_plain_loads(dtype, device, poison, monkeypatch):
    """The shrink is told whether every row of A starts on 16 bytes (its vector loads need it): not with a hidden
    size of 62 (124 or 248 bytes a row), nor for a view one element in, and the results still match, with the
    shrink per segment, per pair, and in the gate_up launch (pair blocks)."""
    x, w13, w2, topk, lora, slots = _case(24, 62, 40, 9, 4, dtype, device, slot_ranks=SMALL_RANKS)
    wide = torch.zeros(*lora.a_gate.shape[:3], 64, dtype=dtype, device=device)
    assert launcher.rows_start_on_16_bytes(wide) and not launcher.rows_start_on_16_bytes(wide.view(-1)[1:])
    told = []
    check = launcher.rows_start_on_16_bytes
    monkeypatch.setattr(launcher, "rows_start_on_16_bytes", lambda *w: told.append(check(*w)) or told[-1])
    cfg = default_config(24, 4, 9, dtype, lora=True)
    for config in (dataclasses.replace(cfg, pair_shrink_max_pairs=0),
                   dataclasses.replace(cfg, pair_shrink_max_pairs=10**6)):
        assert_rows_close(fused_moe(x, w13, w2, topk, lora, slots, impl="triton", config=config),
                          fused_moe(x, w13, w2, topk, lora, slots, impl="torch"), rel_tolerance(dtype, device))
    first = (x[:6], w13, w2, TopKOutput(topk.weights[:6].contiguous(), topk.ids[:6].contiguous()), lora, slots[:6])
    assert_rows_close(fused_moe(*first, impl="triton", config=dataclasses.replace(cfg, pair_blocks=True)),
                      fused_moe(*first, impl="torch"), rel_tolerance(dtype, device))  # (a program per pair)
    assert told == [False] * 3


def _uncover(lora: ExpertLoRASlots, slot: int, expert: int) -> None:
    """The slot's adapter no longer covers the expert: rank 0, and NaN weights that no kernel may read."""
    lora.ranks[:, slot, expert] = 0
    for w in (lora.a_gate, lora.b_gate, lora.a_up, lora.b_up, lora.a_down, lora.b_down):
        w[slot, expert] = float("nan")


@pytest.mark.parametrize("token_slots", [(5,), (5, -1), (5, 0)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_pair_blocks_lora_equal_aligned_blocks(token_slots, dtype, device, poison):
    """At T <= 2 (pair blocks) the gate/up shrink runs in the gate_up launch, its GEMM programs waiting on a
    ready counter per pair: the bits must equal aligned blocks' (the shrink in a launch of its own), for an
    expert the adapter covers, one it does not (rank 0), a dropped one and base tokens; and the counters must
    be back at 0 for the next launch."""
    tokens = len(token_slots)
    x, w13, w2, topk, lora, slots = _case(tokens, 600, 72, 5, 3, dtype, device, slot_ranks=SMALL_RANKS)
    slots.copy_(torch.tensor(token_slots, dtype=torch.int32))
    uncovered = (int(topk.ids[0, 0]) + 1) % 5  # topk.ids[0, 0] is covered by slot 5 (see _case)
    topk.ids[0, 1:] = torch.tensor([uncovered, -1])
    _uncover(lora, 5, uncovered)
    cfg = default_config(tokens, 3, 5, dtype, lora=True)
    assert cfg.pair_blocks
    got = fused_moe(x, w13, w2, topk, lora, slots, impl="triton", config=cfg)
    assert not launcher._ready[x.device].any(), "ready counters not put back to 0"
    aligned = fused_moe(x, w13, w2, topk, lora, slots, impl="triton",
                        config=dataclasses.replace(cfg, pair_blocks=False))
    assert torch.equal(got, aligned)
    assert_rows_close(got, fused_moe(x, w13, w2, topk, lora, slots, impl="torch"), rel_tolerance(dtype, device))
    base = fused_moe(x, w13, w2, topk, impl="triton", config=cfg)
    assert not torch.equal(got[0], base[0]), "LoRA was not applied"
    assert torch.equal(got[slots < 0], base[slots < 0])


@pytest.mark.parametrize("small", [0, 2])
@pytest.mark.parametrize("dtype", DTYPES)
def test_row_bits_do_not_depend_on_rank_tiles(small, dtype, device, poison):
    """Each block runs its LoRA on the smallest rank tile (16, 32, ..., the buffers' 64) that holds its rows'
    ranks. A rank-8 row gets the same bits on a 16-column tile (its adapter alone), on a 64-column one (blocks
    shared with rank-24 and rank-64 rows, whose first slot it is (small = 0) or whose last (small = 2): the
    epilogues treat the first slot apart), with buffers whose tile is 16 (no larger adapter loaded), and at T = 1
    (a block per pair)."""
    slot_ranks = [8, 24, 64] if small == 0 else [64, 24, 8]
    x, w13, w2, topk, lora, _ = _case(24, 72, 40, 3, 2, dtype, device, coverage=1.0, slot_ranks=slot_ranks)
    topk = TopKOutput(topk.weights, topk.ids.clamp(0, 2).contiguous())  # every pair routed: blocks mix slots
    slots = (torch.arange(24, device=device) % 3).to(torch.int32)
    mixed = fused_moe(x, w13, w2, topk, lora, slots, impl="triton")
    assert_rows_close(mixed, fused_moe(x, w13, w2, topk, lora, slots, impl="torch"), rel_tolerance(dtype, device))
    own = slots == small
    alone_topk = TopKOutput(topk.weights[own].contiguous(), topk.ids[own].contiguous())
    alone = fused_moe(x[own].contiguous(), w13, w2, alone_topk, lora, slots[own].contiguous(), impl="triton")
    assert torch.equal(alone, mixed[own]), "a rank-8 row changed with the rank tile of its blocks"
    ranks = torch.zeros_like(lora.ranks)
    ranks[:, small] = lora.ranks[:, small]  # only the rank-8 adapter loaded: buffers' tile 16
    only_small = dataclasses.replace(lora, ranks=ranks, max_rank_in_use=8)
    assert torch.equal(fused_moe(x[own].contiguous(), w13, w2, alone_topk, only_small, slots[own].contiguous(),
                                 impl="triton"), alone), "a rank-8 row changed with the slot buffers' tile"
    first = int(own.nonzero()[0])
    one = fused_moe(x[first:first + 1], w13, w2, TopKOutput(topk.weights[first:first + 1],
                                                          topk.ids[first:first + 1]), lora, slots[first:first + 1],
                    impl="triton")
    assert torch.equal(one, mixed[first:first + 1]), "a rank-8 row changed between pair blocks and aligned blocks"


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="counts the interpreter's calls")
def test_each_run_costs_the_rank_chunks_of_its_own_rank(device, poison, monkeypatch):
    """An aligned block holding a rank-8 run beside a rank-64 run expands them in 16-rank steps, one for the rank-8
    run and four for the rank-64 one, in each of gate, up and down (the LoRA work follows each run's rank, not the
    block's largest); the result is the reference's, and the rank-8 rows keep the bits they have alone."""
    dtype = DTYPES[0]
    x, w13, w2, _, lora, _ = _case(8, 64, 32, 2, 1, dtype, device, coverage=1.0, slot_ranks=[8, 64])
    topk = TopKOutput(torch.ones(8, 1, device=device), torch.zeros(8, 1, dtype=torch.int32, device=device))
    slots = (torch.arange(8, device=device) % 2).to(torch.int32)  # one block of expert 0: a run of each slot
    widths = []
    real_expand = gemm.lora_expand

    def expand(acc, xa, rows, rank, bt):
        widths.append(int(xa.shape[1]))
        return real_expand(acc, xa, rows, rank, bt)

    monkeypatch.setattr(gemm, "lora_expand", expand)
    got = fused_moe(x, w13, w2, topk, lora, slots, impl="triton")
    assert widths == [16] * 15, "expected (1 + 4) 16-rank steps in each of gate, up and down"
    assert_rows_close(got, fused_moe(x, w13, w2, topk, lora, slots, impl="torch"), rel_tolerance(dtype, device))
    own = slots == 0
    alone = fused_moe(x[own].contiguous(), w13, w2, TopKOutput(topk.weights[own], topk.ids[own].contiguous()), lora,
                      slots[own].contiguous(), impl="triton")
    assert torch.equal(alone, got[own])


def test_all_pairs_dropped_gives_zero(device, poison):
    dtype = DTYPES[0]
    x, w13, w2, topk, lora, slots = _case(5, 64, 32, 4, 2, dtype, device)
    ids = torch.full_like(topk.ids, -1)
    y = fused_moe(x, w13, w2, TopKOutput(topk.weights, ids), lora, slots, impl="triton")
    assert torch.equal(y, torch.zeros_like(y))


@pytest.mark.parametrize("with_lora", [False, True])
def test_no_tokens_gives_an_empty_output(with_lora, device, poison):
    """An expert-parallel rank that receives no pairs runs its experts on 0 tokens (top-1, local ids)."""
    dtype = DTYPES[0]
    x, w13, w2, topk, lora, slots = _case(1, 64, 32, 4, 1, dtype, device)
    empty = TopKOutput(topk.weights[:0], topk.ids[:0])
    lora, slots = (lora, slots[:0]) if with_lora else (None, None)
    y = fused_moe(x[:0], w13, w2, empty, lora, slots, impl="triton")
    assert y.shape == (0, 64) and y.dtype == dtype


def test_uncovered_and_empty_slots_cost_nothing_and_give_base(device, poison):
    """Slots whose adapter covers no expert (rank 0 everywhere, weights NaN) give the base result."""
    dtype = DTYPES[0]
    x, w13, w2, topk, lora, slots = _case(9, 64, 32, 4, 2, dtype, device, coverage=0.0)
    got = fused_moe(x, w13, w2, topk, lora, slots, impl="triton")
    assert torch.equal(got, fused_moe(x, w13, w2, topk, impl="triton"))


def test_rejects_bad_inputs(device):
    dtype = DTYPES[0]
    x, w13, w2, topk, lora, slots = _case(4, 64, 32, 4, 2, dtype, device)
    with pytest.raises(ValueError, match="w13 .* do not fit"):
        fused_moe(x, w13[:, :10], w2, topk)
    with pytest.raises(ValueError, match="topk ids must be contiguous int32"):
        fused_moe(x, w13, w2, TopKOutput(topk.weights, topk.ids.long()))
    with pytest.raises(ValueError, match="token_slots must be int32 of shape"):
        fused_moe(x, w13, w2, topk, lora, slots[:2])
    bad = ExpertLoRASlots(**{**lora.__dict__, "b_down": lora.b_down[:, :, :5]})
    with pytest.raises(ValueError, match=r"ExpertLoRASlots.b_down has shape"):
        fused_moe(x, w13, w2, topk, bad, slots)
    with pytest.raises(ValueError, match="impl must be"):
        fused_moe(x, w13, w2, topk, impl="cuda")


@pytest.mark.parametrize("field,value,rule", [("block_m", 24, "a power of two of at least 16"),
                                              ("shrink_rows", 8, "a power of two of at least 16"),
                                              ("num_warps", 3, "a power of two from 1 to 32"),
                                              ("segment_rows", 0, "an int of at least 1"),
                                              ("pair_shrink_max_pairs", -1, "an int of at least 0"),
                                              ("max_registers", 300, "None or an int from 32 to 255")])
def test_config_names_a_bad_field(field, value, rule):
    good = default_config(64, 2, 8, DTYPES[0], lora=True)
    with pytest.raises(ValueError, match=rf"MoEKernelConfig\.{field} must be {rule}, got {value}"):
        dataclasses.replace(good, **{field: value})


def test_large_rank_tiles_take_fewer_pipeline_stages():
    """The GEMMs' slot-loop pipeline and the segment shrink's stages hold tiles of the rank tile in shared memory: at
    rank tiles of 128 and 256 the prefill row's asked 294912 B and its shrink 245760 B of an H100's 232448 (compiled
    for sm_90, session 48), so a launch of those runs fewer stages; and the segment shrink, whose registers spilled
    kilobytes there (session 49), runs on 8 warps and fewer rows a pass. Up to 64 every row keeps its own; past 256
    the launch names the limit."""
    from moelora.kernels.fused_moe.config import for_rank_tile
    rows = [default_config(t, 8, 128, torch.bfloat16, lora=True) for t in (1, 32, 512, 1024, 8192)]
    for cfg in rows:
        assert for_rank_tile(cfg, 64) == cfg and for_rank_tile(cfg, 16) == cfg
        for block_r in (128, 256):
            large = for_rank_tile(cfg, block_r)
            assert large.shrink_num_warps == 8 and large.shrink_rows == min(cfg.shrink_rows, 8192 // block_r)
    prefill = rows[-1]
    assert (prefill.slot_stages, prefill.shrink_num_stages, prefill.shrink_rows) == (4, 3, 128)
    assert (for_rank_tile(prefill, 128).slot_stages, for_rank_tile(prefill, 128).shrink_num_stages) == (2, 3)
    assert (for_rank_tile(prefill, 256).slot_stages, for_rank_tile(prefill, 256).shrink_num_stages) == (1, 3)
    with pytest.raises(ValueError, match="rank tiles up to 256 .* got 512: a --max-lora-rank of at most 256"):
        for_rank_tile(prefill, 512)


def test_pair_blocks_past_the_ready_counters(device, monkeypatch):
    x, w13, w2, topk, lora, slots = _case(3, 64, 32, 4, 2, DTYPES[0], device)
    monkeypatch.setattr(launcher, "READY_COUNTERS", 5)
    with pytest.raises(ValueError, match="pair blocks with LoRA on 6 pairs: more than the 5 counters"):
        fused_moe(x, w13, w2, topk, lora, slots, impl="triton",
                  config=dataclasses.replace(default_config(1, 2, 4, DTYPES[0], lora=True), pair_blocks=True))


@pytest.mark.parametrize("tokens, hidden, slot_ranks, with_lora, caps", [
    (1, 64, SLOT_RANKS, True, (128, 128)), (48, 600, SLOT_RANKS, True, (168, None)),
    (48, 64, SLOT_RANKS, True, (None, None)), (8, 64, SLOT_RANKS, True, (None, None)),
    (1, 64, [16, 8], True, (None, None)), (48, 600, [16, 8], True, (None, None)),
    (1, 64, SLOT_RANKS, False, (None, None)), (48, 64, SLOT_RANKS, False, (None, None))])
def test_register_cap_and_pdl_reach_the_gemm_launches(tokens, hidden, slot_ranks, with_lora, caps, device,
                                                      monkeypatch):
    """Pair blocks (T = 1 here) and blocks of 32 rows (T = 48: 24 rows an expert) cap a GEMM kernel's registers
    (MoEKernelConfig.max_registers) when it holds the epilogues of rank tiles past the smallest, so those do not set
    every program's occupancy. A kernel whose LoRA partials are one part runs in 16-rank steps and holds none: at
    T = 48 the gate_up kernel's xa has two K splits with a hidden size of 600 (one with 64), the down kernel's one
    part of I = 32 either way. Blocks of 16 rows (T = 8), the smallest rank tile alone and no LoRA leave the
    compiler's choice. All launch with PDL where the device has it (here it is made to)."""
    launches = []
    real_pdl = pdl_launch(torch.device(device))

    class Recorder:  # records the GEMMs' launch options, then launches with the device's real PDL choice
        def __init__(self, name):
            self.name, self.kernel = name, getattr(launcher, name)

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                if self.name in ("gate_up_kernel", "down_kernel"):
                    launches.append((kwargs.get("maxnreg"), kwargs["PDL"], kwargs["launch_pdl"]))
                return self.kernel[grid](*args, **{**kwargs, **(real_pdl if kwargs["PDL"] else {})})
            return launch

    for name in ("pair_shrink_kernel", "shrink_kernel", "gate_up_kernel", "down_kernel", "moe_sum_kernel"):
        monkeypatch.setattr(launcher, name, Recorder(name))
    x, w13, w2, topk, lora, slots = _case(tokens, hidden, 32, 4, 2, DTYPES[0], device, slot_ranks=slot_ranks)
    lora = lora if with_lora else None
    cfg = default_config(tokens, 2, 4, DTYPES[0], lora=with_lora)
    expected = fused_moe(x, w13, w2, topk, lora, slots, impl="torch")
    monkeypatch.setattr(launcher, "pdl_launch", lambda _: {"PDL": True, "launch_pdl": True})
    got = fused_moe(x, w13, w2, topk, lora, slots, impl="triton", config=cfg)
    assert_rows_close(got, expected, rel_tolerance(DTYPES[0], device))
    assert launches == [(cap, True, True) for cap in caps]


@pytest.mark.parametrize("shape", [SHAPES[0], SHAPES[1], SHAPES[3]])
def test_slots_no_token_names_are_never_read(shape, device, poison):
    """A slot that no token of the batch names may be half written while the batch runs (an adapter loading into it
    on another stream): its A, B and ranks are never read, at one token (pair blocks), on aligned blocks and with
    the shrink per segment. The same bits with every such slot NaN and covering every expert at the full rank."""
    dtype = DTYPES[0]
    x, w13, w2, topk, lora, slots = _case(*shape, dtype, device)
    slots = torch.where(slots == 1, 0, torch.where(slots == 3, 2, slots))  # slots 1 and 3 are named by no token
    unread = torch.tensor([False, True, False, True], device=device).view(-1, 1, 1, 1)
    torn = ExpertLoRASlots(**{name: getattr(lora, name).masked_fill(unread, float("nan"))
                              for name in ("a_gate", "b_gate", "a_up", "b_up", "a_down", "b_down")},
                           ranks=lora.ranks.masked_fill(unread.view(1, -1, 1), lora.a_gate.shape[2]),
                           max_rank_in_use=lora.max_rank_in_use)
    for impl in ("triton", "torch"):
        got = fused_moe(x, w13, w2, topk, torn, slots, impl=impl)
        assert torch.equal(got, fused_moe(x, w13, w2, topk, lora, slots, impl=impl)), impl
