"""CUDA graphs: decode replayed from graphs gives bit-identical logprobs and tokens to the same
engine run eagerly, for batch sizes that are capture sizes, with adapters and the base model mixed, from the
graph of each experts' rank bound (slots of rank 32: steps of rank <= 16 adapters and steps with a rank-20 one);
a batch padded up to a captured size gives the same tokens. Overlap scheduling: launching a step
never waits for the device, nor does writing an adapter into a slot. A started engine compiles nothing while
serving; a profile sees the graphs' kernels.
Prefix caching gives the tokens of an engine without it."""
import cProfile
import gc
import io
import pstats
import time

import pytest
import torch

from moelora.engine.cuda_graph import CudaGraphs, RankBounds
from moelora.engine.lora_slots import share_of, write_share_to_slot
from moelora.engine.profiler import read_summary
from moelora.engine.sampling_params import SamplingParams
from moelora.lora import load_adapter
from tests.support import record_compiles

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

FAMILY = "qwen3_moe"
LORAS = [None, "full", "partial", "wide"]  # a batch of fewer than 4 requests runs with rank bound 16, else 32


def prompts(bs: int) -> list[list[int]]:
    return [[(11 * i + 5 * j) % 90 + 3 for j in range(4 + i % 5)] for i in range(bs)]


def graphed_options(adapters, wide_adapter) -> dict:
    return dict(device="cuda", dtype="bfloat16", cuda_graph_max_bs=8, max_total_tokens=4096,  # engines share the GPU
                max_lora_rank=32, max_loras_per_batch=3,
                lora_paths={**{n: str(a.path) for n, a in adapters(FAMILY).items()}, "wide": wide_adapter})


@pytest.fixture(scope="module")
def engines(make_engine, adapters, wide_adapter):
    kwargs = graphed_options(adapters, wide_adapter)
    graphed, eager = make_engine(FAMILY, **kwargs), make_engine(FAMILY, disable_cuda_graph=True, **kwargs)
    assert graphed.runner.graphs is not None and eager.runner.graphs is None
    assert graphed.runner.graphs.sizes == [1, 2, 4, 8]
    assert sorted(graphed.runner.graphs.graphs) == [(bs, key) for bs in (1, 2, 4, 8) for key in (0, 16, 32)]
    return graphed, eager


@pytest.mark.parametrize("bs", [1, 2, 4, 8])
def test_graph_decode_is_bitwise_eager(engines, bs, monkeypatch):
    params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=5, ignore_eos=True)
    loras = [LORAS[i % 4] for i in range(bs)]
    keys, real_key = [], RankBounds.key
    monkeypatch.setattr(RankBounds, "key", lambda self, batch: keys.append(real_key(self, batch)) or keys[-1])
    graphed, eager = (e.generate(prompts(bs), params, lora=loras) for e in engines)
    for g, e in zip(graphed, eager):
        assert g.token_ids == e.token_ids and g.logprobs == e.logprobs
    assert set(keys) == {0 if bs == 1 else 16 if bs < 4 else 32}  # the graphs replayed: no LoRA, rank bound 16, 32


def test_padded_batch_gives_the_same_tokens(engines):
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    loras = [LORAS[i % 3] for i in range(3)]  # replays the graph of 4
    graphed, eager = (e.generate(prompts(3), params, lora=loras) for e in engines)
    assert [o.token_ids for o in graphed] == [o.token_ids for o in eager]


