"""Expert-parallel dispatch by all-to-all (`torch.distributed.all_to_all_single`).

The hidden states are replicated over the ranks (attention is tensor-parallel), so each rank takes its share
of the tokens (rank r: rows [r * c, (r + 1) * c), c = ceil(T / ranks)) and sends each of their (token, expert)
pairs, with the token's hidden state, its adapter slot and the pair's routing weight, to the ranks of the
expert's group (all of them: they split the expert's intermediate dimension, so each returns a partial sum).
A rank runs what it receives as tokens of one expert each (top-1, local ids), sends the weighted outputs back
in the same order, and each sender sums its pairs into its tokens' rows (zero elsewhere). Combine's
all-reduce then gives every rank every row. The counts are exchanged first and read on the host, so this
path cannot run inside a CUDA graph.
"""
from __future__ import annotations

import torch

from moelora.core import LoRABatch, TopKOutput
from moelora.distributed.comm import all_to_all, exchange_counts
from moelora.distributed.state import ParallelState
from moelora.layers.moe.dispatcher import Dispatched, Dispatcher


class AllToAllDispatcher(Dispatcher):
    def __init__(self, num_experts: int, state: ParallelState):
        per_group = num_experts // state.ep_size
        super().__init__(num_experts, state.ep_rank * per_group, per_group)
        self.dist_state, self.rank, self.world, self.moe_tp_size = state, state.rank, state.tp_size, state.moe_tp_size

    def dispatch(self, x: torch.Tensor, topk: TopKOutput, lora: LoRABatch | None) -> Dispatched:
        num_tokens, k = topk.ids.shape
        share = -(-num_tokens // self.world)
        first, last = min(self.rank * share, num_tokens), min((self.rank + 1) * share, num_tokens)
        ids = topk.ids[first:last].reshape(-1).long()
        tokens = torch.arange(first, last, device=x.device).repeat_interleave(k)
        group = ids // self.num_local
        # each pair goes to every rank of its expert's group, the copies ordered by destination rank
        dest = (group[:, None] * self.moe_tp_size + torch.arange(self.moe_tp_size, device=x.device)).reshape(-1)
        order = torch.argsort(dest, stable=True)
        pair = torch.arange(ids.shape[0], device=x.device).repeat_interleave(self.moe_tp_size)[order]
        send = torch.bincount(dest, minlength=self.world).tolist()
        recv = exchange_counts(self.dist_state, torch.tensor(send, dtype=torch.int64, device=x.device)).tolist()
        slots = (lora.token_slots[tokens] if lora is not None
                 else torch.full_like(tokens, -1, dtype=torch.int32))
        weights = topk.weights[first:last].reshape(-1).contiguous().view(torch.int32)  # travels as its bits
        meta = torch.stack([(ids - group * self.num_local).to(torch.int32), slots, weights], dim=1)[pair]
        got_x = all_to_all(self.dist_state, x[tokens[pair]], send, recv)
        got_meta = all_to_all(self.dist_state, meta, send, recv)
        routed = TopKOutput(got_meta[:, 2].contiguous().view(torch.float32)[:, None], got_meta[:, :1].contiguous())
        got_lora = LoRABatch(got_meta[:, 1].contiguous()) if lora is not None else None
        return Dispatched(got_x, routed, got_lora, (tokens[pair], send, recv, num_tokens))

    def combine(self, y: torch.Tensor, dispatched: Dispatched) -> torch.Tensor:
        tokens, send, recv, num_tokens = dispatched.route
        back = all_to_all(self.dist_state, y, recv, send)
        out = torch.zeros(num_tokens, y.shape[1], dtype=torch.float32, device=y.device)
        return out.index_add_(0, tokens, back.float()).to(y.dtype)
