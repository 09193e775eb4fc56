"""The engine over several ranks (CPU processes with gloo, started by the engine, over two "nodes" of this
machine, or by torchrun): the same tokens and log-probs as one rank, adapters loaded and unloaded at runtime with
requests in flight on every rank, and a rank that dies or hangs, while loading or serving, stops the engine with
an error naming it instead of hanging."""
import dataclasses
import functools
import gc
import json
import multiprocessing
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import moelora.engine.engine as engine_module
import moelora.engine.lora_manager as lora_manager
import moelora.engine.model_runner as model_runner
import moelora.engine.stepper as stepper_module
import moelora.engine.workers as workers_module
from moelora.cli import _ranks_in_a_line_each
from moelora.distributed.launch import free_port, host_port, rendezvous_store, report_failures
from moelora.distributed.state import ParallelState
from moelora.engine.config import EngineConfig
from moelora.engine.engine import Engine, EngineDead, RequestFailed
from moelora.engine.lora_slots import slotted_modules
from moelora.engine.profiler import read_summary, summary_path
from moelora.engine.sampling_params import SamplingParams
from moelora.engine.model_runner import warm_up_sizes
from moelora.engine.workers import WorkerFailure, Workers, node_config, node_ranks, serves_engine
from moelora.layers.moe.all_to_all import FIXED_MAX_TOKENS
from moelora.layers.moe.runner import Runner
from moelora.lora import load_adapter
from moelora.models.config import ModelConfig
from tests.distributed.load_unload import PROMPTS, drive_load_and_unload
from tests.models.families import assert_logprobs_close, family_config
from tests.support import assert_released, rank_memory, reordered_sums_tolerance

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("family, options", [
    ("qwen3_moe", dict(tp_size=2, ep_size=2)),
    ("qwen3_moe", dict(tp_size=2, disable_overlap_schedule=True)),
    ("deepseek_v3", dict(tp_size=2, enable_expert_parallel=True, moe_dispatch="all_to_all")),
    # the other families, experts split over two groups: each dispatch on a family with shared experts and one without
    ("qwen2_moe", dict(tp_size=2, ep_size=2, moe_dispatch="all_to_all")),
    ("mixtral", dict(tp_size=2, ep_size=2)),
    ("olmoe", dict(tp_size=2, ep_size=2, moe_dispatch="all_to_all")),
    ("deepseek_v2", dict(tp_size=2, ep_size=2)),
], ids=lambda v: v if isinstance(v, str) else "-".join(f"{k}={w}" for k, w in v.items()))
def test_same_tokens_and_logprobs_as_one_rank(family, options, start_engine, checkpoint):
    """With overlap scheduling (the default) the decode rows' tokens reach ranks 1.. from rank 0's device: a row
    whose token did not arrive would decode token 0's continuation. The start's memory lines are each rank's."""
    one, many = start_engine(family), start_engine(family, **options)
    assert many.stepper.overlap == (not options.get("disable_overlap_schedule", False))
    loras = ["full", None, "partial", "full"]
    assert [o.token_ids for o in many.generate(PROMPTS, GREEDY, lora=loras)] == \
        [o.token_ids for o in one.generate(PROMPTS, GREEDY, lora=loras)]
    for got, want in zip(many.prompt_logprobs(PROMPTS, lora=loras), one.prompt_logprobs(PROMPTS, lora=loras)):
        assert_logprobs_close(got, want, f"{family} {options}", reordered_sums_tolerance(family_config(family), want))
    _assert_memory_per_rank(many, one, checkpoint(family))


def test_cached_prefixes_over_two_ranks(start_engine):
    """Prefix caching: every rank records a request's cached prefix in its row (rank 0 decides, the step carries
    the slots), so the second round, every prompt but its last token cached, gives the first round's tokens."""
    one, many = start_engine("qwen3_moe"), start_engine("qwen3_moe", tp_size=2, enable_prefix_caching=True)
    loras = ["full", None, "partial", "full"]
    want = [o.token_ids for o in one.generate(PROMPTS, GREEDY, lora=loras)]
    for _ in range(2):
        assert [o.token_ids for o in many.generate(PROMPTS, GREEDY, lora=loras)] == want
    assert many.scheduler.cache.hit_tokens >= sum(len(p) - 1 for p in PROMPTS)
    assert_released(many)


@pytest.mark.parametrize("options", [dict(enable_lora_overlap_loading=True), dict(max_cpu_loras=1)],
                         ids=["overlap-loading", "host-1"])
def test_prefetch_over_two_ranks(start_engine, options):
    """One slot for two adapters, with enable_lora_overlap_loading or with host memory for one (max_cpu_loras): rank
    0's prefetch writes and reads from disk are replayed by rank 1 before the steps that need them, so every request
    gets one rank's tokens."""
    one = start_engine("qwen3_moe")
    many = start_engine("qwen3_moe", tp_size=2, ep_size=2, max_loras_per_batch=1, **options)
    for loras in (["full", None, "partial", "full"], ["full", "partial", None, "partial"]):
        assert [o.token_ids for o in many.generate(PROMPTS, GREEDY, lora=loras)] == \
            [o.token_ids for o in one.generate(PROMPTS, GREEDY, lora=loras)]
    stats = many.runner.lora.stats
    assert stats.slot_evictions >= 2 and (stats.disk_loads >= 4 or "max_cpu_loras" not in options), stats
    assert_released(many)


