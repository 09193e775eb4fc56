"""LoRA slots: LRU order, adapters in use never evicted, requests waiting for a slot, adapters
loaded and unloaded at runtime, the host-memory cache, and the counters."""
import dataclasses
import os
import shutil
import threading
import time
import weakref

import pytest
import torch
from peft import LoraConfig
from safetensors.torch import load_file, save_file

import moelora.engine.lora_manager as lora_manager
from moelora.core import ExpertLoRASlots, LinearLoRASlots
from moelora.engine.config import MAX_LORA_RANK
from moelora.engine.engine import RequestFailed
from moelora.engine.lora_manager import LoRAManager, LoRASlotPool
from moelora.engine.sampling_params import SamplingParams
from moelora.lora import AdapterError, load_adapter
from tests.models.families import family_config, hf_model
from tests.support import assert_released, peft_adapter

FAMILY = "qwen3_moe"
PROMPTS = [[5, 17, 2, 93, 41], [11, 4, 77, 30, 1, 9]]
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(make_engine):
    """Greedy tokens of each prompt on each adapter, from an engine with a slot for both."""
    engine = make_engine(FAMILY)
    return {(i, a): engine.generate([p], GREEDY, lora=a)[0].token_ids
            for i, p in enumerate(PROMPTS) for a in ("full", "partial")}


def test_slot_pool_evicts_least_recently_used_not_in_use():
    pool = LoRASlotPool(2)
    assert pool.assign("a", {"a"}) == (0, None) and pool.assign("b", {"b"}) == (1, None)
    assert pool.lookup("a") == 0 and pool.names == ["b", "a"]  # a used last
    assert pool.assign("c", {"c"}) == (1, "b")
    assert pool.assign("d", {"c", "d"}) == (0, "a")  # c is in use although least recently used
    with pytest.raises(RuntimeError, match="in use"):
        pool.assign("e", {"c", "d", "e"})
    pool.release("c")
    assert pool.lookup("c") is None and pool.assign("e", {"e"}) == (1, None)


def test_one_slot_two_adapters_both_complete(make_engine, reference):
    engine = make_engine(FAMILY, max_loras_per_batch=1, max_cpu_loras=1)
    jobs = [(i, a) for a in ("full", "partial") for i in range(len(PROMPTS))] * 2
    outputs = engine.generate([PROMPTS[i] for i, _ in jobs], GREEDY, lora=[a for _, a in jobs])
    assert [o.token_ids for o in outputs] == [reference[j] for j in jobs]
    stats = engine.runner.lora.stats
    # the two adapters took turns in the slot, and in host memory (re-read from disk)
    assert stats.slot_evictions >= 1 and stats.slot_loads == stats.slot_evictions + 1
    assert stats.disk_loads >= 3 and stats.slot_hits > 0


def test_prepare_never_evicts_what_running_requests_use(make_engine, adapters):
    engine = make_engine(FAMILY, max_loras_per_batch=1)
    manager = engine.runner.lora
    assert manager.prepare(["full", None], in_use={"full"}) == [0, -1]
    with pytest.raises(RuntimeError, match="in use"):
        manager.prepare(["partial"], in_use={"full", "partial"})
    assert manager.prepare(["partial"], in_use={"partial"}) == [0]
    assert manager.pool.names == ["partial"]


def test_the_rank_bound_follows_the_adapters_of_the_step(make_engine, adapters, wide_adapter):
    """In slots of rank 32: a step whose adapters fit the smallest rank tile (16) runs every LoRA layer, dense and
    experts, with that bound, one with a rank-20 adapter among them with the slots' (lora_tiles.step_rank_bound); a
    step without adapters leaves it as it was. Slots of rank 8: always 8."""
    manager = make_engine(FAMILY, max_lora_rank=32, lora_paths={**{n: str(a.path) for n, a in adapters(FAMILY).items()},
                                                                "wide": wide_adapter}, max_loras_per_batch=3).runner.lora
    kinds = {type(lora) for lora in manager.slot_buffers}
    assert kinds == {LinearLoRASlots, ExpertLoRASlots}, kinds
    assert load_adapter(wide_adapter, family_config(FAMILY)).max_rank == 20
    assert max(load_adapter(a.path, family_config(FAMILY)).max_rank for a in adapters(FAMILY).values()) <= 16
    for step, bound in ((["full", None], 16), (["partial", "wide"], 32), ([None], 32), (["partial"], 16)):
        manager.prepare(step, in_use=set(step) - {None})
        assert {lora.max_rank_in_use for lora in manager.slot_buffers} == {bound}, step
    small = make_engine(FAMILY, max_loras_per_batch=2).runner.lora
    for step in (["full"], ["partial", None]):
        small.prepare(step, in_use=set(step) - {None})
        assert {lora.max_rank_in_use for lora in small.slot_buffers} == {8}


