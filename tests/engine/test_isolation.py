"""A failure inside a step stays with its request: a fault injected at every stage of a step
(allocating its cache, preparing LoRA slots, the forward pass, sampling, detokenizing), at prefill
and at decode, for one request of a mixed batch fails that request alone. The others finish with
the tokens they get alone, and every request row, KV slot and adapter reference is back."""
from dataclasses import replace

import pytest
import torch

from moelora.engine import model_runner
from moelora.engine import lora_manager
from moelora.engine.engine import EngineDead, RequestFailed
from moelora.engine.sampling_params import SamplingParams, StructuredOutput
from tests.support import assert_released

FAMILY = "qwen3_moe"
PROMPTS = [[(5 * i + 2 * j) % 90 + 3 for j in range(4 + i)] for i in range(6)]
LORAS = [None, "full", "partial", None, "full", None]  # the victim alone uses "partial"
VICTIM = 2
PARAMS = [SamplingParams(max_tokens=6, temperature=0.0 if i % 2 else 0.9, seed=100 + i, ignore_eos=True)
          for i in range(6)]
STAGES = ["scheduling", "lora", "forward", "sampling", "detokenization"]


class Injected(RuntimeError):
    pass


@pytest.fixture(scope="module")
def solo(make_engine) -> list[list[int]]:
    engine = make_engine(FAMILY)
    return [engine.generate([p], sp, lora=[a])[0].token_ids for p, sp, a in zip(PROMPTS, PARAMS, LORAS)]


def drain(engine) -> dict[str, list]:
    """rid -> its outputs, stepping until nothing is left."""
    outputs: dict[str, list] = {}
    while engine.has_unfinished():
        for out in engine.step():
            assert not outputs.get(out.rid) or not outputs[out.rid][-1].finished, "output after the end"
            outputs.setdefault(out.rid, []).append(out)
    return outputs


def assert_serves_on(engine, solo: list[list[int]]) -> None:
    """Everything released; the engine serves the whole batch again, each request its tokens alone, and no adapter
    reference is left behind (the adapter leaves at once)."""
    assert_released(engine)
    assert [o.token_ids for o in engine.generate(PROMPTS, PARAMS, lora=LORAS)] == solo
    engine.unload_lora("partial")
    assert "partial" not in engine.runner.lora.names
    assert_released(engine)


def inject(engine, victim, stage: str, when: str, monkeypatch) -> None:
    """Make `stage` raise whenever it works on the victim at `when` (its prefill, or a decode step)."""
    def due() -> bool:
        before = len(victim.output_ids) - (stage == "detokenization")  # its token is appended before it is decoded
        return before == 0 if when == "prefill" else before >= 2

    def failing(fn, applies):
        def wrapper(*args, **kwargs):
            if due() and applies(*args, **kwargs):
                raise Injected(f"{stage} fault")
            return fn(*args, **kwargs)
        return wrapper

    if stage == "scheduling":
        monkeypatch.setattr(engine.scheduler, "_take", failing(engine.scheduler._take, lambda req, n: req is victim))
    elif stage == "lora":
        lora = engine.runner.lora
        monkeypatch.setattr(lora, "prepare", failing(lora.prepare, lambda adapters, in_use: victim.lora in adapters))
    elif stage == "forward":
        monkeypatch.setattr(engine.runner, "logits", failing(
            engine.runner.logits, lambda batch: victim.row in batch.req_pool_indices.tolist()))
    elif stage == "sampling":
        monkeypatch.setattr(model_runner, "sample", failing(
            model_runner.sample, lambda logits, batch, k: victim.seed in batch.seed.tolist()))
    else:
        monkeypatch.setattr(victim.detokenizer, "add", failing(victim.detokenizer.add, lambda token: True))


