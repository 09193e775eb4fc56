"""Scheduler and KV pool on their own: a fake model appends one token per completing request."""
import pytest
import torch

from moelora.engine.config import EngineConfig
from moelora.engine.kv_pool import KVPool
from moelora.engine.request import Req
from moelora.engine.sampling_params import SamplingParams
from moelora.engine.scheduler import ScheduledBatch, Scheduler


def make(num_slots=64, rows=8, **kw) -> Scheduler:
    """Mixed steps unless told otherwise: most of these tests are about decode rows beside prompt pieces. No prefix
    caching: these count the pool's slots (tests/engine/test_prefix_cache.py has the cache's)."""
    options = {"enable_mixed_chunk": True, "enable_prefix_caching": False, **kw}
    return Scheduler(EngineConfig("model", device="cpu", **options), KVPool(num_slots, rows))


def req(rid, prompt_len, max_new, lora=None, priority=0) -> Req:
    return Req(rid, list(range(prompt_len)), SamplingParams(max_tokens=max_new), lora, priority=priority)


def check_cache(s: Scheduler) -> None:
    """Every held slot is held once, slot 0 never, and held + free = all slots but 0."""
    held = torch.cat([torch.empty(0, dtype=torch.int64)] + [r.kv_slots for r in s._holding()])
    assert held.unique().numel() == held.numel() and (held > 0).all()
    assert held.numel() + s.pool.free_slots == s.pool.num_slots - 1
    assert all(r.kv_slots.numel() == 0 and r.row is None for r in s.waiting)


def step(s: Scheduler) -> ScheduledBatch:
    batch = s.schedule()
    assert batch is not None
    assert batch.out_slots.numel() == sum(batch.extend_lens)
    s.start_decoding(batch)
    for i, r in enumerate(batch.reqs):
        assert r.kv_len == batch.prefix_lens[i] + batch.extend_lens[i] <= r.num_tokens
        if batch.completes[i]:
            r.output_ids.append(r.num_tokens)  # a token that says where it was made
            if len(r.output_ids) == r.params.max_tokens:
                r.finish_reason = "length"
    for r in batch.reqs:
        if r.finished:  # what the stepper does once a step's tokens are appended
            s.remove(r)
    check_cache(s)
    return batch


def run(s: Scheduler, max_steps=200) -> list[ScheduledBatch]:
    batches = []
    while s.has_unfinished():
        batches.append(step(s))
        assert len(batches) < max_steps
    return batches


def test_kv_pool_never_hands_out_slot_zero():
    pool = KVPool(5, 2)
    slots = pool.alloc_slots(4)
    assert sorted(slots.tolist()) == [1, 2, 3, 4] and pool.free_slots == 0
    with pytest.raises(RuntimeError, match="out of slots"):
        pool.alloc_slots(1)
    pool.free(slots[:2])
    assert pool.free_slots == 2
    assert {pool.alloc_row(), pool.alloc_row()} == {0, 1}
    with pytest.raises(RuntimeError, match="rows"):
        pool.alloc_row()


def test_chunked_prefill_then_decode():
    s = make(chunked_prefill_size=4)
    r = req("a", 10, 3)
    s.add(r)
    batches = run(s)
    assert [(b.is_decode, b.extend_lens) for b in batches] == [
        (False, [4]), (False, [4]), (False, [2]), (True, [1]), (True, [1])]
    assert r.output_ids == [10, 11, 12]  # each token sees every token before it
    assert s.pool.free_slots == 63 and s.pool.free_rows == 8


def test_requests_join_and_leave_every_step():
    s = make()
    a, b = req("a", 3, 4), req("b", 2, 2)
    s.add(a)
    assert step(s).reqs == [a]
    s.add(b)
    mixed = step(s)
    assert (mixed.num_decode, mixed.reqs, mixed.extend_lens) == (1, [a, b], [1, 2])  # b's prefill joins a's decode
    assert (lambda bt: (bt.is_decode, bt.reqs))(step(s)) == (True, [a, b])  # one decode batch of both
    assert step(s).reqs == [a]  # b finished with 2 tokens
    run(s)
    assert a.output_ids == [3, 4, 5, 6] and b.output_ids == [2, 3]


def test_without_mixed_chunk_prompt_pieces_run_in_steps_of_their_own_first():
    s = make(chunked_prefill_size=4, enable_mixed_chunk=False)
    a, b = req("a", 3, 3), req("b", 6, 2)
    s.add(a)
    step(s)
    s.add(b)
    batches = run(s)
    assert [(bt.num_decode, bt.reqs, bt.extend_lens) for bt in batches] == [
        (0, [b], [4]), (0, [b], [2]), (2, [a, b], [1, 1]), (1, [a], [1])]  # a's decode waits for b's prompt
    assert a.output_ids == [3, 4, 5] and b.output_ids == [6, 7]


