import pytest
import torch

from moelora.kernels.moe_align import (CHUNK, SINGLE_PROGRAM_MAX_PAIRS, cursor_copies, max_aligned_rows, max_segments,
                                       moe_align, moe_align_reference)

CASES = [  # tokens, top_k, experts, slots, block_m
    (1, 1, 4, 0, 16),
    (1, 8, 128, 8, 16),
    (7, 2, 5, 3, 16),
    (37, 4, 6, 4, 16),  # more pairs per expert than one block
    (64, 6, 64, 8, 32),
    (300, 2, 8, 33, 64),  # many slots, several blocks per expert
    (720, 4, 16, 5, 64),  # past SINGLE_PROGRAM_MAX_PAIRS: the grid-wide kernels, 5 copies of the counters, 16 programs
    (600, 2, 128, 63, 16),  # 128 x 64 keys: 1 copy
    (1100, 2, 128, 1, 16),  # 2 copies over 17 programs
]


def _random_routing(tokens, top_k, experts, slots, device, gen):
    ids = torch.randint(0, experts, (tokens, top_k), generator=gen, dtype=torch.int32).to(device)
    # EP-style -1 and garbage ids must be dropped
    drop = torch.rand(tokens, top_k, generator=gen).to(device) < 0.15
    ids = torch.where(drop, torch.randint(-3, 0, ids.shape, generator=gen, dtype=torch.int32).to(device), ids)
    far = torch.rand(tokens, top_k, generator=gen).to(device) < 0.1
    ids = torch.where(far, experts + torch.randint(0, 5, ids.shape, generator=gen, dtype=torch.int32).to(device), ids)
    token_slots = torch.randint(-1, slots + 2, (tokens,), generator=gen, dtype=torch.int32).to(device)
    return ids.contiguous(), token_slots


def _pair_slots(ids, token_slots, slots):
    pair_slot = token_slots.cpu().long().repeat_interleave(ids.shape[1])
    return torch.where((pair_slot >= 0) & (pair_slot < slots), pair_slot, -1)