def test_load_and_unload_at_runtime(make_engine, adapters, reference, tmp_path):
    engine = make_engine(FAMILY, lora_paths={})
    path = str(adapters(FAMILY)["full"].path)
    engine.load_lora("mine", path)
    with pytest.raises(AdapterError, match="already loaded"):
        engine.load_lora("mine", path)
    assert engine.generate(PROMPTS[0], GREEDY, lora="mine")[0].token_ids == reference[0, "full"]

    rid = engine.add_request(PROMPTS[1], GREEDY, lora="mine")
    tokens = [t for o in engine.step() if o.rid == rid for t in o.token_ids]  # (none, with overlap scheduling)
    engine.unload_lora("mine")  # in flight: it finishes, new requests are refused
    with pytest.raises(AdapterError, match="being unloaded"):
        engine.add_request(PROMPTS[0], GREEDY, lora="mine")
    with pytest.raises(AdapterError, match="still being unloaded"):
        engine.load_lora("mine", path)
    while engine.has_unfinished():
        tokens += [t for o in engine.step() if o.rid == rid for t in o.token_ids]
    assert tokens == reference[1, "full"]
    with pytest.raises(AdapterError, match="unknown adapter 'mine'"):
        engine.add_request(PROMPTS[0], GREEDY, lora="mine")
    assert engine.runner.lora.pool.names == []
    loads = engine.lora_stats.disk_loads
    engine.load_lora("mine", path, engine.read_lora(path))  # the name is free again; read first (a server's worker)
    assert engine.lora_stats.disk_loads == loads + 1
    assert engine.generate(PROMPTS[1], GREEDY, lora="mine")[0].token_ids == reference[1, "full"]

    broken = tmp_path / "broken"
    shutil.copytree(path, broken)
    (broken / "adapter_model.safetensors").unlink()
    with pytest.raises(AdapterError, match="broken"):
        engine.load_lora("broken", str(broken))
    with pytest.raises(AdapterError, match="unknown adapter 'broken'"):
        engine.unload_lora("broken")


def test_an_adapter_replaced_in_place_serves_its_new_files_once_no_request_uses_it(make_engine, adapters, reference):
    engine = make_engine(FAMILY, lora_paths={})
    full, partial = (str(adapters(FAMILY)[name].path) for name in ("full", "partial"))
    engine.load_lora("mine", full)
    assert engine.generate(PROMPTS[0], GREEDY, lora="mine")[0].token_ids == reference[0, "full"]
    rid = engine.add_request(PROMPTS[1], GREEDY, lora="mine")
    engine.step()
    with pytest.raises(AdapterError, match="'mine' cannot be replaced while 1 requests use it"):
        engine.load_lora("mine", partial, replace=True)
    tokens = []
    while engine.has_unfinished():
        tokens += [t for o in engine.step() if o.rid == rid for t in o.token_ids]
    assert reference[1, "full"][-len(tokens):] == tokens  # (the first step's tokens, if any, were not kept)
    engine.load_lora("mine", partial, replace=True)
    assert engine.generate(PROMPTS, GREEDY, lora="mine")[1].token_ids == reference[1, "partial"]
    assert_released(engine)


def test_names_of_one_adapters_files_share_one_host_copy(make_engine, adapters, reference):
    """A path loaded under many names costs host memory once; each name serves it and unloads alone."""
    engine = make_engine(FAMILY, lora_paths={})
    path = str(adapters(FAMILY)["full"].path)
    for name in ("one", "two", "three"):
        engine.load_lora(name, path)
    host = engine.runner.lora._host
    assert host["one"] is host["two"] is host["three"]
    outputs = engine.generate([PROMPTS[0]] * 3, GREEDY, lora=["one", "two", "three"])
    assert [o.token_ids for o in outputs] == [reference[0, "full"]] * 3
    engine.unload_lora("one")
    assert "one" not in host and engine.generate(PROMPTS[1], GREEDY, lora="three")[0].token_ids == reference[1, "full"]