def test_decode_graphs_share_one_output(engines, monkeypatch):
    """Every decode graph copies its logits into one buffer of the largest batch's rows: a graph's own output would
    hold its memory apart from the others' (dozens of graphs of up to 256 rows x the vocabulary)."""
    graphed, _ = engines
    out, real_replay, starts = graphed.runner.graphs.out, CudaGraphs.replay, set()
    assert out.shape[0] == 8
    monkeypatch.setattr(CudaGraphs, "replay",
                        lambda self, batch: (logits := real_replay(self, batch), starts.add(logits.data_ptr()))[0])
    for bs in (1, 3, 8):
        graphed.generate(prompts(bs), SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    assert starts == {out.data_ptr()}


def test_penalties_biases_and_masks_on_the_gpu(engines):
    """The sampler's per-row state on the device (penalty counts, biases, min_tokens, allowed tokens):
    graphs and eager agree, and each request gets its tokens alone."""
    params = [SamplingParams(max_tokens=8, temperature=0.0 if i % 2 == 0 else 0.8, seed=i, presence_penalty=0.5 * (i % 3),
                             frequency_penalty=0.3, repetition_penalty=1.0 + 0.2 * i, logit_bias={7: 2.0, 9: -100},
                             min_tokens=3, allowed_token_ids=list(range(3, 80)) if i == 3 else None)
              for i in range(4)]
    loras = [LORAS[i % 3] for i in range(4)]
    graphed, eager = (e.generate(prompts(4), params, lora=loras) for e in engines)
    assert [o.token_ids for o in graphed] == [o.token_ids for o in eager]
    alone = [engines[0].generate([p], sp, lora=[a])[0].token_ids for p, sp, a in zip(prompts(4), params, loras)]
    assert [o.token_ids for o in graphed] == alone
    assert all(9 not in o.token_ids for o in graphed) and set(graphed[3].token_ids) <= set(range(3, 80))


def test_cached_prefixes_on_the_gpu(engines, make_engine, adapters, wide_adapter):
    """Prefix caching with the prompt and decode graphs: the second round starts every prompt on its cached prefix
    (the request's row filled on the device) and gives the tokens of the engine without the cache; log-probabilities
    within bf16's reordering (a cached prefix's keys are summed apart from the new token's)."""
    graphed = engines[0]
    cached = make_engine(FAMILY, enable_prefix_caching=True, **graphed_options(adapters, wide_adapter))
    system = [(7 * j) % 90 + 3 for j in range(60)]
    batch = [system + p for p in prompts(6)]
    params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=3, ignore_eos=True)
    loras = [LORAS[i % 4] for i in range(6)]
    want = graphed.generate(batch, params, lora=loras)
    for _ in range(2):
        for g, w in zip(cached.generate(batch, params, lora=loras), want):
            assert g.token_ids == w.token_ids
            assert max(abs(a[t] - b[t]) for a, b in zip(g.logprobs, w.logprobs) for t in a) < 0.05
    assert cached.scheduler.cache.hit_tokens >= sum(len(p) - 1 for p in batch)
    assert cached.scheduler.accounting_error() is None


def test_slots_on_the_adapters_modules_alone_give_the_same_bits(make_engine, adapters):
    """lora_target_modules by default (partial's modules: no slots, no LoRA kernels, on o_proj, the router and
    the dense MLP) against slots on every module: the same tokens and logprobs, from CUDA graphs and eagerly."""
    kwargs = dict(device="cuda", dtype="bfloat16", cuda_graph_max_bs=8, max_total_tokens=4096,
                  lora_paths={"partial": str(adapters(FAMILY)["partial"].path)})
    default, everything = (make_engine(FAMILY, lora_target_modules=t, **kwargs) for t in (None, "all"))
    router = [e.runner.model.model.layers[0].mlp.gate.lora for e in (default, everything)]
    assert router[0] is None and router[1] is not None and default.runner.graphs is not None
    params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=5, ignore_eos=True)
    loras = ["partial" if i % 2 else None for i in range(5)]
    got, want = (e.generate(prompts(5), params, lora=loras) for e in (default, everything))
    assert [(o.token_ids, o.logprobs) for o in got] == [(o.token_ids, o.logprobs) for o in want]


def _largest_costs(profile: cProfile.Profile, lines: int = 12) -> str:
    """The profile's functions of the most time spent in them and what they called."""
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("cumulative").print_stats(lines)
    return text.getvalue()


