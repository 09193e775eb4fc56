"""Prefix caching (EngineConfig.enable_prefix_caching): the radix tree's bookkeeping against a plain model of it,
and engines that take cached prefixes giving every request the tokens and log-probabilities an engine without the
cache gives it, per adapter (another adapter's or an adapter reloaded under the name's keys are never taken), under
eviction, retraction, chunked prefill and overlap scheduling, with every slot back in the pool or the tree after."""
from __future__ import annotations

import random

import pytest
import torch

from moelora.engine.prefix_cache import PrefixCache
from moelora.engine.sampling_params import SamplingParams
from tests.support import assert_released

# ------------------------------------------------------------------------------------ the tree


def check_counts(cache: PrefixCache) -> None:
    nodes = cache._nodes()
    assert cache.cached == sum(n.slots.numel() for n in nodes) == cache.slots().numel()
    assert cache.evictable == sum(n.slots.numel() for n in nodes if n.refs == 0)
    assert all(len(n.tokens) == n.slots.numel() > 0 for n in nodes)
    assert all(n.refs >= sum(c.refs for c in n.children.values()) for n in nodes)


def test_the_tree_gives_back_what_it_was_given():
    """Random sequences over a small vocabulary (shared prefixes, splits at every depth): a match is the slots first
    inserted for the longest cached start; a later insert of cached tokens hands its own slots back; locked paths
    survive eviction, which takes least recently used leaves first and frees every slot exactly once."""
    rng = random.Random(0)
    cache, truth, next_slot, locked = PrefixCache(), {}, 1, []  # truth: token tuple -> slot of its last token
    key = cache.key(None)
    for step in range(400):
        tokens = [rng.randrange(4) for _ in range(rng.randrange(1, 12))]
        slots, node = cache.match(key, tokens)
        m = slots.numel()
        assert m == max((k for k in range(len(tokens) + 1) if tuple(tokens[:k]) in truth or k == 0))
        assert slots.tolist() == [truth[tuple(tokens[:k + 1])] for k in range(m)]
        if node is not None and rng.random() < 0.3:
            cache.lock(node)
            locked.append(node)
        if locked and rng.random() < 0.3:
            cache.unlock(locked.pop(rng.randrange(len(locked))))
        mine = torch.cat([slots, torch.arange(next_slot, next_slot + len(tokens) - m)])
        next_slot += len(tokens) - m
        spare = cache.insert(key, tokens, mine)
        assert spare.numel() == 0  # it took exactly the slots of tokens it did not hold
        for k in range(m, len(tokens)):
            truth[tuple(tokens[:k + 1])] = int(mine[k])
        check_counts(cache)
        if step % 50 == 49:
            held = {int(s) for n in locked for s in _path_slots(n)}
            before = set(cache.slots().tolist())
            freed = cache.evict(rng.randrange(1, 20)).tolist()
            assert len(freed) == len(set(freed)) and set(freed) <= before - held
            truth = {k: v for k, v in truth.items() if v not in set(freed)}
            check_counts(cache)
    while locked:
        cache.unlock(locked.pop())
    freed = cache.evict(10**6)
    assert sorted(freed.tolist()) == sorted(set(freed.tolist())) and cache.cached == cache.evictable == 0


def _path_slots(node) -> list[int]:
    out = []
    while node.parent is not None:
        out += node.slots.tolist()
        node = node.parent
    return out


def test_duplicate_tokens_hand_their_slots_back_and_least_recently_used_go_first():
    cache = PrefixCache()
    key = cache.key("a")
    assert cache.insert(key, [1, 2, 3], torch.tensor([10, 11, 12])).numel() == 0
    assert cache.insert(key, [1, 2, 4], torch.tensor([20, 21, 22])).tolist() == [20, 21]  # 1, 2 were cached
    assert cache.insert(key, [5], torch.tensor([30])).numel() == 0
    slots, node = cache.match(key, [1, 2, 3, 9])
    assert slots.tolist() == [10, 11, 12] and cache.lock_cost(node) == 3
    cache.lock(node)
    assert cache.evictable == 2 and cache.lock_cost(node) == 0
    assert cache.evict(1).tolist() == [22]  # [1, 2, 4]'s leaf is older than [5]; [1, 2, 3] is held
    assert cache.evict(5).tolist() == [30] and cache.cached == 3
    cache.unlock(node)
    assert sorted(cache.evict(5).tolist()) == [10, 11, 12] and cache.cached == 0


