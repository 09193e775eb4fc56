"""The sampler's logit processing: token masks (packed bitmasks), logit_bias, min_tokens and the
repetition/frequency/presence penalties, batched against the row-by-row reference, by hand, and
the bitmask against xgrammar's own apply."""
import random

import pytest
import torch

from moelora.engine.sampler import (PenaltyState, SamplingBatch, TokenMask, hold_back, pack_bitmask, process_logits,
                                    process_logits_reference, sample, sample_reference, unpack_bitmask)
from moelora.engine.sampling_params import SamplingParams

VOCAB = 301  # not a multiple of 32: the last bitmask word is partial


def _random_params(rng: random.Random, vocab: int) -> SamplingParams:
    kind = rng.choice(["plain", "penalties", "bias", "min_tokens", "all"])
    penalties = kind in ("penalties", "all")
    return SamplingParams(
        max_tokens=50, temperature=rng.choice([0.0, 0.7, 1.3]), top_k=rng.choice([-1, 20]),
        presence_penalty=rng.uniform(-2, 2) if penalties else 0.0,
        frequency_penalty=rng.uniform(-2, 2) if penalties else 0.0,
        repetition_penalty=rng.choice([0.5, 1.3, 2.0]) if penalties else 1.0,
        logit_bias={rng.randrange(vocab): rng.uniform(-100, 100) for _ in range(3)} if kind in ("bias", "all") else {},
        min_tokens=rng.choice([0, 5, 20]) if kind in ("min_tokens", "all") else 0)


def _batch(params, device, rng, gen, vocab=VOCAB, masked=()):
    """A batch over random histories: each row's prompt and output so far, its stop tokens, and a
    random mask on the rows `masked`."""
    steps = [rng.randrange(0, 30) for _ in params]
    stops = [rng.sample(range(vocab), 2) for _ in params]
    batch = SamplingBatch.build(params, [rng.getrandbits(63) for _ in params], steps, device, stops)
    state = PenaltyState(len(params) + 3, vocab, device)
    rows = [i for i, p in enumerate(params) if p.has_penalties]
    state_rows = [r + 2 for r in rows]  # request rows differ from batch rows
    for i, r in zip(rows, state_rows):
        state.reset(r, [rng.randrange(vocab) for _ in range(rng.randrange(1, 40))],
                    [rng.randrange(vocab) for _ in range(steps[i])])
    if rows:
        batch.penalties = state.gather(rows, state_rows, [params[i] for i in rows])
    if masked:
        allowed = torch.rand(len(masked), vocab, generator=gen) < 0.3
        allowed[:, 0] = True  # never an empty row
        batch.token_mask = TokenMask(torch.tensor(masked, device=device), pack_bitmask(allowed).to(device))
    return batch


@pytest.mark.parametrize("case", range(3))
def test_processing_and_sampling_match_the_reference(case, device):
    rng, gen = random.Random(case), torch.Generator().manual_seed(case)
    params = [_random_params(rng, VOCAB) for _ in range(12)]
    params[0], params[2] = SamplingParams(temperature=0.7), SamplingParams(temperature=0)  # plain rows
    batch = _batch(params, device, rng, gen, masked=[1, 4, 5, 11])
    logits = (torch.randn(12, VOCAB, generator=gen) * 3).to(device)
    before = logits.clone()
    got, want = process_logits(logits, batch), process_logits_reference(logits, batch)
    assert torch.equal(got, want)  # the same float32 operations in the same order
    untouched = [i for i, p in enumerate(params) if not p.logit_bias and not p.has_penalties
                 and i not in (1, 4, 5, 11) and batch.step[i] >= p.min_tokens]
    assert untouched and torch.equal(got[untouched], logits[untouched])
    assert not torch.equal(got, logits)
    out, ref = sample(logits, batch, 3), sample_reference(logits, batch, 3)
    assert out.token_ids.tolist() == ref.token_ids.tolist()
    torch.testing.assert_close(out.logprobs, torch.log_softmax(logits, -1).gather(1, out.token_ids[:, None])[:, 0])
    assert torch.equal(logits, before)  # the caller's logits are not changed
    allowed = unpack_bitmask(batch.token_mask.bitmask, VOCAB)
    assert allowed[torch.arange(4), out.token_ids[[1, 4, 5, 11]]].all()