@pytest.mark.parametrize("newcomer", [False, True])
def test_a_step_launched_ahead_does_not_wait_for_the_device(make_engine, newcomer):
    """With overlap scheduling a step's host work (scheduling, the batch's and the sampler's
    host-to-device copies, penalties, a token mask, reading the step before) must not wait for the
    device: with it busy for tens of milliseconds after the step in flight, Engine.step returns long
    before the device is done (a blocking copy anywhere would wait for the busy work). `newcomer`: the
    timed step also admits a penalised request (its prompt, its penalty row's reset: session 48's audit found
    that reset waiting)."""
    engine = make_engine(FAMILY, device="cuda", dtype="bfloat16", cuda_graph_max_bs=8, max_total_tokens=4096,
                         disable_overlap_schedule=False)
    params = [SamplingParams(max_tokens=8, temperature=0.8, seed=i, presence_penalty=0.5, logit_bias={7: 1.0},
                             min_tokens=2, allowed_token_ids=list(range(3, 80)) if i == 1 else None, ignore_eos=True)
              for i in range(3)]
    for p, sp, lora in zip(prompts(3), params, LORAS):
        engine.add_request(p, sp, lora=lora)
    engine.step()
    engine.step()  # prompts read, the first decode step in flight; every kernel compiled
    if newcomer:
        engine.add_request(prompts(4)[3], SamplingParams(max_tokens=4, repetition_penalty=1.2, ignore_eos=True))
    busy = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    gc.collect()  # a full collection of the test process's garbage in the timed step is no wait for the device
    gc.disable()
    profile = cProfile.Profile()  # where the host's time went, if it was too long
    try:
        for _ in range(200):  # about 300 ms of an H100 or H200, queued after the step in flight
            busy @ busy
        start = time.perf_counter()
        profile.enable()
        outputs = engine.step()
        profile.disable()
        returned = time.perf_counter()
        torch.cuda.synchronize()
        done = time.perf_counter()
    finally:
        gc.enable()
    # a step that waited would return with the device near done; the launches above are not timed: beside other
    # processes on the device they may wait for room in the launch queue
    host, busy_after = returned - start, done - returned
    assert len(outputs) == 3 and host < busy_after, (
        f"the step's host work took {host:.3f} s, the device was busy {busy_after:.3f} s after it; its largest "
        f"costs:\n{_largest_costs(profile)}")
    while engine.has_unfinished():
        engine.step()


def test_writing_an_adapter_into_a_slot_does_not_wait_for_the_device(make_engine, adapters):
    """The host copies of adapters are staged (page-locked, in the slots' layout), so putting one into a GPU slot
    queues its copies and returns: with the device busy for tens of milliseconds, `prepare` returns long before the
    device is done, and the slot then holds what a synchronous write of the adapter's plain share gives."""
    engine = make_engine(FAMILY, device="cuda", dtype="bfloat16", max_total_tokens=4096, max_loras_per_batch=2,
                         lora_paths={n: str(a.path) for n, a in adapters(FAMILY).items()})
    lora = engine.runner.lora
    assert lora.pool.peek("full") is None  # (no adapter is in a slot before a request names it)
    busy = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    # as test_a_step_launched_ahead_does_not_wait_for_the_device: the earlier tests' engines are garbage, and a
    # collection in the timed part would destroy their CUDA graphs, which may wait for the device
    gc.collect()
    gc.disable()
    try:
        start = time.perf_counter()
        for _ in range(200):
            busy @ busy
        torch.cuda.set_sync_debug_mode("error")  # names a synchronizing call it knows (session 48: one element's
        # `ranks[slot, part] = rank`, a copy from pageable memory)
        slot, = lora.prepare(["full"], in_use=set())
        host = time.perf_counter() - start
        torch.cuda.synchronize()
        device = time.perf_counter() - start
    finally:
        torch.cuda.set_sync_debug_mode(0)
        gc.enable()
    assert host < device / 3, f"writing the adapter took {host:.3f} s of the host's {device:.3f} s"
    written = [t.clone() for t in _slot_tensors(engine.runner.model, slot)]
    write_share_to_slot(engine.runner.model, share_of(engine.runner.model, load_adapter(
        adapters(FAMILY)["full"].path, lora.shapes)), slot)
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(written, _slot_tensors(engine.runner.model, slot), strict=True))