def test_an_eviction_takes_least_recently_used_leaves_without_walking_the_trees(monkeypatch):
    """A full cache evicts at every admission: it pops its heap of leaves, whose stale entries (leaves used, held or
    gone since) it skips, never walking thousands of nodes."""
    cache = PrefixCache()
    key = cache.key(None)
    for i in range(2000):
        cache.insert(key, [i % 7, i, i + 1], torch.tensor([3 * i, 3 * i + 1, 3 * i + 2]))
    cache.match(key, [0, 0, 1])  # (splits nothing: used again, now the latest)
    held = cache.match(key, [1, 1, 2])[1]
    cache.lock(held)
    monkeypatch.setattr(cache, "_nodes", lambda: pytest.fail("an eviction walked the trees"))
    cache.insert(key, [0, 0, 1], torch.tensor([0, 1, 2]))  # used: its entry again, at the end
    freed = cache.evict(6).tolist()
    # the leaves of sequences 2, 3 and 4 (0 used again, 1 held): their last two tokens, the first one being shared
    # with every seventh sequence
    assert freed == [7, 8, 10, 11, 13, 14]
    monkeypatch.undo()
    check_counts(cache)
    assert len(cache._leaves) <= 2 * cache.cached + 64


def test_an_adapter_loaded_again_gets_a_new_tree():
    cache = PrefixCache()
    old = cache.key("a")
    cache.insert(old, [1, 2], torch.tensor([5, 6]))
    held = cache.match(old, [1, 2])[1]
    cache.lock(held)
    cache.insert(old, [1, 3], torch.tensor([5, 7]))
    assert cache.forget("a").tolist() == [7] and cache.key("a") != old  # what no request holds goes at once
    assert cache.match(cache.key("a"), [1, 2])[1] is None and cache.match(cache.key(None), [1])[1] is None
    cache.unlock(held)
    assert sorted(cache.evict(9).tolist()) == [5, 6] and cache.cached == 0


# ------------------------------------------------------------------------------------ engines

FAMILY = "qwen3_moe"
SYSTEM = [(7 * j) % 90 + 3 for j in range(40)]  # a shared start
PROMPTS = [SYSTEM + [(5 * i + 2 * j) % 90 + 3 for j in range(3 + i)] for i in range(6)]
LORAS = [None, "full", "partial", None, "full", "partial"]
PENALTIES = [{}, {"repetition_penalty": 1.8}, {}, {"frequency_penalty": 1.5, "presence_penalty": 0.5}, {},
             {"repetition_penalty": 0.6, "presence_penalty": -1.0}]  # (counted over the prompt's cached start too)
PARAMS = [SamplingParams(max_tokens=6, temperature=0.0 if i % 2 else 0.9, seed=100 + i, ignore_eos=True, logprobs=2,
                         **PENALTIES[i]) for i in range(6)]


@pytest.fixture(scope="module")
def solo(make_engine):
    engine = make_engine(FAMILY, enable_prefix_caching=False)
    return engine.generate(PROMPTS, PARAMS, lora=LORAS)


def same(outs, want) -> None:
    for o, w in zip(outs, want):
        assert o.token_ids == w.token_ids
        for a, b in zip(o.logprobs, w.logprobs):
            assert a.keys() == b.keys() and all(abs(a[t] - b[t]) < 1e-5 for t in a)


