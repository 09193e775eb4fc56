import dataclasses

import pytest
import torch

from moelora.kernels.attention import AttentionConfig, attention, attention_reference, extend_blocks
from tests.support import assert_rows_close, random_paged_attention, rel_tolerance

DTYPES = [torch.bfloat16, torch.float16] if torch.cuda.is_available() else [torch.float16, torch.float32]
SMALL = AttentionConfig(block_m=16, block_n=16, decode_block_n=16, num_warps=4, num_stages=1)  # many tiles, cheap
EXTEND_CASES = [  # prefix lengths, extend lengths, Hq, Hkv, Dk, Dv
    ([0], [1], 2, 2, 16, 16),  # a single token
    ([0, 7, 40], [37, 1, 20], 4, 2, 16, 16),  # extend > block, prefix 0, lengths off the tile grid
    ([3, 0], [18, 33], 4, 1, 24, 16),  # group 4; Dk not a power of two, Dk != Dv
    ([25], [17], 2, 2, 48, 32),  # group 1; Dk = 32 + 16 (the MLA-style split)
]
DECODE_CASES = [  # sequence lengths, Hq, Hkv, Dk, Dv
    ([1], 2, 2, 16, 16),
    ([1, 17, 64, 200], 8, 2, 16, 32),  # up to 7 splits of 2 tiles
    ([5, 130], 4, 2, 24, 16),
    ([90, 33], 2, 2, 48, 32),
]


def _run(case, impl, **kw):
    return attention(*case, impl=impl, **kw)


def _check(case, got, dtype, device):
    ref = _run(case, "torch")
    heads = got.shape[1]
    assert_rows_close(got.flatten(0, 1), ref.flatten(0, 1), rel_tolerance(dtype, device), f"[token*{heads} + head]")


def _sdpa(case):
    """Independent formula: torch's scaled_dot_product_attention on each sequence's gathered keys."""
    q, k_cache, v_cache, req_to_token, rows, seq_lens, ext, starts, scale = case
    out = torch.zeros(q.shape[0], q.shape[1], v_cache.shape[-1], dtype=torch.float64)
    for row, total, new, start in zip(rows.tolist(), seq_lens.tolist(), ext.tolist(), starts.tolist()):
        slots = req_to_token[row, :total].long()
        k, v = k_cache[slots].double().transpose(0, 1), v_cache[slots].double().transpose(0, 1)  # [Hkv, L, D]
        causal = torch.arange(total)[None, :] <= torch.arange(total - new, total)[:, None]
        o = torch.nn.functional.scaled_dot_product_attention(q[start:start + new].double().cpu().transpose(0, 1),
                                                             k.cpu(), v.cpu(), attn_mask=causal, scale=scale,
                                                             enable_gqa=True)
        out[start:start + new] = o.transpose(0, 1)
    return out


@pytest.mark.parametrize("case_args", EXTEND_CASES + [([0, 1, 60], [1, 1, 1], 4, 2, 16, 32)])
def test_reference_matches_sdpa(case_args, device):
    case = random_paged_attention(*case_args, torch.float32, device)
    got = attention_reference(*case)
    assert_rows_close(got.cpu().flatten(0, 1), _sdpa(case).flatten(0, 1), 1e-5, "reference vs sdpa")


