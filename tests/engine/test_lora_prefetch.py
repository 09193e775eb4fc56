"""LoRAManager.prefetch: the waiting requests' adapters made ready before their requests start, the running requests'
steps going on meanwhile and the requests behind them free to start first. An adapter out of host memory
(max_cpu_loras) is read from disk in a thread of its own; with EngineConfig.enable_lora_overlap_loading, adapters go
into GPU slots, on GPUs on a copy stream beside the steps. On this CPU the copies are synchronous: a copy still
running is stood in for by an event the test completes (`copies`), as a read still running is in the random test
(`reads`)."""
import concurrent.futures
import random
import shutil
import threading
from pathlib import Path

import pytest
import torch

from moelora.engine import lora_manager
from moelora.engine.lora_manager import LoRAManager
from moelora.engine.sampling_params import SamplingParams
from tests.support import assert_released

FAMILY = "qwen3_moe"
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, logprobs=2, ignore_eos=True)


class Injected(RuntimeError):
    pass


class Copying:
    """A copy stream's event: done when the test says so, or once the host waits for it."""

    def __init__(self):
        self.done, self.waits = False, 0

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.done = True

    def wait(self) -> None:  # a step's stream waits for the copies
        self.waits += 1


@pytest.fixture
def copies(monkeypatch) -> dict[int, Copying]:
    """slot -> the event of prefetch's last write into it, running until completed (engines made with `make`)."""
    events: dict[int, Copying] = {}
    real_write = LoRAManager._write

    def write(self, name, slot, stream):
        real_write(self, name, slot, None)
        if stream is not None:
            self._loading[slot] = events[slot] = Copying()
    monkeypatch.setattr(LoRAManager, "_write", write)
    return events


class Reading(concurrent.futures.Future):
    """A read from disk in the reader thread: done when the test finishes it, or once the host waits for reads."""

    def __init__(self, read):
        super().__init__()
        self.read = read

    def finish(self) -> None:
        if not self.done():  # (cancelled: dropped)
            try:
                self.set_result(self.read())
            except Exception as e:
                self.set_exception(e)


@pytest.fixture
def reads(monkeypatch) -> dict[str, Reading]:
    """adapter -> prefetch's last read of it from disk, running until finished."""
    started: dict[str, Reading] = {}
    real_wait = LoRAManager.wait_for_prefetch

    def start_read(self, name):
        path = self._paths[name]
        self._reading[name] = started[name] = Reading(lambda: self.read(path))

    def wait_for_prefetch(self, timeout):
        for read in started.values():
            read.finish()
        real_wait(self, timeout)
    monkeypatch.setattr(LoRAManager, "_start_read", start_read)
    monkeypatch.setattr(LoRAManager, "wait_for_prefetch", wait_for_prefetch)
    return started


@pytest.fixture
def make(make_engine, adapters):
    """An engine with 2 GPU slots and 3 adapters (three_adapters); `copy_stream`: with a copy
    stream, whose writes go to `copies`."""
    def make(copy_stream: bool = False, **kwargs):
        engine = make_engine(FAMILY, **{"enable_lora_overlap_loading": True, "lora_paths": three_adapters(adapters),
                                        **kwargs})
        if copy_stream:
            engine.runner.lora._copy_stream = "the copy stream"
        return engine
    return make


def prompt(i: int) -> list[int]:
    return [(7 * i + 3 * j) % 90 + 3 for j in range(5 + i)]


def three_adapters(adapters) -> dict[str, str]:
    """"full", "partial" and "again": full's weights in files of its own (another adapter to read from disk: names of
    one path's files share a copy in host memory)."""
    paths = {n: str(a.path) for n, a in adapters(FAMILY).items()}
    again = Path(paths["full"] + "-again")
    if not again.exists():
        shutil.copytree(paths["full"], again)
    return {**paths, "again": str(again)}