def hits(engine, monkeypatch) -> list[int]:
    """The cached tokens each request admitted from now on started with."""
    seen, admit = [], engine.scheduler._admit

    def recorded(req, cached, node):
        admit(req, cached, node)
        seen.append(req.cached_len)
    monkeypatch.setattr(engine.scheduler, "_admit", recorded)
    return seen


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
@pytest.mark.parametrize("chunk", [None, 16], ids=["whole", "chunked"])
def test_cached_prefixes_give_the_tokens_of_an_engine_without(make_engine, solo, monkeypatch, overlap, chunk):
    options = {"chunked_prefill_size": chunk} if chunk else {}
    engine = make_engine(FAMILY, enable_prefix_caching=True, disable_overlap_schedule=not overlap, **options)
    seen = hits(engine, monkeypatch)
    outs = engine.generate(PROMPTS, PARAMS, lora=LORAS)  # all at once: nothing cached yet
    same(outs, solo)
    assert seen == [o.num_cached_tokens for o in outs] == [0] * 6
    outs = engine.generate(PROMPTS, PARAMS, lora=LORAS)
    same(outs, solo)
    assert seen[6:] == [o.num_cached_tokens for o in outs] == [len(p) - 1 for p in PROMPTS]  # all but the last token
    for i in range(6):  # one at a time: each takes the shared start (or more) its adapter's requests left
        without = make_engine(FAMILY, enable_prefix_caching=False)
        same(engine.generate([SYSTEM + [4, 5, i + 3]], PARAMS[i], lora=LORAS[i]),
             without.generate([SYSTEM + [4, 5, i + 3]], PARAMS[i], lora=LORAS[i]))
        assert seen[-1] >= len(SYSTEM)
    assert_released(engine)


def test_an_adapters_keys_are_its_own(make_engine, adapters, monkeypatch):
    """Another adapter, the base model, and an adapter loaded again under the name start from nothing."""
    engine = make_engine(FAMILY, enable_prefix_caching=True)
    seen = hits(engine, monkeypatch)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    engine.generate([PROMPTS[0]], params, lora="full")
    engine.generate([PROMPTS[0]], params, lora="partial")
    engine.generate([PROMPTS[0]], params)
    assert seen == [0, 0, 0]
    engine.load_lora("x", str(adapters(FAMILY)["full"].path))
    assert engine.generate([PROMPTS[0]], params, lora="x")[0].token_ids == \
        engine.generate([PROMPTS[0]], params, lora="full")[0].token_ids
    assert seen[3:] == [0, len(PROMPTS[0]) - 1]
    engine.generate([PROMPTS[0]], params, lora="x")
    assert seen[-1] == len(PROMPTS[0]) - 1
    engine.unload_lora("x")
    engine.load_lora("x", str(adapters(FAMILY)["partial"].path))
    got = engine.generate([PROMPTS[0]], params, lora="x")[0].token_ids
    assert seen[-1] == 0 and got == make_engine(FAMILY, enable_prefix_caching=False).generate([PROMPTS[0]], params, lora="partial")[0].token_ids
    assert_released(engine)


def test_a_short_cache_evicts_and_retracts_and_still_gives_the_same_tokens(make_engine, solo, monkeypatch):
    """A cache of 100 slots: cached prefixes go (least recently used first) for new prompts and decode rows, and
    running requests are retracted when even that is not enough, their computed tokens cached for their return."""
    engine = make_engine(FAMILY, enable_prefix_caching=True, max_total_tokens=100)
    seen, admit, resumed = hits(engine, monkeypatch), engine.scheduler._admit, []

    def admitted(req, cached, node):  # a retracted request takes back its output's keys too, where still cached
        admit(req, cached, node)
        resumed.append(req.num_retractions > 0 and req.cached_len >= len(req.prompt_ids))
    monkeypatch.setattr(engine.scheduler, "_admit", admitted)
    for _ in range(2):
        same(engine.generate(PROMPTS, PARAMS, lora=LORAS), solo)
        assert engine.scheduler.accounting_error() is None
    assert any(seen) and engine.scheduler.num_retractions > 0 and any(resumed)
    assert_released(engine)


def test_prompt_logprobs_are_computed_not_cached(make_engine, monkeypatch):
    engine = make_engine(FAMILY, enable_prefix_caching=True)
    seen = hits(engine, monkeypatch)
    params = SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=1)
    first = engine.generate([PROMPTS[1]], params, lora="full")[0]
    again = engine.generate([PROMPTS[1]], params, lora="full")[0]
    assert seen == [0, 0] and again.prompt_logprobs == first.prompt_logprobs
    assert engine.prompt_logprobs([PROMPTS[1]], lora="full")[0].shape[0] == len(PROMPTS[1])
    assert_released(engine)


