"""MoE routing at real model shapes on a GPU, bf16 router logits (scripts/gpu_check.sh); skipped on CPU machines."""
import pytest
import torch

from moelora.core import TopKConfig
from moelora.kernels.topk import select_experts
from tests.support import assert_rows_close, rel_tolerance, tie_free_router_logits

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

ROUTERS = {  # experts, config, whether the router has a correction bias
    "qwen3-30b-a3b": (128, TopKConfig(top_k=8, renormalize=True), False),
    "mixtral": (8, TopKConfig(top_k=2, renormalize=True), False),
    "deepseek-v2-lite-grouped": (64, TopKConfig(top_k=6, renormalize=False, num_expert_group=8, topk_group=3,
                                                routed_scaling_factor=1.0), False),
    "deepseek-v2": (160, TopKConfig(top_k=6, renormalize=False, num_expert_group=8, topk_group=3,
                                    routed_scaling_factor=16.0), False),
    "deepseek-v3": (256, TopKConfig(top_k=8, renormalize=True, scoring="sigmoid", num_expert_group=8, topk_group=4,
                                    routed_scaling_factor=2.5), True),
}


def _router(model, tokens, gen):
    num_experts, config, has_bias = ROUTERS[model]
    bias = (torch.randn(num_experts, generator=gen) * 0.3).cuda() if has_bias else None
    logits = tie_free_router_logits(tokens, num_experts, config, bias, torch.bfloat16, "cuda", generator=gen)
    return logits, config, bias


@pytest.mark.parametrize("tokens", [1, 7, 513, 8192])
@pytest.mark.parametrize("model", list(ROUTERS))
def test_real_shape_matches_reference(model, tokens, poison):
    gen = torch.Generator().manual_seed(torch.seed())
    logits, config, bias = _router(model, tokens, gen)
    got, want = select_experts(logits, config, bias), select_experts(logits, config, bias, impl="torch")
    bad = (got.ids != want.ids).any(-1).nonzero().flatten().tolist()
    assert not bad, f"{model} T={tokens}: ids differ in rows {bad[:10]}"
    assert_rows_close(got.weights, want.weights, rel_tolerance(torch.float32, "cuda"), f"{model} T={tokens} weights")


@pytest.mark.parametrize("model", list(ROUTERS))
def test_row_does_not_depend_on_batch(model, poison):
    gen = torch.Generator().manual_seed(torch.seed())
    logits, config, bias = _router(model, 1000, gen)
    batch = select_experts(logits, config, bias)
    for t in (0, 1, 500, 999):
        alone = select_experts(logits[t:t + 1], config, bias)
        assert torch.equal(alone.ids[0], batch.ids[t]) and torch.equal(alone.weights[0], batch.weights[t]), f"token {t}"


def test_replays_in_a_cuda_graph():
    gen = torch.Generator().manual_seed(torch.seed())
    logits, config, bias = _router("deepseek-v3", 16, gen)
    logits_buf = logits.clone()
    select_experts(logits_buf, config, bias)  # compile outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = select_experts(logits_buf, config, bias)
    for _ in range(2):
        logits = tie_free_router_logits(16, 256, config, bias, torch.bfloat16, "cuda", generator=gen)
        logits_buf.copy_(logits)
        graph.replay()
        want = select_experts(logits, config, bias, impl="torch")
        assert torch.equal(out.ids, want.ids)
        assert_rows_close(out.weights, want.weights, rel_tolerance(torch.float32, "cuda"), "graph replay")