def alone(make_engine, adapters, loras: list[str | None]) -> list:
    """Each request's outputs from an engine without overlap loading, one request at a time."""
    engine = make_engine(FAMILY, lora_paths=three_adapters(adapters))
    return [engine.generate([prompt(i)], GREEDY, lora=[a])[0] for i, a in enumerate(loras)]


def step(engine, outputs: dict[str, list]) -> None:
    """One step, its outputs added to each request's."""
    for out in engine.step():
        outputs.setdefault(out.rid, []).append(out)


def wait_beside(engine, outputs: dict[str, list], first: str, lora: str) -> tuple[str, str]:
    """Beside the running request `first`, a request of `lora` and then a base request come: for three steps the
    former waits, holding nothing, while `first` decodes and the base request starts. Their rids."""
    step(engine, outputs)
    waiting = engine.add_request(prompt(1), GREEDY, lora=lora)
    later = engine.add_request(prompt(2), GREEDY, lora=None)
    made = len(outputs[first])
    for _ in range(3):
        step(engine, outputs)
        req = engine.scheduler.find(waiting)
        assert req in engine.scheduler.waiting and req.row is None
    assert len(outputs[first]) > made and outputs[later], "the others did not go on"
    return waiting, later


def run(engine, outputs: dict[str, list] | None = None) -> dict[str, list]:
    """Step until nothing is left; each request's outputs."""
    outputs = {} if outputs is None else outputs
    while engine.has_unfinished():
        step(engine, outputs)
    return outputs


def same(outputs: list, expected) -> bool:
    """A request's step outputs give the tokens of `expected` (its output alone), their log-probabilities within fp32's
    error of a batch of another size on this CPU."""
    tokens = [t for out in outputs for t in out.token_ids]
    logprobs = [lp for out in outputs for lp in out.logprobs]
    return outputs[-1].finish_reason == "length" and tokens == expected.token_ids and close(logprobs, expected.logprobs)


def close(got: list[dict[int, float]], expected: list[dict[int, float]]) -> bool:
    return len(got) == len(expected) and all(
        g.keys() == e.keys() and all(abs(g[t] - e[t]) < 1e-4 for t in g) for g, e in zip(got, expected))


@pytest.mark.parametrize("overlap_schedule", [True, False])
def test_more_adapters_than_slots_give_the_tokens_of_an_engine_without_it(make, make_engine, adapters,
                                                                          overlap_schedule):
    """Requests of 3 adapters and the base model in 2 slots, all at once (synchronous copies): every request gets
    what it gets alone from an engine without overlap loading, and the slots changed adapters on the way."""
    loras = ["full", "partial", None, "again", "full", "again", "partial"]
    engine = make(disable_overlap_schedule=not overlap_schedule)
    outputs = engine.generate([prompt(i) for i in range(len(loras))], GREEDY, lora=loras)
    for out, expected in zip(outputs, alone(make_engine, adapters, loras), strict=True):
        assert out.token_ids == expected.token_ids and close(out.logprobs, expected.logprobs)
    assert engine.runner.lora.stats.slot_evictions > 0
    assert_released(engine)


def test_a_request_waits_for_its_adapters_copies_and_the_others_go_on(make, make_engine, adapters, copies):
    """A request whose adapter is still being copied into its slot waits, while the running request decodes and a
    base request that came after it starts; the first step with it waits for the copies once; all get their tokens.
    With nothing else to run, the host waits for the copies (the first request's adapter)."""
    engine = make(copy_stream=True)
    outputs: dict[str, list] = {}
    first = engine.add_request(prompt(0), GREEDY, lora="full")
    step(engine, outputs)
    assert copies[0].done and engine.scheduler.find(first).row is not None  # waited for: nothing else could run
    waiting, later = wait_beside(engine, outputs, first, "partial")
    assert not copies[1].waits
    copies[1].done = True
    run(engine, outputs)
    assert copies[1].waits == 1 and copies[0].waits == 1
    for rid, expected in zip((first, waiting, later), alone(make_engine, adapters, ["full", "partial", None])):
        assert same(outputs[rid], expected), rid
    assert_released(engine)