def test_mixed_steps_carry_every_decode_row_and_prompt_chunks_within_the_budget():
    s = make(chunked_prefill_size=5)
    a, b = req("a", 2, 6), req("b", 2, 6)
    s.add(a)
    s.add(b)
    step(s)  # both prompts
    c = req("c", 9, 2)
    s.add(c)
    batches = [step(s) for _ in range(4)]
    assert [(bt.num_decode, bt.extend_lens) for bt in batches] == [(2, [1, 1, 3]), (2, [1, 1, 3]), (2, [1, 1, 3]),
                                                                   (3, [1, 1, 1])]
    assert [bt.reqs for bt in batches[:3]] == [[a, b, c]] * 3 and batches[2].completes == [True] * 3
    run(s)
    assert a.output_ids == b.output_ids == list(range(2, 8)) and c.output_ids == [9, 10]


def test_the_chunked_prompt_keeps_its_slots_while_others_decode():
    """Its admission promised the cache its whole prompt: when decode rows would eat into that, the
    newest running request is retracted, not the prompt half prefilled."""
    s = make(num_slots=16, chunked_prefill_size=3)
    a, c = req("a", 1, 12), req("c", 10, 1)
    s.add(a)
    step(s)
    s.add(c)
    batches = run(s)
    assert [bt.extend_lens[-1] for bt in batches[:5]] == [2, 2, 2, 2, 2] and batches[4].reqs == [c]
    assert a.num_retractions == 1 and c.num_retractions == 0
    assert a.output_ids == list(range(1, 13)) and c.output_ids == [10]


def test_prefill_token_budget_and_request_limit():
    s = make(max_prefill_tokens=8, chunked_prefill_size=-1, max_running_requests=2)
    reqs = [req("a", 5, 1), req("b", 5, 1), req("c", 12, 1), req("d", 1, 1)]
    for r in reqs:
        s.add(r)
    # a alone (b over budget), b alone, c alone although over budget (unchunked), then d
    assert [[r.rid for r in b.reqs] for b in run(s)] == [["a"], ["b"], ["c"], ["d"]]
    s = make(max_running_requests=2)
    reqs = [req(str(i), 2, 3) for i in range(3)]
    for r in reqs:
        s.add(r)
    first = step(s)
    assert [r.rid for r in first.reqs] == ["0", "1"]
    run(s)
    assert all(len(r.output_ids) == 3 for r in reqs)


def test_decode_out_of_slots_retracts_newest_and_recomputes():
    s = make(num_slots=16, chunked_prefill_size=4)
    reqs = [req("a", 4, 8), req("b", 4, 8)]
    for r in reqs:
        s.add(r)
    run(s)
    assert s.num_retractions > 0 and reqs[1].num_retractions > 0 and reqs[0].num_retractions == 0
    for r in reqs:  # recomputation continued where it left off
        assert r.output_ids == list(range(4, 12))
    assert s.pool.free_slots == 15


def test_priority_policy_admits_lower_values_first_then_by_arrival():
    s = make(scheduling_policy="priority", max_running_requests=1)
    for rid, priority in (("a", 3), ("b", 1), ("c", 2), ("d", 1), ("e", -5)):
        s.add(req(rid, 2, 1, priority=priority))
    assert [r.rid for r in s.waiting] == ["e", "b", "d", "c", "a"]
    admitted = [b.reqs[-1].rid for b in run(s) if not b.is_decode]
    assert admitted == ["e", "b", "d", "c", "a"]
    s = make(max_running_requests=1)  # fcfs: arrival alone
    for rid, priority in (("a", 3), ("b", 1)):
        s.add(req(rid, 2, 1, priority=priority))
    assert [b.reqs[-1].rid for b in run(s) if not b.is_decode] == ["a", "b"]


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_decode_out_of_slots_retracts_the_highest_priority_value_and_requeues_it_in_order(policy):
    """fcfs retracts the newest running request and puts it first in the queue; priority retracts the one of the
    highest value (the latest of those) and puts it back at its place: behind a waiting request of a lower value,
    ahead of later ones of its own."""
    s = make(num_slots=24, chunked_prefill_size=-1, scheduling_policy=policy)
    low, high, newest = req("low", 4, 12, priority=5), req("high", 4, 12, priority=0), req("newest", 4, 12)
    for r in (low, high, newest):
        s.add(r)
    step(s)  # all three prefilled: 12 of 23 slots, then each decodes a token a step
    waiting = [req("later", 8, 1, priority=5), req("first", 8, 1, priority=1)]
    for r in waiting:
        s.add(r)
    while not any(r.num_retractions for r in (low, high, newest)):
        step(s)
    retracted = [r.rid for r in (low, high, newest) if r.num_retractions]
    if policy == "fcfs":
        assert retracted == ["newest"] and [r.rid for r in s.waiting] == ["newest", "later", "first"]
    else:
        assert retracted == ["low"] and [r.rid for r in s.waiting] == ["first", "low", "later"]
    run(s)
    assert all(len(r.output_ids) == r.params.max_tokens for r in (low, high, newest, *waiting))


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_adapter_that_does_not_fit_waits_and_requests_whose_adapter_fits_overtake_it(policy):
    s = make(max_loras_per_batch=1, scheduling_policy=policy)
    a, b, c, d, e = (req("a", 2, 3, "x"), req("b", 2, 3, "y"), req("c", 2, 1, None), req("d", 2, 2, "x"),
                     req("e", 2, 2, "z"))
    for r in (a, b, c, d, e):
        s.add(r)
    first = step(s)
    assert first.reqs == [a, c, d]  # b and e wait for the slot; the base request and x's start before them
    assert s.active_adapters() == {"x"} and [r.rid for r in s.waiting] == ["b", "e"] and b.overtaken == 2
    batches = run(s)
    assert all(len(r.output_ids) == r.params.max_tokens for r in (a, b, c, d, e))
    starts = [next(i for i, batch in enumerate(batches) if r in batch.reqs) for r in (b, e)]
    assert starts[0] < starts[1]  # the slot, once free, goes in queue order
    for batch in batches:  # never two adapters at once among requests holding cache
        assert len({r.lora for r in batch.reqs} - {None}) <= 1


