"""Adapters by name, in three tiers: registered (name -> directory), this rank's share of each in host memory
(lora_slots.RankShare: the canonical tensors cut to the rank's experts and shards; LRU, at most max_cpu_loras;
re-read from disk when needed again), and max_loras_per_batch GPU slots (LRU, never evicting an adapter of a
request that holds KV cache).

Only the target modules (EngineConfig.lora_target_modules; by default those the adapters given at start
adapt) get slot buffers; an adapter of other modules is refused when it is read, before it is registered.

The scheduler admits a request only when its adapter fits among the running batch's adapters, so
`prepare` always finds a slot. Where adapters can leave host memory (max_cpu_loras), `prefetch` reads the waiting
requests' adapters back from disk in a thread of their own, beside the steps, and the scheduler starts such a request
once `ready` says its adapter is in. With EngineConfig.enable_lora_overlap_loading, `prefetch` also puts them into
slots before they start, on a GPU on a copy stream beside the steps; the scheduler starts such a request once `ready`
says its copies are done, and the first step reading the slot waits for them on the device.
Unloading an adapter with requests in flight lets them finish; new requests naming it are refused from then on.

Under tensor parallelism rank 0's manager decides (record_events=True) and the others follow: every change it
makes to what the ranks hold (an adapter registered or dropped, read back from disk, taken into host memory or
evicted from it, written to a slot, the rank tile of a step) is also recorded as an event, which the engine sends
with the next step or at once, and the other ranks' managers `replay`, each reading the adapter from disk (in its own
reader thread) and writing its own shard. So every rank's slots hold the same adapters in the same places, and its
host memory the same adapters. No step waits for another rank's disk: while the other ranks read adapters for rank 0
(one loaded at runtime, or read back for prefetch), rank 0's events end with a "poll" of those reads, which every
rank answers over the control group (how far its reads got); an adapter is `ready` once every rank has read it, and
only then do the others take it into host memory. A read that failed on another rank fails the adapter's waiting
requests, as rank 0's own does. The adapters given at start every rank reads itself; the ranks compare a digest of
what each read (start_digests), and the start fails where a rank read other files than rank 0.
"""
from __future__ import annotations

import concurrent.futures
import hashlib
import itertools
import logging
from collections import Counter, OrderedDict
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from moelora.core import ExpertLoRASlots, LinearLoRASlots
from moelora.distributed.launch import name_ranks
from moelora.engine.config import MAX_LORA_RANK, EngineConfig, adapter_name_problem
from moelora.engine.lora_slots import (RankShare, adapted_layers, allocate_lora_slots, fit_problems, model_modules,
                                       resolve_targets, share_of, slot_buffer_bytes, slot_bytes, slotted_modules,
                                       staged_share, unslotted_problems, write_share_to_slot)
from moelora.kernels.lora_tiles import step_rank_bound
from moelora.lora.adapter import load_adapter
from moelora.lora.errors import AdapterError
from moelora.lora.model_shapes import load_model_shapes


logger = logging.getLogger(__name__)

# how far a rank's read of an adapter for rank 0 got, as the "poll" event asks: the ranks' smallest is the answer
READ_PENDING, READ_FAILED, READ_DONE = 0, 1, 2


class AdapterNameError(AdapterError):
    """load_lora's name is taken: loaded already, or still being unloaded (its requests in flight finish first)."""