def test_a_slot_in_use_or_being_copied_for_a_waiting_request_is_not_taken(make, make_engine, adapters, copies):
    """Both slots taken, one by the running request's adapter and one by the adapter of a request still waiting for
    its copies: a third adapter's request waits and nothing is written over either. Once that request is aborted, its
    adapter's slot takes the third adapter at once (the copy stream writes a slot in order)."""
    engine = make(copy_stream=True)
    outputs: dict[str, list] = {}
    first = engine.add_request(prompt(0), GREEDY, lora="full")
    step(engine, outputs)
    second = engine.add_request(prompt(1), GREEDY, lora="partial")
    third = engine.add_request(prompt(2), GREEDY, lora="again")
    pool = engine.runner.lora.pool
    for _ in range(2):
        step(engine, outputs)
    assert (pool.peek("full"), pool.peek("partial"), pool.peek("again")) == (0, 1, None) and sorted(copies) == [0, 1]
    orphan = copies[1]
    engine.abort(second)
    step(engine, outputs)
    assert (pool.peek("partial"), pool.peek("again")) == (None, 1) and copies[1] is not orphan
    assert engine.scheduler.find(third) in engine.scheduler.waiting
    copies[1].done = True
    run(engine, outputs)
    assert engine.runner.lora.stats.slot_evictions == 1 and outputs[second][-1].finish_reason == "abort"
    for rid, expected in zip((first, third), alone(make_engine, adapters, ["full", "partial", "again"])[::2]):
        assert same(outputs[rid], expected), rid
    assert_released(engine)


@pytest.mark.parametrize("finished", [False, True], ids=["copying", "done-after-prefetch"])
def test_the_copy_of_an_aborted_request_holds_no_slot_back(make, make_engine, adapters, copies, finished, monkeypatch):
    """One slot, its adapter's copies running for a request aborted since (or done just after the next prefetch),
    nothing else to run: a request of another adapter takes the slot, the host waits for its copies, and it runs."""
    engine = make(copy_stream=True, max_loras_per_batch=1)
    lora = engine.runner.lora
    outputs: dict[str, list] = {}
    base = engine.add_request(prompt(0), GREEDY, lora=None)
    step(engine, outputs)
    aborted = engine.add_request(prompt(1), GREEDY, lora="full")
    step(engine, outputs)
    assert lora.pool.peek("full") == 0 and not copies[0].done
    engine.abort(aborted)
    run(engine, outputs)  # the base request ends; the copy still runs
    assert not copies[0].done
    if finished:
        def prefetch(*args):
            failed = real_prefetch(*args)
            copies[0].done = True
            return failed
        real_prefetch = lora.prefetch
        monkeypatch.setattr(lora, "prefetch", prefetch)
    later = engine.add_request(prompt(2), GREEDY, lora="partial")
    run(engine, outputs)
    assert lora.pool.peek("partial") == 0
    for rid, expected in zip((base, later), alone(make_engine, adapters, [None, "full", "partial"])[::2]):
        assert same(outputs[rid], expected), rid
    assert_released(engine)