def test_a_name_out_of_host_memory_is_served_from_the_copy_another_name_holds(make_engine, adapters, reference,
                                                                              tmp_path):
    """Host memory for 2 adapters: "one" and "two" share a copy, "p" taken in evicts "one" alone. Its copy is still
    in host memory (under "two"): "one" serves from it, without a read from disk, even with its files rewritten (a
    read would refuse them)."""
    path = tmp_path / "mine"
    shutil.copytree(adapters(FAMILY)["full"].path, path)
    engine = make_engine(FAMILY, lora_paths={}, max_cpu_loras=2, max_loras_per_batch=1)
    for name, where in (("one", path), ("two", path), ("p", adapters(FAMILY)["partial"].path)):
        engine.load_lora(name, str(where))
    host, stats = engine.runner.lora._host, engine.runner.lora.stats
    assert "one" not in host and "two" in host
    _touch(path)
    loads = stats.disk_loads
    assert engine.generate(PROMPTS[0], GREEDY, lora="one")[0].token_ids == reference[0, "full"]
    assert stats.disk_loads == loads and "one" in host


def test_an_adapter_rewritten_in_place_is_refused_when_read_again(make_engine, adapters, wide_adapter, reference,
                                                                   tmp_path):
    """An adapter out of host memory is read again from its directory: if its files changed since it was loaded (here
    a rank-20 adapter where a rank-8 one was, past the rank tile the step would be bounded with), its request fails
    with an error that says so, and the others are served as before; unloaded and loaded again, the new one serves."""
    path = tmp_path / "mine"
    shutil.copytree(adapters(FAMILY)["full"].path, path)
    engine = make_engine(FAMILY, max_lora_rank=32, max_cpu_loras=1, max_loras_per_batch=1)
    engine.load_lora("mine", str(path))
    assert engine.generate(PROMPTS[0], GREEDY, lora="mine")[0].token_ids == reference[0, "full"]
    assert engine.generate(PROMPTS[1], GREEDY, lora="partial")[0].token_ids == reference[1, "partial"]
    shutil.rmtree(path)
    shutil.copytree(wide_adapter, path)
    with pytest.raises(RequestFailed, match=r"adapter 'mine': its files in .*mine changed since it was loaded"):
        engine.generate(PROMPTS, GREEDY, lora=["partial", "mine"])
    assert_released(engine)
    assert engine.generate(PROMPTS[1], GREEDY, lora="partial")[0].token_ids == reference[1, "partial"]
    engine.unload_lora("mine")
    engine.load_lora("mine", str(path))
    wide = make_engine(FAMILY, max_lora_rank=32, lora_paths={"wide": wide_adapter})
    assert engine.generate(PROMPTS[0], GREEDY, lora="mine")[0].token_ids == \
        wide.generate(PROMPTS[0], GREEDY, lora="wide")[0].token_ids


def test_an_adapter_past_the_models_dtype_is_refused(make_engine, adapters, tmp_path):
    """A float32 adapter whose B (times its scaling) a float16 model's slots cannot hold is refused when loaded,
    with the layer and module named, rather than served as Inf."""
    path = tmp_path / "big"
    shutil.copytree(adapters(FAMILY)["full"].path, path)
    tensors = load_file(path / "adapter_model.safetensors")
    key = next(k for k in tensors if "layers.1.self_attn.q_proj.lora_B" in k)
    tensors[key][0, 0] = 1e6
    save_file(tensors, path / "adapter_model.safetensors")
    engine = make_engine(FAMILY, dtype="float16", lora_paths={})
    with pytest.raises(AdapterError, match=r"layer 1 self_attn.q_proj: A or B \(times the scaling\) reaches .*, past "
                                           r"the model's torch.float16 largest value 6.55e\+04"):
        engine.load_lora("big", str(path))
    assert engine.runner.lora.names == []


