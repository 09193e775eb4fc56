import math

import pytest
import torch

from moelora.core import TopKConfig
from moelora.kernels.topk import MAX_EXPERTS, MAX_TOP_K, fused_topk_supports, select_experts
from tests.support import assert_rows_close, rel_tolerance, tie_free_router_logits

# The interpreter rounds fp32 -> bf16 toward zero, so bf16 logits are checked on GPUs only.
DTYPES = [torch.bfloat16, torch.float32] if torch.cuda.is_available() else [torch.float16, torch.float32]
SHAPES = [(e, k) for e in (8, 60, 64, 128, 256) for k in (1, 2, 6, 8) if k <= e]  # experts, top_k
FAMILIES = {  # name: (config fields, whether the router has a correction bias)
    "softmax": (dict(renormalize=True), False),  # Qwen, Mixtral, OLMoE
    "softmax-raw-scaled": (dict(renormalize=False, routed_scaling_factor=2.5), False),
    "sigmoid": (dict(scoring="sigmoid"), False),
    "sigmoid-bias": (dict(scoring="sigmoid", renormalize=False), True),
    "grouped-softmax": (dict(renormalize=False, routed_scaling_factor=1.5, grouped=True), False),  # DeepSeek-V2
    "grouped-sigmoid-bias": (dict(scoring="sigmoid", routed_scaling_factor=2.5, grouped=True), True),  # DeepSeek-V3
}


def _config(family: str, num_experts: int, top_k: int) -> TopKConfig:
    fields, _ = FAMILIES[family]
    fields = dict(fields)
    if fields.pop("grouped", False):
        groups = 4 if num_experts < 64 else 8
        # about half the groups, and at least enough of them to hold k experts
        fields.update(num_expert_group=groups, topk_group=max(groups // 2, math.ceil(top_k * groups / num_experts)))
    return TopKConfig(top_k=top_k, **fields)


def _case(family, num_experts, top_k, num_tokens, dtype, device):
    gen = torch.Generator().manual_seed(torch.seed())
    config = _config(family, num_experts, top_k)
    bias = (torch.randn(num_experts, generator=gen) * 0.3).to(device) if FAMILIES[family][1] else None
    return tie_free_router_logits(num_tokens, num_experts, config, bias, dtype, device, generator=gen), config, bias


def _check(got, want, device, what=""):
    assert got.weights.dtype == torch.float32 and got.ids.dtype == torch.int32
    assert got.weights.is_contiguous() and got.ids.is_contiguous()
    assert torch.equal(got.ids, want.ids), f"{what}: ids differ in rows {(got.ids != want.ids).any(-1).nonzero()}"
    assert_rows_close(got.weights, want.weights, rel_tolerance(torch.float32, device), f"{what} weights")


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("shape", SHAPES)
def test_matches_reference(shape, family, device, poison):
    """Every family at every size; few tokens, as each is a program of its own (slow in the interpreter)."""
    logits, config, bias = _case(family, *shape, 8, torch.float32, device)
    want = select_experts(logits, config, bias, impl="torch")
    _check(select_experts(logits, config, bias, impl="triton"), want, device, f"{config}")


@pytest.mark.parametrize("family", ["softmax", "grouped-sigmoid-bias"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_logit_dtypes_and_strides(family, dtype, device, poison):
    """Logits in the model's dtype and a strided view (a column slice of a wider output)."""
    logits, config, bias = _case(family, 64, 6, 37, dtype, device)
    wide = torch.cat([logits, torch.full_like(logits[:, :5], float("nan"))], dim=1)[:, :64]
    want = select_experts(logits, config, bias, impl="torch")
    _check(select_experts(wide, config, bias, impl="triton"), want, device, f"{dtype}")


def test_single_token_and_empty_batch(device, poison):
    logits, config, bias = _case("grouped-sigmoid-bias", 256, 8, 1, torch.float32, device)
    want = select_experts(logits, config, bias, impl="torch")
    _check(select_experts(logits, config, bias, impl="triton"), want, device)
    empty = select_experts(logits[:0], config, bias, impl="triton")
    assert empty.weights.shape == empty.ids.shape == (0, 8)


def test_ties_go_to_the_lower_index(device):
    """Equal scores: experts (and groups) are taken in index order. The interpreter's argmax always takes
    the first of equals, so only the compiled kernel (this file on a GPU) really tests tie_break_left."""
    logits = torch.zeros(3, 64, device=device)
    out = select_experts(logits, TopKConfig(top_k=6), impl="triton")
    assert out.ids.tolist() == [list(range(6))] * 3
    torch.testing.assert_close(out.weights, torch.full((3, 6), 1 / 6, device=device))
    grouped = TopKConfig(top_k=3, scoring="sigmoid", num_expert_group=8, topk_group=2)
    logits[:, 40:48] = 1.0  # group 5 best, then groups 0..4 and 6, 7 tie
    assert select_experts(logits, grouped, impl="triton").ids.tolist() == [[40, 41, 42]] * 3
    logits[:, 40:48] = -1.0  # group 5 worst; groups 0 and 1 win the tie
    assert select_experts(logits, TopKConfig(top_k=12, num_expert_group=8, topk_group=2), impl="triton").ids.tolist() \
        == [list(range(12))] * 3


@pytest.mark.parametrize("num_experts, config, bias, supported", [
    (MAX_EXPERTS, TopKConfig(top_k=MAX_TOP_K), False, True),
    (MAX_EXPERTS + 1, TopKConfig(top_k=8), False, False),
    (64, TopKConfig(top_k=MAX_TOP_K + 1), False, False),
    (64, TopKConfig(top_k=9, num_expert_group=8, topk_group=1), False, False),  # 8 experts kept, k = 9
    (64, TopKConfig(top_k=8, num_expert_group=8, topk_group=1), False, True),
    (8, TopKConfig(top_k=2, scoring="sigmoid", num_expert_group=8, topk_group=2), True, False),  # top-2 of 1 expert
    (8, TopKConfig(top_k=2, num_expert_group=8, topk_group=2), False, True),
])
def test_supported_configs(num_experts, config, bias, supported):
    assert fused_topk_supports(num_experts, config, bias) == supported


def test_unsupported_config_runs_the_reference_or_refuses():
    logits, config = torch.randn(5, 300), TopKConfig(top_k=4)
    torch.testing.assert_close(select_experts(logits, config), select_experts(logits, config, impl="torch"))
    with pytest.raises(ValueError, match="does not cover"):
        select_experts(logits, config, impl="triton")
    with pytest.raises(ValueError, match="impl must be"):
        select_experts(logits[:, :8], config, impl="cuda")