@pytest.mark.parametrize("fault", ["write", "read"])
def test_a_failed_write_or_read_fails_only_the_requests_of_its_adapter(make, make_engine, adapters, monkeypatch,
                                                                         fault):
    """Putting one adapter into its slot (overlap loading: "partial"), or reading one back from disk (host memory for
    two adapters of three: "full"), raises: every waiting request naming it ends with the error, the others finish
    with their tokens, it holds no slot, and once the fault is gone it serves again (the read: nothing else to run,
    the host waits for it)."""
    engine = make() if fault == "write" else make(enable_lora_overlap_loading=False, max_cpu_loras=2)
    lora, faults = engine.runner.lora, [Injected("no copy" if fault == "write" else "unreadable")]
    faulty = "partial" if fault == "write" else "full"
    real_write, real_read, faulty_path = lora_manager.write_share_to_slot, lora.read, str(adapters(FAMILY)[faulty].path)

    def write(model, share, slot):
        if str(share.path) == faulty_path and faults:
            raise faults.pop()
        real_write(model, share, slot)

    def read(path):
        if faults:
            raise faults.pop()
        return real_read(path)
    monkeypatch.setattr(lora_manager, "write_share_to_slot", write) if fault == "write" else \
        monkeypatch.setattr(lora, "read", read)
    loras = ["full" if faulty == "partial" else "partial", faulty, None, faulty]
    rids = [engine.add_request(prompt(i), GREEDY, lora=a) for i, a in enumerate(loras)]
    outputs = run(engine)
    what = "putting its adapter into a GPU slot failed: Injected: no copy" if fault == "write" else \
        "reading its adapter from disk failed: Injected: unreadable"
    for i in (1, 3):
        assert outputs[rids[i]][-1].finish_reason == "error" and what in outputs[rids[i]][-1].error
    expected = alone(make_engine, adapters, loras)
    for i in (0, 2):
        assert same(outputs[rids[i]], expected[i]), i
    assert lora.pool.peek(faulty) is None and not faults
    assert_released(engine)
    out, = engine.generate([prompt(1)], GREEDY, lora=[faulty])
    assert out.token_ids == expected[1].token_ids


def test_an_interrupt_inside_a_write_leaves_no_half_written_adapter(make, make_engine, adapters, monkeypatch):
    """Ctrl-C inside prefetch's write: it escapes the step, the adapter holds no slot, and the waiting request
    (which no step had touched) starts later and gets its tokens."""
    engine = make()
    real_write = lora_manager.write_share_to_slot
    interrupts = [KeyboardInterrupt()]

    def write(model, share, slot):
        if interrupts:
            raise interrupts.pop()
        real_write(model, share, slot)
    monkeypatch.setattr(lora_manager, "write_share_to_slot", write)
    rid = engine.add_request(prompt(1), GREEDY, lora="partial")
    with pytest.raises(KeyboardInterrupt):
        engine.step()
    assert engine.runner.lora.pool.peek("partial") is None
    assert same(run(engine)[rid], alone(make_engine, adapters, ["full", "partial"])[1])
    assert_released(engine)


@pytest.mark.parametrize("slots", [1, 2])
@pytest.mark.parametrize("options", [dict(disable_overlap_schedule=True, scheduling_policy="priority"),
                                     dict(max_total_tokens=28, max_running_requests=4),
                                     dict(max_cpu_loras=2, max_running_requests=4),
                                     dict(max_cpu_loras=2, enable_lora_overlap_loading=False)],
                         ids=["sync-priority", "small", "host-2", "host-2-no-overlap"])
