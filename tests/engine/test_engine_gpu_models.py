"""The engine on a GPU in bf16: for every family, prompt log-probs of the base model and two PEFT
adapters (one batch) against the fp32 CPU engine, and greedy tokens of a request alone equal to
those it gets in a batch mixed with other adapters and the base model; then a dummy-weight model of
Qwen3-30B-A3B's real sizes serving 8 rank-16 adapters in one batch."""
import gc
import math
import shutil

import pytest
import torch

from moelora.engine.sampling_params import SamplingParams
from tests.engine.dummy_qwen3 import check_adapters_in_one_batch, dummy_qwen3_engine
from tests.models.families import FAMILIES, family_config

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

DEVICE = "cuda"
GPU = dict(device=DEVICE, dtype="bfloat16", max_total_tokens=4096)  # a small KV cache: engines share the GPU
LORAS = [None, "full", "partial"]
PROMPTS = [[(7 * i + 3 * j) % 90 + 3 for j in range(5 + i)] for i in range(6)]  # 5 to 10 tokens
TOP = 5  # log-probs compared at the reference's most likely tokens of each position
# Share of positions allowed past the rounding tolerance: where two experts' router scores nearly
# tie, bf16 rounding can pick the other one for a token, an O(1) change of that layer's output that
# no rounding bound covers (and that reaches later positions through attention). The CPU engine in
# bf16 shows it at up to 1 position in 10 on these models; another adapter's log-probs are off everywhere.
MAX_OFF = 0.25


def bf16_tolerance(reference: list[torch.Tensor], num_layers: int) -> float:
    """The largest log-prob error that bf16 rounding explains. Each layer adds to the residual stream
    a few values rounded to bf16 (the normed inputs and outputs of attention and of the MoE block),
    each off by up to one ulp, 2^-8 of its size: about 4 ulps per layer. Rounding errors of different
    layers are independent and add like a random walk, so the final hidden state is off by
    4 * 2^-8 * sqrt(L) of its size, and the logits by that share of their scale (the largest
    |logit - mean logit| of the reference). A log-prob is a logit minus the log-sum-exp; both move,
    hence twice that. The CPU engine in bf16 is off by a tenth of it at the median position (0.5-2
    ulps of the logits' scale), another adapter's log-probs by 7-20 times it."""
    scale = max((r - r.mean(-1, keepdim=True)).abs().max().item() for r in reference)
    return 2 * 4 * 2.0**-8 * math.sqrt(num_layers) * scale


def share_off(got: list[torch.Tensor], want: list[torch.Tensor], tol: float) -> float:
    """Share of positions where a log-prob of one of want's TOP tokens is off by more than tol."""
    errors = []
    for g, w in zip(got, want):
        top = w.topk(TOP, dim=-1).indices
        errors.append((g.gather(1, top) - w.gather(1, top)).abs().amax(-1))
    return (torch.cat(errors) > tol).float().mean().item()


@pytest.fixture(autouse=True)
def release_gpu_memory():
    """A test's engines are gone once it returns (reference cycles aside): their GPU memory goes back
    before the next test builds its own."""
    yield
    gc.collect()
    torch.cuda.empty_cache()


def test_qwen3_30b_dummy_serves_8_adapters_in_one_batch(tmp_path):
    """A dummy Qwen3-30B-A3B at its real sizes serves 8 adapters in one batch. First in the file: the longest test
    (about 200 s on a cold Triton cache) then starts first when scripts/gpu_engine_check.sh spreads the file over
    workers (pytest-xdist hands tests out in collection order), instead of last, past the script's time limit."""
    engine = dummy_qwen3_engine(tmp_path, tiny=False, device=DEVICE, max_total_tokens=8192, cuda_graph_max_bs=16)
    shutil.rmtree(tmp_path)  # 10 GB of adapters, read already
    assert 30e9 < sum(p.numel() for p in engine.runner.model.parameters()) < 31e9 and engine.runner.dtype == torch.bfloat16
    check_adapters_in_one_batch(engine)


@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_logprobs_match_fp32_cpu(family, make_engine):
    jobs = [(p, a) for a in LORAS for p in PROMPTS]
    prompts, loras = [p for p, _ in jobs], [a for _, a in jobs]
    want = make_engine(family).prompt_logprobs(prompts, lora=loras)
    engine = make_engine(family, disable_cuda_graph=True, **GPU)  # prefill only: no decode graphs needed
    got = engine.prompt_logprobs(prompts, lora=loras)
    num_layers = family_config(family).num_hidden_layers
    rows = {a: [i for i, (_, b) in enumerate(jobs) if b == a] for a in LORAS}
    for a, mine in rows.items():
        reference = [want[i] for i in mine]
        tol = bf16_tolerance(reference, num_layers)
        for b, theirs in rows.items():  # the check must tell this adapter from the others
            if b != a:
                assert share_off([want[i] for i in theirs], reference, tol) > MAX_OFF, f"{b} passes for {a}"
        off = share_off([got[i] for i in mine], reference, tol)
        assert off <= MAX_OFF, f"{family} {a or 'base'}: {off:.0%} of positions off by more than {tol:.3f}"


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_tokens_do_not_depend_on_the_batch(family, make_engine):
    engine = make_engine(family, cuda_graph_max_bs=8, **GPU)  # alone: graph of 1; together: of 8, padded
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=2)
    loras = [LORAS[i % 3] for i in range(len(PROMPTS))]
    alone = [engine.generate([p], params, lora=[a])[0] for p, a in zip(PROMPTS, loras)]
    together = engine.generate(PROMPTS, params, lora=loras)
    for i, (one, mixed) in enumerate(zip(alone, together)):
        if one.token_ids != mixed.token_ids:
            step = next(j for j, (x, y) in enumerate(zip(one.token_ids, mixed.token_ids)) if x != y)
            pytest.fail(f"{family} request {i} ({loras[i] or 'base'}): tokens differ from step {step} on, alone "
                        f"{one.token_ids[step]}, in the batch {mixed.token_ids[step]}; top log-probs there alone "
                        f"{one.logprobs[step]}, in the batch {mixed.logprobs[step]} (a near-tie shows a bit-level difference)")