@pytest.mark.parametrize("mode", ["sync", "overlap", "cached"])
@pytest.mark.parametrize("when", ["prefill", "decode"])
@pytest.mark.parametrize("stage", STAGES)
def test_a_fault_fails_only_its_request(make_engine, solo, stage, when, mode, monkeypatch):
    """mode cached: prefix caching, every request starting on its cached prompt (held while it runs)."""
    engine = make_engine(FAMILY, disable_overlap_schedule=mode == "sync", enable_prefix_caching=mode == "cached")
    if mode == "cached":
        assert [o.token_ids for o in engine.generate(PROMPTS, PARAMS, lora=LORAS)] == solo
    rids = [engine.add_request(p, sp, lora=a) for p, sp, a in zip(PROMPTS, PARAMS, LORAS)]
    victim = engine.scheduler.find(rids[VICTIM])
    inject(engine, victim, stage, when, monkeypatch)
    outputs = drain(engine)
    assert mode != "cached" or engine.scheduler.cache.hit_tokens == sum(len(p) - 1 for p in PROMPTS)
    for i, rid in enumerate(rids):
        last = outputs[rid][-1]
        if i == VICTIM:
            assert last.finished and last.finish_reason == "error" and f"{stage} fault" in last.error
            assert last.cached_tokens == (len(PROMPTS[i]) - 1 if mode == "cached" else 0)
            assert len(victim.output_ids) < len(solo[i])
        else:
            assert last.finish_reason == "length" and last.error is None
            assert [t for o in outputs[rid] for t in o.token_ids] == solo[i], f"request {i}"
    assert_released(engine)
    monkeypatch.undo()  # the engine serves the whole batch again, the victim included
    assert [o.token_ids for o in engine.generate(PROMPTS, PARAMS, lora=LORAS)] == solo
    assert_released(engine)


def test_a_value_that_slipped_past_validation_fails_only_its_request(make_engine, solo):
    """What crashed the server's steps: a top_k beyond int64 fails building the sampling tensors."""
    engine = make_engine(FAMILY)
    rids = [engine.add_request(p, sp, lora=a) for p, sp, a in zip(PROMPTS, PARAMS, LORAS)]
    victim = engine.scheduler.find(rids[VICTIM])
    victim.params.top_k = 2**70
    outputs = drain(engine)
    assert "Overflow" in outputs[rids[VICTIM]][-1].error
    assert [[t for o in outputs[r] for t in o.token_ids] for i, r in enumerate(rids) if i != VICTIM] == \
        [s for i, s in enumerate(solo) if i != VICTIM]
    assert_released(engine)


def test_a_failed_slot_write_leaves_no_adapter_in_the_slot(make_engine, solo, monkeypatch):
    engine = make_engine(FAMILY)
    lora = engine.runner.lora
    real = lora_manager.write_share_to_slot

    def write(model, adapter, slot):
        if lora.pool.names and adapter is lora._host.get("partial"):
            real(model, adapter, slot)  # half written, then the copy fails
            raise Injected("slot write fault")
        real(model, adapter, slot)
    monkeypatch.setattr(lora_manager, "write_share_to_slot", write)
    with pytest.raises(RequestFailed, match=r"prompt 2: Injected: slot write fault"):
        engine.generate(PROMPTS, PARAMS, lora=LORAS)
    assert "partial" not in lora.pool.names
    assert_released(engine)
    monkeypatch.undo()
    assert [o.token_ids for o in engine.generate(PROMPTS, PARAMS, lora=LORAS)] == solo


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
@pytest.mark.parametrize("after", [0, 1], ids=["at-once", "while-isolating"])
def test_a_device_error_fails_everything_and_the_engine_says_so(make_engine, monkeypatch, after, overlap):
    """`after`: plain failures before the device error, which then strikes a half of the batch."""
    engine = make_engine(FAMILY, disable_overlap_schedule=not overlap)
    rids = [engine.add_request(p, sp, lora=a) for p, sp, a in zip(PROMPTS, PARAMS, LORAS)]
    calls = []

    def broken(batch):
        calls.append(1)
        if len(calls) <= after:
            raise Injected("not the device")
        raise torch.AcceleratorError("CUDA error: an illegal memory access was encountered")
    monkeypatch.setattr(engine.runner, "logits", broken)
    outputs = drain(engine)
    assert len(calls) == after + 1, "a device error is not retried request by request"
    assert all(len(outputs[r]) == 1 for r in rids), "each request ends once"
    assert all(outputs[r][-1].finish_reason == "error" and "illegal memory access" in outputs[r][-1].error for r in rids)
    assert engine.fatal is not None and "device error" in engine.fatal
    assert_released(engine)
    with pytest.raises(EngineDead, match="cannot run any more"):
        engine.add_request(PROMPTS[0])