class LoRASlotPool:
    """Which adapter sits in which GPU slot: least recently used goes first, never one in use."""

    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self._slots: OrderedDict[str, int] = OrderedDict()  # name -> slot, least recently used first
        self._free = list(range(num_slots - 1, -1, -1))  # popped from the end: slot 0 first

    @property
    def names(self) -> list[str]:
        """Adapters in slots, least recently used first."""
        return list(self._slots)

    def lookup(self, name: str) -> int | None:
        """The adapter's slot, marking it used; None if it has none."""
        if name in self._slots:
            self._slots.move_to_end(name)
        return self._slots.get(name)

    def peek(self, name: str) -> int | None:
        """The adapter's slot (None if it has none), leaving the order of use as it is."""
        return self._slots.get(name)

    def has_room(self, in_use: Collection[str]) -> bool:
        """assign would find a slot: one is free, or holds an adapter not in `in_use`."""
        return bool(self._free) or any(n not in in_use for n in self._slots)

    def assign(self, name: str, in_use: Collection[str]) -> tuple[int, str | None]:
        """A slot for an adapter that has none: a free one, else the least recently used one among
        adapters not in `in_use`. Returns (slot, evicted adapter or None)."""
        evicted = None
        if self._free:
            slot = self._free.pop()
        else:
            evicted = next((n for n in self._slots if n not in in_use), None)
            if evicted is None:
                raise RuntimeError(f"all {self.num_slots} LoRA slots hold adapters in use: {sorted(self._slots)}")
            slot = self._slots.pop(evicted)
        self._slots[name] = slot
        return slot, evicted

    def release(self, name: str) -> None:
        """Free the adapter's slot, if it has one."""
        slot = self._slots.pop(name, None)
        if slot is not None:
            self._free.append(slot)


@dataclass
class LoRAStats:
    slot_hits: int = 0       # an adapter of a step was in a GPU slot already
    slot_loads: int = 0      # copied from host memory into a GPU slot
    slot_evictions: int = 0  # another adapter's slot was taken over
    disk_loads: int = 0      # read (and validated) from disk: at load_lora, or after leaving host memory


# ("load", name, path, files' version) | ("drop", name) | ("read", name: from disk, in the reader thread) | ("take",
# name: the read into host memory) | ("take", name, other: the copy of the same files `other` holds) | ("discard",
# name: the read dropped) | ("evict", name: out of host memory) | ("write", name, slot, on the copy stream) | ("use",
# slot: a step waits for its copies) | ("rank", rank tile)
Event = tuple


