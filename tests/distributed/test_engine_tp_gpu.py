"""Tensor and expert parallel on 2 and 4 GPUs (NCCL), each layout (tp x ep, experts reached by all-reduce or all-to-all)
against one GPU, in bf16: prompt log-probs within bf16 rounding, greedy tokens of one batch of the base model and 8
adapters (ranks 2 to 64, two of them on some experts only) equal but where one GPU's pick and the layout's are within
bf16 rounding of each other, and a prompt step past the all-to-all's fixed capacity within it too; decode and prompt
steps replayed from CUDA graphs, whose capture includes the collectives (the all-to-all's at fixed capacity too), give
the bits of the same engine run eagerly, from the graphs of each rank bound; a request gets the same tokens alone as in
a batch; adapters loaded, unloaded and evicted with requests in flight serve as if loaded from the start. Layouts that
need more GPUs than the machine has are skipped."""
import math
import threading

import pytest
import torch

from moelora.engine.engine import Engine
from moelora.engine.sampling_params import SamplingParams
from tests.distributed.load_unload import REQUESTS, drive_load_and_unload, greedy
from tests.models.families import MAX_OFF, bf16_tolerance, family_config, share_off

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")]

FAMILY = "qwen3_moe"
# the base model and 8 adapters: "full" rank 4 everywhere, "partial" rank 2 on some projections, "first_half" rank 4
# on experts [0, E/2), "last_quarter" rank 8 on [3E/4, E) (one ep rank's at ep 4); batches of up to 4 requests run the
# experts' LoRA with rank bound 16, larger ones (r64 among them) with 64
LORAS = [None, "full", "partial", "first_half", "last_quarter", "r4", "r8", "r16", "r64"]
# no start-time prompt steps: these tests compare outputs, not latency; prompt graphs of 64, 128 and 256 tokens (the
# all-to-all dispatch's largest), which hold these tests' prompt steps, and their capture stays short
GPU = dict(device="cuda", dtype="bfloat16", cuda_graph_max_bs=16, cuda_graph_max_prefill_tokens=256,
           max_total_tokens=4096, skip_server_warmup=True, max_lora_rank=64, max_loras_per_batch=8)
PARAMS = SamplingParams(max_tokens=8, temperature=0.0, logprobs=5, ignore_eos=True)
# (tp, ep, dispatch): ep 1 splits every expert over the tp ranks (the dispatch is moot); ep = tp puts whole experts
# on each rank
LAYOUTS = [(2, 1, "all_reduce"), (2, 2, "all_reduce"), (2, 2, "all_to_all"), (4, 1, "all_reduce"),
           (4, 2, "all_to_all"), (4, 4, "all_reduce"), (4, 4, "all_to_all")]


# 3 x 120 tokens: one prompt step past 256 tokens
LONG_PROMPTS = [([(7 * i + 3 * j) % 90 + 3 for j in range(120)], adapter)
                for i, adapter in enumerate(["full", "last_quarter", None])]


def prompts(bs: int) -> list[list[int]]:
    return [[(11 * i + 5 * j) % 90 + 3 for j in range(4 + i % 5)] for i in range(bs)]


def layout_id(layout: tuple) -> str:
    tp, ep, dispatch = layout
    return f"tp{tp}-ep{ep}-{dispatch}"


def needs_gpus(layouts: list[tuple]) -> list:
    return [pytest.param(layout, id=layout_id(layout), marks=pytest.mark.skipif(
        torch.cuda.device_count() < layout[0], reason=f"needs {layout[0]} CUDA devices")) for layout in layouts]


def _lora_paths(adapters, split_adapters) -> dict[str, str]:
    """LORAS' adapter files (the session fixtures')."""
    paths = {**{n: str(a.path) for n, a in adapters(FAMILY).items()}, **split_adapters(FAMILY)}
    return {n: p for n, p in paths.items() if n in LORAS}


@pytest.fixture
def gpu_options(adapters, split_adapters) -> dict:
    return {**GPU, "lora_paths": _lora_paths(adapters, split_adapters)}