def _check_layout(blocks, ids, token_slots, experts, slots):
    """Invariants any correct alignment satisfies."""
    num_pairs = ids.numel()
    sorted_ids, bm = blocks.sorted_ids.cpu().long(), blocks.block_m
    block_expert = blocks.block_expert.cpu().long()
    num_rows = int(blocks.num_rows)
    flat = ids.flatten().cpu().long()
    valid = (flat >= 0) & (flat < experts)
    pair_slot = _pair_slots(ids, token_slots, slots)

    assert num_rows % bm == 0 and num_rows <= sorted_ids.numel() == max_aligned_rows(num_pairs, experts, bm)
    used = sorted_ids[:num_rows]
    assert (sorted_ids[num_rows:] == num_pairs).all(), "rows past num_rows must be padding"
    assert ((used >= 0) & (used <= num_pairs)).all(), "row holds neither a pair nor padding"
    assert sorted(used[used < num_pairs].tolist()) == torch.nonzero(valid).flatten().tolist(), "each valid pair once"
    n_used = num_rows // bm
    assert (block_expert[n_used:] == -1).all()
    assert ((block_expert[:n_used] >= 0) & (block_expert[:n_used] < experts)).all()
    assert (block_expert[1:n_used] >= block_expert[:n_used - 1]).all(), "blocks ordered by expert"
    row_expert = block_expert[:n_used].repeat_interleave(bm)
    is_pair = used < num_pairs
    assert (flat[used[is_pair]] == row_expert[is_pair]).all(), "pair placed in a block of another expert"
    for e in row_expert.unique().tolist():  # slot-ordered pairs, then less than a block of padding
        seg = used[row_expert == e]
        n = int((seg < num_pairs).sum())
        assert n > 0 and (seg[n:] == num_pairs).all() and len(seg) == -(-n // bm) * bm
        seg_slots = pair_slot[seg[:n]]
        assert (seg_slots[1:] >= seg_slots[:-1]).all(), f"expert {e}: pairs not ordered by slot"


def test_cases_count_in_one_and_in_several_copies():
    """The grid-wide cases cover one copy of the counters and several, in grids of programs that the copies do not
    divide."""
    copies = {cursor_copies(t * k, e, s) for t, k, e, s, _ in CASES if t * k > SINGLE_PROGRAM_MAX_PAIRS}
    assert copies == {1, 2, 5}
    for t, k, e, s, bm in CASES:
        n = cursor_copies(t * k, e, s)
        if t * k > SINGLE_PROGRAM_MAX_PAIRS and n > 1:
            assert -(-max_aligned_rows(t * k, e, bm) // CHUNK) % n, (t, k, e, s)


@pytest.mark.parametrize("experts,slots,block_m,segment_rows", [(128, 0, 64, 0), (128, 8, 64, 64), (16, 3, 16, 0)])
def test_the_number_of_pairs_picks_no_kernel_variant(experts, slots, block_m, segment_rows, monkeypatch):
    """The grid-wide kernels' constexprs follow the experts, slots and tiles alone, and their integers that follow
    the pairs (the count, the copies of the counters) are not specialised: a number of tokens the engine's warm-up
    never ran compiles nothing new (kernels/__init__.py)."""
    import moelora.kernels.moe_align as ma

    launches = {}

    class Recorder:
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            return lambda *args, **constexprs: launches.setdefault(self.kernel.fn.__name__, set()).add(
                tuple(sorted(constexprs.items())))

    for name in ("_count_kernel", "_lay_out_kernel", "_place_kernel"):
        kernel = getattr(ma, name)
        # (the interpreter keeps the decorator's names, a compiled kernel their indices)
        unspecialised = kernel.kwargs["do_not_specialize"] if hasattr(kernel, "kwargs") else kernel.do_not_specialize
        unspecialised = {kernel.arg_names[i] if isinstance(i, int) else i for i in unspecialised}
        assert {"num_pairs", "copies"} & set(kernel.arg_names) <= unspecialised, name
        monkeypatch.setattr(ma, name, Recorder(kernel))
    copies = set()
    for tokens in range(SINGLE_PROGRAM_MAX_PAIRS + 1, 1 << 17, 997):
        ids = torch.zeros(tokens, 1, dtype=torch.int32)
        moe_align(ids, torch.zeros(tokens, dtype=torch.int32) if slots else None, experts, slots, block_m,
                  segment_rows)
        copies.add(cursor_copies(tokens, experts, slots))
    assert len(copies) > 2 and all(len(variants) == 1 for variants in launches.values()), launches


@pytest.mark.parametrize("tokens,top_k,experts,slots,block_m", CASES)
@pytest.mark.parametrize("with_slots", [True, False])
def test_moe_align_matches_reference(tokens, top_k, experts, slots, block_m, with_slots, device, poison):
    gen = torch.Generator().manual_seed(torch.seed())
    ids, token_slots = _random_routing(tokens, top_k, experts, slots, device, gen)
    token_slots = token_slots if with_slots else None
    got = moe_align(ids, token_slots, experts, slots, block_m)
    ref = moe_align_reference(ids, token_slots, experts, slots, block_m)
    none = torch.full((tokens,), -1, dtype=torch.int32, device=device)
    _check_layout(ref, ids, none if token_slots is None else token_slots, experts, slots)
    _check_layout(got, ids, none if token_slots is None else token_slots, experts, slots)
    assert torch.equal(got.num_rows.cpu(), ref.num_rows.cpu())
    assert torch.equal(got.block_expert.cpu(), ref.block_expert.cpu())
    # order inside one (expert, slot) run may differ (atomics); each run's place may not
    key = ids.flatten().cpu().long() * (slots + 1) + 1 + _pair_slots(ids, none if token_slots is None else token_slots, slots)
    key = torch.cat([key, torch.tensor([-1])])  # padding rows
    assert torch.equal(key[got.sorted_ids.cpu().long()], key[ref.sorted_ids.cpu().long()])


@pytest.mark.parametrize("tokens,top_k,experts,slots,block_m", [c for c in CASES if c[3] > 0])
@pytest.mark.parametrize("segment_rows", [3, 64])
def test_segments_are_the_runs_of_each_expert_and_slot(tokens, top_k, experts, slots, block_m, segment_rows, device,
                                                        poison):
    """AlignedBlocks.segments: each (expert, slot >= 0) key's run of rows, in key order, in pieces of at most
    segment_rows rows (all full but the last), as the reference lays them out: every row of a piece holds a pair of
    the piece's key, and the pieces hold every pair with an expert here and a slot."""
    gen = torch.Generator().manual_seed(torch.seed())
    ids, token_slots = _random_routing(tokens, top_k, experts, slots, device, gen)
    got = moe_align(ids, token_slots, experts, slots, block_m, segment_rows)
    ref = moe_align_reference(ids, token_slots, experts, slots, block_m, segment_rows)
    pair_slots = _pair_slots(ids, token_slots, slots).cpu()
    flat = ids.flatten().cpu().long()
    lora_pair = (flat >= 0) & (flat < experts) & (pair_slots >= 0)
    per_key = torch.bincount((flat * slots + pair_slots)[lora_pair], minlength=experts * slots)
    n = int(((per_key + segment_rows - 1) // segment_rows).sum())  # a key of c pairs: ceil(c / segment_rows) pieces
    assert int(got.num_segments) == int(ref.num_segments) == n
    assert got.segments.shape == ref.segments.shape == (3, max_segments(tokens * top_k, experts, slots, segment_rows))
    assert torch.equal(got.segments[:, :n].cpu(), ref.segments[:, :n].cpu())
    covered = []
    for first, rows, key in got.segments[:, :n].T.cpu().tolist():
        assert 0 < rows <= segment_rows
        pairs = got.sorted_ids[first:first + rows].cpu().long()
        assert ((flat[pairs] * slots + pair_slots[pairs]) == key).all()
        covered += pairs.tolist()
    # together the pieces hold each pair with an expert here and a slot exactly once
    assert sorted(covered) == lora_pair.nonzero().flatten().tolist()
    assert moe_align(ids, token_slots, experts, slots, block_m).segments is None  # only where asked for


def test_moe_align_rejects_bad_dtypes(device):
    ids = torch.zeros(3, 2, dtype=torch.int64, device=device)
    with pytest.raises(ValueError, match="topk_ids must be contiguous int32"):
        moe_align(ids, None, 4, 0, 16)
    with pytest.raises(ValueError, match="token_slots must be int32 of shape"):
        moe_align(ids.int(), torch.zeros(2, dtype=torch.int32, device=device), 4, 1, 16)