def test_a_failed_launch_after_a_step_that_ended_all_its_requests(make_engine, solo, monkeypatch):
    """Overlap scheduling: the step launched after a request's stop token raises (say a transient out-of-memory),
    and reading the step before ends every request of it. Nothing is left to run again: the request ends with
    its stop token, and the engine goes on (the empty rerun raised out of Engine.step, losing that output)."""
    engine = make_engine(FAMILY)
    tokens = solo[1]
    stop = tokens.index(tokens[2])  # its first occurrence ends the request
    rid = engine.add_request(PROMPTS[1], replace(PARAMS[1], stop_token_ids=[tokens[2]]), lora=LORAS[1])
    req = engine.scheduler.find(rid)
    logits = engine.runner.logits

    def out_of_memory_after_the_stop(batch):
        if req.num_pending and len(req.output_ids) == stop:  # its pending token is the stop token
            raise Injected("out of memory")
        return logits(batch)
    monkeypatch.setattr(engine.runner, "logits", out_of_memory_after_the_stop)
    outputs = drain(engine)
    assert [t for o in outputs[rid] for t in o.token_ids] == tokens[:stop + 1]
    assert outputs[rid][-1].finish_reason == "stop"
    assert_released(engine)


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_a_step_whose_tokens_cannot_be_read_fails_its_requests_and_is_not_run_again(make_engine, solo, monkeypatch,
                                                                                     overlap):
    """Reading a step's sampled tokens raises once its device work is done: the requests of that step fail (their
    prompts started decoding, their pending tokens were counted: running the step again repeated that and put
    them in the running batch twice); the requests running beside them go on."""
    engine = make_engine(FAMILY, disable_overlap_schedule=not overlap)
    rids = [engine.add_request(p, sp, lora=a) for p, sp, a in zip(PROMPTS[:2], PARAMS, LORAS)]
    outputs = engine.step() + engine.step()  # both prefilled and decoding
    victims = [engine.add_request(p, sp, lora=a) for p, sp, a in zip(PROMPTS[2:4], PARAMS[2:4], LORAS[2:4])]
    first = engine.scheduler.find(victims[0])
    append_tokens = engine.stepper._append_tokens

    def unreadable(reqs, tokens, outputs):
        if first in reqs and not first.finished:  # the step of the new prompts, which run in a step of their own
            raise Injected("reading the tokens failed")
        return append_tokens(reqs, tokens, outputs)
    monkeypatch.setattr(engine.stepper, "_append_tokens", unreadable)
    drained = drain(engine)
    for rid in victims:
        assert [(o.finish_reason, o.error) for o in drained[rid]] == [("error", "Injected: reading the tokens failed")]
    for i, rid in enumerate(rids):
        mine = [o for o in outputs if o.rid == rid] + drained[rid]
        assert [t for o in mine for t in o.token_ids] == solo[i] and mine[-1].finish_reason == "length"
    assert_released(engine)