def _assert_memory_per_rank(many: Engine, one: Engine, model_path) -> None:
    """The summary's weights, KV cache and LoRA slots at tp_size ranks are, within its rounding, what every rank
    holds (the rank's model built on the meta device, as rank r builds it), about 1 / tp_size of one process's
    weights."""
    config, lines, max_rank = many.config, many.summary(), many.runner.lora.max_rank
    tokens, slotted = many.runner.kv.num_slots - 1, slotted_modules(many.runner.model)
    parallel = [line for line in lines if line.startswith(f"parallel: {config.tp_size} ranks")]
    kv = [line for line in lines if line.startswith(f"KV cache: {tokens} tokens")]
    slots = [line for line in lines if line.startswith(f"LoRA: {config.max_loras_per_batch} GPU slots ")]
    assert len(parallel) == len(kv) == len(slots) == 1, lines
    # the start's phases over several ranks: rank 0's, between its waits for the others
    phases = list(many.start_seconds)
    assert phases[0] == "ranks started" and phases[-1] == "the other ranks' starts waited for", phases
    assert "the other ranks' loads waited for" in phases and lines[-1].startswith("start: ranks started in "), lines
    for rank in range(config.tp_size):
        held = rank_memory(ModelConfig.from_pretrained(model_path), ParallelState(rank, config.tp_size, config.ep_size),
                           torch.float32, config.max_loras_per_batch, max_rank, slotted)
        assert f"per rank: weights {held.weights / 2**20:.1f} MiB," in parallel[0], (rank, parallel[0])
        assert f"({tokens * held.kv_per_token / 2**20:.1f} MiB)" in kv[0], (rank, kv[0])
        assert f"({held.lora_slots / 2**20:.1f} MiB)" in slots[0], (rank, slots[0])
        assert held.weights < 0.6 * one.runner.weight_bytes()


