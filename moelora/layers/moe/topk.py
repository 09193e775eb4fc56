"""The MoE block's first stage, TopK: the router (a LoRA-able Linear) and the top-k expert selection of
every MoE family we serve.

Selection runs on CUDA as one Triton kernel (moelora/kernels/topk.py) where it covers the config, otherwise
as plain torch ops (`select_experts_reference`). Both keep fixed shapes and never synchronise with the host,
so they run inside CUDA graphs.
"""
from __future__ import annotations

import torch
from torch import nn

from moelora.core import LoRABatch, TopKConfig, TopKOutput
from moelora.kernels.topk import fused_topk, fused_topk_supports
from moelora.layers.linear import Linear


class TopK(Linear):
    """x [T, H] -> TopKOutput (weights float32 [T, k], ids int32 [T, k] of global experts, best first).

    Its parameters carry the checkpoints' names under `mlp.gate`: `weight` (the router [E, H], LoRA-able as
    "mlp.gate") and, for DeepSeek-V3, `e_score_correction_bias` [E] (fp32), which shifts the choice of
    experts but not their weights."""

    def __init__(self, hidden_size: int, num_experts: int, config: TopKConfig, layer_id: int,
                 correction_bias: bool = False):
        super().__init__(hidden_size, num_experts, part_names=("mlp.gate",), layer_id=layer_id)
        self.config = config
        self.e_score_correction_bias = (nn.Parameter(torch.empty(num_experts, dtype=torch.float32), requires_grad=False)
                                        if correction_bias else None)

    def forward(self, x: torch.Tensor, lora: LoRABatch | None = None) -> TopKOutput:
        return select_experts(super().forward(x, lora), self.config, self.e_score_correction_bias)


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
        choice = _mask_to_best_groups(choice, config, use_top2=correction_bias is not None)

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


def _mask_to_best_groups(choice: torch.Tensor, config: TopKConfig, use_top2: bool) -> torch.Tensor:
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
