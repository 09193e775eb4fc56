import math
import random

import pytest
import torch

from moelora.engine.sampler import SamplingBatch, _filter, exponential_noise, sample, sample_reference
from moelora.engine.sampling_params import SamplingParams


def _batch(params, device, seeds=None, steps=None):
    seeds = list(range(len(params))) if seeds is None else seeds
    return SamplingBatch.build(params, seeds, [0] * len(params) if steps is None else steps, device)


def _random_params(rng: random.Random) -> SamplingParams:
    kind = rng.choice(["greedy", "plain", "top_k", "top_p", "min_p", "all"])
    return SamplingParams(
        temperature=0.0 if kind == "greedy" else rng.choice([0.3, 0.7, 1.0, 1.5]),
        top_k=rng.choice([1, 5, 40]) if kind in ("top_k", "all") else rng.choice([-1, 0]),
        top_p=rng.choice([0.3, 0.8, 0.95]) if kind in ("top_p", "all") else 1.0,
        min_p=rng.choice([0.05, 0.2]) if kind in ("min_p", "all") else 0.0,
    )


def test_greedy_is_argmax_with_ties_to_lowest_id(device):
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0], [5.0, 5.0, 5.0, 5.0], [-1.0, -2.0, -0.5, -0.5]], device=device)
    out = sample(logits, _batch([SamplingParams(temperature=0)] * 3, device))
    assert out.token_ids.tolist() == [1, 0, 2]
    mixed = [SamplingParams(temperature=0), SamplingParams(top_p=0.5), SamplingParams(temperature=0)]
    assert sample(logits, _batch(mixed, device)).token_ids[[0, 2]].tolist() == [1, 2]


def test_greedy_rows_do_not_depend_on_the_rest_of_the_batch(device):
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(32, 1000, generator=gen).to(device)
    greedy = sample(logits, _batch([SamplingParams(temperature=0)] * 32, device)).token_ids
    rng = random.Random(0)
    params = [SamplingParams(temperature=0) if i % 2 else _random_params(rng) for i in range(32)]
    mixed = sample(logits, _batch(params, device)).token_ids
    assert torch.equal(mixed[1::2], greedy[1::2])
    assert torch.equal(greedy, logits.argmax(-1))


@pytest.mark.parametrize("case", range(4))
def test_batched_matches_reference_row_by_row(case, device, poison):
    rng, gen = random.Random(case), torch.Generator().manual_seed(case)
    batch_size, vocab = 24, 777
    params = [_random_params(rng) for _ in range(batch_size)]
    batch = _batch(params, device, seeds=[rng.getrandbits(63) for _ in params],
                   steps=[rng.randrange(0, 5000) for _ in params])
    logits = (torch.randn(batch_size, vocab, generator=gen) * rng.choice([1.0, 4.0])).to(device)
    logits[0, :10] = logits[0].max()  # ties at the top
    got, ref = sample(logits, batch, num_top_logprobs=5), sample_reference(logits, batch, num_top_logprobs=5)
    assert got.token_ids.tolist() == ref.token_ids.tolist()
    torch.testing.assert_close(got.logprobs, ref.logprobs)
    torch.testing.assert_close(got.top_logprobs, ref.top_logprobs)
    # ties may come in either order: compare the logprob of each returned id instead
    log_probs = torch.log_softmax(logits, -1)
    torch.testing.assert_close(log_probs.gather(1, got.top_ids), ref.top_logprobs)