def test_slots_past_the_free_memory_are_an_error_before_they_are_allocated(make_engine, monkeypatch):
    """The slot buffers' bytes are known before they are allocated (slot_buffer_bytes, the bytes allocate_lora_slots
    then holds): more than the memory available is an error naming both fields, not an allocation's traceback or
    the out-of-memory killer ending the process."""
    from moelora.engine import model_runner
    from moelora.engine.lora_slots import slot_buffer_bytes, slot_bytes
    engine = make_engine(FAMILY, max_lora_rank=32, max_loras_per_batch=3, lora_target_modules="all")
    model = engine.runner.model
    assert slot_buffer_bytes(model, 3, 32) == slot_bytes(model) > 0
    monkeypatch.setattr(model_runner, "_host_memory_available", lambda: slot_bytes(model) - 1)
    with pytest.raises(ValueError, match=r"the LoRA slots need .* GiB \(EngineConfig.max_loras_per_batch 3 of "
                                         r"EngineConfig.max_lora_rank 32\); .* GiB of host memory is available"):
        make_engine(FAMILY, max_lora_rank=32, max_loras_per_batch=3, lora_target_modules="all", max_cpu_loras=5)


def test_an_adapter_past_the_kernels_largest_rank_is_refused_at_the_start(make_engine, tmp_path):
    """Without max_lora_rank the slots take the largest rank among the adapters given at start, up to the LoRA
    kernels' largest rank tile: past it, the start names the adapter and its rank (the kernels refused it only when
    their first step was compiled, at warm-up on the GPU)."""
    path = tmp_path / "huge"
    peft_adapter(hf_model(family_config(FAMILY)), LoraConfig(r=MAX_LORA_RANK + 8, target_modules=["q_proj"]), path)
    with pytest.raises(AdapterError, match=rf"(?s)adapter .*huge: .*q_proj.lora_A.weight: rank {MAX_LORA_RANK + 8} is "
                                           rf"above the engine's max_lora_rank={MAX_LORA_RANK}"):
        make_engine(FAMILY, max_lora_rank=None, lora_paths={"huge": str(path)})


def test_no_slots_without_a_rank(make_engine, adapters):
    engine = make_engine(FAMILY, lora_paths={}, max_lora_rank=None)
    with pytest.raises(AdapterError, match="no LoRA slots"):
        engine.load_lora("full", str(adapters(FAMILY)["full"].path))
    with pytest.raises(AdapterError, match="no LoRA slots"):
        engine.read_lora(str(adapters(FAMILY)["full"].path))


def test_the_start_holds_one_whole_adapter_at_a_time(make_engine, monkeypatch):
    """The adapters given at start are each cut to the rank's share as they are read: when the next is read, the one
    before is no longer held whole (under tp, 4 ranks each held every adapter whole at once)."""
    read, alive_at_read = [], []

    def load(*args, **kwargs):
        alive_at_read.append([r() is not None for r in read])
        adapter = real(*args, **kwargs)
        read.append(weakref.ref(adapter))
        return adapter
    real = lora_manager.load_adapter
    monkeypatch.setattr(lora_manager, "load_adapter", load)
    engine = make_engine(FAMILY)
    assert len(read) == 2 and alive_at_read == [[], [False]]
    assert sorted(engine.runner.lora._host) == ["full", "partial"]


def test_a_path_given_at_start_under_many_names_is_read_once(make_engine, adapters, monkeypatch):
    """lora_paths naming one path under several names: one read from disk and one host copy, not a copy per name
    held at once until the start had read them all (1000 names of one adapter read it 1000 times)."""
    path = str(adapters(FAMILY)["full"].path)
    read = []
    real = lora_manager.load_adapter
    monkeypatch.setattr(lora_manager, "load_adapter", lambda path, *args: read.append(path) or real(path, *args))
    engine = make_engine(FAMILY, lora_paths={"one": path, "two": path, "three": path})
    host = engine.runner.lora._host
    assert host["one"] is host["two"] is host["three"]
    assert read == [path] and engine.runner.lora.stats.disk_loads == 1


def exchange(lead: LoRAManager, follower: LoRAManager, wait: float = 0.0, rounds: int = 1000) -> None:
    """Rank 0's events replayed by another rank, and its polls answered (ModelRunner._send, _serve_commands), until
    no poll is left or `rounds` polls went unanswered by a finished read."""
    for _ in range(rounds):
        status = follower.replay(lead.take_events(wait))
        if status is None:
            return
        lead.others_read(status)


