"""Prompt-step CUDA graphs (moelora/engine/cuda_graph.py). On the CPU: a prompt step padded the way the graphs
pad it (PaddedPrompt) gives its real rows the logits and cache entries of the step run as it is, its padding
rows stay finite, and it writes no cache slot but its own and slot 0. On a GPU: prompt steps replayed from the
graphs give the bits of the same engine run eagerly."""
import gc

import pytest
import torch

from moelora.core import ForwardBatch
from moelora.engine import model_runner
from moelora.engine.config import EngineConfig
from moelora.engine.cuda_graph import (PROMPT_ROWS, GraphCapture, PaddedPrompt, PromptGraphs, RankBounds,
                                       collector_paused, decode_graph_sizes, prompt_graph_sizes)
from moelora.engine.sampling_params import SamplingParams
from moelora.kernels import gemm_tiles
from moelora.kernels import linear as linear_module

FAMILY = "qwen3_moe"


class _Cycle:
    """Garbage only the cyclic collector frees; counts its collections."""
    freed = 0

    def __init__(self):
        self.me = self

    def __del__(self):
        _Cycle.freed += 1


@pytest.mark.parametrize("enabled", [True, False])
def test_no_collection_while_graphs_are_captured(enabled):
    """collector_paused collects what was garbage before the captures and none during them (a collection may destroy
    another engine's graphs, which fails the capture running: seen on an H200), then leaves the collector as it was."""
    (gc.enable if enabled else gc.disable)()
    try:
        _Cycle.freed = 0
        _Cycle()
        with collector_paused():
            assert _Cycle.freed == 1 and not gc.isenabled()
            for _ in range(3 * gc.get_threshold()[0]):
                _Cycle()
            assert _Cycle.freed == 1
        assert gc.isenabled() == enabled
    finally:
        gc.enable()
        gc.collect()


def test_prompt_graph_sizes_double_from_64_then_pad_by_at_most_half():
    assert prompt_graph_sizes(1024) == [64, 128, 256, 512, 1024]
    assert prompt_graph_sizes(4096) == [64, 128, 256, 512, 1024, 1536, 2048, 3072, 4096]
    assert prompt_graph_sizes(5000) == [64, 128, 256, 512, 1024, 1536, 2048, 3072, 4096, 5000]
    assert prompt_graph_sizes(300) == [64, 128, 256, 300]
    assert prompt_graph_sizes(64) == [64] and prompt_graph_sizes(10) == [10]


def test_decode_graph_sizes_every_8_to_256_then_every_16():
    assert decode_graph_sizes(8) == [1, 2, 4, 8] and decode_graph_sizes(1) == [1] and decode_graph_sizes(3) == [1, 2, 3]
    assert decode_graph_sizes(128) == [1, 2, 4, *range(8, 129, 8)]
    assert decode_graph_sizes(256) == [1, 2, 4, *range(8, 257, 8)]
    assert decode_graph_sizes(300) == [1, 2, 4, *range(8, 257, 8), 272, 288, 300]
    assert decode_graph_sizes(130)[-2:] == [128, 130]


@pytest.mark.parametrize("slots_rank, slotted, keys", [(64, True, [0, 16, 64]), (32, True, [0, 16, 32]),
                                                      (16, True, [0, 16]), (8, True, [0, 8]), (64, False, [0, 64]),
                                                      (0, False, [0])])
def test_a_graph_for_each_rank_bound(make_engine, slots_rank, slotted, keys):
    """The graphs' keys: no LoRA (0) and, with LoRA, each rank bound a step can run with (one, the slots' rank, when
    no layer has slots); a step replays the graph of the bound LoRAManager.prepare set for it, on every layer."""
    loras = make_engine(FAMILY, max_lora_rank=64).runner.lora.slot_buffers if slotted else []
    bounds = RankBounds(loras, slots_rank)
    assert bounds.keys == keys
    runner = make_engine(FAMILY).runner
    base, adapted = prompt_step(runner, [3], [-1]), prompt_step(runner, [3], [0])
    for key in keys:
        assert bounds.set(key) == (key > 0)
        assert all(lora.max_rank_in_use == (key or slots_rank) for lora in loras)
        assert bounds.key(base) == 0 and bounds.key(adapted) == (key or slots_rank if slots_rank else 0)