@pytest.fixture(scope="module")
def one_gpu(checkpoint, adapters, split_adapters):
    """One GPU's outputs (_outputs), from graphs as the layouts' are."""
    engine = Engine(str(checkpoint(FAMILY)), lora_paths=_lora_paths(adapters, split_adapters), **GPU)
    try:
        return _outputs(engine)
    finally:
        engine.shutdown()


def _outputs(engine: Engine) -> tuple[list, list[torch.Tensor], list[torch.Tensor]]:
    """Greedy outputs (with log-probs) of one batch of a prompt for each of LORAS; prompt log-probs of the same 3
    prompts under each of LORAS (in that order), one batch; prompt log-probs of LONG_PROMPTS, one step of more tokens
    than the all-to-all's fixed capacity (its counted way) and than the prompt graphs hold (eager)."""
    logprob_prompts = prompts(3)
    return (engine.generate(prompts(len(LORAS)), PARAMS, lora=LORAS),
            engine.prompt_logprobs(logprob_prompts * len(LORAS), lora=[a for a in LORAS for _ in logprob_prompts]),
            engine.prompt_logprobs([p for p, _ in LONG_PROMPTS], lora=[a for _, a in LONG_PROMPTS]))


def _decode_logprobs_off(got: list, want: list, tol: float, what: str) -> float:
    """Share of decode positions where a log-prob of one of want's top tokens (that got has too) is off by more than
    tol, over each request's positions up to the first where the tokens part (after it the prefixes differ). They
    may part only where got's token is one of want's top ones, within 2 * tol of want's: bf16 rounding of either
    run can order such two either way."""
    off, positions = 0, 0
    for i, (g, w) in enumerate(zip(got, want)):
        parted = next((k for k, (a, b) in enumerate(zip(g.token_ids, w.token_ids)) if a != b), None)
        for k in range(len(w.token_ids) if parted is None else parted + 1):
            common = w.logprobs[k].keys() & g.logprobs[k].keys()
            off += any(abs(g.logprobs[k][t] - w.logprobs[k][t]) > tol for t in common)
            positions += 1
        if parted is not None:
            theirs, mine = w.logprobs[parted][w.token_ids[parted]], w.logprobs[parted].get(g.token_ids[parted])
            assert mine is not None and theirs - mine <= 2 * tol, (
                f"{what}, request {i} ({LORAS[i] or 'base'}): token {parted} is {g.token_ids[parted]}, one GPU's "
                f"{w.token_ids[parted]}; one GPU's top log-probs there {w.logprobs[parted]} put them more than "
                f"2 x {tol:.3f} apart (bf16 rounding)")
    return off / positions


@pytest.mark.parametrize("layout", needs_gpus(LAYOUTS))
def test_layout_matches_one_gpu(layout, start_engine, gpu_options, one_gpu):
    """Ranks that dropped or double-counted a share of a projection, of an expert's rows or of a token's experts,
    or an adapter's experts written to the wrong rank, move log-probs by far more than bf16 rounding: each
    adapter's log-probs are told apart from every other's by the same check."""
    tp, ep, dispatch = layout
    engine = start_engine(FAMILY, tp_size=tp, ep_size=ep, moe_dispatch=dispatch, **gpu_options)
    (got_out, got, got_long), (want_out, want, want_long) = _outputs(engine), one_gpu
    # Both runs round as bf16_tolerance says (4 ulps a layer); the layout's run rounds more: each rank's share of
    # o_proj and of the experts' sum, ~1/sqrt(tp) of it, to bf16 before the shares are added (in fp32, rounded once;
    # at tp 2 in bf16, one more rounding): tp such roundings add up to about one ulp of the sum, two with its own,
    # for each of the two sums a layer. The two runs' errors are independent.
    tol = bf16_tolerance(want, family_config(FAMILY).num_hidden_layers, ulps_per_layer=math.hypot(4, 4 + 2 * 2))
    per = len(want) // len(LORAS)
    rows = {a: slice(i * per, (i + 1) * per) for i, a in enumerate(LORAS)}
    for a, mine in rows.items():
        for b, theirs in rows.items():  # the check must tell this adapter from the others
            if b != a:
                assert share_off(want[theirs], want[mine], tol) > MAX_OFF, f"{b} passes for {a}"
        off = share_off(got[mine], want[mine], tol)
        assert off <= MAX_OFF, f"{layout_id(layout)}, {a or 'base'}: {off:.0%} of positions off by more than {tol:.3f}"
    off = _decode_logprobs_off(got_out, want_out, tol, layout_id(layout))
    assert off <= MAX_OFF, f"{layout_id(layout)}: {off:.0%} of decode positions off by more than {tol:.3f}"
    off = share_off(got_long, want_long, tol)
    assert off <= MAX_OFF, \
        f"{layout_id(layout)}, a prompt step of 360 tokens: {off:.0%} of positions off by more than {tol:.3f}"