def test_penalties_by_hand(device):
    state = PenaltyState(4, 5, device)
    state.reset(3, prompt_ids=[1, 1], output_ids=[0, 2, 2])
    params = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    batch = SamplingBatch.build([SamplingParams(), params], [0, 0], [0, 3], device)
    batch.penalties = state.gather([1], [3], [params])
    logits = torch.tensor([[1.0, 2.0, 3.0, 4.0, 5.0], [2.0, -2.0, 1.0, 4.0, -1.0]], device=device)
    # token 0: output once, 2 -> 1 - 0.5 - 0.25; token 1: prompt only, -2 -> -4; token 2: output twice,
    # 1 -> 0.5 - 1.0 - 0.25; tokens 3, 4 unseen
    want = torch.tensor([[1.0, 2.0, 3.0, 4.0, 5.0], [0.25, -4.0, -0.75, 4.0, -1.0]], device=device)
    torch.testing.assert_close(process_logits(logits, batch), want, rtol=0, atol=1e-6)
    state.count(torch.tensor([3, 3], device=device), torch.tensor([4, 4], device=device))
    assert state.output_counts[3].tolist() == [1, 0, 2, 0, 2] and state.in_prompt[3].tolist() == [0, 1, 0, 0, 0]
    state.reset(3, prompt_ids=[4], output_ids=[])  # the row's next request
    assert state.output_counts[3].tolist() == [0] * 5 and state.in_prompt[3].tolist() == [0, 0, 0, 0, 1]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_penalty_row_starts_without_waiting_for_the_device():
    """A penalised request's first step resets its row after the step's forward is queued (overlap scheduling):
    no host synchronisation (session 48: `in_prompt[row, ids] = True` copied the scalar from pageable memory)."""
    state = PenaltyState(4, 1000, "cuda")
    state.reset(0, prompt_ids=[1], output_ids=[])  # the buffers' allocation, once
    torch.cuda.set_sync_debug_mode("error")
    try:
        state.reset(2, prompt_ids=[5, 7, 7], output_ids=[9, 9])
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert state.in_prompt[2].nonzero().flatten().tolist() == [5, 7]
    assert state.output_counts[2].nonzero().flatten().tolist() == [9] and int(state.output_counts[2, 9]) == 2


def test_logit_bias_and_min_tokens(device):
    logits = torch.zeros(3, 10, device=device)
    logits[:, 9] = 5.0
    params = [SamplingParams(temperature=0, logit_bias={3: 100}), SamplingParams(temperature=0, logit_bias={9: -100}),
              SamplingParams(temperature=0, min_tokens=2)]
    stops = [[9], [9], [9, 8]]
    assert sample(logits, SamplingBatch.build(params, [0] * 3, [0] * 3, device, stops)).token_ids.tolist() == [3, 0, 0]
    # min_tokens reached: the stop token may come
    assert sample(logits, SamplingBatch.build(params, [0] * 3, [2] * 3, device, stops)).token_ids.tolist() == [3, 0, 9]


def test_penalised_seeded_row_does_not_depend_on_the_batch(device):
    rng, gen = random.Random(7), torch.Generator().manual_seed(7)
    target = SamplingParams(temperature=0.9, presence_penalty=1.0, frequency_penalty=0.3, repetition_penalty=1.2,
                            logit_bias={5: 3.0})
    state = PenaltyState(8, VOCAB, device)
    state.reset(6, [1, 2, 3], [4, 4, 5])
    row_logits = torch.randn(VOCAB, generator=gen).to(device)

    def run(size: int, pos: int) -> int:
        params = [_random_params(rng, VOCAB) for _ in range(size)]
        params[pos] = target
        batch = SamplingBatch.build(params, [99] * size, [3] * size, device)
        batch.penalties = state.gather([pos], [6], [target])
        logits = torch.randn(size, VOCAB, generator=gen).to(device)
        logits[pos] = row_logits
        return sample(logits, batch).token_ids[pos].item()
    alone = run(1, 0)
    assert all(run(size, pos) == alone for size, pos in [(2, 1), (5, 0), (9, 4), (16, 15)])


@pytest.mark.parametrize("vocab", [31, 32, 33, 1000])
def test_bitmask_pack_unpack_and_xgrammar_apply(vocab, device):
    xgr = pytest.importorskip("xgrammar")
    allowed = torch.rand(5, vocab, generator=torch.Generator().manual_seed(vocab)) < 0.5
    allowed[:, -1] = True  # bit 31 of a full last word: the sign bit
    bitmask = pack_bitmask(allowed)
    assert bitmask.shape == tuple(xgr.get_bitmask_shape(5, vocab)) and bitmask.dtype == xgr.bitmask_dtype
    assert torch.equal(unpack_bitmask(bitmask.to(device), vocab).cpu(), allowed)
    logits = torch.randn(8, vocab)
    rows = [0, 3, 4, 6, 7]
    ours = logits.clone().to(device)
    TokenMask(torch.tensor(rows, device=device), bitmask.to(device)).apply(ours)
    theirs = logits.clone()
    full = torch.full((8, bitmask.shape[1]), -1, dtype=torch.int32)
    full[rows] = bitmask
    xgr.apply_token_bitmask_inplace(theirs, full, vocab_size=vocab)
    assert torch.equal(ours.cpu(), theirs)


def test_hold_back_clears_stop_tokens_unless_nothing_is_left():
    allowed = torch.zeros(1, 70, dtype=torch.bool)
    allowed[0, [0, 31, 40, 69]] = True
    row = pack_bitmask(allowed)[0]
    held = unpack_bitmask(hold_back(row, {31, 69, 5})[None], 70)[0]
    assert held.nonzero()[:, 0].tolist() == [0, 40]
    assert torch.equal(hold_back(row, {0, 31, 40, 69}), row)  # only stop tokens allowed: they stay
    assert hold_back(row, ()) is row
