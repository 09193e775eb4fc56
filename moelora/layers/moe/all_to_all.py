"""Expert-parallel dispatch by all-to-all (`torch.distributed.all_to_all_single`).

The hidden states are replicated over the ranks (attention is tensor-parallel), so each rank takes its share
of the tokens (rank r: rows [r * c, (r + 1) * c), c = ceil(T / ranks)) and sends each of their (token, expert)
pairs, with the token's hidden state, its adapter slot and the pair's routing weight, to the ranks of the
expert's group (all of them: they split the expert's intermediate dimension, so each returns a partial sum).
A rank runs what it receives as tokens of one expert each (top-1, local ids), sends the weighted outputs back
in the same order, and each sender sums its pairs into its tokens' rows (zero elsewhere). Combine's
all-reduce then gives every rank every row.

Two ways to size the exchange:
- up to FIXED_MAX_TOKENS tokens (decode, small prompt steps), at a fixed capacity: every rank sends every rank
  a slot for each of its c * top_k pairs, those not for that rank marked -1 (never read: the Runner skips them,
  their output is 0); no count is read on the host, so the step can be captured in a CUDA graph, and each
  token's pairs are summed in top-k order, in a fixed order whatever the batch;
- above it, exactly the pairs each rank needs: the counts are exchanged first and read on the host (a sync:
  never inside a CUDA graph), which keeps a long prompt's traffic at what it needs.
Both sum what comes back alike (a pair's copies in rank order, then a token's pairs in top-k order, in fp32), so a
token's row has the same bits whichever way its pairs travelled.
"""
from __future__ import annotations

import torch

from moelora.core import LoRABatch, TopKOutput
from moelora.distributed.comm import all_to_all, exchange_counts
from moelora.distributed.state import ParallelState
from moelora.kernels.sum_in_order import sum_in_order
from moelora.layers.moe.dispatcher import Dispatched, Dispatcher

FIXED_MAX_TOKENS = 256  # the largest step dispatched at fixed capacity (decode CUDA graphs go no higher)


class AllToAllDispatcher(Dispatcher):
    def __init__(self, num_experts: int, state: ParallelState):
        per_group = num_experts // state.ep_size
        super().__init__(num_experts, state.ep_rank * per_group, per_group)
        self.dist_state, self.rank, self.world, self.moe_tp_size = state, state.rank, state.tp_size, state.moe_tp_size

    def dispatch(self, x: torch.Tensor, topk: TopKOutput, lora: LoRABatch | None) -> Dispatched:
        if topk.ids.shape[0] <= FIXED_MAX_TOKENS:
            return self._dispatch_fixed(x, topk, lora)
        return self._dispatch_counted(x, topk, lora)

    def combine(self, y: torch.Tensor, dispatched: Dispatched) -> torch.Tensor:
        if dispatched.route[0] == "fixed":
            return self._combine_fixed(y, dispatched)
        return self._combine_counted(y, dispatched)

    def _share(self, num_tokens: int) -> tuple[int, int]:
        """(first row, rows) of this rank's share of the tokens (c = ceil(T / ranks) rows, fewer at the end)."""
        share = -(-num_tokens // self.world)
        first = min(self.rank * share, num_tokens)
        return first, min(share, num_tokens - first)

    def _dispatch_fixed(self, x: torch.Tensor, topk: TopKOutput, lora: LoRABatch | None) -> Dispatched:
        num_tokens, k = topk.ids.shape
        share = -(-num_tokens // self.world)
        first, mine = self._share(num_tokens)
        # c rows whatever this rank's share: rows past the tokens stand in as row 0, their pairs sent nowhere
        rows = torch.arange(share, device=x.device)
        tokens = torch.where(rows < mine, rows + first, torch.zeros_like(rows))
        ids = topk.ids[tokens].reshape(-1).long()  # [c * k] pairs, token by token, in top-k order
        group = ids // self.num_local
        ranks = torch.arange(self.world, device=x.device)
        to_rank = (ranks[:, None] // self.moe_tp_size == group[None, :]) & (rows < mine).repeat_interleave(k)[None, :]
        local = torch.where(to_rank, (ids - group * self.num_local)[None, :], -1).to(torch.int32)  # [ranks, c * k]
        pair_tokens = tokens.repeat_interleave(k)
        slots = (lora.token_slots[pair_tokens] if lora is not None
                 else torch.full_like(pair_tokens, -1, dtype=torch.int32))
        weights = topk.weights[tokens].reshape(-1).contiguous().view(torch.int32)  # travels as its bits
        meta = torch.stack([local, slots.expand_as(local), weights.expand_as(local)], dim=2).reshape(-1, 3)
        even = [share * k] * self.world
        got_x = all_to_all(self.dist_state, x[pair_tokens].repeat(self.world, 1), even, even)
        got_meta = all_to_all(self.dist_state, meta, even, even)
        routed = TopKOutput(got_meta[:, 2].contiguous().view(torch.float32)[:, None], got_meta[:, :1].contiguous())
        got_lora = LoRABatch(got_meta[:, 1].contiguous()) if lora is not None else None
        return Dispatched(got_x, routed, got_lora, ("fixed", num_tokens, share, k))

    def _combine_fixed(self, y: torch.Tensor, dispatched: Dispatched) -> torch.Tensor:
        _, num_tokens, share, k = dispatched.route
        even = [share * k] * self.world
        # a pair's partial sums in rank order (the ranks not of its expert's group send zeros)
        back = all_to_all(self.dist_state, y, even, even).view(self.world, share * k, y.shape[1])
        first, rows = self._share(num_tokens)
        return self._into_rows(back, share, k, first, rows, num_tokens)

    @staticmethod
    def _into_rows(back: torch.Tensor, share: int, k: int, first: int, rows: int, num_tokens: int) -> torch.Tensor:
        """back [copies, share * k, H]: each of this rank's share of tokens' k pairs as returned by each rank of its
        expert's group (copies) -> [num_tokens, H], this rank's tokens' rows the sums of their copies in rank order,
        then of their pairs in top-k order (in fp32, rounded once; the same bits whatever the batch and whichever
        way the pairs travelled), zeros elsewhere."""
        hidden = back.shape[-1]
        pairs = sum_in_order(back, torch.empty(share * k, hidden, dtype=torch.float32, device=back.device))
        tokens = sum_in_order(pairs.view(share, k, hidden).transpose(0, 1),
                              torch.empty(share, hidden, dtype=back.dtype, device=back.device))
        out = torch.zeros(num_tokens, hidden, dtype=back.dtype, device=back.device)
        out[first:first + rows] = tokens[:rows]
        return out

    def _dispatch_counted(self, x: torch.Tensor, topk: TopKOutput, lora: LoRABatch | None) -> Dispatched:
        num_tokens, k = topk.ids.shape
        first, rows = self._share(num_tokens)
        last = first + rows
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
        return Dispatched(got_x, routed, got_lora, ("counted", order, send, recv, num_tokens, k))

    def _combine_counted(self, y: torch.Tensor, dispatched: Dispatched) -> torch.Tensor:
        _, order, send, recv, num_tokens, k = dispatched.route
        sent = all_to_all(self.dist_state, y, recv, send)  # this rank's pairs' copies, ordered by destination
        back = torch.empty_like(sent)
        back[order] = sent  # pair by pair, each pair's copies in rank order
        first, rows = self._share(num_tokens)
        back = back.view(rows * k, self.moe_tp_size, y.shape[1]).transpose(0, 1)
        return self._into_rows(back, rows, k, first, rows, num_tokens)