@pytest.mark.parametrize("layout", needs_gpus([(2, 2, "all_reduce"), (2, 2, "all_to_all"), (4, 1, "all_reduce"),
                                               (4, 4, "all_to_all")]))
def test_graphs_capture_the_collectives(layout, start_engine, gpu_options):
    tp, ep, dispatch = layout
    options = dict(tp_size=tp, ep_size=ep, moe_dispatch=dispatch, **gpu_options)
    graphed = start_engine(FAMILY, **options)
    assert graphed.runner.graphs is not None
    assert {key for _, key in graphed.runner.graphs.graphs} == {0, 16, 64}
    got = [(o.token_ids, o.logprobs) for bs in (1, 3, len(LORAS))
           for o in graphed.generate(prompts(bs), PARAMS, lora=LORAS[:bs])]
    alone = [(o.token_ids, o.logprobs) for p, a in zip(prompts(len(LORAS)), LORAS)
             for o in graphed.generate([p], PARAMS, lora=[a])]
    assert [t for t, _ in got[-len(LORAS):]] == [t for t, _ in alone], "a request's tokens depend on its batch"
    graphed.shutdown()  # one world per process: the eager engine's comes next
    eager = start_engine(FAMILY, disable_cuda_graph=True, **options)
    assert [(o.token_ids, o.logprobs) for bs in (1, 3, len(LORAS))
            for o in eager.generate(prompts(bs), PARAMS, lora=LORAS[:bs])] == got


@pytest.mark.parametrize("layout", needs_gpus([(2, 2, "all_to_all"), (4, 4, "all_to_all")]))
def test_load_and_unload_while_serving(layout, start_engine, adapters):
    """Two LoRA slots: "late" loaded and "full" unloaded with a request of it in flight, "late" evicted for
    "partial"; each request's tokens are then those it gets alone from the same engine once every adapter is loaded
    (a request's tokens do not depend on its batch, so any slot written to the wrong place, on any rank, shows)."""
    tp, ep, dispatch = layout
    engine = start_engine(FAMILY, tp_size=tp, ep_size=ep, moe_dispatch=dispatch, device="cuda", dtype="bfloat16",
                          cuda_graph_max_bs=8, cuda_graph_max_prefill_tokens=256, max_total_tokens=4096,
                          skip_server_warmup=True)
    paths = {name: str(a.path) for name, a in adapters(FAMILY).items()}
    served = drive_load_and_unload(engine, paths["partial"])
    assert engine.lora_stats.slot_evictions > 0
    engine.load_lora("full", paths["full"])
    alone = [engine.generate([p], greedy(n), lora=[a])[0].token_ids for p, n, a in REQUESTS]
    assert served == alone


def test_an_engine_on_another_device_steps_from_any_thread(start_engine, gpu_options):
    """Triton launches on the calling thread's current device: an engine on cuda:1 stepped from a thread that
    starts on device 0 (as a server's engine thread does) computes what the same engine on cuda:0 does."""
    batch = prompts(4)
    on_0 = start_engine(FAMILY, **gpu_options).generate(batch, PARAMS, lora=LORAS[:4])
    on_1 = start_engine(FAMILY, **{**gpu_options, "device": "cuda:1"})
    result = []
    thread = threading.Thread(target=lambda: result.append(on_1.generate(batch, PARAMS, lora=LORAS[:4])))
    thread.start()
    thread.join()
    assert [o.token_ids for o in result[0]] == [o.token_ids for o in on_0]
    assert [o.logprobs for o in result[0]] == [o.logprobs for o in on_0]