def prompt_step(runner, lengths: list[int], slots: list[int]) -> ForwardBatch:
    """Prompts of `lengths` tokens on request rows 1.. and cache slots 1.., adapter slot slots[i] each."""
    new_tokens = [[(7 * i + 3 * j) % 90 + 3 for j in range(n)] for i, n in enumerate(lengths)]
    ends = torch.tensor(lengths).cumsum(0)
    return ForwardBatch.build(runner.kv, list(range(1, len(lengths) + 1)), new_tokens, [0] * len(lengths),
                              torch.arange(1, sum(lengths) + 1), (ends - 1).tolist(),
                              [s for s, n in zip(slots, lengths) for _ in range(n)], 0)


@pytest.mark.parametrize("slots", [[-1, -1, -1], [0, -1, 1]], ids=["base", "adapters"])
def test_a_padded_prompt_step_matches_the_step_as_it_is(make_engine, poison, slots):
    runner = make_engine(FAMILY).runner
    batch = prompt_step(runner, [5, 9, 14], slots)
    kv = runner.kv
    with torch.inference_mode():
        eager = runner.logits(batch)
        keys = [k.clone() for k in kv.k]
        table = kv.req_to_token.clone()
        padded = PaddedPrompt(kv, 64)
        assert padded.fits(batch, 64)
        padded.fill(batch, 64)
        step = padded.batch(64, batch.lora is not None)
        hidden = runner.model(step)
        logits = runner.model.compute_logits(hidden[step.logits_indices])
    # every token is some sequence's (the padding ones the padding sequence's): attention writes every row
    covered = [t for start, n in zip(step.extend_starts.tolist(), step.extend_lens.tolist()) for t in range(start, start + n)]
    assert sorted(covered) == list(range(64)) and (step.seq_lens >= step.extend_lens).all()
    assert torch.isfinite(hidden).all()
    torch.testing.assert_close(logits[:3], eager)
    assert torch.isfinite(logits).all()
    real = set(range(1, batch.num_tokens + 1))
    for before, after in zip(keys, kv.k):
        changed = set((before != after).flatten(1).any(1).nonzero().flatten().tolist())
        assert changed <= real | {0}
        torch.testing.assert_close(after[sorted(real)], before[sorted(real)])
    assert torch.equal(kv.req_to_token, table) and not kv.req_to_token[0].any()


def test_which_steps_fit(make_engine):
    runner = make_engine(FAMILY).runner
    padded = PaddedPrompt(runner.kv, 128)
    assert padded.fits(prompt_step(runner, [30, 34], [-1, -1]), 64)
    assert not padded.fits(prompt_step(runner, [30, 35], [-1, -1]), 64)  # 65 tokens
    assert not padded.fits(prompt_step(runner, [1] * PROMPT_ROWS, [-1] * PROMPT_ROWS), 128)  # no row for the padding
    assert padded.fits(prompt_step(runner, [1] * (PROMPT_ROWS - 1), [-1] * (PROMPT_ROWS - 1)), 128)
    mixed = ForwardBatch.build(runner.kv, [1, 2], [[5], [6, 7]], [3, 0], torch.arange(1, 4), [0, 2], [-1] * 3, 1)
    assert not padded.fits(mixed, 64)  # a decode row: eager


GPU = dict(device="cuda", dtype="bfloat16", cuda_graph_max_bs=8, max_total_tokens=4096,
           cuda_graph_max_prefill_tokens=512)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("lengths", [[4], [5, 9, 14], [100, 37], [60, 90, 100], [200, 150, 100]],
                         ids=["1", "3", "137", "250", "450"])