def tensor_parallel_pair(engine, **options) -> tuple[LoRAManager, LoRAManager]:
    """Rank 0's manager and another rank's, on the engine's model (each with its own host memory and reads)."""
    config = dataclasses.replace(engine.config, **options)
    return (LoRAManager(config, engine.runner.model, record_events=True),
            LoRAManager(dataclasses.replace(config, tp_size=2), engine.runner.model))


def test_every_rank_serves_a_name_out_of_host_memory_from_the_copy_another_name_holds(make_engine, adapters):
    """Tensor parallel, host memory for 2 adapters: "one" and "two" name one path, "p" taken in evicts "one". Rank 0
    takes "one" back from the copy "two" holds; the other rank, replaying it, does the same: no rank reads it again."""
    paths = {n: str(a.path) for n, a in adapters(FAMILY).items()}
    lead, follower = tensor_parallel_pair(make_engine(FAMILY, lora_paths={}), max_cpu_loras=2)
    for name, path in (("one", paths["full"]), ("two", paths["full"]), ("p", paths["partial"])):
        lead.load_lora(name, path, adapter=lead.read(path))
        exchange(lead, follower, wait=30)
    assert [sorted(m._host) for m in (lead, follower)] == [["p", "two"]] * 2
    loads = [m.stats.disk_loads for m in (lead, follower)]
    assert lead.prefetch(["one"], set()) == [] and lead.ready("one")
    exchange(lead, follower, wait=30)
    assert [m.stats.disk_loads for m in (lead, follower)] == loads and not lead._reading and not follower._reading
    assert [sorted(m._host) for m in (lead, follower)] == [["one", "p"]] * 2


def test_another_rank_whose_read_of_a_name_failed_takes_the_copy_another_name_holds(make_engine, adapters):
    """Tensor parallel: a second name of the files "full" was loaded from at start, loaded at runtime; the other rank
    cannot read it (its first requests fail). A later request: rank 0 takes the copy "full" holds, and so does the
    other rank (rank 0's files, checked at start), not a read inside the step that would fail there again."""
    path = str(adapters(FAMILY)["full"].path)
    lead, follower = tensor_parallel_pair(make_engine(FAMILY, lora_paths={"full": path}), max_cpu_loras=3)

    def read(path):
        raise OSError("no such adapter on this rank's node")
    follower.read = read
    lead.load_lora("again", path, adapter=lead.read(path))
    exchange(lead, follower, wait=30)
    assert [name for name, _, _ in lead.prefetch(["again"], set())] == ["again"] and "again" not in follower._host
    assert lead.prefetch(["again"], set()) == [] and lead.ready("again")
    exchange(lead, follower, wait=30)
    assert follower._host["again"] is follower._host["full"] and not follower._reading


def test_a_name_of_files_retrained_since_another_name_took_them_holds_a_copy_of_its_own(make_engine, adapters,
                                                                                      tmp_path):
    """Tensor parallel: "old" from the start at a path whose weights are retrained in place since (the files' sizes as
    they were), "new" loaded from it at runtime: every rank holds the new weights under "new" and the old under "old".
    (Another rank checks its read of an adapter loaded at runtime by the files' names and sizes, which are the same.)"""
    path = shutil.copytree(adapters(FAMILY)["full"].path, tmp_path / "p")
    lead, follower = tensor_parallel_pair(make_engine(FAMILY, lora_paths={"old": str(path)}))
    file = path / "adapter_model.safetensors"
    size = file.stat().st_size
    save_file({k: 2 * t for k, t in load_file(file).items()}, file, metadata={"format": "pt"})
    assert file.stat().st_size == size
    lead.load_lora("new", str(path), adapter=lead.read(str(path)))
    exchange(lead, follower, wait=30)
    for manager in (lead, follower):
        old, new = (manager._host[n] for n in ("old", "new"))
        assert all(torch.equal(b, 2 * a) for a, b in zip(_tensors(old), _tensors(new)))


