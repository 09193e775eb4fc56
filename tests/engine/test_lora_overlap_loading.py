"""EngineConfig.enable_lora_overlap_loading: the waiting requests' adapters go into GPU slots before their requests
start (LoRAManager.prefetch), on GPUs on a copy stream beside the steps; a request starts once its adapter's copies
are done, the running requests' steps going on meanwhile and the requests behind it free to start first. On this CPU
the copies are synchronous: a copy still running is stood in for by an event the test completes (`copies`)."""
import random

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


@pytest.fixture
def make(make_engine, adapters):
    """An engine with 2 GPU slots and 3 adapters ("again": "full" under another name); `copy_stream`: with a copy
    stream, whose writes go to `copies`."""
    def make(copy_stream: bool = False, **kwargs):
        paths = {n: str(a.path) for n, a in adapters(FAMILY).items()}
        engine = make_engine(FAMILY, enable_lora_overlap_loading=True, lora_paths={**paths, "again": paths["full"]},
                             **kwargs)
        if copy_stream:
            engine.runner.lora._copy_stream = "the copy stream"
        return engine
    return make


def prompt(i: int) -> list[int]:
    return [(7 * i + 3 * j) % 90 + 3 for j in range(5 + i)]


def alone(make_engine, adapters, loras: list[str | None]) -> list:
    """Each request's outputs from an engine without overlap loading, one request at a time."""
    engine = make_engine(FAMILY, lora_paths={**{n: str(a.path) for n, a in adapters(FAMILY).items()},
                                             "again": str(adapters(FAMILY)["full"].path)})
    return [engine.generate([prompt(i)], GREEDY, lora=[a])[0] for i, a in enumerate(loras)]


def step(engine, outputs: dict[str, list]) -> None:
    """One step, its outputs added to each request's."""
    for out in engine.step():
        outputs.setdefault(out.rid, []).append(out)


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
    step(engine, outputs)
    waiting = engine.add_request(prompt(1), GREEDY, lora="partial")
    later = engine.add_request(prompt(2), GREEDY, lora=None)
    made = len(outputs[first])
    for _ in range(3):
        step(engine, outputs)
        req = engine.scheduler.find(waiting)
        assert req in engine.scheduler.waiting and req.row is None and not copies[1].waits
    assert len(outputs[first]) > made and outputs[later], "the others did not go on"
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


def test_a_failed_write_fails_only_the_requests_of_its_adapter(make, make_engine, adapters, monkeypatch):
    """Putting one adapter into its slot raises: every waiting request naming it ends with the error, the others
    finish with their tokens, the adapter holds no slot, and once the fault is gone it serves again."""
    engine = make()
    partial = str(adapters(FAMILY)["partial"].path)
    real_write = lora_manager.write_share_to_slot

    def write(model, share, slot):
        if str(share.path) == partial:
            raise Injected("no copy")
        real_write(model, share, slot)
    monkeypatch.setattr(lora_manager, "write_share_to_slot", write)
    loras = ["full", "partial", None, "partial"]
    rids = [engine.add_request(prompt(i), GREEDY, lora=a) for i, a in enumerate(loras)]
    outputs = run(engine)
    for i in (1, 3):
        assert outputs[rids[i]][-1].finish_reason == "error"
        assert "putting its adapter into a GPU slot failed: Injected: no copy" in outputs[rids[i]][-1].error
    for i, expected in ((0, "full"), (2, None)):
        assert same(outputs[rids[i]], alone(make_engine, adapters, [expected] * (i + 1))[i]), i
    assert engine.runner.lora.pool.peek("partial") is None
    assert_released(engine)
    monkeypatch.setattr(lora_manager, "write_share_to_slot", real_write)
    out, = engine.generate([prompt(1)], GREEDY, lora=["partial"])
    assert out.token_ids == alone(make_engine, adapters, ["full", "partial"])[1].token_ids


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
                                     dict(max_total_tokens=28, max_running_requests=4)], ids=["sync-priority", "small"])
def test_random_traffic_keeps_every_invariant(make, make_engine, adapters, copies, slots, options):
    """Random requests of 3 adapters and the base model, aborts, copies finishing at random, an adapter unloaded and
    loaded again, steps (a small KV cache: retractions): after every call the books add up and no running request's
    adapter is out of its slot; in the end everything is released and each request that ran to its length got the
    tokens it gets alone."""
    seed = int(torch.randint(0, 2**31, ()).item())
    rng = random.Random(seed)
    engine = make(copy_stream=True, max_loras_per_batch=slots, **options)
    reference = make_engine(FAMILY, lora_paths={**{n: str(a.path) for n, a in adapters(FAMILY).items()},
                                                "again": str(adapters(FAMILY)["full"].path)})
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
        elif op < 0.5 and copies:
            rng.choice(list(copies.values())).done = True
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