def test_an_abort_keeps_the_prefix_cached_and_frees_the_rest(make_engine, monkeypatch):
    engine = make_engine(FAMILY, enable_prefix_caching=True)
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    engine.generate([PROMPTS[2]], params)
    cached = engine.scheduler.cache.cached
    rid = engine.add_request(PROMPTS[2], params)
    engine.step()
    req = engine.scheduler.find(rid)
    assert req.cached_len == len(PROMPTS[2]) - 1 and engine.scheduler.cache.evictable < cached
    engine.abort(rid)
    ends = []
    while engine.has_unfinished():
        ends += [o for o in engine.step() if o.finished]
    assert [(o.rid, o.finish_reason, o.cached_tokens) for o in ends] == [(rid, "abort", len(PROMPTS[2]) - 1)]
    assert engine.scheduler.cache.cached == engine.scheduler.cache.evictable == cached  # nothing of the abort's
    assert_released(engine)


def test_a_stop_its_caller_found_is_cached_an_abort_is_not(make_engine):
    """A server finds stop strings itself and stops the request (Engine.abort with reason "stop"): its tokens are
    cached as a finished request's; an abort's are not."""
    engine = make_engine(FAMILY, enable_prefix_caching=True)
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    for reason, cached in (("abort", 0), ("stop", len(PROMPTS[3]) + 2)):
        rid = engine.add_request(PROMPTS[3], params, detokenize=False)
        while len(engine.scheduler.find(rid).output_ids) < 3:
            engine.step()
        req = engine.scheduler.find(rid)
        assert engine.abort(rid, reason)
        while engine.has_unfinished():
            engine.step()
        assert engine.scheduler.cache.cached == cached and req.finish_reason == reason  # prompt + 3 but the last
    with pytest.raises(ValueError, match="abort's reason must be 'abort' or 'stop', got 'length'"):
        engine.abort("x", "length")
    assert_released(engine)


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_short_of_slots_a_cached_prefix_goes_before_another_request_is_retracted(make_engine, overlap):
    """Decode rows short of slots retract the newest request; the prefix it held, evictable now, is evicted before
    any other is retracted: never more retractions than without the cache, the same tokens."""
    prompts = [[(11 * i + 7 * j) % 90 + 3 for j in range(30)] for i in range(8)]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    retractions, tokens = {}, {}
    for caching in (False, True):
        for total in (250, 251, 252):
            engine = make_engine(FAMILY, enable_prefix_caching=caching, max_total_tokens=total,
                                 disable_overlap_schedule=not overlap)
            if caching:
                engine.generate(prompts, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))  # cached
            before = engine.scheduler.num_retractions
            tokens[caching, total] = [o.token_ids for o in engine.generate(prompts, params)]
            retractions[caching, total] = engine.scheduler.num_retractions - before
            assert_released(engine)
    for total in (250, 251, 252):
        assert tokens[True, total] == tokens[False, total]
        assert 0 < retractions[True, total] <= retractions[False, total], retractions


def test_a_request_on_a_cached_prefix_counts_once_however_often_retracted(make_engine):
    """Admissions (step stats) count every request once, on a cached prefix too; the cache's token counts take a
    prompt once, not again at each re-admission after a retraction."""
    prompts = [[(5 * i + 2 * j) % 90 + 3 for j in range(20)] for i in range(4)]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    admitted = {}
    for caching in (False, True):
        engine = make_engine(FAMILY, enable_prefix_caching=caching, max_total_tokens=100)
        outs = [engine.generate(prompts, params) for _ in range(2)]
        admitted[caching] = engine.step_stats.admitted
        assert engine.scheduler.num_retractions > 0
    assert admitted[True] == admitted[False] == 8
    counts = engine.prefix_cache_counts()
    assert counts["query_tokens"] == 2 * sum(map(len, prompts)) and 0 < counts["hit_tokens"] <= counts["query_tokens"]
    assert sum(o.num_cached_tokens for o in outs[1]) == counts["hit_tokens"]  # the first admission's (none before)
    assert sum(o.num_cached_tokens for o in outs[0]) == 0