def test_a_request_waiting_for_an_adapter_slot_is_overtaken_at_most_max_running_requests_times():
    """A stream of requests for the running adapter, two arriving every step: the one of another adapter starts once
    four (max_running_requests) have started before it, as the running ones drain."""
    s = make(max_loras_per_batch=1, rows=4, num_slots=256, max_running_requests=4)
    s.add(req("first", 2, 3, "x"))
    blocked = req("blocked", 2, 2, "y")
    s.add(blocked)
    started_before, n = [], 0
    while not blocked.finished:
        batch = step(s)
        if blocked in batch.reqs:
            break
        started_before += [r for r in batch.reqs if r.rid.startswith("x") and batch.prefix_lens[batch.reqs.index(r)] == 0]
        for _ in range(2):
            s.add(req(f"x{n}", 2, 3, "x"))
            n += 1
        assert n < 100
    assert len(started_before) == 4 and blocked.overtaken == 4
    run(s, max_steps=400)


def test_the_overtaking_bound_holds_within_one_step():
    """Requests of the running adapter, one token each, behind one waiting for a slot: three start in one step (the
    rows allow), and of the next three only one does, the fourth (max_running_requests) to overtake it."""
    s = make(max_loras_per_batch=1, rows=4, num_slots=256, max_running_requests=4)
    s.add(req("first", 2, 6, "x"))
    blocked = req("blocked", 2, 2, "y")
    s.add(blocked)
    step(s)
    for i in range(6):
        s.add(req(f"x{i}", 2, 1, "x"))
    assert [r.rid for r in step(s).reqs] == ["first", "x0", "x1", "x2"] and blocked.overtaken == 3
    assert [r.rid for r in step(s).reqs] == ["first", "x3"] and blocked.overtaken == 4
    run(s)


def test_remove_frees_cache_anywhere():
    s = make(chunked_prefill_size=4)
    a, b = req("a", 10, 5), req("b", 3, 5)
    s.add(a)
    s.add(b)
    step(s)  # a's first chunk
    assert s.chunked is a and s.find("b") is b and s.find("zzz") is None
    s.remove(a)
    s.remove(b)
    assert not s.has_unfinished() and s.pool.free_slots == 63 and s.pool.free_rows == 8


def test_find_knows_each_request_from_its_add_to_its_remove_wherever_it_is():
    """By id, not a walk of the queues (an abort storm of thousands of queued requests walked them once per abort);
    the requests by id are the queued ones at every step, and accounting_error says when they are not."""
    s = make(num_slots=64, rows=2, chunked_prefill_size=8)
    reqs = [req("chunked", 20, 2), req("short", 2, 4), req("waits", 3, 2), req("gone", 3, 2)]
    for r in reqs:
        s.add(r)
    s.remove(reqs[3])
    step(s)  # "chunked" prefills its first 8 tokens, the others wait
    assert s.chunked is reqs[0] and reqs[1] in s.waiting and reqs[2] in s.waiting
    assert [s.find(r.rid) for r in reqs] == [*reqs[:3], None] and s.accounting_error() is None
    while s.has_unfinished():
        step(s)
        assert all((s.find(r.rid) is r) == (r in s.unfinished()) for r in reqs) and s.accounting_error() is None
    s._by_rid["gone"] = reqs[3]
    assert s.accounting_error() == "the requests by id are 1, the queues hold 0"