@pytest.mark.parametrize("options", [dict(tp_size=2, ep_size=2), dict(tp_size=2)], ids=["tp2-ep2", "tp2-ep1"])
def test_each_rank_keeps_its_share_of_an_adapter(options, start_engine, adapters):
    """Rank 0 keeps in host memory only what its layers take, in memory of its own: at ep 2 its half of the experts,
    at ep 1 every expert's half of the intermediate rows (gate and up: B's rows, down: A's columns); its shard of
    each attention projection (q: B's rows, o: A's columns). The whole adapter is not kept."""
    many = start_engine("qwen3_moe", **options)
    whole = load_adapter(adapters("qwen3_moe")["full"].path, family_config("qwen3_moe"))
    share = many.runner.lora._host["full"]
    assert share.num_bytes() < (0.6 if "ep_size" in options else 0.9) * whole.num_bytes()  # A and B of each expert
    assert share.max_rank == whole.max_rank
    for layer_id, layer in share.layers.items():
        full = whole.layers[layer_id]
        pieces = [(name, lora, full.experts[name]) for name, lora in layer.experts.items()] + \
            [(name, lora, full.modules[name]) for name, lora in layer.modules.items()]
        for name, got, want in pieces:
            for t, w in ((got.a, want.a), (got.b, want.b)):
                if t.shape != w.shape:  # cut: memory of its own, not a view of the whole adapter's
                    assert t.untyped_storage().nbytes() == t.nbytes, (layer_id, name)
        for name, got in layer.experts.items():
            (e, r, a_in), b_out = full.experts[name].a.shape, full.experts[name].b.shape[1]
            if "ep_size" in options:
                want = ((e // 2, r, a_in), (e // 2, b_out, r))
            else:  # down: its input is the intermediate dimension; gate and up: their output
                want = ((e, r, a_in // 2), (e, b_out, r)) if name == "down" else ((e, r, a_in), (e, b_out // 2, r))
            assert (tuple(got.a.shape), tuple(got.b.shape)) == want, (layer_id, name)
        q, o = layer.modules["self_attn.q_proj"], layer.modules["self_attn.o_proj"]
        assert q.b.shape[0] * 2 == full.modules["self_attn.q_proj"].b.shape[0]
        assert o.a.shape[1] * 2 == full.modules["self_attn.o_proj"].a.shape[1]


def test_load_and_unload_with_requests_in_flight(start_engine, adapters):
    one, many = start_engine("qwen3_moe"), start_engine("qwen3_moe", tp_size=2, ep_size=2, moe_dispatch="all_to_all")
    partial = str(adapters("qwen3_moe")["partial"].path)
    assert drive_load_and_unload(many, partial) == drive_load_and_unload(one, partial)
    assert many.lora_stats.slot_evictions == one.lora_stats.slot_evictions > 0
    before = many.generate(PROMPTS[:1], GREEDY, lora="late")[0].token_ids
    for engine in (one, many):  # every rank serves the new files under the name
        engine.load_lora("late", str(adapters("qwen3_moe")["full"].path), replace=True)
    after = many.generate(PROMPTS[:1], GREEDY, lora="late")[0].token_ids
    assert after == one.generate(PROMPTS[:1], GREEDY, lora="late")[0].token_ids != before


def test_every_rank_writes_its_profile(start_engine, tmp_path, monkeypatch):
    """start_profile / stop_profile over two ranks: each rank's trace and summary of the steps between, rank 0's and
    rank 1's (its own process) side by side, and the engine serving on. A start that fails on rank 0 leaves rank 1
    recording nothing (else its next profile would be the old one, under the old name)."""
    many, loras = start_engine("qwen3_moe", tp_size=2, ep_size=2), ["full", None, "partial", None]
    want = [o.token_ids for o in many.generate(PROMPTS, GREEDY, lora=loras)]
    with monkeypatch.context() as patch:
        patch.setattr(many.runner.profiler, "start", lambda *_: (_ for _ in ()).throw(RuntimeError("injected")))
        with pytest.raises(RuntimeError, match="injected"):
            many.start_profile(str(tmp_path / "failed"))
    assert many.fatal is None and not many.runner.profiler.active
    many.start_profile(str(tmp_path))
    assert [o.token_ids for o in many.generate(PROMPTS, GREEDY, lora=loras)] == want
    traces = many.stop_profile()
    assert [t.name.rsplit("-", 1)[1] for t in traces] == ["rank0.trace.json.gz", "rank1.trace.json.gz"]
    assert len({t.name.rsplit("-", 1)[0] for t in traces}) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["failed", *(t.name for t in traces),
                                                                 *(summary_path(t).name for t in traces)])
    for trace in traces:
        summary = read_summary(trace)
        assert summary["device"] == "cpu" and any(name.startswith("aten::") for name in summary["kernels"]), trace
    assert [o.token_ids for o in many.generate(PROMPTS, GREEDY, lora=loras)] == want


def _wait_failed(engine: Engine, seconds: float) -> str:
    start = time.time()
    with pytest.raises(RequestFailed) as failed:
        engine.generate(PROMPTS[:2], GREEDY)
    assert time.time() - start < seconds
    assert engine.fatal is not None
    with pytest.raises(EngineDead):
        engine.add_request(PROMPTS[0], GREEDY)
    return str(failed.value)


def test_a_rank_that_dies_stops_the_engine(start_engine):
    many = start_engine("qwen3_moe", tp_size=2)
    many.generate(PROMPTS[:1], GREEDY)
    os.kill(many.workers.ranks.procs[1].pid, signal.SIGKILL)
    error = _wait_failed(many, 20)
    assert "rank 1 exited with code -9" in error and "a step failed on the tensor-parallel ranks" in error


def test_a_rank_that_hangs_stops_the_engine_within_the_timeout(start_engine):
    many = start_engine("qwen3_moe", tp_size=2, dist_timeout=3)
    many.generate(PROMPTS[:1], GREEDY)
    os.kill(many.workers.ranks.procs[1].pid, signal.SIGSTOP)
    error = _wait_failed(many, 3 + 20)
    assert "rank 1 is still running: it did not answer in time" in error
    assert not many.workers.ranks.procs[1].is_alive()  # stopped, then killed


class _NeverDone:
    """A step's device work that never ends, as one whose collective waits for a rank that died or hangs on a GPU
    (NCCL): query() stays False and synchronize() would never return."""
    def query(self) -> bool:
        return False

    def synchronize(self) -> None:
        raise AssertionError("the host waits for a step of several ranks without a deadline")


def test_a_step_that_never_ends_stops_the_engine_within_the_timeout(start_engine, monkeypatch):
    """Rank 0 waits for a step's device work at most dist_timeout (on a GPU, a collective whose peer died or hangs
    holds it forever): then the engine fails its requests and stops the ranks, instead of hanging."""
    many = start_engine("qwen3_moe", tp_size=2, dist_timeout=2)
    many.generate(PROMPTS[:1], GREEDY)
    monkeypatch.setattr(stepper_module, "_copy_to_host", lambda tokens: (tokens, _NeverDone()))
    rid = many.add_request(PROMPTS[1], GREEDY, "full")  # its row, KV slots and adapter reference are released too
    error = _wait_failed(many, 2 + 10)
    assert "a step's device work failed on the tensor-parallel ranks" in error
    assert "it did not end within dist_timeout (2 s)" in error
    assert not many.workers.ranks.procs[1].is_alive()
    assert many.scheduler.find(rid) is None
    assert_released(many)


class _PeerDiesMidStep(_NeverDone):
    """A step's device work that never ends because rank 1 dies while rank 0 waits for it."""
    def __init__(self, rank1: multiprocessing.Process):
        self.rank1 = rank1

    def query(self) -> bool:
        if self.rank1.is_alive():
            os.kill(self.rank1.pid, signal.SIGKILL)
        return False


def test_a_step_waiting_on_a_rank_that_died_stops_the_engine_at_once(start_engine, monkeypatch):
    """On a GPU a rank that dies mid-step leaves the others' collectives waiting for good: rank 0's wait for the
    step's device work ends once it finds the rank ended (a waitpid), not after dist_timeout."""
    many = start_engine("qwen3_moe", tp_size=2, dist_timeout=120)
    many.generate(PROMPTS[:1], GREEDY)
    states = [m.dist_state for m in many.runner.model.modules() if hasattr(m, "dist_state")]
    assert states and all(s.peers_failed == many.workers._peers_failed for s in states)  # (comm.host_values')
    rank1 = many.workers.ranks.procs[1]
    monkeypatch.setattr(stepper_module, "_copy_to_host", lambda tokens: (tokens, _PeerDiesMidStep(rank1)))
    error = _wait_failed(many, 20)
    assert "a step's device work failed on the tensor-parallel ranks (rank 1 ended)" in error
    assert "rank 1 exited with code -9" in error
    assert_released(many)


def test_a_failure_looking_for_failed_ranks_mid_step_stops_the_engine(start_engine, monkeypatch):
    """Rank 0 cannot tell whether a rank failed while a step waits (another node's reports unreadable): the engine
    fails with that reason, its ranks stopped, not a step's error alone with the ranks out of step."""
    many = start_engine("qwen3_moe", tp_size=2, dist_timeout=120)
    many.generate(PROMPTS[:1], GREEDY)

    def unreadable() -> dict[int, str]:
        raise OSError("the rendezvous store is gone")
    monkeypatch.setattr(many.workers, "_failed_ranks", unreadable)
    monkeypatch.setattr(stepper_module, "_copy_to_host", lambda tokens: (tokens, _NeverDone()))
    error = _wait_failed(many, 20)
    assert "looking for failed ranks raised OSError: the rendezvous store is gone" in error
    assert not many.workers.ranks.procs[1].is_alive()


def test_shutdown_ends_the_ranks_together(start_engine):
    """Every rank meets rank 0 at shutdown's barrier, then leaves the world and ends with 0."""
    many = start_engine("qwen3_moe", tp_size=2)
    many.generate(PROMPTS[:1], GREEDY)
    rank1 = many.workers.ranks.procs[1]
    many.shutdown()
    assert rank1.exitcode == 0


def test_rank_0_takes_its_share_of_the_cores_and_gives_them_back(start_engine, tmp_path, monkeypatch):
    """Rank 0 takes threads // ranks of its CPU threads as the other ranks do (rank 0 keeping every core beside the
    others' shares oversubscribed them: its adapter loads crawled), and gives them back at shutdown, or when the
    construction fails, before or after the ranks started; not over a count set since."""
    torch.set_num_threads(4)  # the autouse fixture gives back the count before the test
    many = start_engine("qwen3_moe", tp_size=2)
    assert torch.get_num_threads() == 2
    many.shutdown()
    assert torch.get_num_threads() == 4
    with pytest.raises(ValueError, match="EngineConfig.tokenizer_path"):
        start_engine("qwen3_moe", tp_size=2, tokenizer_path=str(tmp_path / "missing"))
    assert torch.get_num_threads() == 4
    many = start_engine("qwen3_moe", tp_size=2)
    torch.set_num_threads(3)
    many.shutdown()
    assert torch.get_num_threads() == 3

    def no_world(*args, **kwargs):
        raise RuntimeError("the ranks did not start")
    monkeypatch.setattr(engine_module, "Workers", no_world)
    with pytest.raises(RuntimeError, match="did not start"):
        start_engine("qwen3_moe", tp_size=2)
    assert torch.get_num_threads() == 3


def test_shutdown_gives_up_on_a_rank_that_hangs(start_engine):
    """Shutdown's barrier waits dist_timeout for a rank that hangs, which is then killed: no shutdown hangs, and
    the next engine over two ranks starts."""
    many = start_engine("qwen3_moe", tp_size=2, dist_timeout=3)
    many.generate(PROMPTS[:1], GREEDY)
    rank1 = many.workers.ranks.procs[1]
    os.kill(rank1.pid, signal.SIGSTOP)
    start = time.time()
    many.shutdown()
    assert time.time() - start < 3 + 10 + 10  # the barrier's timeout, then LocalRanks.stop's wait before it kills
    assert rank1.exitcode == -signal.SIGKILL
    assert start_engine("qwen3_moe", tp_size=2, dist_timeout=20).generate(PROMPTS[:1], GREEDY)[0].token_ids


TORCHRUN_SCRIPT = """
import json, sys
from moelora.engine.engine import Engine
from moelora.engine.sampling_params import SamplingParams

if __name__ == "__main__":
    model, lora_paths, prompts, loras = json.loads(sys.argv[1])
    engine = Engine(model, lora_paths=lora_paths, tp_size=2, ep_size=2, device="cpu", dtype="float32",
                    max_loras_per_batch=2, max_lora_rank=8)
    outs = engine.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True), lora=loras)
    print("TOKENS", json.dumps([o.token_ids for o in outs]))
    engine.shutdown()
"""


def test_under_torchrun(start_engine, checkpoint, adapters, tmp_path):
    """Two processes torchrun started, each constructing the Engine: rank 0's generates, rank 1's serves it and
    ends its process; the tokens are one rank's."""
    script = tmp_path / "run.py"
    script.write_text(TORCHRUN_SCRIPT)
    paths = {name: str(a.path) for name, a in adapters("qwen3_moe").items()}
    loras = ["full", None, "partial", "full"]
    spec = json.dumps([str(checkpoint("qwen3_moe")), paths, PROMPTS, loras])
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                          str(free_port()), str(script), spec], env={**os.environ, "OMP_NUM_THREADS": "1"},
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    tokens = [json.loads(line.removeprefix("TOKENS ")) for line in run.stdout.splitlines() if line.startswith("TOKENS ")]
    assert tokens == [[o.token_ids for o in start_engine("qwen3_moe").generate(PROMPTS, GREEDY, lora=loras)]]


def _stop(*args, **kwargs) -> None:
    os.kill(os.getpid(), signal.SIGSTOP)  # as a rank that hangs


def _kill(*args, **kwargs) -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _stops_before_joining(rank, config, init_method):
    _stop()
    model_runner.serve_rank(rank, config, init_method)


def _stops_while_loading(rank, config, init_method):
    model_runner.load_model = _stop
    model_runner.serve_rank(rank, config, init_method)


def _dies_while_loading(rank, config, init_method):
    model_runner.load_model = _kill
    model_runner.serve_rank(rank, config, init_method)


@pytest.mark.parametrize("serve, stage, fate", [
    (_stops_before_joining, "starting the ranks", "rank 1 is still running: it did not answer in time"),
    (_stops_while_loading, "loading the model", "rank 1 is still running: it did not answer in time"),
    (_dies_while_loading, "loading the model", "rank 1 exited with code -9 (signal 9)"),
], ids=["hangs-before-joining", "hangs-while-loading", "dies-while-loading"])
def test_a_rank_that_hangs_or_dies_while_loading_fails_the_construction(serve, stage, fate, start_engine,
                                                                        monkeypatch):
    """The spawned rank 1 runs serve_rank through a wrapper that stops (hangs) or kills it at one stage; the
    construction fails within dist_timeout (after the ranks' start, seconds here) naming it, stops it, and leaves
    no world behind: the next engine over two ranks starts."""
    monkeypatch.setattr(engine_module, "serve_rank", serve)
    start = time.time()
    with pytest.raises(WorkerFailure) as failed:
        start_engine("qwen3_moe", tp_size=2, dist_timeout=3)
    assert time.time() - start < 3 + 20
    assert str(failed.value).startswith(f"{stage} failed on the tensor-parallel ranks") and fate in str(failed.value)
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("moelora-rank")]
    monkeypatch.undo()
    assert start_engine("qwen3_moe", tp_size=2, dist_timeout=20).generate(PROMPTS[:1], GREEDY)[0].token_ids


def _raises_before_joining(rank, config, init_method):
    Path(os.environ["MOELORA_TEST_ENDED"]).touch()
    raise RuntimeError("this rank has no device")


def _killed_before_joining(rank, config, init_method):
    Path(os.environ["MOELORA_TEST_ENDED"]).touch()
    _kill()


def _killed_as_rank_0_connects(rank, config, init_method):
    time.sleep(0.2)  # meanwhile rank 0 starts its join, its client connecting to the rendezvous store (_slow_clients)
    _killed_before_joining(rank, config, init_method)


def _slow_clients(monkeypatch) -> None:
    """This process's clients of a TCPStore connect half a second late, as on a busy machine."""
    store = torch.distributed.TCPStore

    def slow(*args, **kwargs):
        if not kwargs.get("is_master", False):
            time.sleep(0.5)
        return store(*args, **kwargs)
    monkeypatch.setattr(torch.distributed, "TCPStore", slow)


def _assert_start_undone(addr: str) -> None:
    """After a start that failed: no rank runs, no world is left, no join thread either (one would set up a world, or
    reset torch's count of groups, under a retry's), and the rendezvous port is free for a retry."""
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("moelora-rank")]
    assert not torch.distributed.is_initialized()
    assert not [t for t in threading.enumerate() if t.name == "moelora-join"]
    rendezvous_store(addr, 5)  # (dropped at once)