def test_ranks_that_read_a_path_at_other_times_take_the_copy_rank_0_names(make_engine, adapters, tmp_path):
    """Tensor parallel, host memory for 2 adapters: "a" from the start; "b" loaded from the same path, which rank 0
    read before the files' times changed (the same bytes) and the other rank after, and "a" evicted. Rank 0 takes
    "a" back from the copy "b" holds (its versions of the files equal); so does the other rank, though its versions
    differ: no read in its replay, which would refuse the files as changed and stop the rank."""
    path = shutil.copytree(adapters(FAMILY)["full"].path, tmp_path / "p")
    engine = make_engine(FAMILY, lora_paths={"a": str(path), "q": str(adapters(FAMILY)["partial"].path)})
    lead, follower = tensor_parallel_pair(engine, max_cpu_loras=2)
    share = lead.read(str(path))
    _touch(path)
    lead.load_lora("b", str(path), adapter=share)
    exchange(lead, follower, wait=30)
    assert set(lead._host) == set(follower._host) == {"q", "b"}
    assert lead.prefetch(["a"], set()) == [] and lead.ready("a")
    exchange(lead, follower, wait=30)
    assert follower._host["a"] is follower._host["b"] and set(follower._host) == set(lead._host) == {"b", "a"}


def _tensors(share) -> list[torch.Tensor]:
    modules = [m for layer in share.layers.values() for m in {**layer.experts, **layer.modules}.values()]
    return [t for m in modules for t in (m.a, m.b)]


@pytest.mark.parametrize("fails", [False, True], ids=["slow", "fails"])
def test_no_slot_write_before_the_other_ranks_have_read_the_adapter(make_engine, adapters, fails):
    """Overlap loading, host memory for 2 adapters: rank 0 has read an adapter back from disk but another rank is
    still reading it (or its read fails): rank 0 queues no slot write of it (the other rank would replay it waiting
    for its read, or raise out of the read and stop the engine); the adapter is not ready until the other rank has
    read it, and a failed read there fails it here."""
    paths = {n: str(a.path) for n, a in adapters(FAMILY).items()}
    engine = make_engine(FAMILY, max_cpu_loras=2, enable_lora_overlap_loading=True)
    lead, follower = tensor_parallel_pair(engine)
    lead.load_lora("x", paths["partial"], adapter=lead.read(paths["partial"]))  # host memory: partial, x
    exchange(lead, follower, wait=30)
    assert "full" not in lead._host and "full" not in follower._host
    gate, real = threading.Event(), follower.read

    def held_read(path):
        assert gate.wait(30)
        if fails:
            raise OSError("no such adapter on this rank's node")
        return real(path)

    follower.read = held_read
    lead.prefetch(["full"], set())
    lead.wait_for_prefetch(30)
    exchange(lead, follower, rounds=1)
    assert lead.prefetch(["full"], set()) == [] and "full" in lead._host and not lead.ready("full")
    events = lead.take_events()
    assert not [e for e in events if e[0] == "write"], events
    start = time.perf_counter()
    assert follower.replay(events) == [lora_manager.READ_PENDING]
    assert time.perf_counter() - start < 5
    gate.set()
    lead.others_read([lora_manager.READ_PENDING])
    exchange(lead, follower, wait=30)
    failed = lead.prefetch(["full"], set())
    if fails:
        assert [(name, what) for name, what, _ in failed] == [("full", "reading its adapter from disk on another rank")]
        assert "full" not in lead._host and "full" not in follower._host
    else:
        exchange(lead, follower)
        assert not failed and lead.ready("full") and "full" in follower._host
        assert lead.pool.peek("full") is not None


def test_another_ranks_failed_read_of_an_adapter_replaced_since_fails_no_request_of_the_new_one(make_engine, adapters):
    """Another rank's read of an adapter loaded at runtime failed (a poll told rank 0, whose next prefetch fails the
    adapter's waiting requests); before that prefetch, the adapter is replaced in place (or unloaded and loaded
    again): the new adapter's requests do not fail for the old one's read."""
    paths = {n: str(a.path) for n, a in adapters(FAMILY).items()}
    lead, follower = tensor_parallel_pair(make_engine(FAMILY, max_cpu_loras=3))
    real, fails = follower.read, [True]

    def read(path):
        if fails[0]:
            raise OSError("no such adapter on this rank's node")
        return real(path)

    follower.read = read
    lead.load_lora("x", paths["partial"], adapter=lead.read(paths["partial"]))
    exchange(lead, follower, wait=30)
    assert [name for name, _, _ in lead._others_failed] == ["x"]
    fails[0] = False
    lead.load_lora("x", paths["full"], adapter=lead.read(paths["full"]), replace=True)
    exchange(lead, follower, wait=30)
    assert lead.ready("x") and "x" in follower._host
    assert lead.prefetch(["x"], set()) == []


