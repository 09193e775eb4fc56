"""Continuous batching: which requests run in the next step, and with how many new tokens.

A step carries every running request's decode row and, after them, pieces of prompts (new prompts,
the next chunk of a long prompt, recomputation of retracted requests) under a token budget per step
(chunked_prefill_size, decode rows included), so a newcomer's prefill joins the decode batch instead
of stalling it and a long prompt is prefilled over several steps. A step with no prompt is a pure
decode step (CUDA graphs). Admission needs a request row, free KV slots for the whole prompt plus one
decode slot for every request holding cache, and a LoRA slot: the adapters of all running requests
must fit in max_loras_per_batch at once. A request whose adapter does not fit waits and, as in vLLM and SGLang, the
requests behind it whose adapter fits (the base model's, a running adapter's) may start first, until
max_running_requests of them have: then it holds the queue, the running adapters drain, and it takes the first slot
that frees (without that bound a steady stream for the running adapters would starve it). With
enable_lora_overlap_loading, one whose adapter is still on its way into its slot waits and may be overtaken too.
The slots of the prompt being prefilled over several steps are promised to it; no
slots are reserved for tokens yet to be decoded: when a step finds too few free slots for its decode
rows, the newest running requests go back to the front of the queue, their cache freed, and are
recomputed later.

The queue is in arrival order (scheduling_policy "fcfs"), or (scheduling_policy "priority", as vLLM's) in order
of the requests' priority, lower values first, then arrival; a retracted request goes back to its place in that
order, and the running request of the highest value (the latest of those) is the first retracted. A request of
a lower value waits for rows and KV slots as any other: running requests are not retracted to admit it.

With prefix caching (prefix_cache.py) a new request starts on the cached slots of the longest cached start of its
prompt, held while it holds cache, and admission counts the cached slots no request holds as free: they are
evicted for prompts and decode rows before any request is retracted; a finished request's tokens go to the cache.

A step is planned first and allocated second, request by request: a request leaves `waiting` (or
takes its next chunk) only together with its row and KV slots, and one whose planning (its retraction, its
cached prefix's match and admission) or allocation raises is dropped with everything it held and reported in the
batch's `failed`, so an exception at any point leaves the accounting exact and costs only that request. A
request's release (_free) takes each thing it holds off it before giving it back, so a release that raises
part-way gives back the rest all the same and nothing twice.
"""
from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from itertools import accumulate, count

import torch

from moelora.engine.config import EngineConfig
from moelora.engine.kv_pool import KVPool
from moelora.engine.prefix_cache import PrefixCache
from moelora.engine.request import Req


@dataclass
class ScheduledBatch:
    reqs: list[Req]
    prefix_lens: list[int]   # tokens already in the cache per request
    extend_lens: list[int]   # new tokens per request this step
    out_slots: torch.Tensor  # [sum(extend_lens)] int64 host: cache slot of each new token
    num_decode: int          # reqs[:num_decode] are decode rows (running requests), the rest prompt pieces
    completes: list[bool]    # request reaches the end of its tokens this step, so samples the next one
    failed: list[tuple[Req, Exception]] = field(default_factory=list)  # dropped while allocating: not in reqs
    num_stalled: int = 0     # running requests with tokens to go that the step leaves out (a prompt step of its own)

    @property
    def is_decode(self) -> bool:
        """Decode rows only."""
        return self.num_decode == len(self.reqs)

    def subset(self, indices: list[int]) -> ScheduledBatch:
        """The batch of the requests at `indices` (ascending), with their allocations (to run part of a
        step again)."""
        starts = [0, *accumulate(self.extend_lens)]
        return ScheduledBatch([self.reqs[i] for i in indices], [self.prefix_lens[i] for i in indices],
                              [self.extend_lens[i] for i in indices],
                              torch.cat([self.out_slots[starts[i]:starts[i + 1]] for i in indices]),
                              sum(i < self.num_decode for i in indices), [self.completes[i] for i in indices])