def test_a_device_error_reading_a_step_fails_the_prompts_of_a_launch_that_failed(make_engine, monkeypatch):
    """Overlap scheduling: a step of new prompts fails to launch, and reading the step before it then meets a device
    error. The new prompts, which are in no queue of the scheduler until their step has run, fail with every other
    request (they were left holding their rows, KV slots and adapter references, never to end)."""
    engine = make_engine(FAMILY)
    running = engine.add_request(PROMPTS[0], PARAMS[0], lora=LORAS[0])
    assert engine.step() == []  # its prompt launched
    new = [engine.add_request(p, sp, lora=a) for p, sp, a in zip(PROMPTS[1:3], PARAMS[1:3], LORAS[1:3])]
    rows = [engine.scheduler.find(rid) for rid in new]
    logits = engine.runner.logits

    def failing_launch(batch):
        if rows[0].row in batch.req_pool_indices.tolist():
            raise Injected("launch fault")
        return logits(batch)

    def device_error(reqs, tokens, outputs):
        raise torch.AcceleratorError("CUDA error: an illegal memory access was encountered")
    monkeypatch.setattr(engine.runner, "logits", failing_launch)
    monkeypatch.setattr(engine.stepper, "_append_tokens", device_error)
    outputs = drain(engine)
    for rid in [running, *new]:
        assert [o.finish_reason for o in outputs[rid]] == ["error"] and "illegal memory" in outputs[rid][0].error
    assert engine.fatal is not None
    assert_released(engine)


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
@pytest.mark.parametrize("where", ["forward", "detokenization"])
@pytest.mark.parametrize("when", ["prefill", "decode"])
def test_an_interrupt_in_a_step_ends_its_requests_and_leaves_the_engine_serving(make_engine, solo, monkeypatch, where,
                                                                               when, overlap):
    """Ctrl-C in generate (a notebook's interrupt) escapes the step. Its requests end with an error and release what
    they hold, a prompt scheduled but not yet launched included (in no queue until then). The engine serves the next
    call as before: it once leaked those and then failed every step ("the scheduler found nothing to run")."""
    engine = make_engine(FAMILY, disable_overlap_schedule=not overlap)

    def interrupt(fn, applies):
        def wrapper(*args, **kwargs):
            if applies(*args, **kwargs):
                raise KeyboardInterrupt
            return fn(*args, **kwargs)
        return wrapper
    calls = {"n": 0}

    def due(*_) -> bool:
        calls["n"] += 1
        return calls["n"] == (1 if when == "prefill" else 3)
    if where == "forward":
        monkeypatch.setattr(engine.runner, "logits", interrupt(engine.runner.logits, due))
    else:
        from moelora.engine.detokenizer import IncrementalDetokenizer
        monkeypatch.setattr(IncrementalDetokenizer, "add", interrupt(IncrementalDetokenizer.add, due))
    with pytest.raises(KeyboardInterrupt):
        engine.generate(PROMPTS, PARAMS, lora=LORAS)
    monkeypatch.undo()
    while engine.has_unfinished():  # a step left in flight (overlap) reads as usual
        engine.step()
    assert_serves_on(engine, solo)


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
@pytest.mark.parametrize("where", ["allocation", "retraction", "priority retraction", "admission"])
def test_an_interrupt_while_scheduling_ends_the_requests_it_took(make_engine, solo, monkeypatch, where, overlap):
    """Ctrl-C while the scheduler allocates a step's second prompt (the first already out of the waiting queue with
    its row and KV slots, in no queue yet), while it retracts a request (out of the running ones, not yet
    queued again; under scheduling_policy "priority" the one of the highest priority value, not the newest), or
    while it admits a second prompt on its cached prefix (prefix caching: the first holds its cached prefix, still
    in the waiting queue): the requests it took end with an error and release what they hold; the engine serves
    on."""
    priority = where == "priority retraction"
    engine = make_engine(FAMILY, disable_overlap_schedule=not overlap,
                         **({"max_total_tokens": 40} if where.endswith("retraction") else {}),
                         scheduling_policy="priority" if priority else "fcfs", enable_prefix_caching=where == "admission")
    if where == "admission":
        engine.generate(PROMPTS, PARAMS, lora=LORAS)  # every prompt cached
    scheduler, calls, running = engine.scheduler, [], []
    name = {"allocation": "_take", "admission": "_admit"}.get(where, "_retract")
    real = getattr(scheduler, name)

    def interrupted(*args):
        calls.append(args[0].rid)
        running.append([r.rid for r in scheduler.running] + [args[0].rid])  # (the victim: out of them already)
        if len(calls) == 2 or name == "_retract":
            raise KeyboardInterrupt
        return real(*args)
    monkeypatch.setattr(scheduler, name, interrupted)
    # under priority the first three (value 3) run before the last three (value 0) come: the newest running
    # requests are not the ones to retract
    priorities = [3, 3, 3, 0, 0, 0] if priority else [0] * len(PROMPTS)
    rids = []
    for i, (p, sp, a, pr) in enumerate(zip(PROMPTS, PARAMS, LORAS, priorities)):
        rids.append(engine.add_request(p, sp, lora=a, priority=pr))
        if priority and i == 2:
            engine.step()
            engine.step()
    with pytest.raises(KeyboardInterrupt):
        while engine.has_unfinished():
            engine.step()
    monkeypatch.undo()
    outputs = drain(engine)
    assert calls[0] in outputs and "its step was interrupted: KeyboardInterrupt" in outputs[calls[0]][-1].error
    if priority:  # of the requests running, the one of the highest value, the latest of those
        held = [rids.index(rid) for rid in running[0]]
        assert len(held) > 1 and calls[0] == rids[max(held, key=lambda i: (priorities[i], i))], (calls, held)
    assert set(outputs) <= set(rids)
    assert_serves_on(engine, solo)


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_a_release_that_fails_leaves_the_others_released_and_answered(make_engine, solo, monkeypatch, overlap):
    """An adapter reference whose release raises (an engine fault, not a request's): logged, and the other requests
    that ended in that step are released and get their last output all the same."""
    engine = make_engine(FAMILY, disable_overlap_schedule=not overlap)
    lora, faults = engine.runner.lora, []
    release = lora.release

    def failing_once(name):
        if name == "partial" and not faults:
            faults.append(name)
            raise Injected("release fault")
        return release(name)
    monkeypatch.setattr(lora, "release", failing_once)
    rids = [engine.add_request(p, sp, lora=a) for p, sp, a in zip(PROMPTS, PARAMS, LORAS)]
    outputs = drain(engine)
    assert faults == ["partial"]
    assert [[t for o in outputs[r] for t in o.token_ids] for r in rids] == solo
    assert all(outputs[r][-1].finished and outputs[r][-1].finish_reason == "length" for r in rids)
    assert engine.scheduler.accounting_error() is None and not engine.has_unfinished()
    assert engine.runner.lora.in_flight == {"partial": 1}  # the one reference whose release failed


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
@pytest.mark.parametrize("fault", [Injected, KeyboardInterrupt])
def test_every_request_a_failed_step_ends_gets_its_end_from_the_next_step(make_engine, monkeypatch, overlap, fault):
    """A fault that escapes a step (here in scheduling, once) ends the requests of the steps it was running with an
    error, and an abort asked for before it still ends its request: the step API's caller gets each end from the next
    steps, exactly once, and has_unfinished says so until then (the ends were lost, and a caller waiting for them
    waited for ever). The requests the fault did not touch finish as they would alone."""
    engine = make_engine(FAMILY, disable_overlap_schedule=not overlap)
    rids = [engine.add_request(p, sp, lora=a) for p, sp, a in zip(PROMPTS[:2], PARAMS[:2], LORAS[:2])]
    outputs: dict[str, list] = {}
    for _ in range(3):
        for out in engine.step():
            outputs.setdefault(out.rid, []).append(out)
    assert engine.abort(rids[1])
    schedule = engine.scheduler.schedule

    def once():
        monkeypatch.setattr(engine.scheduler, "schedule", schedule)
        raise fault("a fault outside the requests' parts")
    monkeypatch.setattr(engine.scheduler, "schedule", once)
    with pytest.raises(fault):
        engine.step()
    for rid, outs in drain(engine).items():
        outputs.setdefault(rid, []).extend(outs)
    ends = {rid: [(o.finish_reason, o.error) for o in outputs[rid] if o.finished] for rid in rids}
    assert ends[rids[1]] == [("abort", None)]
    assert len(ends[rids[0]]) == 1 and ends[rids[0]][0][0] in ("error", "length"), ends
    assert_released(engine)