def test_another_ranks_changed_files_fail_the_adapter_not_the_rank(make_engine, adapters, tmp_path):
    """Another rank reads an adapter back from disk (host memory for 2 adapters) and finds its files changed since it
    was loaded (another modification time): its answer to rank 0's poll says so, and the adapter's waiting requests
    fail, where its replay of rank 0's "take" raised (the rank, and the engine, stopped)."""
    paths = {n: str(a.path) for n, a in adapters(FAMILY).items()}
    mine = tmp_path / "full"
    shutil.copytree(paths["full"], mine)
    engine = make_engine(FAMILY, max_cpu_loras=2)
    lead = LoRAManager(dataclasses.replace(engine.config, max_cpu_loras=2), engine.runner.model, record_events=True)
    follower = LoRAManager(dataclasses.replace(engine.config, max_cpu_loras=2, tp_size=2,
                                               lora_paths={**engine.config.lora_paths, "full": str(mine)}),
                           engine.runner.model)
    lead.load_lora("x", paths["partial"])  # "full" out of host memory on both
    exchange(lead, follower, wait=30)
    assert "full" not in follower._host
    _touch(mine)
    lead.prefetch(["full"], set())
    lead.wait_for_prefetch(30)
    exchange(lead, follower, wait=30)
    failed = lead.prefetch(["full"], set())
    assert [(name, what) for name, what, _ in failed] == [("full", "reading its adapter from disk on another rank")]
    exchange(lead, follower)
    assert "full" not in lead._host and "full" not in follower._host and not lead._others_reading


def test_another_ranks_host_memory_follows_rank_0s(make_engine, adapters, tmp_path):
    """Under tensor parallelism (max_cpu_loras 2 of 3 adapters) rank 0's manager decides which adapters stay in host
    memory, and another rank's follows its events: reads from disk started, taken in, dropped and evicted as rank 0's
    were, whatever order its own reads finish in, so a slot write it replays finds the adapter in its memory."""
    paths = {n: str(a.path) for n, a in adapters(FAMILY).items()}
    again = shutil.copytree(paths["full"], tmp_path / "again")  # (other files: no name shares a copy with another)
    engine = make_engine(FAMILY, max_cpu_loras=2, lora_paths={**paths, "again": str(again)})
    lead = LoRAManager(engine.config, engine.runner.model, record_events=True)
    follower = LoRAManager(dataclasses.replace(engine.config, tp_size=2), engine.runner.model)

    def prefetch(*waiting: str) -> None:
        """Rank 0's prefetch with its reads finished, then the other rank's replay, rank 0 polling its reads until
        they are done too, and the other rank's replay of what rank 0 did then."""
        lead.prefetch(waiting, set())
        lead.wait_for_prefetch(30)
        exchange(lead, follower, wait=30)
        assert not lead._others_reading
        assert list(follower._host) and set(follower._host) == set(lead._host)

    prefetch()  # the start's evictions
    assert list(lead._host) == ["partial", "again"]
    prefetch("full")  # read
    prefetch("full")  # taken in, "partial" out
    prefetch("again", "partial")  # read ...
    prefetch("again", "partial")  # ... taken in: "full" out, not "again" (used last by rank 0's prefetch alone)
    assert set(lead._host) == {"again", "partial"} and lead.stats.disk_loads == 5
    prefetch("full")  # read ...
    prefetch()  # ... for a request gone since: dropped, host memory being full
    assert not lead._reading and not follower._reading and set(lead._host) == {"again", "partial"}
    lead.prepare(["full"], {"full"})  # a synchronous read and slot write
    follower.replay(lead.take_events())
    assert set(follower._host) == set(lead._host) == {"partial", "full"}


def _touch(path) -> None:
    """The adapter's files a second later, their bytes unchanged (as another copy of them, or a rewrite, would be)."""
    for f in path.iterdir():
        os.utime(f, ns=(f.stat().st_atime_ns, f.stat().st_mtime_ns + 10**9))
