"""TopK against the routers of the transformers model families themselves."""
import pytest
import torch
from transformers import DeepseekV2Config, DeepseekV3Config, MixtralConfig, Qwen3MoeConfig
from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter
from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

from moelora.core import TopKConfig
from moelora.kernels.topk import select_experts

HIDDEN, TOKENS = 32, 50


def _by_id(weights, ids):
    """Routers may return the k experts in any order: sort each row by expert id."""
    order = ids.long().argsort(dim=-1)
    return weights.float().gather(1, order), ids.long().gather(1, order)


def _compare(router, logits_fn, config, bias=None):
    router.weight.data.normal_()
    x = torch.randn(TOKENS, HIDDEN)
    out = router(x)
    ref_w, ref_ids = out[1], out[2]
    got = select_experts(logits_fn(x, router), config, bias)
    assert got.weights.dtype == torch.float32 and got.ids.dtype == torch.int32
    assert got.weights.shape == got.ids.shape == (TOKENS, config.top_k)
    got_w, got_ids = _by_id(*got)
    ref_w, ref_ids = _by_id(ref_w, ref_ids)
    assert torch.equal(got_ids, ref_ids)
    torch.testing.assert_close(got_w, ref_w, rtol=1e-6, atol=1e-7)


def _linear(x, router):
    return torch.nn.functional.linear(x.float(), router.weight.float())


@pytest.mark.parametrize("norm", [True, False])
def test_softmax_topk_matches_qwen3_moe(norm):
    cfg = Qwen3MoeConfig(hidden_size=HIDDEN, num_experts=12, num_experts_per_tok=4, norm_topk_prob=norm)
    _compare(Qwen3MoeTopKRouter(cfg), _linear, TopKConfig(top_k=4, renormalize=norm))


def test_softmax_topk_matches_mixtral():
    cfg = MixtralConfig(hidden_size=HIDDEN, num_local_experts=8, num_experts_per_tok=2)
    _compare(MixtralTopKRouter(cfg), _linear, TopKConfig(top_k=2, renormalize=True))


def test_grouped_topk_matches_deepseek_v2():
    cfg = DeepseekV2Config(hidden_size=HIDDEN, n_routed_experts=16, num_experts_per_tok=3, n_group=4, topk_group=2,
                           topk_method="group_limited_greedy", routed_scaling_factor=1.5)
    _compare(DeepseekV2TopkRouter(cfg), _linear,
             TopKConfig(top_k=3, renormalize=False, num_expert_group=4, topk_group=2, routed_scaling_factor=1.5))


def test_sigmoid_biased_grouped_topk_matches_deepseek_v3():
    cfg = DeepseekV3Config(hidden_size=HIDDEN, n_routed_experts=32, num_experts_per_tok=4, n_group=8, topk_group=3,
                           norm_topk_prob=True, routed_scaling_factor=2.5)
    router = DeepseekV3TopkRouter(cfg)
    router.e_score_correction_bias.normal_(0, 0.3)  # large enough to change choices
    config = TopKConfig(top_k=4, renormalize=True, scoring="sigmoid", num_expert_group=8, topk_group=3,
                        routed_scaling_factor=2.5)
    _compare(router, _linear, config, router.e_score_correction_bias)


def test_bias_changes_choice_not_weights():
    logits = torch.randn(TOKENS, 8)
    bias = torch.zeros(8)
    bias[3] = 10.0  # expert 3 always chosen, weighted by its own unbiased score
    out = select_experts(logits, TopKConfig(top_k=2, renormalize=False, scoring="sigmoid"), bias)
    assert (out.ids == 3).any(-1).all()
    w3 = out.weights[out.ids == 3]
    torch.testing.assert_close(w3, logits[:, 3].sigmoid())


def test_topk_rejects_bad_config():
    logits = torch.randn(4, 8)
    with pytest.raises(ValueError, match="top_k=9"):
        select_experts(logits, TopKConfig(top_k=9))
    with pytest.raises(ValueError, match="not divisible by num_expert_group"):
        select_experts(logits, TopKConfig(top_k=2, num_expert_group=3, topk_group=1))
    with pytest.raises(ValueError, match="correction_bias must have shape"):
        select_experts(logits, TopKConfig(top_k=2), torch.zeros(7))