@pytest.mark.parametrize("serve, fate, slow_clients", [
    (_raises_before_joining, "rank 1 raised RuntimeError: this rank has no device", False),
    (_killed_before_joining, "rank 1 exited with code -9 (signal 9)", False),
    (_killed_as_rank_0_connects, "rank 1 exited with code -9 (signal 9)", True),
], ids=["raises", "killed", "killed-as-rank-0-connects"])
def test_a_rank_that_ends_before_joining_fails_the_start_at_once(serve, fate, slow_clients, tmp_path, monkeypatch):
    """Rank 0 watches its ranks while it joins their world: rank 1 raising, or killed, before it joined fails the
    start within moments of its end, not once dist_timeout (120 s here) has passed, naming it and what became of it;
    the start leaves nothing behind. Also when rank 1 ends as rank 0's client of the rendezvous store connects (which,
    the store given up by then, would retry connecting for dist_timeout)."""
    ended = tmp_path / "ended"
    monkeypatch.setenv("MOELORA_TEST_ENDED", str(ended))
    if slow_clients:
        _slow_clients(monkeypatch)
    addr = f"127.0.0.1:{free_port()}"
    with pytest.raises(WorkerFailure) as failed:
        Workers(EngineConfig("unused", tp_size=2, device="cpu", dist_timeout=120, dist_init_addr=addr), serve)
    assert time.time() - ended.stat().st_mtime < 10
    error = str(failed.value)
    assert error.startswith("starting the ranks failed on the tensor-parallel ranks (RuntimeError: rank 1 ended "
                            f"before joining the world: {fate})"), error
    _assert_start_undone(addr)