@pytest.mark.parametrize("case_args", EXTEND_CASES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_extend_matches_reference(case_args, dtype, device, poison):
    case = random_paged_attention(*case_args, dtype, device)
    got = _run(case, "triton", config=SMALL)
    _check(case, got, dtype, device)


@pytest.mark.parametrize("seed", range(4))
def test_extend_blocks_list_each_query_block_once(seed, device):
    """Every (sequence, query block) of the step once, the blocks nearest each sequence's end first (ties by
    sequence), then -1 entries only; the table's length a bound from the token and sequence counts alone."""
    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(0, 60, (int(torch.randint(1, 12, (1,), generator=gen)),), generator=gen)
    lens[torch.rand(lens.shape, generator=gen) < 0.3] = 0  # empty sequences, as a prompt graph's padding rows
    tokens = int(lens.sum()) + int(torch.randint(0, 40, (1,), generator=gen))  # more rows than new tokens is fine
    q, k = torch.zeros(max(tokens, 1), 2, 16, device=device), torch.zeros(4, 1, 16, device=device)
    entries = extend_blocks(q, k, lens.to(torch.int32).to(device), SMALL).entries.cpu()
    counts = [(n + SMALL.block_m - 1) // SMALL.block_m for n in lens.tolist()]
    want = sorted(((c - 1 - b, s), (s, b)) for s, c in enumerate(counts) for b in range(c))
    assert entries.dtype == torch.int32 and entries.shape[1] == 2
    assert entries[:len(want)].tolist() == [list(pair) for _, pair in want]
    assert (entries[len(want):] == -1).all()
    assert entries.shape[0] <= -(-q.shape[0] // SMALL.block_m) + len(counts)


def test_extend_grid_skips_padding_sequences(device, poison):
    """A prompt graph's step: one prompt, a padding sequence, and empty rows after them (their start past the
    tokens): the table lists the two sequences' blocks alone, and each row gets the reference's values. Each program
    computes its entry alone: a table of the same blocks shuffled, with more -1 entries, gives the same bits."""
    dtype = DTYPES[0]
    q, k, v, req_to_token, rows, seq_lens, ext, starts, scale = random_paged_attention(
        [5, 0, 0, 0, 0], [37, 11, 0, 0, 0], 4, 2, 16, 16, dtype, device)
    case = (q, k, v, req_to_token, rows, seq_lens, ext, starts.masked_fill(ext == 0, q.shape[0]), scale)
    blocks = extend_blocks(q, k, ext, SMALL)
    real = blocks.entries[blocks.entries[:, 0] >= 0]
    assert sorted(real.tolist()) == [[0, 0], [0, 1], [0, 2], [1, 0]]
    got = _run(case, "triton", config=SMALL, blocks=blocks)
    _check(case, got, dtype, device)
    shuffled = torch.cat([real[torch.randperm(real.shape[0], device=device)], real.new_full((9, 2), -1)])
    again = _run(case, "triton", config=SMALL, blocks=dataclasses.replace(blocks, entries=shuffled.contiguous()))
    assert torch.equal(got, again)


@pytest.mark.parametrize("dtype", DTYPES)
def test_extend_default_tiles(dtype, device, poison):
    """The shipped tile sizes: extends longer than a default query block, with a prefix."""
    case = random_paged_attention([0, 70], [150, 40], 2, 1, 32, 16, dtype, device)
    _check(case, _run(case, "triton"), dtype, device)


@pytest.mark.parametrize("case_args", DECODE_CASES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_matches_reference(case_args, dtype, device, poison):
    seq_lens, *heads = case_args
    case = random_paged_attention([n - 1 for n in seq_lens], [1] * len(seq_lens), *heads, dtype, device)
    got = _run(case, "triton", is_decode=True, max_kv_splits=8, config=SMALL)
    _check(case, got, dtype, device)


def test_decode_with_default_tiles_and_splits(device, poison):
    dtype = DTYPES[0]
    case = random_paged_attention([0, 300, 47], [1, 1, 1], 8, 1, 16, 16, dtype, device)
    _check(case, _run(case, "triton", is_decode=True), dtype, device)


def test_decode_combines_more_splits_than_a_round(device, poison):
    """22 splits of 32 keys (the reduce loads 8 a round: two full rounds and a part of one) beside sequences of
    one split and of five."""
    dtype = DTYPES[0]
    case = random_paged_attention([699, 0, 129], [1, 1, 1], 2, 1, 16, 16, dtype, device)
    _check(case, _run(case, "triton", is_decode=True, max_kv_splits=32, config=SMALL), dtype, device)


def test_decode_result_does_not_depend_on_batch(device, poison):
    """A sequence's split size follows its own length only: alone or batched, the same bits."""
    dtype = DTYPES[0]
    batch = random_paged_attention([150, 3, 40, 99], [1] * 4, 4, 2, 16, 16, dtype, device)
    full = _run(batch, "triton", is_decode=True, max_kv_splits=8, config=SMALL)
    q, k, v, req_to_token, rows, seq_lens, ext, starts, scale = batch
    for i in (0, 2):
        alone = attention(q[i:i + 1], k, v, req_to_token, rows[i:i + 1], seq_lens[i:i + 1], ext[i:i + 1],
                          torch.zeros_like(starts[:1]), scale, is_decode=True, max_kv_splits=8, config=SMALL,
                          impl="triton")
        assert torch.equal(alone[0], full[i]), f"sequence {i} differs alone vs in the batch"


def test_decode_padding_rows_give_zero(device, poison):
    """CUDA-graph padding rows (seq_len 0) write zeros, not NaN, and leave the real rows alone."""
    dtype = DTYPES[0]
    case = random_paged_attention([20, 0], [1, 1], 2, 2, 16, 16, dtype, device)
    q, k, v, req_to_token, rows, seq_lens, ext, starts, scale = case
    seq_lens = seq_lens.clone()
    seq_lens[1] = 0
    got = attention(q, k, v, req_to_token, rows, seq_lens, ext, starts, scale, is_decode=True, config=SMALL,
                    impl="triton")
    assert torch.equal(got[1], torch.zeros_like(got[1]))
    assert_rows_close(got[0], _run(case, "torch")[0], rel_tolerance(dtype, device))


def test_rejects_bad_inputs(device):
    case = random_paged_attention([2], [3], 4, 2, 16, 16, DTYPES[0], device)
    q, k, v, req_to_token, rows, seq_lens, ext, starts, scale = case
    with pytest.raises(ValueError, match="do not fit"):
        attention(q[:, :3], k, v, req_to_token, rows, seq_lens, ext, starts, scale)
    with pytest.raises(ValueError, match="v_cache must have q's dtype"):
        attention(q, k, v.float() if v.dtype != torch.float32 else v.half(), req_to_token, rows, seq_lens, ext,
                  starts, scale)
    with pytest.raises(ValueError, match="seq_lens must be contiguous int32"):
        attention(q, k, v, req_to_token, rows, seq_lens.long(), ext, starts, scale)
    with pytest.raises(ValueError, match="the extend block table is on query blocks of 16, the tiles' are"):
        attention(*case, impl="triton", blocks=extend_blocks(q, k, ext, SMALL))  # default tiles: other blocks
    with pytest.raises(ValueError, match="impl must be"):
        attention(*case, impl="cuda")


@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_mixed_step_fills_one_output(impl, device, poison):
    """A mixed step's decode rows through the decode kernels and its prompt pieces through the extend
    kernel, both into one `out`: each row the bits of the call of its own kind, the whole batch at once."""
    dtype = DTYPES[0]
    batch = random_paged_attention([150, 40, 0, 30], [1, 1, 20, 9], 4, 2, 16, 16, dtype, device)
    q, k, v, req_to_token, rows, seq_lens, ext, starts, scale = batch
    common = dict(max_kv_splits=8, config=SMALL, impl=impl)
    out = torch.full((q.shape[0], q.shape[1], v.shape[-1]), float("nan"), dtype=dtype, device=q.device)
    attention(q, k, v, req_to_token, rows[:2], seq_lens[:2], ext[:2], starts[:2], scale, is_decode=True,
              out=out, **common)
    got = attention(q, k, v, req_to_token, rows[2:], seq_lens[2:], ext[2:], starts[2:], scale, out=out, **common)
    assert got is out
    decode = attention(q[:2], k, v, req_to_token, rows[:2], seq_lens[:2], ext[:2], starts[:2], scale, is_decode=True,
                       **common)
    extend = attention(*batch, **common)
    assert torch.equal(out[:2], decode) and torch.equal(out[2:], extend[2:])
    with pytest.raises(ValueError, match="out must be"):
        attention(*batch, out=out[1:], **common)