@pytest.mark.parametrize("max_cpu_loras", [None, 2], ids=["host-all", "host-2"])
def test_overlap_loading_gives_the_bits_of_an_engine_without_it(make_engine, adapters, wide_adapter, max_cpu_loras):
    """More adapters than slots with enable_lora_overlap_loading: the waiting requests' adapters are copied on a
    stream of their own while the steps go on (and, with host memory for 2 of the 3 adapters, read back from disk in
    a thread of their own, staged there), and every request gets the bits an engine without either gives."""
    options = dict(device="cuda", dtype="bfloat16", cuda_graph_max_bs=8, max_total_tokens=4096, max_lora_rank=32,
                   max_loras_per_batch=2,
                   lora_paths={**{n: str(a.path) for n, a in adapters(FAMILY).items()}, "wide": wide_adapter})
    params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=3, ignore_eos=True)
    loras = [LORAS[i % 4] for i in range(12)]
    overlapped = make_engine(FAMILY, enable_lora_overlap_loading=True, max_cpu_loras=max_cpu_loras, **options)
    assert overlapped.runner.lora._copy_stream is not None
    got = overlapped.generate(prompts(12), params, lora=loras)
    expected = make_engine(FAMILY, **options).generate(prompts(12), params, lora=loras)
    assert [(o.token_ids, o.logprobs) for o in got] == [(o.token_ids, o.logprobs) for o in expected]
    stats = overlapped.runner.lora.stats
    assert stats.slot_evictions > 0 and (stats.disk_loads > 3 or max_cpu_loras is None)


def _slot_tensors(model, slot: int) -> list[torch.Tensor]:
    """Every LoRA slot buffer's part of `slot` (the experts' ranks: [3, S, E])."""
    return [t[:, slot] if name == "ranks" and t.dim() == 3 else t[slot] for m in model.modules()
            if getattr(m, "lora", None) is not None for name, t in vars(m.lora).items() if isinstance(t, torch.Tensor)]


@pytest.mark.parametrize("graphs", [True, False])
def test_a_started_engine_compiles_nothing_while_serving(make_engine, adapters, wide_adapter, monkeypatch, graphs):
    """The start's warm-up steps and graph captures compile every kernel variant a step can pick (the tiles follow
    the token counts in classes, the counts themselves are not specialised: kernels/__init__.py), so no request
    stalls the running ones for a compile: prompts of many lengths, the base model and adapters of each rank bound
    mixed, decode batches inside and past the graphs' sizes, and prompt pieces beside decode rows (mixed steps, after
    any number of decode rows); with the graphs off too (every step eager)."""
    engine = make_engine(FAMILY, device="cuda", dtype="bfloat16", cuda_graph_max_bs=8, disable_cuda_graph=not graphs,
                         max_total_tokens=4096,
                         max_lora_rank=32, max_loras_per_batch=3, chunked_prefill_size=256, enable_mixed_chunk=True,
                         lora_paths={**{n: str(a.path) for n, a in adapters(FAMILY).items()}, "wide": wide_adapter})
    compiled = record_compiles(monkeypatch)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    for bs, length in ((1, 1), (3, 7), (5, 33), (12, 20), (2, 300), (9, 100)):
        batch = [[(7 * i + 3 * j) % 90 + 3 for j in range(length + i)] for i in range(bs)]
        engine.generate(batch, params, lora=[LORAS[i % 4] for i in range(bs)])
    # newcomers while 1, 2, 3 requests decode: their prompts join those decode rows' steps
    for running in (1, 2, 3):
        for i in range(running):
            engine.add_request(prompts(1)[0], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
                               lora=LORAS[i])
        engine.step()
        engine.step()  # the running requests decode
        engine.add_request([5 + running] * 40, params, lora="wide")
        while engine.has_unfinished():
            engine.step()
    assert engine.step_stats.mixed_steps > 0
    assert compiled == [], f"compiled while serving: {compiled}"


def test_a_profile_holds_the_kernels_of_graph_replays(engines, tmp_path):
    """stop_profile's summary is device time by kernel, the decode steps' kernels included though they ran inside
    CUDA graph replays, and the tokens are those of an unprofiled run."""
    graphed, _ = engines
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    want = [o.token_ids for o in graphed.generate(prompts(4), params, lora=LORAS)]
    graphed.start_profile(str(tmp_path))
    assert [o.token_ids for o in graphed.generate(prompts(4), params, lora=LORAS)] == want
    (trace,) = graphed.stop_profile()
    summary = read_summary(trace)
    assert summary["device"] == "cuda"
    launches = {name: n for name, (n, _) in summary["kernels"].items()}
    # 5 decode steps from graphs, 1 prompt step: each kernel of a layer at least 6 times a layer
    layers = len(graphed.runner.model.config.moe_layers)
    for kernel in ("_linear_kernel", "gate_up_kernel", "down_kernel"):
        assert launches.get(kernel, 0) >= 6 * layers, (kernel, sorted(launches.items(), key=lambda kv: -kv[1])[:20])