def test_a_rank_another_node_reports_failed_fails_the_start_at_once():
    """Over two nodes, rank 1 (node 1's) failing before it joined: its node reports it to the rendezvous store, and
    rank 0's start fails within moments of the report, naming it and what became of it, not once dist_timeout has
    passed; the start leaves nothing behind."""
    addr = f"127.0.0.1:{free_port()}"
    reported = []

    def node1() -> None:  # what `follow` on node 1 does once its rank failed
        while True:
            try:
                socket.create_connection(host_port(addr), timeout=5).close()  # rank 0 listens
                break
            except OSError:
                time.sleep(0.05)
        time.sleep(0.5)
        report_failures(addr, {1: "raised RuntimeError: this node has no GPU"})
        reported.append(time.monotonic())
    reporter = threading.Thread(target=node1, daemon=True)
    reporter.start()
    config = EngineConfig("unused", tp_size=2, nnodes=2, dist_init_addr=addr, device="cpu", dist_timeout=120)
    with pytest.raises(WorkerFailure) as failed:
        Workers(config, serve=None)
    assert time.monotonic() - reported[0] < 10
    error = str(failed.value)
    assert "rank 1 ended before joining the world: rank 1 raised RuntimeError: this node has no GPU (on another " \
           "node)" in error, error
    assert "rank 1 raised RuntimeError: this node has no GPU (on another node: its node's output says why)" in error
    reporter.join()
    _assert_start_undone(addr)


def _interrupted(interrupts: list[float]) -> Callable[..., None]:
    """Rank 0's ModelRunner interrupted (Ctrl-C) as it starts loading; when, in `interrupts`."""
    def runner(*args, **kwargs) -> None:
        interrupts.append(time.monotonic())
        raise KeyboardInterrupt
    return runner


def test_the_rendezvous_listens_before_any_rank_starts(monkeypatch):
    """The ranks are started with the address of a store that already listens (launch.rendezvous_store): rank 0
    binding it only after they started would leave them calling a port nothing listens on, which the system can
    hand one of them as its own local port."""
    seen = []

    class Ranks:  # in place of LocalRanks: looks at the address the ranks would get, then ends the start
        def __init__(self, target, ranks, args):
            host, _, port = args[1].removeprefix("tcp://").rpartition(":")
            socket.create_connection((host, int(port)), timeout=5).close()  # refused if nothing listens
            seen.append(args[1])
            raise RuntimeError("no ranks in this test")
    monkeypatch.setattr(workers_module, "LocalRanks", Ranks)
    with pytest.raises(RuntimeError, match="no ranks in this test"):
        Workers(EngineConfig(model_path="unused", tp_size=2, device="cpu"), serve=None)
    assert len(seen) == 1


def test_an_interrupt_while_loading_stops_the_ranks_at_once(start_engine, monkeypatch):
    """Ctrl-C while rank 0 loads its share: the construction ends at once, the rank stopped and no world left behind,
    rather than after dist_timeout, which the shutdown command's send would wait for a rank that loads or waits at
    the loading's barrier (it reads no command there)."""
    interrupts: list[float] = []
    monkeypatch.setattr(engine_module, "ModelRunner", _interrupted(interrupts))  # rank 0's: this process's
    with pytest.raises(KeyboardInterrupt):
        start_engine("qwen3_moe", tp_size=2, dist_timeout=60)
    assert time.monotonic() - interrupts[0] < 20
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("moelora-rank")]
    assert not torch.distributed.is_initialized()


