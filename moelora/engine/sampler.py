"""Batched sampling: one call per step for the whole batch, no host synchronisation.

Before the draw the logits are processed, in vLLM's order, only on the rows that ask for it: the
token mask (grammars, allowed_token_ids: a packed bitmask, xgrammar's layout), then sparse
additions (logit_bias, and -inf on EOS and stop tokens before min_tokens), then the repetition,
frequency and presence penalties from per-row token counts kept on the device (`PenaltyState`).
Greedy rows take the argmax of the processed logits; log-probabilities are of the raw ones (vLLM's
default).

Random rows draw with the exponential race argmax(p / E), E ~ Exp(1) (equivalent to Gumbel-max),
where E comes from a counter-based hash of (seed, step, token id) in torch integer ops. A seeded
request therefore samples the same tokens alone or in any batch, at any row, on CPU or GPU.
Unseeded requests get a seed from the engine at admission (Python's `random`), so every row has one.
"""
from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import NamedTuple

import torch

from moelora.core import to_device
from moelora.engine.sampling_params import CheckedBias, SamplingParams


NEG_INF = float("-inf")


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
    additions: LogitAdditions | None = None  # logit_bias and min_tokens
    penalties: Penalties | None = None
    token_mask: TokenMask | None = None

    @classmethod
    def build(cls, params: list[SamplingParams], seeds: list[int], steps: list[int],
              device: torch.device | str, stop_token_ids: list[Collection[int]] | None = None,
              biases: list[LogitBias | None] | None = None) -> SamplingBatch:
        """seeds[i]: params[i].seed, or the one the engine drew for an unseeded request; stop_token_ids[i]:
        the tokens min_tokens holds back (the request's stop tokens and EOS); biases[i]: logit_bias_tensors(params[i])
        as the request keeps it (by default made here). Penalties and the token mask need state beyond the params:
        the caller sets them (`PenaltyState.gather`, `TokenMask`)."""
        if not len(params) == len(seeds) == len(steps):
            raise ValueError(f"params, seeds and steps differ in length: {len(params)}, {len(seeds)}, {len(steps)}")
        random = [not p.greedy for p in params]
        # two host-to-device copies a step, not one per column
        floats = to_device([[p.temperature if r else 0.0 for p, r in zip(params, random)],
                            [p.top_p for p in params], [p.min_p for p in params]], torch.float32, device)
        ints = to_device([[p.top_k for p in params], seeds, steps], torch.int64, device)
        return cls(
            temperature=floats[0], top_p=floats[1], min_p=floats[2], top_k=ints[0], seed=ints[1], step=ints[2],
            all_greedy=not any(random),
            needs_filter=any(r and (p.top_k > 0 or p.top_p < 1 or p.min_p > 0) for p, r in zip(params, random)),
            additions=LogitAdditions.build(params, steps, stop_token_ids or [()] * len(params), device,
                                           biases if biases is not None else [logit_bias_tensors(p) for p in params]),
        )

    def advance(self) -> None:
        """Every row generated one more token; in place, so a captured graph sees the new steps."""
        self.step.add_(1)


class LogitBias(NamedTuple):
    """A request's logit_bias as host tensors, made once (logit_bias_tensors)."""
    tokens: torch.Tensor  # [N] int64
    values: torch.Tensor  # [N] float32


def logit_bias_tensors(params: SamplingParams) -> LogitBias | None:
    """params.logit_bias as tensors, made once for a checked one (sampling_params.CheckedBias), which every copy of
    the params shares: the n sequences of a request, a whole vocabulary's each."""
    bias = params.logit_bias
    if not bias:
        return None
    made = getattr(bias, "tensors", None)
    if made is None:
        made = LogitBias(torch.tensor(list(bias), dtype=torch.int64),
                         torch.tensor(list(bias.values()), dtype=torch.float32))
        if isinstance(bias, CheckedBias):
            bias.tensors = made
    return made