def test_row_does_not_depend_on_batch_position_or_size(device):
    gen = torch.Generator().manual_seed(1)
    vocab = 500
    targets = [SamplingParams(), SamplingParams(temperature=0.7, top_p=0.9), SamplingParams(top_k=20, min_p=0.05)]
    target_logits = torch.randn(vocab, generator=gen).to(device)
    seed, step = 1234567, 42
    for target in targets:
        alone = sample(target_logits[None], _batch([target], device, [seed], [step])).token_ids.item()
        for size in (2, 5, 16):
            for pos in (0, size // 2, size - 1):
                others = [SamplingParams(top_k=3), SamplingParams(temperature=0), SamplingParams(top_p=0.5)]
                params = [others[i % 3] for i in range(size)]
                params[pos] = target
                seeds, steps = list(range(size)), [7] * size
                seeds[pos], steps[pos] = seed, step
                logits = torch.randn(size, vocab, generator=gen).to(device)
                logits[pos] = target_logits
                got = sample(logits, _batch(params, device, seeds, steps)).token_ids[pos].item()
                assert got == alone, f"{target} at row {pos} of {size}: {got} != {alone} alone"


def test_draws_change_with_step_and_seed(device):
    flat = torch.zeros(64, 1000, device=device)
    by_step = sample(flat, _batch([SamplingParams()] * 64, device, [5] * 64, list(range(64)))).token_ids
    by_seed = sample(flat, _batch([SamplingParams()] * 64, device, list(range(64)), [5] * 64)).token_ids
    # 64 draws from 1000 equally likely tokens: about 2 repeats expected
    assert len(set(by_step.tolist())) > 55 and len(set(by_seed.tolist())) > 55


def test_advance_moves_every_row_one_step(device):
    params = [SamplingParams(), SamplingParams(top_k=50)]
    batch = _batch(params, device, [3, 4], [0, 10])
    step = batch.step
    batch.advance()
    assert batch.step is step and batch.step.tolist() == [1, 11]
    logits = torch.randn(2, 300, generator=torch.Generator().manual_seed(2)).to(device)
    assert torch.equal(sample(logits, batch).token_ids, sample(logits, _batch(params, device, [3, 4], [1, 11])).token_ids)


def test_top_k_1_is_greedy(device):
    logits = torch.randn(64, 200, generator=torch.Generator().manual_seed(3)).to(device)
    logits[:8, :3] = 10.0  # ties: greedy takes the lowest id, so must top_k=1
    batch = _batch([SamplingParams(top_k=1, temperature=1.7)] * 64, device)
    assert torch.equal(sample(logits, batch).token_ids, logits.argmax(-1))


def test_filters_that_are_off_change_nothing(device):
    # one dominant token and 5000 below float32's half ulp at 1: the cumulative mass stops growing,
    # so an unguarded top_p=1 cut would drop them
    probs = torch.full((2, 5001), 2e-8, device=device)
    probs[:, 0] = 1 - 5000 * 2e-8
    off = _filter(probs, torch.tensor([-1, 0], device=device), torch.ones(2, device=device), torch.zeros(2, device=device))
    assert torch.equal(off, probs)


def _splitmix64(state: int) -> int:
    mask = 2**64 - 1
    z = (state + 0x9E3779B97F4A7C15) & mask
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
    return z ^ (z >> 31)


def test_noise_is_splitmix64_of_seed_step_and_token(device):
    seeds, steps, vocab = [0, 1, -5, 2**62 + 12345], [0, 7, 3, 2**40], 6
    noise = exponential_noise(torch.tensor(seeds, device=device), torch.tensor(steps, device=device), vocab)
    for row, (seed, step) in enumerate(zip(seeds, steps)):
        key = _splitmix64(_splitmix64(seed % 2**64) ^ step)
        for tok in range(vocab):
            u = ((_splitmix64((key + tok * 0x9E3779B97F4A7C15) % 2**64) >> 12) + 0.5) / 2**52
            assert noise[row, tok].item() == pytest.approx(-math.log(u), rel=1e-6)


# (temperature, top_k, top_p, min_p); distinct probabilities far from every cut-off
PROBS = [0.35, 0.25, 0.15, 0.1, 0.07, 0.05, 0.03]
FILTERS = [(1.0, -1, 1.0, 0.0), (0.5, -1, 1.0, 0.0), (1.0, 3, 1.0, 0.0), (1.0, 0, 0.7, 0.0), (1.0, -1, 1.0, 0.3),
           (0.8, 5, 0.9, 0.25), (2.0, -1, 0.5, 0.0),
           (1.0, -1, 0.7, 0.4)]  # vLLM's order: top-p of the 0.75 min-p left keeps 2 tokens (after min-p: 3)


def _filtered_distribution(temperature, top_k, top_p, min_p):
    """PROBS after temperature, min-p, top-k and top-p (of the mass min-p and top-k left), renormalised (PROBS is
    sorted)."""
    weights = [p ** (1 / temperature) for p in PROBS]
    q = [w / sum(weights) for w in weights]
    keep = sum(1 for x in q if x >= min_p * q[0])
    keep = keep if top_k <= 0 else min(keep, top_k)
    keep = next(i for i in range(1, keep + 1) if sum(q[:i]) >= top_p * sum(q[:keep]) or i == keep)
    return [x / sum(q[:keep]) if i < keep else 0.0 for i, x in enumerate(q)]


@pytest.mark.parametrize("vary", ["seed", "step"])
@pytest.mark.parametrize("filters", FILTERS)
def test_frequencies_match_filtered_softmax(filters, vary, device):
    temperature, top_k, top_p, min_p = filters
    draws = 20000
    perm = torch.randperm(len(PROBS), generator=torch.Generator().manual_seed(4))  # token id != rank
    logits = torch.empty(len(PROBS))
    logits[perm] = torch.tensor(PROBS).log() + 3.0
    params = [SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)] * draws
    counter = list(range(draws))
    batch = _batch(params, device, counter if vary == "seed" else [99] * draws,
                   [0] * draws if vary == "seed" else counter)
    ids = sample(logits.to(device).expand(draws, -1), batch).token_ids.cpu()
    counts = torch.bincount(ids, minlength=len(PROBS))[perm].tolist()  # in PROBS order
    expected = [p * draws for p in _filtered_distribution(*filters)]
    assert all(c == 0 for c, e in zip(counts, expected) if e == 0), f"filtered tokens drawn: {counts} vs {expected}"
    chi2 = sum((c - e) ** 2 / e for c, e in zip(counts, expected) if e > 0)
    # at most 6 degrees of freedom: P(chi2 > 35) < 1e-5 for a correct sampler
    assert chi2 < 35, f"counts {counts} vs expected {[round(e) for e in expected]} (chi2 {chi2:.1f})"


def test_logprobs_are_of_the_raw_logits(device):
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(5)).to(device) * 3
    params = [SamplingParams(temperature=0.3, top_k=4, logprobs=3), SamplingParams(temperature=0, logprobs=3)] * 3
    out = sample(logits, _batch(params, device), num_top_logprobs=3)
    log_probs = torch.log_softmax(logits, -1)
    torch.testing.assert_close(out.logprobs, log_probs.gather(1, out.token_ids[:, None]).squeeze(1))
    top = log_probs.topk(3, dim=-1)
    torch.testing.assert_close(out.top_logprobs, top.values)
    assert torch.equal(out.top_ids, top.indices)
    assert out.logprobs.dtype == torch.float32 and out.token_ids.dtype == torch.int64
    plain = sample(logits, _batch(params, device))
    assert plain.top_ids is None and plain.top_logprobs is None


def test_build_rejects_mismatched_lengths():
    with pytest.raises(ValueError, match="differ in length"):
        SamplingBatch.build([SamplingParams()] * 2, [1], [0, 0], "cpu")
