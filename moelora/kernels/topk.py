"""MoE routing in one launch: router logits [T, E] -> top-k weights fp32 [T, k] and expert ids int32 [T, k].

_topk_kernel, one program (one warp: every reduction stays in registers and shuffles) per token:
scores = softmax or sigmoid of the logits in fp32; the choice is the scores plus the optional
correction bias; grouped routing sets every expert outside the topk_group best of num_expert_group
groups to -inf (a group scores as its best choice, or with a bias as the sum of its two best); then
k rounds of argmax pick the experts, best first, each weighted by its unbiased score; renormalise
and scale. Ties, between experts or between groups, go to the lower index (torch leaves the order
of ties unspecified, so only tie-free inputs compare exactly). Outputs depend only on their own row.

The torch version is `select_experts_reference`; `select_experts` picks the kernel or it for each config.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from moelora.core import TopKConfig, TopKOutput
from moelora.kernels.pdl import pdl_launch, wait_for_previous_kernel

MAX_EXPERTS = 256
MAX_TOP_K = 16


@triton.jit
def _mask_to_best_groups(choice, experts, GROUP_SIZE: tl.constexpr, NUM_GROUPS: tl.constexpr,
                         TOPK_GROUP: tl.constexpr, G_P: tl.constexpr, TOP2: tl.constexpr):
    """choice [E_P] with the experts outside the TOPK_GROUP best groups set to -inf."""
    groups = tl.arange(0, G_P)
    member = (experts // GROUP_SIZE)[None, :] == groups[:, None]  # [G_P, E_P]; padding experts fall past NUM_GROUPS
    grouped = tl.where(member, choice[None, :], float("-inf"))
    score = tl.max(grouped, 1)
    if TOP2:  # the best and the second best (equal to the best when tied, as torch.topk has it)
        first = tl.argmax(grouped, 1, tie_break_left=True)
        score += tl.max(tl.where(experts[None, :] == first[:, None], float("-inf"), grouped), 1)
    score = tl.where(groups < NUM_GROUPS, score, float("-inf"))
    keep = groups < 0
    for _ in tl.static_range(TOPK_GROUP):
        best = tl.argmax(score, 0, tie_break_left=True)
        keep = keep | (groups == best)
        score = tl.where(groups == best, float("-inf"), score)
    kept = tl.max((member & keep[:, None]).to(tl.int32), 0) > 0
    return tl.where(kept, choice, float("-inf"))


@triton.jit
def _topk_kernel(
    logits_ptr, bias_ptr, weights_ptr, ids_ptr, num_experts, stride_lt, stride_le, routed_scaling_factor,
    TOP_K: tl.constexpr, SIGMOID: tl.constexpr, HAS_BIAS: tl.constexpr, RENORMALIZE: tl.constexpr,
    GROUP_SIZE: tl.constexpr, NUM_GROUPS: tl.constexpr, TOPK_GROUP: tl.constexpr,
    E_P: tl.constexpr, G_P: tl.constexpr, K_P: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_previous_kernel(PDL)
    t = tl.program_id(0).to(tl.int64)
    experts = tl.arange(0, E_P)
    valid = experts < num_experts
    logits = tl.load(logits_ptr + t * stride_lt + experts * stride_le, mask=valid, other=float("-inf"))
    logits = logits.to(tl.float32)
    if SIGMOID:
        scores = tl.sigmoid(logits)
    else:
        p = tl.exp(logits - tl.max(logits, 0))
        scores = p / tl.sum(p, 0)
    choice = scores
    if HAS_BIAS:
        choice += tl.load(bias_ptr + experts, mask=valid, other=0.0).to(tl.float32)
    choice = tl.where(valid, choice, float("-inf"))
    if NUM_GROUPS > 1:
        choice = _mask_to_best_groups(choice, experts, GROUP_SIZE, NUM_GROUPS, TOPK_GROUP, G_P, HAS_BIAS)

    ranks = tl.arange(0, K_P)
    ids = tl.zeros((K_P,), dtype=tl.int32)
    weights = tl.zeros((K_P,), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        best = tl.argmax(choice, 0, tie_break_left=True)
        ids = tl.where(ranks == j, best, ids)
        weights = tl.where(ranks == j, tl.sum(tl.where(experts == best, scores, 0.0), 0), weights)
        choice = tl.where(experts == best, float("-inf"), choice)  # the kernel is only run when k finite choices exist
    if RENORMALIZE:
        weights = weights / tl.sum(weights, 0)
    weights = weights * routed_scaling_factor
    tl.store(weights_ptr + t * TOP_K + ranks, weights, mask=ranks < TOP_K)
    tl.store(ids_ptr + t * TOP_K + ranks, ids, mask=ranks < TOP_K)


def fused_topk_supports(num_experts: int, config: TopKConfig, has_bias: bool) -> bool:
    """Whether the kernel covers the (already validated) config; the reference runs the others."""
    if num_experts > MAX_EXPERTS or config.top_k > MAX_TOP_K:
        return False
    if config.num_expert_group is None or config.num_expert_group <= 1:
        return True
    group_size = num_experts // config.num_expert_group
    # fewer kept experts than k would make the reference pick masked (-inf) ones
    return config.topk_group * group_size >= config.top_k and (group_size >= 2 or not has_bias)


def fused_topk(router_logits: torch.Tensor, config: TopKConfig,
               correction_bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights fp32 [T, k], ids int32 [T, k]) for a config that `fused_topk_supports`."""
    num_tokens, num_experts = router_logits.shape
    weights = torch.empty(num_tokens, config.top_k, dtype=torch.float32, device=router_logits.device)
    ids = torch.empty(num_tokens, config.top_k, dtype=torch.int32, device=router_logits.device)
    if num_tokens == 0:
        return weights, ids
    num_groups = config.num_expert_group or 1
    bias = router_logits if correction_bias is None else correction_bias.contiguous()  # never read without a bias
    _topk_kernel[(num_tokens,)](
        router_logits, bias, weights, ids, num_experts, *router_logits.stride(), float(config.routed_scaling_factor),
        TOP_K=config.top_k, SIGMOID=config.scoring == "sigmoid", HAS_BIAS=correction_bias is not None,
        RENORMALIZE=config.renormalize, GROUP_SIZE=num_experts // num_groups, NUM_GROUPS=num_groups,
        TOPK_GROUP=config.topk_group or 1, E_P=triton.next_power_of_2(num_experts),
        G_P=triton.next_power_of_2(num_groups), K_P=triton.next_power_of_2(config.top_k), num_warps=1,
        **pdl_launch(router_logits.device),
    )
    return weights, ids


