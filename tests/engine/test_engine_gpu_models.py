"""The engine on a GPU in bf16: for every family, prompt log-probs of the base model and two PEFT
adapters (one batch) against the fp32 CPU engine, and greedy tokens of a request alone equal to
those it gets in a batch mixed with other adapters and the base model; then a dummy-weight model of
Qwen3-30B-A3B's real sizes serving 8 rank-16 adapters in one batch."""
import gc
import shutil

import pytest
import torch

from moelora.engine.sampling_params import SamplingParams
from tests.engine.dummy_qwen3 import check_adapters_in_one_batch, dummy_qwen3_engine
from tests.models.families import FAMILIES, MAX_OFF, bf16_tolerance, family_config, share_off

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

DEVICE = "cuda"
GPU = dict(device=DEVICE, dtype="bfloat16", max_total_tokens=4096)  # a small KV cache: engines share the GPU
LORAS = [None, "full", "partial"]
PROMPTS = [[(7 * i + 3 * j) % 90 + 3 for j in range(5 + i)] for i in range(6)]  # 5 to 10 tokens
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