def test_an_interrupt_during_a_step_stops_the_ranks(start_engine, monkeypatch):
    """Ctrl-C on rank 0 after it sent a step, before it ran its share: rank 1 runs the step alone and waits in its
    first collective, out of step with rank 0 for good (rank 0's next step would meet it there). The interrupt is
    raised as it is, the rank stopped at once, and the next step fails naming the interrupt (not a later step's
    collectives meeting the earlier step's), as does a shutdown without waiting for rank 1."""
    many = start_engine("qwen3_moe", tp_size=2, dist_timeout=60)
    many.generate(PROMPTS[:1], GREEDY)
    interrupts: list[float] = []
    monkeypatch.setattr(many.runner, "execute", _interrupted(interrupts))  # rank 0's: runs after the step's send
    with pytest.raises(KeyboardInterrupt):
        many.generate(PROMPTS[:1], GREEDY)
    assert interrupts and not many.workers.ranks.procs[1].is_alive()
    monkeypatch.undo()
    error = _wait_failed(many, 20)
    assert "a step was interrupted on rank 0 (KeyboardInterrupt)" in error, error
    start = time.monotonic()
    many.shutdown()
    assert time.monotonic() - start < 20


def _cannot_read_adapters(*args, **kwargs) -> None:
    raise OSError("no such adapter on this rank's node")


def _reads_a_rewritten_adapter(self, path):
    """Reads the adapter as if its files had changed since rank 0 read them."""
    return dataclasses.replace(_READ(self, path), version=(("adapter_model.safetensors", 0, 0),))


def _reads_another_nodes_copy(self, path, *args, **kwargs):
    """Reads the adapter (at start or at runtime) as another node's copy of its files: the same bytes, other
    modification times."""
    share = _READ_SHARE(self, path, *args, **kwargs)
    return dataclasses.replace(share, version=tuple((name, size, mtime + 1) for name, size, mtime in share.version))


def test_another_nodes_copy_of_an_adapter_serves(start_engine, adapters, monkeypatch):
    """A rank that reads a copy of the files rank 0 read (same sizes, other modification times: another node's),
    the adapters given at start as one loaded at runtime, starts and loads it: only files that differ from rank 0's
    stop the engine."""
    monkeypatch.setattr(engine_module, "serve_rank",
                        functools.partial(_serve_with, "_read_share", _reads_another_nodes_copy))
    many = start_engine("qwen3_moe", tp_size=2, dist_timeout=20)
    many.load_lora("late", str(adapters("qwen3_moe")["partial"].path))
    assert many.generate(PROMPTS[:1], GREEDY, lora="late")[0].token_ids == \
        many.generate(PROMPTS[:1], GREEDY, lora="partial")[0].token_ids


def _reads_full_where_partial_is(self, path, *args, **kwargs):
    """Finds the "full" adapter's files where the "partial" one's are (another node's disk, or files replaced while
    the ranks start)."""
    path = Path(path)
    return _READ_SHARE(self, path.with_name(path.name.replace("-partial", "-full")), *args, **kwargs)


def test_a_rank_that_finds_other_files_at_a_start_adapters_path_fails_the_start(start_engine, adapters, monkeypatch):
    """Rank 1 reads other files than rank 0 at the path lora_paths gives "partial": the start fails with one error
    naming that adapter, its path and the rank, where the ranks would serve a mix of two adapters under its name;
    the ranks are stopped."""
    monkeypatch.setattr(engine_module, "serve_rank",
                        functools.partial(_serve_with, "_read_share", _reads_full_where_partial_is))
    with pytest.raises(WorkerFailure) as failed:
        start_engine("qwen3_moe", tp_size=2, dist_timeout=20)
    error = str(failed.value)
    path = adapters("qwen3_moe")["partial"].path
    assert error.startswith("loading the model failed on the tensor-parallel ranks (AdapterError: adapter 'partial' "
                            f"({path}): rank 1 read other files there than rank 0"), error
    line = _ranks_in_a_line_each(error)  # as `moelora serve` prints it
    assert "\n" not in line and "'full'" not in line  # (the same files on every rank)
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("moelora-rank")]


def _cannot_drop_adapters(*args, **kwargs) -> None:
    raise RuntimeError("this rank cannot free the adapter's slot")


_READ, _READ_SHARE = lora_manager.LoRAManager.read, lora_manager.LoRAManager._read_share


def _read_if_frozen(self, path):
    if not gc.get_freeze_count():
        raise RuntimeError("this rank serves with its start's objects in the cyclic collector's scans")
    return _READ(self, path)


def test_the_other_ranks_serve_with_their_start_frozen(start_engine, adapters, monkeypatch):
    """Rank 1 serves with its start's objects frozen out of the cyclic collector's scans (gc.freeze): a full
    collection there would pause every rank's collectives. Its runtime adapter read checks it."""
    monkeypatch.setattr(engine_module, "serve_rank", functools.partial(_serve_with, "read", _read_if_frozen))
    many = start_engine("qwen3_moe", tp_size=2, dist_timeout=20)
    many.load_lora("late", str(adapters("qwen3_moe")["partial"].path))
    assert many.generate(PROMPTS[:1], GREEDY, lora="late")[0].token_ids


def _warm_up_recording(record: Callable[[str], None]) -> None:
    """The start's warm-up on, here on the CPU too, and each run of the experts (Runner) recorded as its rows and
    whether it has adapter slots."""
    forward = Runner.forward
    EngineConfig.warm_up_at_start = property(lambda self: True)
    Runner.forward = lambda self, x, topk, lora: record(f"{x.shape[0]} {lora is not None}") or forward(self, x, topk, lora)


def _serve_recording_experts(path: str, rank, config, init_method) -> None:
    def record(line: str) -> None:
        with open(path, "a") as f:
            f.write(line + "\n")
    _warm_up_recording(record)
    model_runner.serve_rank(rank, config, init_method)