@dataclass
class LogitAdditions:
    """Values added to single logits: logit_bias, and -inf on the stop tokens of rows short of min_tokens."""

    index: torch.Tensor  # [2, N] int64: batch row, token id
    values: torch.Tensor  # [N] float32

    @classmethod
    def build(cls, params: list[SamplingParams], steps: list[int], stop_token_ids: list[Collection[int]],
              device: torch.device | str, biases: list[LogitBias | None]) -> LogitAdditions | None:
        """Row i's bias (biases[i]) and its held-back stop tokens, joined as tensors: a logit_bias of the whole
        vocabulary costs every step a copy, not a Python loop over its entries."""
        index, values = [], []
        for i, (p, step, stops, bias) in enumerate(zip(params, steps, stop_token_ids, biases)):
            parts = [bias] if bias is not None else []
            if step < p.min_tokens and stops:
                held = torch.tensor(list(stops), dtype=torch.int64)
                parts.append(LogitBias(held, torch.full(held.shape, NEG_INF)))
            for tokens, added in parts:
                index.append(torch.stack([torch.full_like(tokens, i), tokens]))
                values.append(added)
        if not index:
            return None
        return cls(to_device(torch.cat(index, 1), torch.int64, device), to_device(torch.cat(values), torch.float32, device))

    def apply(self, logits: torch.Tensor) -> None:
        """In place; a token both biased and held back stays at -inf."""
        logits.index_put_((self.index[0], self.index[1]), self.values, accumulate=True)


@dataclass
class Penalties:
    """The penalties of the rows that have any, with their token counts (gathered for this step)."""

    rows: torch.Tensor  # [P] int64 batch rows
    state_rows: torch.Tensor  # [P] int64 their request rows in the PenaltyState
    output_counts: torch.Tensor  # [P, V] int32: occurrences of each token in the output so far
    in_prompt: torch.Tensor  # [P, V] bool
    presence: torch.Tensor  # [P] float32
    frequency: torch.Tensor  # [P] float32
    repetition: torch.Tensor  # [P] float32

    def apply(self, logits: torch.Tensor) -> None:
        """In place: repetition (prompt and output), then frequency and presence (output), as vLLM."""
        rows = logits[self.rows]
        counts = self.output_counts.float()
        seen = self.in_prompt | (self.output_counts > 0)
        repetition = self.repetition[:, None]
        rows = torch.where(seen, torch.where(rows > 0, rows / repetition, rows * repetition), rows)
        rows = rows - self.frequency[:, None] * counts - self.presence[:, None] * (counts > 0).float()
        logits[self.rows] = rows


class PenaltyState:
    """Per request row of the KV pool: how often each token occurs in the output, and whether it is in
    the prompt. Allocated on first use ([rows, vocab] int32 and bool on the device), set when a request
    (re)starts on a row, counted on the device after each step's draw: no host synchronisation."""

    def __init__(self, num_rows: int, vocab: int, device: torch.device | str):
        self.num_rows, self.vocab, self.device = num_rows, vocab, device
        self.output_counts: torch.Tensor | None = None
        self.in_prompt: torch.Tensor | None = None

    def reset(self, row: int, prompt_ids: list[int], output_ids: list[int]) -> None:
        """The row starts over with this request (idempotent: a step run again sets the same)."""
        if self.output_counts is None:
            self.output_counts = torch.zeros(self.num_rows, self.vocab, dtype=torch.int32, device=self.device)
            self.in_prompt = torch.zeros(self.num_rows, self.vocab, dtype=torch.bool, device=self.device)
        ids = to_device(prompt_ids + output_ids, torch.int64, self.device)
        self.in_prompt[row] = False
        # index_fill_, not `in_prompt[row, ids] = True`: index_put_ copies the Python scalar from pageable host
        # memory, which waits for the stream's queued work (the step just launched)
        self.in_prompt[row].index_fill_(0, ids[:len(prompt_ids)], True)
        output = ids[len(prompt_ids):]
        # index_put_, not bincount: bincount sizes its output from the largest id, a host sync on CUDA
        self.output_counts[row] = 0
        self.output_counts[row].index_put_((output,), torch.ones_like(output, dtype=torch.int32), accumulate=True)

    def gather(self, batch_rows: list[int], state_rows: list[int], params: list[SamplingParams]) -> Penalties:
        """The penalties of batch rows batch_rows (request rows state_rows, params of each)."""
        index = to_device([batch_rows, state_rows], torch.int64, self.device)
        values = to_device([[p.presence_penalty for p in params], [p.frequency_penalty for p in params],
                            [p.repetition_penalty for p in params]], torch.float32, self.device)
        return Penalties(index[0], index[1], self.output_counts[index[1]], self.in_prompt[index[1]], *values)

    def count(self, state_rows: torch.Tensor, token_ids: torch.Tensor) -> None:
        """Each row generated its token (state_rows [P] int64 on the device)."""
        self.output_counts.index_put_((state_rows, token_ids), torch.ones_like(state_rows, dtype=torch.int32),
                                      accumulate=True)