class Scheduler:
    def __init__(self, config: EngineConfig, pool: KVPool, adapter_ready: Callable[[str], bool] | None = None):
        """adapter_ready (EngineConfig.enable_lora_overlap_loading): whether an adapter is in its GPU slot; a new or
        retracted request whose adapter is not waits, and the requests behind it may start first."""
        self.config, self.pool, self.adapter_ready = config, pool, adapter_ready
        self.cache = PrefixCache() if config.enable_prefix_caching else None
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []  # prompt done: decode every step, in admission order
        self.chunked: Req | None = None  # the one prompt being prefilled over several steps
        self.num_retractions = 0
        self._arrivals = count()
        # the requests the last schedule() took out of their queues or gave cache: where it raised (an interrupt
        # between two of them), those it had not put anywhere yet are in no queue, and the caller ends them
        self.taken: list[Req] = []
        self._dropped: list[tuple[Req, Exception]] = []  # requests the last schedule() dropped while planning
        self._by_rid: dict[str, Req] = {}  # every request added and not removed: an abort finds one at once

    def add(self, req: Req) -> None:
        req.arrival_order = next(self._arrivals)
        self._by_rid[req.rid] = req
        self._queue(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.chunked)

    def active_adapters(self) -> set[str]:
        """Adapters that must stay in GPU slots: those of every request holding cache."""
        return {r.lora for r in self._holding() if r.lora is not None}

    def schedule(self) -> ScheduledBatch | None:
        """The next step: the running requests' decode rows, then prompt pieces (enable_mixed_chunk), or
        prompt pieces alone while any can run, else the decode rows; None if nothing can run."""
        self.taken, self._dropped = [], []
        decode = self._decode_rows()
        prefill, extend_lens = self._plan_prefill(len(decode) if self.config.enable_mixed_chunk else 0)
        stalled = 0
        if prefill and not self.config.enable_mixed_chunk:
            decode, stalled = [], len(decode)
        if not decode and not prefill and not self._dropped:
            return None
        batch = self._allocate(decode + prefill, [1] * len(decode) + extend_lens, len(decode))
        batch.num_stalled = stalled
        batch.failed[:0] = self._dropped
        return batch

    def start_decoding(self, batch: ScheduledBatch) -> None:
        """Once the step has run: requests whose prompt it finished decode from the next step on."""
        for i in range(batch.num_decode, len(batch.reqs)):
            req = batch.reqs[i]
            if batch.completes[i]:
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
        if self._by_rid.get(req.rid) is req:
            del self._by_rid[req.rid]
        self._free(req)

    def unfinished(self) -> list[Req]:
        return [*self.waiting, *self._holding()]

    def find(self, rid: str) -> Req | None:
        """The request of id `rid` added and not removed, if any."""
        return self._by_rid.get(rid)

    @property
    def available_slots(self) -> int:
        """KV slots free, or cached and held by no request (evicted when needed)."""
        return self.pool.free_slots + (self.cache.evictable if self.cache is not None else 0)

    def forget_prefixes(self, adapter: str) -> None:
        """The adapter is loaded again or unloaded: its cached prefixes are no longer its keys and values."""
        if self.cache is not None:
            self.pool.free(self.cache.forget(adapter))

    def accounting_error(self) -> str | None:
        """What does not add up between the pool, the prefix cache and the requests (None when every row and KV
        slot is either free, cached, or held by exactly one request holding cache beside the cached prefix it
        shares, and waiting requests hold none)."""
        holding = self._holding()
        cached = self.cache.slots() if self.cache is not None else torch.empty(0, dtype=torch.int64)
        held = torch.cat([cached, *(r.kv_slots[r.cached_len:] for r in holding)])
        rows = [r.row for r in holding]
        if held.numel() + self.pool.free_slots != self.pool.num_slots - 1 or held.unique().numel() != held.numel():
            return (f"{held.numel()} KV slots held ({cached.numel()} cached) and {self.pool.free_slots} free of "
                    f"{self.pool.num_slots - 1}")
        if self.cache is not None and (self.cache.cached != cached.numel()
                                       or not all(torch.isin(r.kv_slots[:r.cached_len], cached).all() for r in holding)):
            return f"the prefix cache counts {self.cache.cached} slots and holds {cached.numel()}, or lost a request's"
        if None in rows or len(set(rows)) != len(rows) or len(rows) + self.pool.free_rows != self.pool.num_rows:
            return f"{len(rows)} requests hold cache, {self.pool.free_rows} of {self.pool.num_rows} rows are free"
        if any(r.row is not None or r.kv_len for r in self.waiting):
            return "a waiting request holds cache"
        queued = self.unfinished()
        if len(self._by_rid) != len(queued) or any(self._by_rid.get(r.rid) is not r for r in queued):
            return f"the requests by id are {len(self._by_rid)}, the queues hold {len(queued)}"
        return None

    # --------------------------------------------------------------------------------- internals

    def _holding(self) -> list[Req]:
        return self.running + ([self.chunked] if self.chunked else [])

    def _promised(self) -> int:
        """KV slots the prompt being prefilled still needs: taken from decode's share of the cache."""
        return self.chunked.num_tokens - self.chunked.kv_len if self.chunked else 0

    def _decode_rows(self) -> list[Req]:
        """Every running request, once the cache has a slot for each beside the promised ones (the
        newest retracted until it has: never the chunked prompt, whose admission promised its slots);
        but one whose pending token is its last (overlap scheduling: it is done, only not yet released)."""
        self._reclaim(self._promised() + len(self.running))
        while self.running and self.pool.free_slots - self._promised() < len(self.running):
            victim = self.running[-1] if self.config.scheduling_policy == "fcfs" else max(self.running, key=_order)
            self.taken.append(victim)
            self.running.remove(victim)
            try:
                self._retract(victim)
            except Exception as e:  # whatever it is, it is this request's
                self._drop(victim, e)
            self._reclaim(self._promised() + len(self.running))  # (the prefix it held may be enough)
        return [r for r in self.running if r.num_generated < r.params.max_tokens]

    def _plan_prefill(self, num_decode: int) -> tuple[list[Req], list[int]]:
        """Prompt pieces to run beside num_decode decode rows: the chunked prompt's next chunk first,
        then waiting requests in order, while the budget, rows, adapter slots and KV slots allow."""
        chunk = self.config.prefill_chunk
        budget = self.config.max_prefill_tokens if chunk is None else min(self.config.max_prefill_tokens,
                                                                           chunk - num_decode)
        adapters = self.active_adapters()
        free = self.available_slots - num_decode  # what the decode rows leave
        reqs, extend_lens = [], []
        passed = []  # waiting for an adapter slot, the requests admitted after them overtaking them
        candidates = ([self.chunked] if self.chunked else []) + list(self.waiting)
        for req in candidates:
            is_new = req.row is None
            if req.num_pending:  # retracted with its last token not read yet: recomputed once it is
                break
            if is_new and len(self.running) + len(reqs) >= self.config.max_running_requests:  # reqs holds the chunked one
                break
            if req.lora is not None and req.lora not in adapters and len(adapters) >= self.config.max_loras_per_batch:
                if req.overtaken >= self.config.max_running_requests:
                    break
                passed.append(req)
                continue
            try:
                if (is_new and req.lora is not None and self.adapter_ready is not None
                        and not self.adapter_ready(req.lora)):
                    continue  # on its way into a slot
                cached, node = self._match(req) if is_new else (None, None)
            except Exception as e:  # whatever it is, it is this request's
                self._drop(req, e)
                continue
            locks = self.cache.lock_cost(node) if node is not None else 0
            remaining = req.num_tokens - (cached.numel() if node is not None else req.kv_len)
            # a prompt starts only when all of it fits, keeping one decode slot for every request (the next
            # step's decode rows); the chunked prompt's remaining slots are promised to it already
            if is_new and remaining > free - locks - sum(extend_lens) - (len(self.running) + len(reqs) + 1):
                break
            n = min(remaining, budget) if chunk is not None else remaining
            if chunk is None and remaining > budget and reqs:  # unchunked: a prompt over the budget runs alone
                break
            if n <= 0:
                break
            if is_new and self.cache is not None:
                try:
                    self._admit(req, cached, node)
                except Exception as e:
                    self._drop(req, e)
                    continue
                free -= locks
            reqs.append(req)
            extend_lens.append(n)
            budget -= n
            if req.lora is not None:
                adapters.add(req.lora)
            for p in passed:
                p.overtaken += 1
            if n < remaining or any(p.overtaken >= self.config.max_running_requests for p in passed):
                break  # (the bound reached: no one else overtakes them, now or in the next steps)
        return reqs, extend_lens

    def _allocate(self, reqs: list[Req], extend_lens: list[int], num_decode: int) -> ScheduledBatch:
        """The planned requests (the first num_decode decode rows) with their rows and new slots, each
        taken whole or not at all."""
        batch = ScheduledBatch([], [], [], torch.empty(0, dtype=torch.int64), 0, [])
        new = []
        for i, (req, n) in enumerate(zip(reqs, extend_lens)):
            prefix = req.kv_len
            self.taken.append(req)
            try:
                slots = self._take(req, n)
            except Exception as e:  # whatever it is, it is this request's
                self.remove(req)
                batch.failed.append((req, e))
                continue
            if req in self.waiting:
                self.waiting.remove(req)
            if i >= num_decode and req.kv_len < req.num_tokens:
                self.chunked = req
            batch.reqs.append(req)
            batch.prefix_lens.append(prefix)
            batch.extend_lens.append(n)
            batch.completes.append(req.kv_len == req.num_tokens)
            batch.num_decode += i < num_decode
            new.append(slots)
        batch.out_slots = torch.cat([batch.out_slots, *new])
        return batch

    def _drop(self, req: Req, e: Exception) -> None:
        """A request whose planning raised: out of its queue, what it holds freed, reported in the batch's `failed`."""
        self.remove(req)
        self._dropped.append((req, e))

    def _match(self, req: Req) -> tuple[torch.Tensor | None, object]:
        """The cached slots of the longest start of a new request's prompt (but its last token, whose logits it
        samples from) and their node; (None, None) without a cache, or for a request that asks for the prompt's
        log-probabilities (computed, not cached)."""
        if self.cache is None or req.return_prompt_logprobs or req.params.prompt_logprobs is not None:
            return None, None
        # (a retracted request: its output so far too, cached when it was retracted)
        slots, node = self.cache.match(self.cache.key(req.lora), req.token_ids(0, req.num_tokens - 1))
        return (slots, node) if node is not None else (None, None)

    def _admit(self, req: Req, cached: torch.Tensor | None, node: object) -> None:
        """A new request takes its cached prefix (held until it frees its cache) and the tree it goes back to."""
        self.taken.append(req)
        req.prefix_key = self.cache.key(req.lora)
        if not req.num_retractions:  # (a retracted request's prompt counted when it first came)
            req.cached_prompt_tokens = cached.numel() if node is not None else 0
            self.cache.query_tokens += len(req.prompt_ids)
            self.cache.hit_tokens += req.cached_prompt_tokens
        if node is not None:
            self.cache.lock(node)
            req.prefix_node, req.kv_slots, req.cached_len = node, cached, cached.numel()

    def _reclaim(self, n: int) -> None:
        """Evict cached prefixes no request holds until n slots are free (or none is left to evict)."""
        if self.cache is not None and self.pool.free_slots < n:
            self.pool.free(self.cache.evict(n - self.pool.free_slots))

    def _take(self, req: Req, n: int) -> torch.Tensor:
        """n new KV slots for the request, and its row if it has none; nothing if this raises."""
        self._reclaim(n)
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
        """Free the request's cache (its computed tokens cached, with prefix caching) and queue it first; it is
        recomputed from prompt + output so far (from what is still cached of them when it is admitted again)."""
        self._free(req, keep=True)
        req.num_retractions += 1
        self.num_retractions += 1
        self._queue(req, first=True)

    def _queue(self, req: Req, first: bool = False) -> None:
        """Into the queue: at its end, or `first` at its front (fcfs), or at its place in priority order."""
        if self.config.scheduling_policy == "priority":
            self.waiting.insert(bisect.bisect_right(self.waiting, _order(req), key=_order), req)
        elif first:
            self.waiting.appendleft(req)
        else:
            self.waiting.append(req)

    def _free(self, req: Req, keep: bool = False) -> None:
        """Free the request's cache: a finished one's computed tokens (or, `keep`, a retracted one's) go to the
        prefix cache, the slots they duplicate and the rest to the pool; its cached prefix stays cached. Each thing
        it holds is taken off it first, and each is given back whatever the others' release raises (which then
        propagates): nothing is kept, nothing given back twice."""
        n = min(req.kv_len, len(req.prompt_ids) + len(req.output_ids) - 1)  # the last token's keys: not computed
        slots, cached_len, node, key, row = req.kv_slots, req.cached_len, req.prefix_node, req.prefix_key, req.row
        req.kv_slots, req.cached_len, req.prefix_node, req.prefix_key, req.row = slots[:0], 0, None, None, None
        own = slots[cached_len:]
        with ExitStack() as release:  # on the way out, last in first: own's slots, the prefix's lock, the row
            if row is not None:
                release.callback(self.pool.free_row, row)
            if node is not None:
                release.callback(self.cache.unlock, node)
            release.callback(lambda: self.pool.free(own))  # (own as the insert below leaves it)
            if key is not None and (keep or req.finish_reason in ("stop", "length")):
                try:
                    own = torch.cat([self.cache.insert(key, req.token_ids(0, n), slots[:n]), slots[n:]])
                except BaseException:  # what the tree took before it raised is the tree's
                    own = own[~torch.isin(own, self.cache.slots())]
                    raise


def _order(req: Req) -> tuple[int, int]:
    """A request's place in the queue under scheduling_policy "priority"."""
    return req.priority, req.arrival_order
