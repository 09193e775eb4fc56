"""Batched sampling: one call per step for the whole batch, no host synchronisation.

Random rows draw with the exponential race argmax(p / E), E ~ Exp(1) (equivalent to Gumbel-max),
where E comes from a counter-based hash of (seed, step, token id) in torch integer ops. A seeded
request therefore samples the same tokens alone or in any batch, at any row, on CPU or GPU.
Unseeded requests get a seed from the engine at admission (Python's `random`), so every row has one.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from moelora.engine.sampling_params import SamplingParams


class SampleOutput(NamedTuple):
    token_ids: torch.Tensor  # [B] int64
    logprobs: torch.Tensor  # [B] float32, chosen token under log_softmax of the raw logits
    top_ids: torch.Tensor | None  # [B, k] int64, the k most likely tokens of the raw logits
    top_logprobs: torch.Tensor | None  # [B, k] float32


@dataclass
class SamplingBatch:
    """The sampling options of a batch as device tensors, one row per sequence."""

    temperature: torch.Tensor  # [B] float32, 0 for greedy rows
    top_p: torch.Tensor  # [B] float32
    top_k: torch.Tensor  # [B] int64, <= 0: off
    min_p: torch.Tensor  # [B] float32
    seed: torch.Tensor  # [B] int64
    step: torch.Tensor  # [B] int64, tokens the sequence has generated so far
    all_greedy: bool  # skip the draw altogether
    needs_filter: bool  # some random row uses top-k/top-p/min-p: sort the probabilities

    @classmethod
    def build(cls, params: list[SamplingParams], seeds: list[int], steps: list[int],
              device: torch.device | str) -> SamplingBatch:
        """seeds[i]: params[i].seed, or the one the engine drew for an unseeded request."""
        if not len(params) == len(seeds) == len(steps):
            raise ValueError(f"params, seeds and steps differ in length: {len(params)}, {len(seeds)}, {len(steps)}")
        random = [not p.greedy for p in params]
        # two host-to-device copies a step, not one per column
        floats = torch.tensor([[p.temperature if r else 0.0 for p, r in zip(params, random)],
                               [p.top_p for p in params], [p.min_p for p in params]], dtype=torch.float32).to(device)
        ints = torch.tensor([[p.top_k for p in params], seeds, steps], dtype=torch.int64).to(device)
        return cls(
            temperature=floats[0], top_p=floats[1], min_p=floats[2], top_k=ints[0], seed=ints[1], step=ints[2],
            all_greedy=not any(random),
            needs_filter=any(r and (p.top_k > 0 or p.top_p < 1 or p.min_p > 0) for p, r in zip(params, random)),
        )

    def advance(self) -> None:
        """Every row generated one more token; in place, so a captured graph sees the new steps."""
        self.step.add_(1)


def sample(logits: torch.Tensor, batch: SamplingBatch, num_top_logprobs: int = 0) -> SampleOutput:
    """logits [B, V] -> one token per row; greedy rows are the exact argmax (ties: lowest id)."""
    logits = logits.float()
    token_ids = logits.argmax(dim=-1)
    if not batch.all_greedy:
        greedy = batch.temperature == 0
        temperature = torch.where(greedy, 1.0, batch.temperature)
        probs = torch.softmax(logits / temperature[:, None], dim=-1)
        if batch.needs_filter:
            probs = _filter(probs, batch.top_k, batch.top_p, batch.min_p)
        drawn = (probs / exponential_noise(batch.seed, batch.step, logits.shape[1])).argmax(dim=-1)
        token_ids = torch.where(greedy, token_ids, drawn)
    return _with_logprobs(logits, token_ids, num_top_logprobs)


def _filter(probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Zero what top-k, then top-p (on what top-k left), then min-p remove; rows with a filter off
    are untouched by it, so a row samples the same whether or not its batch needs filtering."""
    # stable: equal probabilities rank by token id, so top_k=1 is exactly greedy
    sorted_p, order = probs.sort(dim=-1, descending=True, stable=True)
    rank = torch.arange(probs.shape[1], device=probs.device)
    drop = (top_k[:, None] > 0) & (rank >= top_k[:, None])
    kept = sorted_p.masked_fill(drop, 0.0)
    cum = kept.cumsum(dim=-1)
    # a token goes once the tokens before it reach top_p of the mass; the first one always stays.
    # Guarded: at top_p=1 the float32 cumsum can stop growing and would cut tiny tokens
    drop |= (top_p[:, None] < 1) & (cum - kept >= top_p[:, None] * cum[:, -1:])
    drop |= sorted_p < min_p[:, None] * sorted_p[:, :1]
    return probs.masked_fill(torch.zeros_like(drop).scatter_(-1, order, drop), 0.0)