class LoRAManager:
    def __init__(self, config: EngineConfig, model: nn.Module, record_events: bool = False,
                 check_memory: Callable[[int, int], None] | None = None):
        """check_memory(bytes, rank): raises unless the slot buffers of that rank fit the device's free memory."""
        self.config, self.model = config, model
        # on a GPU the host copies are staged (pinned, in the slots' layout): a slot write then never waits
        self._staged = next(model.parameters()).is_cuda
        # EngineConfig.enable_lora_overlap_loading on a GPU: prefetch's slot writes run on a stream of their own, beside
        # the steps; each slot's last such write is waited for by the first step that reads the slot
        self._copy_stream = torch.cuda.Stream(next(model.parameters()).device) \
            if config.enable_lora_overlap_loading and self._staged else None
        self._loading: dict[int, torch.cuda.Event] = {}  # slot -> the end of its copies, until a step waits for it
        self._events: list[Event] | None = [] if record_events else None
        self._follows_rank0 = config.tp_size > 1 and not record_events  # (another rank: it replays rank 0's events)
        self.shapes = load_model_shapes(config.model_path, config.tokenizer_path)  # what adapters are checked against
        self.stats = LoRAStats()
        self._paths: dict[str, Path] = {}
        self._host: OrderedDict[str, RankShare] = OrderedDict()  # this rank's share of each; least recently used first
        # adapters being read back into host memory by prefetch, in a thread of their own (started when first needed)
        self._reading: dict[str, concurrent.futures.Future[RankShare]] = {}
        self._reader: concurrent.futures.ThreadPoolExecutor | None = None
        self._rank: dict[str, int] = {}  # each adapter's largest rank, of any module
        # rank 0 under tensor parallelism: adapters whose reads the other ranks were asked for ("read", "load") and
        # have not all finished (not `ready` meanwhile), those of the poll sent last, and those that failed
        self._others_reading: dict[str, None] = {}
        self._polled: list[str] = []
        self._others_failed: list[tuple[str, str, Exception]] = []
        # another rank: rank 0's version of each adapter loaded at runtime, until this rank's read is checked against it
        self._rank0_version: dict[str, tuple] = {}
        self._version: dict[str, tuple] = {}  # each adapter's files (RankShare.version) when it was registered
        self._in_flight: Counter[str] = Counter()
        self._unloading: set[str] = set()
        self.pool = LoRASlotPool(config.max_loras_per_batch)
        # the adapters given at start, each cut to this rank's share as soon as it is read (one whole adapter in
        # memory at a time), a path given under several names read once (its names share the copy, as _cache's do);
        # without max_lora_rank the slots take the largest rank among them, up to the kernels' limit
        shares: dict[Path, RankShare] = {}
        for name, path in config.lora_paths.items():
            if Path(path) not in shares:
                shares[Path(path)] = self._read_share(path, config.max_lora_rank or MAX_LORA_RANK,
                                                      f"adapter {name!r} ({path})")
        initial = {name: shares[Path(path)] for name, path in config.lora_paths.items()}
        self.stats.disk_loads += len(shares)
        self.max_rank = config.max_lora_rank or max((a.max_rank for a in initial.values()), default=0)
        targets = resolve_targets(config.lora_target_modules, model, [a.modules for a in initial.values()])
        if self.max_rank:
            if check_memory is not None:
                check_memory(slot_buffer_bytes(model, config.max_loras_per_batch, self.max_rank, targets), self.max_rank)
            allocate_lora_slots(model, config.max_loras_per_batch, self.max_rank, targets)
        # every LoRA layer's slot buffers, dense and experts: a step's rank tile is set on all of them (prepare)
        self.slot_buffers = [m.lora for m in model.modules()
                             if isinstance(getattr(m, "lora", None), (ExpertLoRASlots, LinearLoRASlots))]
        for name, share in initial.items():
            self._raise(unslotted_problems(model, share.modules), f"adapter {name!r} ({share.path})")
            self._register(name, Path(config.lora_paths[name]), share)

    @property
    def in_flight(self) -> dict[str, int]:
        """Requests that hold a reference to each adapter."""
        return dict(self._in_flight)

    @property
    def prefetches(self) -> bool:
        """Whether `prefetch` has work: adapters may leave host memory (max_cpu_loras), go into slots ahead of
        their requests (enable_lora_overlap_loading), or be read by the other ranks (tensor parallelism)."""
        return self.config.max_cpu_loras is not None or self.config.enable_lora_overlap_loading \
            or self._events is not None

    @property
    def names(self) -> list[str]:
        """Adapters new requests may name."""
        return sorted(n for n in self._paths if n not in self._unloading)

    def describe(self) -> list[str]:
        """A line for the GPU slots and one per adapter (rank, the host memory of this rank's share), for the server's
        startup log."""
        if not self.max_rank:
            return ["LoRA: no slots (start with max_lora_rank or lora_paths to load adapters)"]
        mib = slot_bytes(self.model) / 2**20
        slotted = slotted_modules(self.model)
        without = [m for m in model_modules(self.model) if m not in slotted]
        lines = [f"LoRA: {self.pool.num_slots} GPU slots of rank {self.max_rank} ({mib:.1f} MiB), host "
                 f"cache of {self.config.max_cpu_loras or 'unlimited'} adapters",
                 f"LoRA slots on {', '.join(slotted)}" + (f"; none on {', '.join(without)}" if without else "")
                 + " (--lora-target-modules)"]
        for name in self.names:
            share = self._host.get(name)
            held = f"{share.max_rank}, {share.num_bytes() / 2**20:.1f} MiB in host memory" if share else \
                "not in host memory"
            lines.append(f"adapter {name}: {self._paths[name]} (rank {held})")
        return lines

    def read(self, path: str | Path) -> RankShare:
        """This rank's share of the adapter at `path`, read and validated against the model for the slots' rank and
        target modules. Reads only what never changes after start (the model's shapes, its layers' slot buffers and
        shards, the rank), so it may run in another thread while the engine steps."""
        if not self.max_rank:
            raise AdapterError("cannot load an adapter: the engine has no LoRA slots (start it with max_lora_rank, "
                               "or with lora_paths)")
        return self._read_share(path, self.max_rank, f"adapter {path}", slotted=True)

    def load_lora(self, name: str, path: str | Path, adapter: RankShare | None = None, replace: bool = False) -> None:
        """Serve the adapter at `path` (`adapter`: what read(path) gave, else it is read here) as `name`. replace: a
        loaded adapter of that name is replaced (vLLM's load_inplace), if no request uses it."""
        if (problem := adapter_name_problem(name)) is not None:
            raise AdapterNameError(problem)
        if name in self._unloading:
            raise AdapterNameError(f"adapter {name!r} is still being unloaded ({self._in_flight[name]} requests in "
                                   "flight)")
        if name in self._paths and not replace:
            raise AdapterNameError(f"adapter {name!r} is already loaded from {self._paths[name]}; unload it first")
        if self._in_flight[name]:
            raise AdapterNameError(f"adapter {name!r} cannot be replaced while {self._in_flight[name]} requests use it")
        if not self.max_rank:
            raise AdapterError(f"cannot load adapter {name!r}: the engine has no LoRA slots "
                               "(start it with max_lora_rank, or with lora_paths)")
        share = adapter if adapter is not None else self.read(path)  # (a bad one leaves the loaded one serving)
        if name in self._paths:
            self._drop(name)
        self._register(name, Path(path), share)
        self.stats.disk_loads += 1
        self._record("load", name, str(path), self._version[name], self._rank[name])
        self._ask_others(name)

    def unload_lora(self, name: str) -> None:
        """New requests naming the adapter are refused from now on; it leaves memory once its
        requests in flight have finished."""
        self.check(name)
        if self._in_flight[name]:
            self._unloading.add(name)
        else:
            self._drop(name)

    def check(self, name: str) -> None:
        """Raise AdapterError unless new requests may name the adapter."""
        if name in self._unloading:
            raise AdapterError(f"adapter {name!r} is being unloaded and takes no new requests")
        if name not in self._paths:
            raise AdapterError(f"unknown adapter {name!r} (loaded: {', '.join(self.names) or 'none'})")

    def acquire(self, name: str) -> None:
        """A new request names the adapter."""
        self.check(name)
        self._in_flight[name] += 1

    def release(self, name: str) -> None:
        """A request naming the adapter finished or was aborted."""
        self._in_flight[name] -= 1
        if not self._in_flight[name]:
            del self._in_flight[name]
            if name in self._unloading:
                self._drop(name)

    def prepare(self, adapters: Sequence[str | None], in_use: Collection[str]) -> list[int]:
        """GPU slot of each request's adapter (-1: base model), loading adapters into slots as
        needed without evicting any in `in_use` (which must include `adapters`); the step queued next waits for the
        copies of any slot prefetch wrote. Also bounds every LoRA layer's rank tile by the largest rank among `adapters`."""
        slots: dict[str, int] = {}
        for name in dict.fromkeys(a for a in adapters if a is not None):
            slot = self.pool.lookup(name)
            if slot is None:
                slot = self._put(name, in_use, None)
            else:
                self.stats.slot_hits += 1
            if self._await_copies(slot):
                self._record("use", slot)
            slots[name] = slot
        if slots:
            rank = step_rank_bound(max(self._rank[n] for n in slots), self.max_rank)
            self._set_rank_tile(rank)
            self._record("rank", rank)
        return [-1 if a is None else slots[a] for a in adapters]

    def prefetch(self, adapters: Iterable[str], in_use: Collection[str]) -> list[tuple[str, str, Exception]]:
        """Get the adapters of waiting requests (`adapters`, in queue order; the first max_loras_per_batch of them)
        ready while the steps go on. One neither in a slot nor in host memory is read from disk in the reader thread
        (a later call takes it in). With enable_lora_overlap_loading, each in host memory then goes into a GPU slot,
        on a GPU on the copy stream, so a step reads the slot only once `ready` says so: it takes a slot while one is
        free or holds an adapter neither in `in_use` nor named before it (one still being copied too, for a request
        gone since: the copy stream writes a slot in order). Reads of adapters out of the window not started yet are
        called off. Returns (adapter, what failed, error) for each whose read or write failed (nothing of it stays in a
        slot; its requests are to fail, and a call after that looks at the queue without them)."""
        window = list(itertools.islice(_distinct(adapters), self.pool.num_slots))
        for name in window:  # used last: the reads taken in below evict none of them (max_cpu_loras >= the window)
            if name in self._host:
                self._host.move_to_end(name)
        keep, slots_left = set(in_use), self.config.enable_lora_overlap_loading
        failed, self._others_failed = self._others_failed, []
        for name in window:
            if any(name == f[0] for f in failed):  # (read again, if still named, once its requests have failed)
                continue
            in_host = self.pool.peek(name) is not None or self._in_host(name, failed)
            if in_host and slots_left:
                slots_left = self._into_slot(name, keep, failed)
        self._take_in_reads(window)
        return failed

    def ready(self, name: str) -> bool:
        """A step may use the adapter without waiting: with enable_lora_overlap_loading it is in a GPU slot, its
        copies done; else it is in a slot or in host memory (a slot write reads no file). Under tensor parallelism,
        not before every rank has read it."""
        if name in self._others_reading:
            return False
        slot = self.pool.peek(name)
        if not self.config.enable_lora_overlap_loading:
            return slot is not None or name in self._host
        return slot is not None and (slot not in self._loading or self._loading[slot].query())

    def pending(self) -> bool:
        """Reads from disk (this rank's or the others') or slot copies that prefetch started are still to be taken in
        or waited for."""
        return bool(self._reading or self._others_reading) or any(not event.query() for event in self._loading.values())

    def wait_for_prefetch(self, timeout: float) -> None:
        """Wait for the slots' copies still running (the host, not a stream), and for the first of prefetch's reads
        from disk to finish, at most `timeout` seconds (the next prefetch takes it in)."""
        for event in self._loading.values():
            event.synchronize()
        if self._reading:
            concurrent.futures.wait(list(self._reading.values()), timeout, concurrent.futures.FIRST_COMPLETED)

    def close(self) -> None:
        """Stop the reader thread (a read running finishes, unused)."""
        if self._reader is not None:
            self._reader.shutdown(wait=False, cancel_futures=True)

    def take_events(self, wait: float = 0.0) -> list[Event]:
        """What changed since the last call, for the other ranks to replay. While they read adapters for rank 0, the
        events end with a "poll" of those reads (each rank waiting up to `wait` seconds for one to finish), which
        every rank answers at once (`polled`: rank 0's answer goes to `others_read`)."""
        events = self._events or []
        if self._events is not None:
            self._events = []
            self._polled = list(self._others_reading)
            if self._polled:
                events.append(("poll", self._polled, wait))
        return events

    @property
    def polled(self) -> list[str]:
        """The adapters of the poll that take_events sent last (rank 0; empty: none sent)."""
        return self._polled

    def others_read(self, status: list[int]) -> None:
        """Rank 0: the ranks' answer to the poll sent last, the least READ_* of each polled adapter over the ranks.
        One read by every rank goes into the others' host memory where it is in rank 0's; one that failed on a rank
        is dropped everywhere (its waiting requests fail, prefetch says; a request naming it later reads it again)."""
        for name, done in zip(self._polled, status):
            if done == READ_PENDING or name not in self._others_reading:
                continue
            del self._others_reading[name]
            if done == READ_DONE:
                if name in self._host:
                    self._record("take", name)
                continue
            self._record("discard", name)
            self._host.pop(name, None)
            self._discard(name)
            self._others_failed.append((name, "reading its adapter from disk on another rank",
                                        AdapterError("a tensor-parallel rank's read failed (its log says why)")))
        self._polled = []

    def start_digests(self) -> list[int]:
        """A digest of each adapter given at start (by name) as this rank read it, for the ranks to compare
        (check_start_digests): the one that checks another rank's read of an adapter loaded at runtime (_same_files)."""
        return [_files_digest(self._version[n], self._rank[n]) for n in sorted(self.config.lora_paths)]

    def check_start_digests(self, digests: list[list[int]]) -> None:
        """AdapterError naming each adapter given at start that a rank read other files of than rank 0 (`digests`:
        every rank's start_digests, in rank order). Each rank reads its own disk: one that found other files (another
        node's, or ones replaced while the ranks started) would have the ranks serve a mix of two adapters."""
        problems = []
        for i, name in enumerate(sorted(self.config.lora_paths)):
            differ = [rank for rank, theirs in enumerate(digests) if theirs[i] != digests[0][i]]
            if differ:
                problems.append(f"adapter {name!r} ({self._paths[name]}): {name_ranks(differ)} read other files there "
                                "than rank 0")
        if problems:
            raise AdapterError("; ".join(problems) + " (each rank reads its own disk: the ranks would serve a mix of "
                               "two adapters); give every rank the same files", problems)

    def replay(self, events: list[Event]) -> list[int] | None:
        """Make the same changes as rank 0's manager did (on another rank, in its order); where they end with a poll,
        this rank's answer (READ_* of each polled adapter) for the ranks to exchange."""
        for kind, *args in events:
            if kind == "load":  # read in the reader thread: rank 0 waits for it through the polls
                name, path, version, rank = args
                self._paths[name], self._rank[name], self._version[name] = Path(path), rank, version
                self._rank0_version[name] = version
                self._start_read(name)
            elif kind == "poll":
                return self._read_status(*args)
            elif kind == "drop":
                self._drop(args[0])
            elif kind == "read":
                if args[0] not in self._host and args[0] not in self._reading:
                    self._start_read(args[0])
            elif kind == "take":
                self._take_copy(*args) if len(args) == 2 else self._host_copy(args[0])
            elif kind == "discard":
                self._discard(args[0])
            elif kind == "evict":
                self._host.pop(args[0], None)
            elif kind == "write":
                name, slot, on_copy_stream = args
                self._write(name, slot, self._copy_stream if on_copy_stream else None)
            elif kind == "use":
                self._await_copies(args[0])
            else:
                self._set_rank_tile(args[0])

    # --------------------------------------------------------------------------------- internals

    def _put(self, name: str, in_use: Collection[str], stream: torch.cuda.Stream | None) -> int:
        """A slot for the adapter (see LoRASlotPool.assign), its copies queued on `stream` (None: the current one)."""
        slot, evicted = self.pool.assign(name, in_use)
        try:
            self._write(name, slot, stream)
        except BaseException:  # the slot holds part of it: nobody may find it there
            self.pool.release(name)
            raise
        self._record("write", name, slot, stream is not None)
        self.stats.slot_loads += 1
        self.stats.slot_evictions += evicted is not None
        return slot

    def _write(self, name: str, slot: int, stream: torch.cuda.Stream | None) -> None:
        """Queue the adapter's copies into the slot: on the current stream (after the copy stream's last write to the
        slot, if any) or on `stream`, after every step queued so far (they may read the slot's adapter before)."""
        share = self._host_copy(name)
        if stream is None:
            self._await_copies(slot)
            write_share_to_slot(self.model, share, slot)
            return
        stream.wait_stream(torch.cuda.current_stream(stream.device))
        with torch.cuda.stream(stream):
            write_share_to_slot(self.model, share, slot)
        self._loading[slot] = done = torch.cuda.Event()
        done.record(stream)

    def _await_copies(self, slot: int) -> bool:
        """The current stream waits for the copy stream's last write to the slot, if no step has yet; whether it had
        to."""
        event = self._loading.pop(slot, None)
        if event is not None:
            event.wait()
        return event is not None

    def _record(self, *event: object) -> None:
        if self._events is not None:
            self._events.append(event)

    def _read_share(self, path: str | Path, max_rank: int | None, what: str, slotted: bool = False) -> RankShare:
        """This rank's share of the adapter at `path`, read and checked against the model's shapes and max_rank, and
        once the slots exist (`slotted`) against their modules."""
        adapter = load_adapter(path, self.shapes, max_rank)
        self._raise(fit_problems(self.model, adapter, max_rank)
                    + (unslotted_problems(self.model, adapted_layers(adapter)) if slotted else []), what)
        share = share_of(self.model, adapter)
        return staged_share(self.model, share) if self._staged else share

    @staticmethod
    def _raise(problems: list[str], what: str) -> None:
        """AdapterError unless the adapter fits the model and its slots: here, not when a request first puts it in a
        slot."""
        if problems:
            raise AdapterError(f"{what} cannot be served by this engine: {len(problems)} problem(s):\n  - "
                               + "\n  - ".join(problems), problems)

    def _set_rank_tile(self, rank: int) -> None:
        for lora in self.slot_buffers:
            lora.max_rank_in_use = rank

    def _register(self, name: str, path: Path, share: RankShare) -> None:
        self._paths[name] = path
        self._rank[name], self._version[name] = share.max_rank, share.version
        self._cache(name, share)

    def _cache(self, name: str, share: RankShare) -> None:
        # names of one path's same files hold one copy between them (a path loaded under many names)
        files = (share.path, share.version)
        self._host[name] = next((s for s in self._host.values() if share.version and (s.path, s.version) == files),
                                share)
        # (another rank replays rank 0's evictions before the adapter each made room for: its memory holds rank 0's)
        self._make_room()

    def _make_room(self) -> None:
        while self.config.max_cpu_loras is not None and len(self._host) > self.config.max_cpu_loras:
            evicted = self._host.popitem(last=False)[0]
            self._record("evict", evicted)
            if evicted in self._others_reading:  # the others drop their read of it too
                del self._others_reading[evicted]
                self._record("discard", evicted)

    def _into_slot(self, name: str, keep: set[str], failed: list[tuple[str, str, Exception]]) -> bool:
        """prefetch's slot for an adapter in host memory (see there; a failure added to `failed`); False when no slot
        is left to take."""
        if self.pool.lookup(name) is None:
            if not self.pool.has_room(keep):
                return False
            try:
                self._put(name, keep, self._copy_stream)
            except Exception as e:  # the adapter's requests fail; the others' adapters go on
                failed.append((name, "putting its adapter into a GPU slot", e))
                return True
        keep.add(name)
        return True

    def _in_host(self, name: str, failed: list[tuple[str, str, Exception]]) -> bool:
        """Whether the adapter is in host memory; if not, its read from disk starts, or, finished, is taken in (a
        failure added to `failed`)."""
        if name in self._host:
            return name not in self._others_reading  # (the other ranks' copies: no slot write waits for them)
        if (other := self._held_by_another_name(name)) is not None:
            self._take_copy(name, other)
            return True
        if name not in self._reading:
            self._start_read(name)
            self._record("read", name)
            self._ask_others(name)
            return False
        if not self._reading[name].done():
            return False
        error = self._take_in(name)
        if error is not None:
            failed.append((name, "reading its adapter from disk", error))
        return error is None and name not in self._others_reading

    def _take_in_reads(self, window: Collection[str]) -> None:
        """Reads of adapters outside prefetch's window (their requests aborted, or further back in the queue now):
        finished, into host memory where it has room (evicting nothing), else dropped; not started, called off (the
        reader thread would read them before the window's)."""
        for name in [n for n in self._reading if n not in window]:
            read = self._reading[name]
            if read.done() and (self.config.max_cpu_loras is None or len(self._host) < self.config.max_cpu_loras):
                self._take_in(name)  # (a failed one is dropped: a request naming it again reads it again)
            elif read.done() or read.cancel():
                self._discard(name)
                self._record("discard", name)

    def _take_in(self, name: str) -> Exception | None:
        """The adapter's finished read into host memory ("take": the other ranks' too, once theirs is done), or,
        failed, dropped ("discard"); the read's error."""
        try:
            self._host_copy(name)
        except Exception as e:
            self._record("discard", name)
            self._others_reading.pop(name, None)
            return e
        if name not in self._others_reading:  # else once theirs is done too (others_read)
            self._record("take", name)
        return None

    def _discard(self, name: str) -> None:
        read = self._reading.pop(name, None)
        if read is not None:
            read.cancel()
        self._others_reading.pop(name, None)  # (rank 0 records the "discard" the others replay)

    def _ask_others(self, name: str) -> None:
        """Rank 0 under tensor parallelism: the other ranks read the adapter ("read" or "load" recorded); not ready
        until the polls say every rank has."""
        if self._events is not None:
            self._others_reading[name] = None

    def _read_status(self, names: list[str], wait: float) -> list[int]:
        """Another rank: how far its reads of `names` got (waiting up to `wait` seconds for one of them to end)."""
        running = [self._reading[n] for n in names if n in self._reading and not self._reading[n].done()]
        if wait and running:
            concurrent.futures.wait(running, wait, concurrent.futures.FIRST_COMPLETED)
        status = []
        for name in names:
            read = self._reading.get(name)
            if name in self._host:
                status.append(READ_DONE)
            elif read is None or read.cancelled():
                status.append(READ_FAILED)
            elif not read.done():
                status.append(READ_PENDING)
            elif read.exception() is not None or not self._same_files(name, read.result()):
                logger.error("adapter %r: reading it from disk failed on this rank: %s", name, read.exception()
                             or "its files are not those rank 0 read, or changed since it was loaded")
                status.append(READ_FAILED)
            else:
                status.append(READ_DONE)
        return status

    def _same_files(self, name: str, share: RankShare) -> bool:
        """Whether this rank read the adapter's registered files (_host_copy's check), or, its first read of one loaded
        at runtime, the files rank 0 read (told by _files_digest)."""
        version = self._rank0_version.get(name)
        if version is None:
            return (share.version, share.max_rank) == (self._version[name], self._rank[name])
        return _files_digest(share.version, share.max_rank) == _files_digest(version, self._rank[name])

    def _start_read(self, name: str) -> None:
        if self._reader is None:
            self._reader = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="moelora-lora-read")
        self._reading[name] = self._reader.submit(self.read, self._paths[name])

    def _host_copy(self, name: str) -> RankShare:
        """The adapter's share in host memory (marked used): there, or the read prefetch started (waited for), or
        read here."""
        if name in self._host:
            self._host.move_to_end(name)
            return self._host[name]
        if (other := self._held_by_another_name(name)) is not None:
            return self._take_copy(name, other)
        read = self._reading.pop(name, None)
        share = read.result() if read is not None else self.read(self._paths[name])
        self.stats.disk_loads += 1
        # the registered adapter or nothing: the one rewritten in place may be another (its rank past the rank
        # tile `prepare` bounds the step with), and the other ranks may read either
        if not self._same_files(name, share):
            raise AdapterError(f"adapter {name!r}: its files in {self._paths[name]} " + (
                "are not those rank 0 read" if name in self._rank0_version
                else "changed since it was loaded; unload it and load it again to serve them"))
        if self._rank0_version.pop(name, None) is not None:  # another rank's first read of one loaded at runtime
            self._version[name] = share.version
        self._cache(name, share)
        return share

    def _held_by_another_name(self, name: str) -> str | None:
        """Rank 0 (or the only rank): another name whose host copy is of the adapter's files (the same path, and the
        same files' version: a path loaded under several names), not one the other ranks are still reading. Another
        rank takes the copy rank 0 names (its "take" event), never one of its own finding: its versions of the files,
        read from its own disk, may group them otherwise."""
        files = (self._paths[name], self._version[name])
        if self._follows_rank0 or not files[1]:
            return None
        return next((other for other in self._host if other not in self._others_reading
                     and (self._paths[other], self._version[other]) == files), None)

    def _take_copy(self, name: str, other: str) -> RankShare:
        """The host copy `other` holds, under `name` too (marked used); a read of it called off, on every rank. Rank
        0 records the take before the evictions that make room for it: another rank replays those after taking the
        copy (before, one might evict the name holding it)."""
        self._discard(name)
        self._record("take", name, other)
        if self._rank0_version.pop(name, None) is not None:  # another rank's first copy of one loaded at runtime
            self._version[name] = self._version[other]  # (the files rank 0 read: `other`'s, checked so)
        share = self._host[name] = self._host[other]
        if not self._follows_rank0:
            self._make_room()
        return share

    def _drop(self, name: str) -> None:
        self._record("drop", name)
        del self._paths[name], self._rank[name], self._version[name]
        self._unloading.discard(name)
        self._host.pop(name, None)
        self._rank0_version.pop(name, None)
        # (another rank's failed read of this adapter: not one of a later adapter of the name, loaded in place or anew)
        self._others_failed = [f for f in self._others_failed if f[0] != name]
        self._discard(name)
        self.pool.release(name)


def _distinct(names: Iterable[str]) -> Iterator[str]:
    """Each name once, in the order first seen (lazily: the caller takes a few of a long queue)."""
    seen = set()
    for name in names:
        if name not in seen:
            seen.add(name)
            yield name


def _files_digest(version: tuple[tuple[str, int, int], ...], max_rank: int) -> int:
    """What tells the files one rank read of an adapter from another rank's, as an int64: a digest of the files'
    names and sizes (of its version, lora.adapter.files_version) and the adapter's LoRA rank (the rank tiles follow
    it). Not the modification times: another node's copy of the same files has other ones."""
    key = repr((tuple((name, size) for name, size, _ in version), max_rank)).encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little", signed=True)
