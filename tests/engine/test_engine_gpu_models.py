"""The engine on a GPU in bf16: for every family, prompt log-probs of the base model and two PEFT
adapters (one batch) against the fp32 CPU engine, and greedy tokens of a request alone equal to
those it gets in a batch mixed with other adapters and the base model; then a dummy-weight model of
Qwen3-30B-A3B's real sizes serving 8 rank-16 adapters in one batch; adapters of ranks up to 256."""
import gc
import shutil

import pytest
import torch
from peft import LoraConfig

from moelora.engine.sampling_params import SamplingParams
from tests.engine.dummy_qwen3 import check_adapters_in_one_batch, dummy_qwen3_engine
from tests.models.conftest import EXPERT_PARAMS
from tests.models.families import FAMILIES, MAX_OFF, bf16_tolerance, family_config, hf_model, share_off
from tests.support import peft_adapter

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


# the dummy Qwen3-30B-A3B's engine takes about 70 GiB (weights 57 GiB in bf16, 8 rank-16 slots on every expert
# 12 GiB, graphs under 1 GiB), and the suite's other engines run beside it on the same GPU: it passed on an H100
# (79 GiB)
GPU_GIB_FOR_QWEN3_30B = 78


@pytest.mark.skipif(torch.cuda.is_available() and
                    torch.cuda.get_device_properties(0).total_memory < GPU_GIB_FOR_QWEN3_30B * 2**30,
                    reason=f"the dummy Qwen3-30B-A3B with 8 adapter slots beside the other tests' engines needs a GPU "
                           f"of {GPU_GIB_FOR_QWEN3_30B} GiB (an H100)")
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


def test_adapters_of_ranks_up_to_256_serve(make_engine, tmp_path):
    """Slots of rank 256 (the largest rank tile of the experts' kernels) with adapters of rank 200 (attention and
    every expert) and 130 (the experts): bf16 prompt log-probs against the fp32 CPU engine, and CUDA-graph decode
    bitwise equal to eager. The kernels' pipelines at these rank tiles were cut to Hopper's shared memory by
    compiling them; this runs them."""
    config = family_config("qwen3_moe")
    lora_paths = {}
    for name, rank, modules in [("r200", 200, ["q_proj", "v_proj", "o_proj"]), ("r130", 130, [])]:
        lora_paths[name] = str(tmp_path / name)
        peft_adapter(hf_model(config), LoraConfig(r=rank, lora_alpha=rank, target_modules=modules,
                                                  target_parameters=EXPERT_PARAMS), tmp_path / name, seed=rank)
    options = dict(max_lora_rank=256, max_loras_per_batch=2, lora_paths=lora_paths)
    loras = [None, "r200", "r130"]
    jobs = [(p, a) for a in loras for p in PROMPTS[:4]]
    prompts, job_loras = [p for p, _ in jobs], [a for _, a in jobs]
    want = make_engine("qwen3_moe", **options).prompt_logprobs(prompts, lora=job_loras)
    rows = {a: [i for i, b in enumerate(job_loras) if b == a] for a in loras}
    tols = {a: bf16_tolerance([want[i] for i in rows[a]], config.num_hidden_layers) for a in loras}
    for a, b in [(None, "r200"), (None, "r130"), ("r200", "r130")]:  # the check tells the adapters apart
        assert share_off([want[i] for i in rows[b]], [want[i] for i in rows[a]], tols[a]) > MAX_OFF, f"{b} passes for {a}"
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=2)
    batch, batch_loras = PROMPTS[:4], ["r200", "r130", None, "r200"]
    outputs = []
    for graphs in [dict(cuda_graph_max_bs=4), dict(disable_cuda_graph=True)]:
        engine = make_engine("qwen3_moe", **graphs, **GPU, **options)
        got = engine.prompt_logprobs(prompts, lora=job_loras)  # both engines: the same prefixes cached before decode
        for a in loras:
            off = share_off([got[i] for i in rows[a]], [want[i] for i in rows[a]], tols[a])
            assert off <= MAX_OFF, f"{a or 'base'}: {off:.0%} of positions off by more than {tols[a]:.3f}"
        outputs.append(engine.generate(batch, params, lora=batch_loras))
        del engine
    for i, (g, e) in enumerate(zip(*outputs)):
        assert g.token_ids == e.token_ids and g.logprobs == e.logprobs, f"request {i} ({batch_loras[i] or 'base'})"