def test_a_step_trace_that_cannot_be_written_stops_and_fails_no_request(make_engine, solo, monkeypatch, tmp_path):
    """MOELORA_STEP_TRACE is a debugging aid: a write that fails (a full disk) is logged and the trace stops; the
    step's outputs are delivered and its requests go on (they were failed, and every later step failed too)."""
    monkeypatch.setenv("MOELORA_STEP_TRACE", str(tmp_path / "trace.jsonl"))
    engine = make_engine(FAMILY)
    trace = engine.stepper._trace

    def full_disk(*args):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(trace, "write", full_disk)
    rids = [engine.add_request(p, sp, lora=a) for p, sp, a in zip(PROMPTS, PARAMS, LORAS)]
    outputs = drain(engine)
    assert engine.stepper._trace is None
    assert [[t for o in outputs[r] for t in o.token_ids] for r in rids] == solo
    assert_released(engine)


def test_the_outputs_a_step_made_before_a_fault_are_reported(make_engine, monkeypatch):
    """Overlapped, a grammar request's tokens are read before the next step is scheduled: a fault after that read
    (here in scheduling) must not lose what the read made, the grammar request's last tokens and its end."""
    grammar = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True,
                             structured_output=StructuredOutput("regex", "[ab]+"))
    other = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    alone = make_engine(FAMILY).generate([PROMPTS[0]], grammar)[0]
    engine = make_engine(FAMILY)
    rids = [engine.add_request(PROMPTS[0], grammar), engine.add_request(PROMPTS[1], other)]
    req, schedule = engine.scheduler.find(rids[0]), engine.scheduler.schedule

    def fault_once_it_is_read():
        if req.finished:
            monkeypatch.setattr(engine.scheduler, "schedule", schedule)
            raise Injected("a fault after the read")
        return schedule()
    monkeypatch.setattr(engine.scheduler, "schedule", fault_once_it_is_read)
    outputs: dict[str, list] = {}
    with pytest.raises(Injected):
        for _ in range(10):
            for out in engine.step():
                outputs.setdefault(out.rid, []).append(out)
    for rid, outs in drain(engine).items():
        outputs.setdefault(rid, []).extend(outs)
    mine = outputs[rids[0]]
    assert [t for o in mine for t in o.token_ids] == alone.token_ids
    assert [o.finish_reason for o in mine if o.finished] == [alone.finish_reason]
    assert [o.finished for o in outputs[rids[1]]].count(True) == 1
    assert_released(engine)


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
@pytest.mark.parametrize("fault", [Injected, KeyboardInterrupt])
@pytest.mark.parametrize("where", ["insert", "free", "unlock"])
def test_a_release_that_raises_part_way_gives_back_the_rest_once(make_engine, solo, monkeypatch, where, fault,
                                                                   overlap):
    """Prefix caching, every prompt cached: the release of the victim's cache raises once, where its tokens go into
    the prefix cache, where its own slots go back to the pool, or where its cached prefix is unlocked (an engine
    fault, or Ctrl-C). What the release did not reach is given back all the same and nothing twice (a KV slot
    given back twice goes to two requests), the adapter reference too: all that stays out is what the raising call
    itself was handed (given back here by hand, the accounting is exact). Every request gets its one end (the
    victim its own, those an interrupted step had not finished an error, from the next step), and the engine serves
    on."""
    engine = make_engine(FAMILY, disable_overlap_schedule=not overlap, enable_prefix_caching=True)
    assert [o.token_ids for o in engine.generate(PROMPTS, PARAMS, lora=LORAS)] == solo
    scheduler, faults = engine.scheduler, []
    owner = {"insert": scheduler.cache, "free": scheduler.pool, "unlock": scheduler.cache}[where]
    real = getattr(owner, where)
    rids = [engine.add_request(p, sp, lora=a) for p, sp, a in zip(PROMPTS, PARAMS, LORAS)]
    victim = scheduler.find(rids[VICTIM])

    def once(*args):
        if victim.finished and not faults:
            faults.append(args)
            raise fault(f"{where} fault")
        return real(*args)
    monkeypatch.setattr(owner, where, once)
    outputs: dict[str, list] = {}
    while engine.has_unfinished():
        try:
            for out in engine.step():
                outputs.setdefault(out.rid, []).append(out)
        except KeyboardInterrupt:
            assert fault is KeyboardInterrupt
    assert len(faults) == 1
    for i, rid in enumerate(rids):
        ends = [o for o in outputs[rid] if o.finished]
        assert len(ends) == 1, (i, ends)
        if ends[0].finish_reason == "length":  # (an interrupt ends the requests of its step with an error)
            assert [t for o in outputs[rid] for t in o.token_ids] == solo[i], i
    assert outputs[rids[VICTIM]][-1].finish_reason == "length"  # (it had finished: its release raised)
    free = scheduler.pool._free_slots
    assert free.unique().numel() == free.numel(), "a KV slot given back twice"
    if where != "insert":  # the slots pool.free was handed, or the cached prefix unlock was
        real(*faults[0])
    monkeypatch.undo()
    assert_serves_on(engine, solo)


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
@pytest.mark.parametrize("where", ["_match", "_admit", "adapter_ready", "_retract"])
def test_a_fault_planning_one_request_fails_it_alone(make_engine, solo, monkeypatch, where, overlap):
    """A fault while the scheduler plans one request's step (matching or admitting its cached prefix, asking whether
    its adapter is in its slot, retracting it for its KV slots) is that request's: it ends with the error and what it
    held is freed; the requests beside it, decoding or newly come, finish with their tokens alone (the fault failed
    the whole step, and the running requests with it)."""
    engine = make_engine(FAMILY, disable_overlap_schedule=not overlap, enable_prefix_caching=where != "adapter_ready",
                         enable_lora_overlap_loading=where == "adapter_ready",
                         **({"max_total_tokens": 40} if where == "_retract" else {}))
    scheduler, faults = engine.scheduler, []
    rids = [engine.add_request(p, sp, lora=a) for p, sp, a in zip(PROMPTS[:VICTIM], PARAMS, LORAS)]
    outputs: dict[str, list] = {}
    for _ in range(3):  # they decode when the victim comes
        for out in engine.step():
            outputs.setdefault(out.rid, []).append(out)
    rids += [engine.add_request(p, sp, lora=a) for p, sp, a in zip(PROMPTS[VICTIM:], PARAMS[VICTIM:], LORAS[VICTIM:])]
    victim = scheduler.find(rids[VICTIM])
    real = getattr(scheduler, where)

    def failing(*args):
        if where == "_retract":  # the first request retracted, whichever it is
            due = not faults or args[0] is faults[0]
        else:
            due = (args[0] is victim or args[0] == victim.lora) and not victim.finished
        if due:
            faults.append(args[0])
            raise Injected(f"{where} fault")
        return real(*args)
    monkeypatch.setattr(scheduler, where, failing)
    for rid, outs in drain(engine).items():
        outputs.setdefault(rid, []).extend(outs)
    assert faults, "the victim was never planned there"
    failed = rids.index(faults[0].rid) if where == "_retract" else VICTIM
    for i, rid in enumerate(rids):
        last = outputs[rid][-1]
        if i == failed:
            assert last.finish_reason == "error" and last.error == f"scheduling it failed: Injected: {where} fault"
        else:
            assert last.finish_reason == "length" and last.error is None, (i, last)
            assert [t for o in outputs[rid] for t in o.token_ids] == solo[i], i
    assert_released(engine)
