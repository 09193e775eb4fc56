"""EngineConfig.enable_lora_overlap_loading: the waiting requests' adapters go into GPU slots before their requests
start (LoRAManager.prefetch), on GPUs on a copy stream beside the steps; a request starts once its adapter's copies
are done, the running requests' steps going on meanwhile and the requests behind it free to start first. On this CPU
the copies are synchronous: a copy still running is stood in for by an event the test completes (`copies`)."""
import pytest

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


def test_a_slot_being_copied_or_in_use_is_not_taken(make, make_engine, adapters, copies):
    """Both slots taken, one by the running request's adapter and one by an adapter still being copied: a third
    adapter's request waits and nothing is written over either, also once the request that wanted the adapter being
    copied is aborted; when the copy is done its slot takes the third adapter."""
    engine = make(copy_stream=True)
    outputs: dict[str, list] = {}
    first = engine.add_request(prompt(0), GREEDY, lora="full")
    step(engine, outputs)
    second = engine.add_request(prompt(1), GREEDY, lora="partial")
    third = engine.add_request(prompt(2), GREEDY, lora="again")
    pool = engine.runner.lora.pool
    for abort in (False, True):
        if abort:
            engine.abort(second)
        for _ in range(2):
            step(engine, outputs)
        assert (pool.peek("full"), pool.peek("partial"), pool.peek("again")) == (0, 1, None)
        assert sorted(copies) == [0, 1]
    copies[1].done = True
    run(engine, outputs)
    assert pool.peek("again") == 1 and engine.runner.lora.stats.slot_evictions == 1
    assert outputs[second][-1].finish_reason == "abort"
    for rid, expected in zip((first, third), alone(make_engine, adapters, ["full", "partial", "again"])[::2]):
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