def test_prompt_graphs_give_the_eager_bits(make_engine, monkeypatch, lengths):
    """A 450-token step runs the dense GEMMs on prefill tiles, which load through the copy engine's descriptors on
    Hopper (kernels/linear.py): captured in the graph as they are."""
    descriptors = []  # the copy engine's, made at the graphs' capture
    real_descriptor = linear_module.tma_descriptor
    monkeypatch.setattr(linear_module, "tma_descriptor",
                        lambda t, block: descriptors.append(real_descriptor(t, block)) or descriptors[-1])
    graphed, eager = make_engine(FAMILY, **GPU), make_engine(FAMILY, disable_cuda_graph=True, **GPU)
    assert graphed.runner.prompt_graphs.sizes == [64, 128, 256, 512] and eager.runner.prompt_graphs is None
    assert any(d is not None for d in descriptors) == gemm_tiles.has_copy_engine(torch.device("cuda"))
    replays = []
    real_replay = PromptGraphs.replay
    monkeypatch.setattr(PromptGraphs, "replay", lambda self, batch, size: replays.append(size) or real_replay(self, batch, size))
    prompts = [[(11 * i + 5 * j) % 90 + 3 for j in range(n)] for i, n in enumerate(lengths)]
    # prompt log-probabilities need a logits row per prompt token: only a short step has rows for them all
    prompt_logprobs = 2 if sum(lengths) < PROMPT_ROWS else None
    params = SamplingParams(max_tokens=3, temperature=0.0, logprobs=5, prompt_logprobs=prompt_logprobs, ignore_eos=True)
    loras = [[None, "full", "partial"][i % 3] for i in range(len(lengths))]
    outs = [e.generate(prompts, params, lora=loras) for e in (graphed, eager)]
    assert replays == [next(s for s in (64, 128, 256, 512) if s >= sum(lengths))]  # the prompt step; decode: CudaGraphs
    for g, e in zip(*outs):
        assert g.token_ids == e.token_ids and g.logprobs == e.logprobs and g.prompt_logprobs == e.prompt_logprobs


def test_the_decode_and_prompt_graphs_share_one_capture(make_engine, monkeypatch):
    """One GraphCapture, its pool and stream, for both sets of graphs: a pool per set would keep the scratch of the
    largest graph of each apart. Faked on the CPU (no CUDA graphs there): the start's graph phases record theirs."""
    given = {}

    class Stop(Exception):
        pass

    def decode_graphs(*args):
        given["decode"] = args[-1]
        return "decode graphs"

    def prompt_graphs(*args):
        given["prompt"] = args[-1]
        raise Stop
    monkeypatch.setattr(EngineConfig, "use_cuda_graph", property(lambda self: True))
    monkeypatch.setattr(model_runner, "GraphCapture", lambda device: object())
    monkeypatch.setattr(model_runner, "CudaGraphs", decode_graphs)
    monkeypatch.setattr(model_runner, "PromptGraphs", prompt_graphs)
    with pytest.raises(Stop):
        make_engine(FAMILY, max_prefill_tokens=32, cuda_graph_max_bs=4, cuda_graph_max_prefill_tokens=16)
    assert given["decode"] is given["prompt"] and given["decode"] is not None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_graphs_of_one_capture_hold_one_graphs_scratch():
    """40 graphs (more than the 32 streams torch hands out in turn), each with 64 MiB of scratch, hold about one
    graph's scratch between them, and each replays what it captured."""
    capture, mib = GraphCapture(torch.device("cuda")), 2**20
    out = torch.full((40,), float("nan"), device="cuda")

    def run(i: int) -> torch.Tensor:
        scratch = torch.full((16 * mib,), float(i), device="cuda")  # 64 MiB of float32, freed within the capture
        return out[i:i + 1].copy_(scratch[-1:])
    torch.cuda.synchronize()
    with collector_paused():  # the earlier tests' engines, garbage now, must not be collected during a capture
        torch.cuda.empty_cache()
        before = torch.cuda.memory_reserved()
        graphs = [capture(lambda i=i: run(i)) for i in range(40)]
        grown = torch.cuda.memory_reserved() - before
    assert grown <= 2 * 64 * mib, f"the graphs' pool grew by {grown / mib:.0f} MiB"
    out.fill_(float("nan"))
    for graph in reversed(graphs):
        graph.replay()
    assert out.tolist() == [float(i) for i in range(40)]