def test_each_rank_warms_its_experts_up_at_every_size_whatever_the_routing(start_engine, tmp_path, monkeypatch):
    """Under the all-to-all dispatch a rank's experts run the rows routed to it (past FIXED_MAX_TOKENS any number up
    to the step's tokens), and the warm-up's prompts route every token alike: each rank's experts still run every
    warm-up size, without and with an adapter slot, so that no kernel variant of theirs compiles while serving."""
    seen = []
    monkeypatch.setattr(Runner, "forward", Runner.forward)  # _warm_up_recording's changes, undone after the test
    monkeypatch.setattr(EngineConfig, "warm_up_at_start", EngineConfig.warm_up_at_start)
    _warm_up_recording(seen.append)
    record = tmp_path / "rank1"
    monkeypatch.setattr(engine_module, "serve_rank", functools.partial(_serve_recording_experts, str(record)))
    most = FIXED_MAX_TOKENS + 4
    start_engine("qwen3_moe", tp_size=2, ep_size=2, moe_dispatch="all_to_all", max_prefill_tokens=most)
    want = {f"{n} {lora}" for n in warm_up_sizes(most) for lora in (False, True)}
    assert most in warm_up_sizes(most) and 1 in warm_up_sizes(most)
    assert want <= set(seen), sorted(want - set(seen))
    assert want <= set(record.read_text().splitlines()), sorted(want - set(record.read_text().splitlines()))


def _serve_with(method: str, replacement: Callable[..., None], rank, config, init_method) -> None:
    """serve_rank with LoRAManager.<method> replaced on this rank (functools.partial of it pickles for the spawn)."""
    setattr(lora_manager.LoRAManager, method, replacement)
    model_runner.serve_rank(rank, config, init_method)


def _reads_when_released(self, path):
    """Reads the adapter once the file $MOELORA_TEST_RELEASE exists (a slow disk of this rank's alone)."""
    release = Path(os.environ["MOELORA_TEST_RELEASE"])
    while not release.exists():
        time.sleep(0.01)
    return _READ(self, path)


def _steps(engine: Engine, count: int) -> dict[str, list]:
    """rid -> its outputs of `count` steps."""
    outputs: dict[str, list] = {}
    for _ in range(count):
        for out in engine.step():
            outputs.setdefault(out.rid, []).append(out)
    return outputs


def test_no_step_waits_for_another_ranks_read_of_an_adapter(start_engine, adapters, tmp_path, monkeypatch):
    """Rank 1 reads an adapter loaded at runtime only when the test lets it: load_lora returns at once, and the
    requests of the other adapters and of the base model are served meanwhile (no step waits for that read); a
    request of the new adapter waits for it, then gets one rank's tokens."""
    release = tmp_path / "release"
    monkeypatch.setenv("MOELORA_TEST_RELEASE", str(release))
    monkeypatch.setattr(engine_module, "serve_rank", functools.partial(_serve_with, "read", _reads_when_released))
    one = start_engine("qwen3_moe")
    many = start_engine("qwen3_moe", tp_size=2, dist_timeout=20)
    many.load_lora("late", str(adapters("qwen3_moe")["partial"].path))
    late = many.add_request(PROMPTS[0], GREEDY, lora="late")
    loras = ["full", None, "full", None]
    assert [o.token_ids for o in many.generate(PROMPTS, GREEDY, lora=loras)] == \
        [o.token_ids for o in one.generate(PROMPTS, GREEDY, lora=loras)]
    assert late not in _steps(many, 3) and many.runner.lora.pending()
    release.touch()
    outputs = _steps(many, 200)
    assert outputs[late][-1].finish_reason == "length", outputs[late][-1].error
    assert [t for out in outputs[late] for t in out.token_ids] == \
        one.generate(PROMPTS[:1], GREEDY, lora="partial")[0].token_ids
    assert not many.has_unfinished() and not many.runner.lora.pending()
    assert_released(many)


@pytest.mark.parametrize("failure, why", [
    (_cannot_read_adapters, "no such adapter"),
    (_reads_a_rewritten_adapter, "not those rank 0 read"),
], ids=["raises", "rewritten"])
def test_a_ranks_failed_read_fails_the_adapters_requests(failure, why, start_engine, adapters, monkeypatch, caplog,
                                                         tmp_path):
    """Rank 1 cannot read an adapter loaded at runtime (as on a node without its files), or reads files that changed
    since rank 0 read them (the ranks would serve two adapters under one name): the adapter's requests fail, each
    saying so (rank 1's log says why), the others are served, and a request naming it later reads it again."""
    monkeypatch.setattr(engine_module, "serve_rank", functools.partial(_serve_with, "read", failure))
    many = start_engine("qwen3_moe", tp_size=2, dist_timeout=20)
    expected = many.generate(PROMPTS[1:2], GREEDY, lora="full")[0].token_ids
    # (files of its own: names of the files the start loaded as "partial" would share its copy, read by every rank)
    many.load_lora("late", str(shutil.copytree(adapters("qwen3_moe")["partial"].path, tmp_path / "late")))
    for _ in range(2):
        rids = [many.add_request(PROMPTS[0], GREEDY, lora="late"), many.add_request(PROMPTS[1], GREEDY, lora="full")]
        outputs = _steps(many, 200)
        assert outputs[rids[0]][-1].finish_reason == "error"
        assert "reading its adapter from disk on another rank failed" in outputs[rids[0]][-1].error
        assert [t for out in outputs[rids[1]] for t in out.token_ids] == expected
        assert not many.has_unfinished() and many.fatal is None
        assert_released(many)


@pytest.mark.parametrize("failure, fate", [
    (_cannot_drop_adapters, "rank 1 failed:\n"),
    (_stop, "rank 1 is still running: it did not answer in time"),
], ids=["raises", "hangs"])
def test_a_rank_that_fails_in_unload_lora_stops_the_engine(failure, fate, start_engine, monkeypatch):
    """Rank 1 raises or hangs where it drops the adapter (host copy and slot) a runtime unload_lora sends it (at
    once: no request of it is in flight; with some the drop goes to the ranks with a later step, a step's failure):
    unload_lora raises WorkerFailure naming it within dist_timeout, and the engine takes no more requests."""
    monkeypatch.setattr(engine_module, "serve_rank", functools.partial(_serve_with, "_drop", failure))
    many = start_engine("qwen3_moe", tp_size=2, dist_timeout=3)
    many.generate(PROMPTS[:1], GREEDY, lora="full")  # in a slot on every rank
    error = _fails_changing_adapters(many, lambda: many.unload_lora("full"), fate)
    assert failure is _stop or "RuntimeError: this rank cannot free the adapter's slot" in error