def select_experts(
    router_logits: torch.Tensor,
    config: TopKConfig,
    correction_bias: torch.Tensor | None = None,
    *,
    impl: str = "auto",
) -> TopKOutput:
    """router_logits [T, E] -> TopKOutput (weights float32 [T, k], ids int32 [T, k]), experts best
    first. impl: "triton", "torch" or "auto" (triton on CUDA when the kernel covers the config)."""
    _check_inputs(router_logits, config, correction_bias)
    supported = fused_topk_supports(router_logits.shape[1], config, correction_bias is not None)
    if impl == "auto":
        impl = "triton" if router_logits.is_cuda and supported else "torch"
    if impl == "torch":
        return select_experts_reference(router_logits, config, correction_bias)
    if impl == "triton":
        if not supported:
            raise ValueError(f"the routing kernel does not cover {config} with {router_logits.shape[1]} experts")
        return TopKOutput(*fused_topk(router_logits, config, correction_bias))
    raise ValueError(f"impl must be 'auto', 'triton' or 'torch', got {impl!r}")


def select_experts_reference(
    router_logits: torch.Tensor,
    config: TopKConfig,
    correction_bias: torch.Tensor | None = None,
) -> TopKOutput:
    """`select_experts` in torch ops, for inputs that passed its checks."""
    logits = router_logits.float()
    scores = logits.softmax(dim=-1) if config.scoring == "softmax" else logits.sigmoid()
    choice = scores if correction_bias is None else scores + correction_bias.float()

    if config.num_expert_group is not None and config.num_expert_group > 1:
        choice = _mask_to_best_groups_reference(choice, config, use_top2=correction_bias is not None)

    _, ids = torch.topk(choice, config.top_k, dim=-1, sorted=True)
    weights = scores.gather(1, ids)
    if config.renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if config.routed_scaling_factor != 1.0:
        weights = weights * config.routed_scaling_factor
    return TopKOutput(weights, ids.to(torch.int32))


def _check_inputs(router_logits: torch.Tensor, config: TopKConfig, correction_bias: torch.Tensor | None) -> None:
    """Shape and config checks only: nothing here reads device memory (CUDA-graph safe)."""
    if router_logits.dim() != 2:
        raise ValueError(f"router_logits must be [tokens, experts], got shape {tuple(router_logits.shape)}")
    num_experts = router_logits.shape[1]
    if not 0 < config.top_k <= num_experts:
        raise ValueError(f"top_k={config.top_k} must be in [1, num_experts={num_experts}]")
    if correction_bias is not None and correction_bias.shape != (num_experts,):
        raise ValueError(f"correction_bias must have shape ({num_experts},), got {tuple(correction_bias.shape)}")
    n_group, topk_group = config.num_expert_group, config.topk_group
    if n_group is not None and n_group > 1:
        if topk_group is None or not 0 < topk_group <= n_group:
            raise ValueError(f"topk_group={topk_group} must be in [1, num_expert_group={n_group}]")
        if num_experts % n_group:
            raise ValueError(f"num_experts={num_experts} is not divisible by num_expert_group={n_group}")


def _mask_to_best_groups_reference(choice: torch.Tensor, config: TopKConfig, use_top2: bool) -> torch.Tensor:
    num_tokens, num_experts = choice.shape
    n_group, topk_group = config.num_expert_group, config.topk_group
    grouped = choice.view(num_tokens, n_group, num_experts // n_group)
    if use_top2:
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
    else:
        group_scores = grouped.amax(dim=-1)
    best_groups = group_scores.topk(topk_group, dim=-1, sorted=False).indices
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best_groups, True)
    return choice.masked_fill(~keep.unsqueeze(-1).expand_as(grouped).reshape_as(choice), float("-inf"))