def _with_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, k: int) -> SampleOutput:
    lse = logits.logsumexp(dim=-1, keepdim=True)
    logprobs = (logits.gather(1, token_ids[:, None]) - lse).squeeze(1)
    if k == 0:
        return SampleOutput(token_ids, logprobs, None, None)
    top = logits.topk(k, dim=-1)
    return SampleOutput(token_ids, logprobs, top.indices, top.values - lse)


# splitmix64 constants as signed int64 (torch has no uint64 arithmetic; products wrap mod 2^64)
_GOLDEN = 0x9E3779B97F4A7C15 - 2**64
_MIX1 = 0xBF58476D1CE4E5B9 - 2**64
_MIX2 = 0x94D049BB133111EB - 2**64


def _shr(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def _splitmix64(state: torch.Tensor) -> torch.Tensor:
    z = state + _GOLDEN
    z = (z ^ _shr(z, 30)) * _MIX1
    z = (z ^ _shr(z, 27)) * _MIX2
    return z ^ _shr(z, 31)


def exponential_noise(seed: torch.Tensor, step: torch.Tensor, vocab: int) -> torch.Tensor:
    """[B] seeds and steps -> [B, vocab] float32 Exp(1) draws, a pure function of (seed, step, token id)."""
    key = _splitmix64(_splitmix64(seed) ^ step)  # one splitmix64 stream per (seed, step)
    bits = _splitmix64(key[:, None] + _GOLDEN * torch.arange(vocab, device=seed.device))
    # 52 bits + 0.5 are exact in float64, so u is in (0, 1) and E > 0 even in float32: p / E never
    # divides by zero, and u near 1 keeps the fine resolution that decides unlikely tokens
    u = (_shr(bits, 12).double() + 0.5) * 2.0**-52
    return (-torch.log(u)).float()


def sample_reference(logits: torch.Tensor, batch: SamplingBatch, num_top_logprobs: int = 0) -> SampleOutput:
    """`sample` spelled out row by row, for tests."""
    token_ids = []
    for i, row in enumerate(logits.float()):
        if batch.temperature[i] == 0:
            token_ids.append(row.argmax())
            continue
        probs = torch.softmax(row / batch.temperature[i], dim=-1)
        sorted_p, order = probs.sort(descending=True, stable=True)
        keep = torch.ones_like(sorted_p, dtype=torch.bool)
        if batch.top_k[i] > 0:
            keep[batch.top_k[i]:] = False
        if batch.top_p[i] < 1:
            kept = sorted_p * keep
            mass_before = kept.cumsum(0) - kept
            keep &= mass_before < batch.top_p[i] * kept.cumsum(0)[-1]
        keep &= sorted_p >= batch.min_p[i] * sorted_p[0]
        filtered = torch.zeros_like(probs)
        filtered[order[keep]] = probs[order[keep]]
        noise = exponential_noise(batch.seed[i:i + 1], batch.step[i:i + 1], row.shape[0])[0]
        token_ids.append((filtered / noise).argmax())
    ids = torch.stack(token_ids)
    log_probs = torch.log_softmax(logits.float(), dim=-1)
    top = log_probs.topk(num_top_logprobs, dim=-1) if num_top_logprobs else None
    return SampleOutput(ids, log_probs.gather(1, ids[:, None]).squeeze(1),
                        top.indices if top else None, top.values if top else None)
