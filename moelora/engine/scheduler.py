"""Continuous batching: which requests run in the next step, and with how many new tokens.

A step is a prefill batch (new prompts, the next chunk of a long prompt, recomputation of
retracted requests) when one can be formed, else a decode batch of every running request: prefill
has priority, bounded by a token budget per step. Admission needs a request row, free KV slots
for the whole prompt plus one decode slot for every request holding cache, and a LoRA slot: the
adapters of all running requests must fit in max_loras_per_batch at once (a request whose adapter
does not fit waits; FIFO, so it is not overtaken). No slots are reserved for tokens yet to be
decoded: when a decode step finds too few free slots, the newest requests go back to the front of
the queue, their cache freed, and are recomputed later.

A step is planned first and allocated second, request by request: a request leaves `waiting` (or
takes its next chunk) only together with its row and KV slots, and one whose allocation raises is
dropped with everything it held and reported in the batch's `failed`, so an exception at any point
leaves the accounting exact and costs only that request.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from itertools import accumulate

import torch

from moelora.engine.config import EngineConfig
from moelora.engine.kv_pool import KVPool
from moelora.engine.request import Req


@dataclass
class ScheduledBatch:
    reqs: list[Req]
    prefix_lens: list[int]   # tokens already in the cache per request
    extend_lens: list[int]   # new tokens per request this step
    out_slots: torch.Tensor  # [sum(extend_lens)] int64 host: cache slot of each new token
    is_decode: bool
    completes: list[bool]    # request reaches the end of its tokens this step, so samples the next one
    failed: list[tuple[Req, Exception]] = field(default_factory=list)  # dropped while allocating: not in reqs

    def subset(self, indices: list[int]) -> ScheduledBatch:
        """The batch of the requests at `indices`, with their allocations (to run part of a step again)."""
        starts = [0, *accumulate(self.extend_lens)]
        return ScheduledBatch([self.reqs[i] for i in indices], [self.prefix_lens[i] for i in indices],
                              [self.extend_lens[i] for i in indices],
                              torch.cat([self.out_slots[starts[i]:starts[i + 1]] for i in indices]),
                              self.is_decode, [self.completes[i] for i in indices])


class Scheduler:
    def __init__(self, config: EngineConfig, pool: KVPool):
        self.config, self.pool = config, pool
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []  # prompt done: decode every step, in admission order
        self.chunked: Req | None = None  # the one prompt being prefilled over several steps
        self.num_retractions = 0

    def add(self, req: Req) -> None:
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.chunked)

    def active_adapters(self) -> set[str]:
        """Adapters that must stay in GPU slots: those of every request holding cache."""
        return {r.lora for r in self._holding() if r.lora is not None}

    def schedule(self) -> ScheduledBatch | None:
        return self._schedule_prefill() or self._schedule_decode()

    def update(self, batch: ScheduledBatch) -> None:
        """After the step's tokens are appended and finish reasons set: release finished requests,
        and move requests whose prompt is done into the running batch."""
        for i, req in enumerate(batch.reqs):
            if req.finished:
                self.remove(req)
            elif not batch.is_decode and batch.completes[i]:
                if self.chunked is req:
                    self.chunked = None
                self.running.append(req)

    def remove(self, req: Req) -> None:
        """Drop a request wherever it is (finished or aborted) and free its cache."""
        if self.chunked is req:
            self.chunked = None
        elif req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self._free(req)

    def unfinished(self) -> list[Req]:
        return [*self.waiting, *self._holding()]

    def find(self, rid: str) -> Req | None:
        return next((r for r in (*self.waiting, *self._holding()) if r.rid == rid), None)

    def accounting_error(self) -> str | None:
        """What does not add up between the pool and the requests (None when every row and KV slot is
        either free or held by exactly one request holding cache, and waiting requests hold none)."""
        holding = self._holding()
        held = torch.cat([torch.empty(0, dtype=torch.int64), *(r.kv_slots for r in holding)])
        rows = [r.row for r in holding]
        if held.numel() + self.pool.free_slots != self.pool.num_slots - 1 or held.unique().numel() != held.numel():
            return f"{held.numel()} KV slots held and {self.pool.free_slots} free of {self.pool.num_slots - 1}"
        if None in rows or len(set(rows)) != len(rows) or len(rows) + self.pool.free_rows != self.pool.num_rows:
            return f"{len(rows)} requests hold cache, {self.pool.free_rows} of {self.pool.num_rows} rows are free"
        if any(r.row is not None or r.kv_len for r in self.waiting):
            return "a waiting request holds cache"
        return None

    # --------------------------------------------------------------------------------- internals

    def _holding(self) -> list[Req]:
        return self.running + ([self.chunked] if self.chunked else [])

    def _schedule_prefill(self) -> ScheduledBatch | None:
        chunk = self.config.prefill_chunk
        budget = min(self.config.max_prefill_tokens, chunk or self.config.max_prefill_tokens)
        adapters = self.active_adapters()
        reqs, extend_lens = [], []
        candidates = ([self.chunked] if self.chunked else []) + list(self.waiting)
        for req in candidates:
            is_new = req.row is None
            if is_new and len(self.running) + len(reqs) >= self.config.max_running_requests:  # reqs holds the chunked one
                break
            if req.lora is not None and req.lora not in adapters and len(adapters) >= self.config.max_loras_per_batch:
                break
            # a prompt starts only when all of it fits, keeping one decode slot for every request
            free = self.pool.free_slots - sum(extend_lens) - (len(self.running) + len(reqs) + 1)
            remaining = req.num_tokens - req.kv_len
            if is_new and remaining > free:
                break
            n = min(remaining, free)
            if chunk is not None:
                n = min(n, budget)
            elif remaining > budget and reqs:  # unchunked: a prompt over the budget runs alone
                break
            if n <= 0:
                break
            reqs.append(req)
            extend_lens.append(n)
            budget -= n
            if req.lora is not None:
                adapters.add(req.lora)
            if n < remaining:
                break
        if not reqs:
            return None
        return self._allocate(reqs, extend_lens, is_decode=False)

    def _schedule_decode(self) -> ScheduledBatch | None:
        while self.running and self.pool.free_slots < len(self.running):
            # never the chunked prompt: it runs before any decode step and its admission reserved its slots
            self._retract(self.running.pop())
        if not self.running:
            return None
        return self._allocate(list(self.running), [1] * len(self.running), is_decode=True)

    def _allocate(self, reqs: list[Req], extend_lens: list[int], is_decode: bool) -> ScheduledBatch:
        """The planned requests with their rows and new slots, each taken whole or not at all."""
        batch = ScheduledBatch([], [], [], torch.empty(0, dtype=torch.int64), is_decode, [])
        new = []
        for req, n in zip(reqs, extend_lens):
            prefix = req.kv_len
            try:
                slots = self._take(req, n)
            except Exception as e:  # whatever it is, it is this request's
                self.remove(req)
                batch.failed.append((req, e))
                continue
            if req in self.waiting:
                self.waiting.remove(req)
            if not is_decode and req.kv_len < req.num_tokens:
                self.chunked = req
            batch.reqs.append(req)
            batch.prefix_lens.append(prefix)
            batch.extend_lens.append(n)
            batch.completes.append(req.kv_len == req.num_tokens)
            new.append(slots)
        batch.out_slots = torch.cat([batch.out_slots, *new])
        return batch

    def _take(self, req: Req, n: int) -> torch.Tensor:
        """n new KV slots for the request, and its row if it has none; nothing if this raises."""
        row = self.pool.alloc_row() if req.row is None else None
        try:
            slots = self.pool.alloc_slots(n)
        except BaseException:
            if row is not None:
                self.pool.free_row(row)
            raise
        if row is not None:
            req.row = row
        req.kv_slots = torch.cat([req.kv_slots, slots])
        return slots

    def _retract(self, req: Req) -> None:
        """Free the request's cache and queue it first; it is recomputed from prompt + output so far."""
        self._free(req)
        req.num_retractions += 1
        self.num_retractions += 1
        self.waiting.appendleft(req)

    def _free(self, req: Req) -> None:
        self.pool.free(req.kv_slots)
        req.kv_slots = req.kv_slots[:0]
        if req.row is not None:
            self.pool.free_row(req.row)
            req.row = None
