"""Tensor and expert parallel on two GPUs (NCCL): decode and prompt steps replayed from CUDA graphs, whose capture
includes the collectives (the all-to-all dispatch's at fixed capacity too), give the bits of the same engine run
eagerly, from the graphs of both experts' rank bounds (slots of rank 64: steps of adapters of rank <= 16, and steps
with a rank-64 one); a request gets the same tokens alone as in a batch (two ranks sum in either order alike);
log-probs of two GPUs, by all-reduce and by all-to-all, are those of one GPU within bf16 rounding."""
import pytest
import torch

from moelora.engine.sampling_params import SamplingParams
from tests.models.families import assert_logprobs_close

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")]

FAMILY = "qwen3_moe"
# batches of up to 4 requests run the experts' LoRA with rank bound 16, larger ones (r64 among them) with 64
LORAS = [None, "full", "partial", "first_half", "r64", "r4", "r16", "full"]
# no start-time prompt steps: these tests compare outputs, not latency
GPU = dict(device="cuda", dtype="bfloat16", cuda_graph_max_bs=8, max_total_tokens=4096, skip_server_warmup=True,
           max_lora_rank=64, max_loras_per_batch=6)
PARAMS = SamplingParams(max_tokens=8, temperature=0.0, logprobs=5, ignore_eos=True)


def prompts(bs: int) -> list[list[int]]:
    return [[(11 * i + 5 * j) % 90 + 3 for j in range(4 + i % 5)] for i in range(bs)]


@pytest.fixture
def gpu_options(adapters, split_adapters) -> dict:
    """GPU, with the family's adapters and the split ones (an adapter on the first half of the experts, ranks 4,
    16 and 64)."""
    paths = {**{n: str(a.path) for n, a in adapters(FAMILY).items()}, **split_adapters(FAMILY)}
    return {**GPU, "lora_paths": {n: p for n, p in paths.items() if n in LORAS}}


def _outputs(engine, sizes=(1, 3, 8)) -> list[tuple[list[int], list]]:
    return [(o.token_ids, o.logprobs) for bs in sizes
            for o in engine.generate(prompts(bs), PARAMS, lora=LORAS[:bs])]


@pytest.mark.parametrize("dispatch", ["all_reduce", "all_to_all"])
def test_graphs_capture_the_collectives(start_engine, gpu_options, dispatch):
    graphed = start_engine(FAMILY, tp_size=2, ep_size=2, moe_dispatch=dispatch, **gpu_options)
    assert graphed.runner.graphs is not None
    assert {key for _, key in graphed.runner.graphs.graphs} == {0, 16, 64}
    got = _outputs(graphed)
    alone = [(o.token_ids, o.logprobs) for p, a in zip(prompts(8), LORAS) for o in graphed.generate([p], PARAMS, lora=[a])]
    assert [t for t, _ in got[-8:]] == [t for t, _ in alone], "a request's tokens depend on its batch"
    graphed.shutdown()  # one world per process: the eager engine's comes next
    eager = start_engine(FAMILY, tp_size=2, ep_size=2, moe_dispatch=dispatch, disable_cuda_graph=True, **gpu_options)
    assert _outputs(eager) == got


@pytest.mark.parametrize("dispatch", ["all_reduce", "all_to_all"])
def test_two_gpus_match_one(start_engine, gpu_options, dispatch):
    one = start_engine(FAMILY, **gpu_options)
    two = start_engine(FAMILY, tp_size=2, ep_size=2, moe_dispatch=dispatch, **gpu_options)
    loras = LORAS[:6]
    for got, want in zip(two.prompt_logprobs(prompts(6), lora=loras), one.prompt_logprobs(prompts(6), lora=loras)):
        assert_logprobs_close(got, want, dispatch, atol=0.05)  # bf16: the ranks' partial sums round apart