def _fails_changing_adapters(many: Engine, change: Callable[[], None], fate: str) -> str:
    """change() (a runtime load_lora or unload_lora) raises WorkerFailure within dist_timeout (3 s), its error
    naming `fate`; the engine is then fatal with that error, has stopped rank 1 and refuses requests. Returns the
    error."""
    start = time.time()
    with pytest.raises(WorkerFailure) as failed:
        change()
    assert time.time() - start < 3 + 20
    error = str(failed.value)
    assert error.startswith("changing adapters failed on the tensor-parallel ranks") and fate in error, error
    assert many.fatal == error and not many.workers.ranks.procs[1].is_alive()  # one that hangs is killed
    with pytest.raises(EngineDead):
        many.add_request(PROMPTS[0], GREEDY)
    return error


def test_the_ranks_of_each_node(monkeypatch):
    """Node k runs ranks k*tp/nnodes..; on GPUs a rank's device is cuda:N + its place on its node; only rank 0's
    process holds the engine; under torchrun (which places the ranks itself) nnodes > 1 is refused."""
    def config(**options):
        return EngineConfig("model", device="cuda:2", tp_size=8, nnodes=4, dist_init_addr="10.0.0.1:5000", **options)
    assert [list(node_ranks(config(node_rank=k))) for k in range(4)] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert [node_config(config(node_rank=3), r).device for r in (6, 7)] == ["cuda:2", "cuda:3"]
    assert serves_engine(config()) and not serves_engine(config(node_rank=1))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "8")
    with pytest.raises(ValueError, match="EngineConfig.nnodes must be 1 under torchrun"):
        serves_engine(config())


@pytest.mark.parametrize("visible, want", [(8, "cuda:5"), (1, "cuda:0")])
def test_under_torchrun_a_rank_takes_its_local_gpu(monkeypatch, visible, want):
    """torchrun's LOCAL_RANK picks the GPU of a process that sees the node's GPUs; one that sees a GPU of its own
    (CUDA_VISIBLE_DEVICES per process) takes it."""
    for name, value in (("RANK", "5"), ("LOCAL_RANK", "5"), ("WORLD_SIZE", "8")):
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: visible)
    assert node_config(EngineConfig("model", device="cuda", tp_size=8), 5).device == want


NODE_SCRIPT = """
import json, sys
from moelora.engine.engine import Engine

if __name__ == "__main__":
    model, lora_paths, options = json.loads(sys.argv[1])
    Engine(model, lora_paths=lora_paths, **options)  # serves node 0's engine, then exits the process with 0
    sys.exit(3)
"""


@pytest.mark.parametrize("options", [dict(tp_size=2), dict(tp_size=4, ep_size=2)], ids=["tp2", "tp4-ep2"])
def test_two_nodes(options, start_engine, checkpoint, adapters, tmp_path):
    """Node 1 (a process constructing the Engine with node_rank=1) runs ranks tp_size/2.., node 0 (this one) is
    rank 0 with the ranks before; the tokens are one rank's, and node 1's process ends with 0 once node 0 shut
    down."""
    script = tmp_path / "node.py"
    script.write_text(NODE_SCRIPT)
    paths = {name: str(a.path) for name, a in adapters("qwen3_moe").items()}
    nodes = dict(nnodes=2, dist_init_addr=f"127.0.0.1:{free_port()}", **options)
    node1_options = dict(device="cpu", dtype="float32", max_loras_per_batch=2, max_lora_rank=8, node_rank=1, **nodes)
    node1 = subprocess.Popen([sys.executable, str(script), json.dumps([str(checkpoint("qwen3_moe")), paths,
                                                                       node1_options])],
                             env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}, stderr=subprocess.PIPE,
                             text=True)
    try:
        many = start_engine("qwen3_moe", **nodes)
        assert many.workers.ranks.local.procs.keys() == set(range(1, options["tp_size"] // 2))
        loras = ["full", None, "partial", "full"]
        tokens = [o.token_ids for o in many.generate(PROMPTS, GREEDY, lora=loras)]
        many.shutdown()
        _, err = node1.communicate(timeout=60)
        assert node1.returncode == 0, err[-3000:]
    finally:
        node1.kill()
    assert tokens == [o.token_ids for o in start_engine("qwen3_moe").generate(PROMPTS, GREEDY, lora=loras)]


def test_a_cpu_cache_over_the_host_memory_counts_every_rank_of_the_node(start_engine):
    """On the CPU each rank checks its KV cache against its share of the memory available: the node's ranks
    allocate theirs at once."""
    with pytest.raises(Exception, match=r"GiB of host memory is available, to 2 ranks of this node"):
        start_engine("qwen3_moe", tp_size=2, max_total_tokens=10**11)
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("moelora-rank")]


def test_a_construction_that_fails_after_loading_stops_the_ranks(start_engine, tmp_path):
    """The construction fails once every rank has loaded its share (here: a tokenizer_path that is no directory,
    read after the model): the ranks, which wait for rank 0's first command by then, are stopped and no world is
    left behind, so the next engine over two ranks starts."""
    with pytest.raises(ValueError, match="EngineConfig.tokenizer_path"):
        start_engine("qwen3_moe", tp_size=2, tokenizer_path=str(tmp_path / "missing"))
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("moelora-rank")]
    assert not torch.distributed.is_initialized()
    assert start_engine("qwen3_moe", tp_size=2, dist_timeout=20).generate(PROMPTS[:1], GREEDY)[0].token_ids