def test_random_traffic_keeps_every_invariant(make, make_engine, adapters, copies, reads, slots, options):
    """Random requests of 3 adapters and the base model, aborts, copies and reads from disk finishing at random, an
    adapter unloaded and loaded again, steps (a small KV cache: retractions): after every call the books add up and no
    running request's adapter is out of its slot; in the end everything is released and each request that ran to its
    length got the tokens it gets alone."""
    seed = int(torch.randint(0, 2**31, ()).item())
    rng = random.Random(seed)
    engine = make(copy_stream=True, max_loras_per_batch=slots, **options)
    reference = make_engine(FAMILY, lora_paths=three_adapters(adapters))
    pool, requests, outputs, loaded = engine.runner.lora.pool, {}, {}, True
    for _ in range(rng.randint(20, 60)):
        op = rng.random()
        if op < 0.3:
            tokens = [rng.randint(3, 30) for _ in range(rng.randint(2, 10))]
            params = SamplingParams(max_tokens=rng.randint(1, 8), temperature=0.0, ignore_eos=True)
            lora = rng.choice(["full", "partial", None] + ["again"] * loaded)
            requests[engine.add_request(tokens, params, lora=lora, priority=rng.randint(0, 2)
                                        if options.get("scheduling_policy") == "priority" else 0)] = tokens, params, lora
        elif op < 0.4 and requests:
            engine.abort(rng.choice(list(requests)))
        elif op < 0.45 and copies:
            rng.choice(list(copies.values())).done = True
        elif op < 0.5 and reads:
            rng.choice(list(reads.values())).finish()
        elif op < 0.55:
            if loaded and not any(r.lora == "again" for r in engine.scheduler.unfinished()):
                engine.unload_lora("again")
            elif not loaded:
                engine.load_lora("again", str(adapters(FAMILY)["full"].path))
            loaded = "again" in engine.runner.lora.names
        else:
            step(engine, outputs)
        assert engine.scheduler.accounting_error() is None, seed
        assert all(r.lora is None or pool.peek(r.lora) is not None for r in engine.scheduler.running), seed
    run(engine, outputs)
    assert_released(engine)
    for rid, (tokens, params, lora) in requests.items():
        assert outputs[rid][-1].finish_reason in ("length", "abort"), (seed, outputs[rid][-1].error)
        if outputs[rid][-1].finish_reason == "length":
            got = [t for out in outputs[rid] for t in out.token_ids]
            assert got == reference.generate([tokens], params, lora=[lora])[0].token_ids, seed


def gated_reads(engine, monkeypatch) -> tuple[threading.Event, threading.Event]:
    """The engine's reads from disk in the reader thread wait until the test sets `go`; `started`: one began."""
    lora, started, go = engine.runner.lora, threading.Event(), threading.Event()
    real_read = lora.read

    def read(path):
        if threading.current_thread() is not threading.main_thread():
            started.set()
            assert go.wait(60), "the test never let the read go"
        return real_read(path)
    monkeypatch.setattr(lora, "read", read)
    return started, go


