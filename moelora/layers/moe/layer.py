"""The MoE block of a decoder layer (its `mlp`), in the four stages every MoE engine has:

    TopK (router + expert selection) -> Dispatcher (the pairs this rank's experts run)
      -> Runner (grouped expert GEMMs with per-expert LoRA, weighted top-k sum) -> Combine (shared experts,
      the ranks' partial sums reduced; without shared experts, the all-to-all dispatch's gather instead)

Under expert parallelism (the current `moelora.distributed` state) the rank holds its group's share of the
experts, and of each its share of the intermediate dimension; the router is replicated, so every rank
routes every token alike.

Parameter names: `gate.weight` and `gate.e_score_correction_bias` (the checkpoints' own), `experts.w13`,
`experts.w2` (the routed experts, stacked), and the shared experts' Linears under `combine`.
"""
from __future__ import annotations

import torch
from torch import nn

from moelora.core import LoRABatch, TopKConfig, TopKOutput
from moelora.distributed.sharding import even_shard, size_of
from moelora.distributed.state import get_parallel
from moelora.layers.mlp import MLP
from moelora.layers.moe.all_to_all import AllToAllDispatcher
from moelora.layers.moe.combine import Combine
from moelora.layers.moe.dispatcher import Dispatcher
from moelora.layers.moe.runner import Runner
from moelora.layers.moe.topk import TopK


class MoE(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, topk: TopKConfig, layer_id: int,
                 shared_experts: MLP | None = None, shared_expert_gate: bool = False, correction_bias: bool = False,
                 backend: str = "auto"):
        super().__init__()
        self.layer_id = layer_id
        state = get_parallel()
        experts = even_shard(num_experts, state.ep_size, state.ep_rank, "the routed experts")
        inter = even_shard(intermediate_size, state.moe_tp_size, state.moe_tp_rank, "the experts' intermediate size")
        self.gate = TopK(hidden_size, num_experts, topk, layer_id, correction_bias)
        self.dispatcher = (AllToAllDispatcher(num_experts, state) if state.moe_dispatch == "all_to_all" and state.tp_size > 1
                           else Dispatcher(num_experts, experts.start, size_of(experts)))
        self.experts = Runner(hidden_size, intermediate_size, num_experts, layer_id, backend, experts, inter)
        self.combine = Combine(hidden_size, layer_id, shared_experts, shared_expert_gate)
        # the all-to-all brings every token's sum to every rank itself, when no shared experts' partial sums need
        # Combine's all-reduce
        self.gathers = isinstance(self.dispatcher, AllToAllDispatcher) and shared_experts is None

    def forward(self, x: torch.Tensor, lora: LoRABatch | None) -> torch.Tensor:
        dispatched = self.dispatcher.dispatch(x, self.gate(x, lora), lora)
        y = self.experts(dispatched.x, dispatched.topk, dispatched.lora)
        if self.gathers:
            return self.dispatcher.gather(y, dispatched)
        return self.combine(x, self.dispatcher.combine(y, dispatched), lora)

    @property
    def rows_follow_routing(self) -> bool:
        """Whether the rows this rank's experts run follow the routing (the all-to-all dispatch's: any number up to
        the step's tokens) rather than the step's token count (the all-reduce Dispatcher's: every token)."""
        return isinstance(self.dispatcher, AllToAllDispatcher)

    def run_experts_alone(self, num_rows: int, slot: int) -> torch.Tensor:
        """This rank's experts (Runner) on num_rows rows of zeros, row t routed to k of them from t on (fewer where
        the rank holds fewer than k), with adapter slot `slot` (-1: none), and no collective: the start's warm-up
        compiles here each kernel variant that a number of received rows can pick, wherever its prompts route."""
        w13, k = self.experts.w13, self.gate.config.top_k
        num_local = self.experts.num_experts
        picks = torch.arange(k, device=w13.device)
        rows = torch.arange(num_rows, device=w13.device)[:, None]
        ids = torch.where(picks < num_local, (rows + picks) % num_local, -1).to(torch.int32)
        weights = torch.full((num_rows, k), 1 / k, dtype=torch.float32, device=w13.device)
        lora = LoRABatch(torch.full((num_rows,), slot, dtype=torch.int32, device=w13.device)) if slot >= 0 else None
        x = torch.zeros(num_rows, w13.shape[2], dtype=w13.dtype, device=w13.device)
        return self.experts(x, TopKOutput(weights, ids), lora)