@dataclass
class TokenMask:
    """Rows that may sample only some tokens: bit t % 32 of word t // 32 set = token t allowed."""

    rows: torch.Tensor  # [C] int64 batch rows
    bitmask: torch.Tensor  # [C, ceil(V / 32)] int32

    def apply(self, logits: torch.Tensor) -> None:
        logits[self.rows] = logits[self.rows].masked_fill(~unpack_bitmask(self.bitmask, logits.shape[1]), NEG_INF)


def unpack_bitmask(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """[C, W] int32 packed bits -> [C, vocab] bool."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    return ((bitmask[:, :, None] >> shifts) & 1).flatten(1)[:, :vocab].bool()


def pack_bitmask(allowed: torch.Tensor) -> torch.Tensor:
    """[C, V] bool -> [C, ceil(V / 32)] int32, the layout unpack_bitmask reads."""
    words = -(-allowed.shape[1] // 32)
    bits = torch.zeros(allowed.shape[0], words * 32, dtype=torch.int64, device=allowed.device)
    bits[:, :allowed.shape[1]] = allowed.long()
    packed = (bits.view(-1, words, 32) << torch.arange(32, device=allowed.device)).sum(-1)
    return torch.where(packed >= 2**31, packed - 2**32, packed).int()  # bit 31 is the sign


def hold_back(bitmask_row: torch.Tensor, token_ids: Collection[int]) -> torch.Tensor:
    """The host bitmask row [W] int32 without token_ids, unless that leaves no token allowed."""
    if not token_ids:
        return bitmask_row
    ids = torch.tensor(sorted(token_ids), dtype=torch.int64)
    cleared = bitmask_row.clone()
    bits = torch.ones_like(ids, dtype=torch.int32) << (ids % 32).int()
    for word, bit in zip((ids // 32).tolist(), bits.tolist()):  # a few stop tokens
        cleared[word] &= ~bit
    return cleared if bool(cleared.any()) else bitmask_row


def process_logits(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """The logits the draw sees (a copy when anything changes them)."""
    if batch.token_mask is None and batch.additions is None and batch.penalties is None:
        return logits
    logits = logits.clone()
    for step in (batch.token_mask, batch.additions, batch.penalties):
        if step is not None:
            step.apply(logits)
    return logits


def sample(logits: torch.Tensor, batch: SamplingBatch, num_top_logprobs: int = 0) -> SampleOutput:
    """logits [B, V] -> one token per row; greedy rows are the exact argmax (ties: lowest id)."""
    raw = logits.float()
    logits = process_logits(raw, batch)
    token_ids = logits.argmax(dim=-1)
    if not batch.all_greedy:
        greedy = batch.temperature == 0
        temperature = torch.where(greedy, 1.0, batch.temperature)
        probs = torch.softmax(logits / temperature[:, None], dim=-1)
        if batch.needs_filter:
            probs = _filter(probs, batch.top_k, batch.top_p, batch.min_p)
        drawn = (probs / exponential_noise(batch.seed, batch.step, logits.shape[1])).argmax(dim=-1)
        token_ids = torch.where(greedy, token_ids, drawn)
    return _with_logprobs(raw, token_ids, num_top_logprobs)


def _filter(probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Zero what min-p, then top-k, then top-p (of the mass the other two left) remove, in vLLM's order; rows
    with a filter off are untouched by it, so a row samples the same whether or not its batch needs filtering."""
    # stable: equal probabilities rank by token id, so top_k=1 is exactly greedy
    sorted_p, order = probs.sort(dim=-1, descending=True, stable=True)
    rank = torch.arange(probs.shape[1], device=probs.device)
    drop = sorted_p < min_p[:, None] * sorted_p[:, :1]
    drop |= (top_k[:, None] > 0) & (rank >= top_k[:, None])
    kept = sorted_p.masked_fill(drop, 0.0)
    cum = kept.cumsum(dim=-1)
    # a token goes once the tokens before it reach top_p of the mass; the first one always stays.
    # Guarded: at top_p=1 the float32 cumsum can stop growing and would cut tiny tokens
    drop |= (top_p[:, None] < 1) & (cum - kept >= top_p[:, None] * cum[:, -1:])
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


def process_logits_reference(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """`process_logits` spelled out row by row and token by token, for tests."""
    out = logits.float().clone()
    if batch.token_mask is not None:
        for row, words in zip(batch.token_mask.rows.tolist(), batch.token_mask.bitmask.tolist()):
            for t in range(out.shape[1]):
                if not (words[t // 32] >> (t % 32)) & 1:
                    out[row, t] = NEG_INF
    if batch.additions is not None:
        for (row, t), v in zip(batch.additions.index.t().tolist(), batch.additions.values.tolist()):
            out[row, t] += v
    if batch.penalties is not None:
        p = batch.penalties
        for i, row in enumerate(p.rows.tolist()):
            for t in range(out.shape[1]):  # float32 0-d tensors: the same roundings as the batched ops
                n, x = p.output_counts[i, t].float(), out[row, t]
                if n > 0 or p.in_prompt[i, t]:
                    x = x / p.repetition[i] if x > 0 else x * p.repetition[i]
                out[row, t] = x - p.frequency[i] * n - p.presence[i] * (n > 0).float()
    return out


def sample_reference(logits: torch.Tensor, batch: SamplingBatch, num_top_logprobs: int = 0) -> SampleOutput:
    """`sample` spelled out row by row, for tests."""
    token_ids = []
    for i, row in enumerate(process_logits_reference(logits, batch)):
        if batch.temperature[i] == 0:
            token_ids.append(row.argmax())
            continue
        probs = torch.softmax(row / batch.temperature[i], dim=-1)
        sorted_p, order = probs.sort(descending=True, stable=True)
        keep = sorted_p >= batch.min_p[i] * sorted_p[0]
        if batch.top_k[i] > 0:
            keep[batch.top_k[i]:] = False
        if batch.top_p[i] < 1:
            kept = sorted_p * keep
            mass_before = kept.cumsum(0) - kept
            keep &= mass_before < batch.top_p[i] * kept.cumsum(0)[-1]
        filtered = torch.zeros_like(probs)
        filtered[order[keep]] = probs[order[keep]]
        noise = exponential_noise(batch.seed[i:i + 1], batch.step[i:i + 1], row.shape[0])[0]
        token_ids.append((filtered / noise).argmax())
    ids = torch.stack(token_ids)
    log_probs = torch.log_softmax(logits.float(), dim=-1)
    top = log_probs.topk(num_top_logprobs, dim=-1) if num_top_logprobs else None
    return SampleOutput(ids, log_probs.gather(1, ids[:, None]).squeeze(1),
                        top.indices if top else None, top.values if top else None)