def aborted_while_read(engine, monkeypatch, outputs: dict[str, list]) -> tuple[str, str, threading.Event]:
    """A base request of 12 tokens running, and a request of "full" (out of host memory) aborted while the reader
    thread reads its adapter, the read held until the test sets the event returned with the two requests' rids."""
    started, go = gated_reads(engine, monkeypatch)
    base = engine.add_request(prompt(0), SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    aborted = engine.add_request(prompt(1), GREEDY, lora="full")
    step(engine, outputs)
    assert started.wait(60)
    engine.abort(aborted)
    return base, aborted, go


@pytest.mark.parametrize("overlap", [False, True], ids=["slot-write-in-step", "overlap-loading"])
def test_an_adapter_read_back_from_disk_keeps_no_one_waiting_but_its_requests(make_engine, adapters, monkeypatch,
                                                                               overlap):
    """Host memory for two adapters of three (max_cpu_loras): a request whose adapter left it waits while the reader
    thread reads its files (held until the test lets it go), the running request decoding and a base request that
    came after it starting meanwhile; then it runs, and each request gets the tokens it gets alone."""
    engine = make_engine(FAMILY, max_cpu_loras=2, enable_lora_overlap_loading=overlap,
                         lora_paths=three_adapters(adapters))
    lora = engine.runner.lora
    assert list(lora._host) == ["partial", "again"]
    started, go = gated_reads(engine, monkeypatch)
    outputs: dict[str, list] = {}
    first = engine.add_request(prompt(0), GREEDY, lora="partial")
    step(engine, outputs)
    waiting, later = wait_beside(engine, outputs, first, "full")
    assert started.is_set()
    go.set()
    run(engine, outputs)
    for rid, expected in zip((first, waiting, later), alone(make_engine, adapters, ["partial", "full", None])):
        assert same(outputs[rid], expected), rid
    assert lora.stats.disk_loads == 4 and list(lora._host) == ["partial", "full"]  # 3 at start, "full" back
    assert_released(engine)


def test_a_read_for_an_adapter_unloaded_since_is_never_used(make_engine, adapters, monkeypatch):
    """A request aborted while its adapter's files are read, the adapter unloaded and another loaded under its name:
    the old read, finished later, is not taken for the new adapter, even once the new one leaves host memory."""
    paths = three_adapters(adapters)
    engine = make_engine(FAMILY, max_cpu_loras=2, lora_paths=paths)
    outputs: dict[str, list] = {}
    base, aborted, go = aborted_while_read(engine, monkeypatch, outputs)
    step(engine, outputs)
    engine.unload_lora("full")
    engine.load_lora("full", paths["partial"])  # (read on this thread)
    go.set()
    step(engine, outputs)
    engine.generate([prompt(0), prompt(2)], GREEDY, lora=["partial", "again"])  # "full" out of host memory again
    run(engine, outputs)
    assert outputs[base][-1].finish_reason == "length" and outputs[aborted][-1].finish_reason == "abort"
    assert "full" not in engine.runner.lora._host
    out, = engine.generate([prompt(1)], GREEDY, lora=["full"])
    assert out.token_ids == alone(make_engine, adapters, ["full", "partial"])[1].token_ids
    assert_released(engine)


def test_prefetch_looks_at_the_queues_first_max_running_requests_requests(make, make_engine, adapters):
    """A long queue is not scanned whole every step: with max_running_requests 2, the adapter of the third waiting
    request goes into a slot only once it is among the first two (it runs then, with its tokens)."""
    engine = make(max_running_requests=2)
    outputs: dict[str, list] = {}
    long = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    rids = [engine.add_request(prompt(i), long) for i in range(4)]
    step(engine, outputs)  # two run, two wait
    late = engine.add_request(prompt(5), GREEDY, lora="partial")
    step(engine, outputs)
    assert engine.runner.lora.pool.peek("partial") is None and len(engine.scheduler.waiting) == 3
    run(engine, outputs)
    assert all(outputs[r][-1].finish_reason == "length" for r in rids)
    reference = make_engine(FAMILY, lora_paths=three_adapters(adapters))
    assert same(outputs[late], reference.generate([prompt(5)], GREEDY, lora=["partial"])[0])


def test_a_step_waits_a_while_for_a_read_and_takes_the_requests_that_come_meanwhile(make_engine, adapters,
                                                                                     monkeypatch):
    """Nothing to run but a request whose adapter is being read (held by the test): a step waits a while and ends
    without outputs instead of blocking on the read, so a base request added meanwhile starts at the next step."""
    engine = make_engine(FAMILY, max_cpu_loras=2, lora_paths=three_adapters(adapters))
    started, go = gated_reads(engine, monkeypatch)
    outputs: dict[str, list] = {}
    waiting = engine.add_request(prompt(1), GREEDY, lora="full")
    step(engine, outputs)
    assert started.is_set() and not outputs
    base = engine.add_request(prompt(2), GREEDY)
    step(engine, outputs)
    step(engine, outputs)
    assert outputs[base] and engine.scheduler.find(waiting) in engine.scheduler.waiting
    go.set()
    run(engine, outputs)
    for rid, expected in zip((waiting, base), alone(make_engine, adapters, ["partial", "full", None])[1:]):
        assert same(outputs[rid], expected), rid
    assert_released(engine)


@pytest.mark.parametrize("max_running_requests", [256, 1])
def test_a_failed_read_brings_the_next_adapter_of_the_queue_in(make_engine, adapters, monkeypatch,
                                                               max_running_requests):
    """One slot, host memory for one adapter, requests of two adapters out of it waiting and nothing running: the
    first one's read fails (its request ends with the error), and the second adapter, now first in the queue (also
    where prefetch looks at one request only), is read and its request served (the step asserted that nothing could
    run)."""
    engine = make_engine(FAMILY, max_loras_per_batch=1, max_cpu_loras=1, max_running_requests=max_running_requests,
                         lora_paths=three_adapters(adapters))
    lora, faults = engine.runner.lora, [OSError("disk error")]
    assert list(lora._host) == ["again"]
    real_read = lora.read

    def read(path):
        if faults:
            raise faults.pop()
        return real_read(path)
    monkeypatch.setattr(lora, "read", read)
    failing = engine.add_request(prompt(1), GREEDY, lora="full")
    served = engine.add_request(prompt(2), GREEDY, lora="partial")
    outputs = run(engine)
    assert outputs[failing][-1].finish_reason == "error" and "OSError: disk error" in outputs[failing][-1].error
    assert same(outputs[served], alone(make_engine, adapters, ["full", "full", "partial"])[2])
    assert_released(engine)


def test_a_read_finished_for_an_aborted_request_evicts_no_adapter_a_waiting_request_needs(make_engine, adapters,
                                                                                         monkeypatch):
    """Host memory for one adapter: the read of an aborted request's adapter finishes just after the next request's
    adapter was read; it is dropped rather than taken in over that one (which the request then could not find: it
    was read again, and the step asserted that nothing could run)."""
    engine = make_engine(FAMILY, max_loras_per_batch=1, max_cpu_loras=1, lora_paths=three_adapters(adapters))
    lora = engine.runner.lora
    outputs: dict[str, list] = {}
    base, _, go = aborted_while_read(engine, monkeypatch, outputs)
    run(engine, outputs)
    real_prefetch = lora.prefetch

    def prefetch(*args):  # the held read finishes just after the next step's first prefetch
        failed = real_prefetch(*args)
        if not go.is_set():
            go.set()
            lora._reading["full"].result()
        return failed
    monkeypatch.setattr(lora, "prefetch", prefetch)
    late = engine.add_request(prompt(2), GREEDY, lora="partial")
    run(engine, outputs)
    assert same(outputs[late], alone(make_engine, adapters, ["full", "full", "partial"])[2])
    assert outputs[base][-1].finish_reason == "length" and list(lora._host) == ["partial"]
    assert lora.stats.disk_loads == 4  # 3 at start, "partial" read once
    assert_released(engine)


def test_the_reads_of_aborted_requests_not_started_yet_are_called_off(make_engine, adapters, monkeypatch):
    """Host memory for one adapter, a base request running: a request's adapter is being read (held by the test) and
    the next one's read waits behind it in the reader thread; both requests are aborted. The waiting read is called
    off (the next request of that adapter would queue behind it); the held one, finished later, is dropped, host
    memory being full; a new request of the second adapter is read once and served."""
    engine = make_engine(FAMILY, max_loras_per_batch=1, max_cpu_loras=1, lora_paths=three_adapters(adapters))
    lora = engine.runner.lora
    outputs: dict[str, list] = {}
    base, _, go = aborted_while_read(engine, monkeypatch, outputs)
    behind = engine.add_request(prompt(2), GREEDY, lora="partial")
    step(engine, outputs)
    assert set(lora._reading) == {"full", "partial"}
    engine.abort(behind)
    step(engine, outputs)
    assert set(lora._reading) == {"full"}  # still running: it cannot be called off
    late = engine.add_request(prompt(2), GREEDY, lora="partial")
    go.set()
    run(engine, outputs)
    assert same(outputs[late], alone(make_engine, adapters, ["full", "full", "partial"])[2])
    assert outputs[base][-1].finish_reason == "length" and list(lora._host) == ["partial"]
    assert lora.stats.disk_loads == 4 and not lora._reading  # 3 at start, "partial" read once
    assert_released(engine)
