"""Expert-parallel dispatch by all-to-all (`torch.distributed.all_to_all_single`).

The hidden states are replicated over the ranks (attention is tensor-parallel), so each rank takes its share
of the tokens (rank r: rows [r * c, (r + 1) * c), c = ceil(T / ranks)) and sends each token once to each rank
that holds one of its experts (all the ranks of that expert's group: they split its intermediate dimension), with
its adapter slot, its k routing weights and its k expert ids as that rank's (-1: not there), as DeepEP does (in the
same all-to-all as the hidden states, their bits as extra columns). A
token thus travels to at most every rank, not once for each of its k experts. A rank runs what it receives as the
all-reduce Dispatcher's Runner does (its experts' pairs of each token summed in top-k order, the others skipped),
sends each token's partial sum back in the same order, and each sender sums its tokens' partial sums in rank order
(fp32, rounded once). Then every rank gets every row: without shared experts by an all-gather of the ranks' shares
(`gather`); with them, whose partial sums Combine all-reduces, as rows of the share beside zeros (`combine`), in
that all-reduce. Either way a row has the bits of the all-reduce Dispatcher's.

Two ways to size the exchange:
- up to FIXED_MAX_TOKENS tokens (decode, small prompt steps), at a fixed capacity: every rank sends every rank
  each of its c tokens, with ids -1 where the token has no expert there (the Runner skips them: its output row is
  0); no count is read on the host, so the step can be captured in a CUDA graph;
- above it, only the tokens each rank needs: the counts are exchanged first and read on the host (a sync: never
  inside a CUDA graph), which keeps a long prompt's traffic at what it needs.
Both sum the same partial sums in the same order (a rank that got nothing of a token adds the zeros it would have
returned), so a token's row has the same bits whichever way it travelled, and whatever else is in the batch.
"""
from __future__ import annotations

import torch

from moelora.core import LoRABatch, TopKOutput
from moelora.distributed.comm import all_to_all, exchange_counts, gather_stacked, host_values
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
        """The Runner's output -> [T, H]: the sums of this rank's share of the tokens in their rows, zeros elsewhere
        (its part of an all-reduce that gives every rank every row)."""
        first, rows = self._share(dispatched.route[-1])
        out = y.new_zeros(dispatched.route[-1], y.shape[1])
        out[first:first + rows] = self._share_sums(y, dispatched)[:rows]
        return out

    def gather(self, y: torch.Tensor, dispatched: Dispatched) -> torch.Tensor:
        """The Runner's output -> every token's routed output [T, H], on every rank: each rank's share summed, then
        gathered (half the bytes of the all-reduce of `combine`'s rows and no sum; for layers without shared
        experts)."""
        num_tokens = dispatched.route[-1]
        share = -(-num_tokens // self.world)
        if share == 0:
            return y.new_zeros(0, y.shape[1])
        sums = self._share_sums(y, dispatched)
        if sums.shape[0] < share:  # the last ranks' shorter shares: every rank gathers as many rows
            sums = torch.cat([sums, sums.new_zeros(share - sums.shape[0], sums.shape[1])])
        return gather_stacked(self.dist_state, sums).view(self.world * share, y.shape[1])[:num_tokens]

    def _share_sums(self, y: torch.Tensor, dispatched: Dispatched) -> torch.Tensor:
        """[n >= rows of the share, H]: each of this rank's share of tokens' partial sums, as returned by each rank,
        summed in rank order (in fp32, rounded once; the same bits whatever the batch and whichever way the tokens
        travelled)."""
        back = (self._back_fixed if dispatched.route[0] == "fixed" else self._back_counted)(y, dispatched)
        return sum_in_order(back, torch.empty(back.shape[1:], dtype=back.dtype, device=back.device))

    def _share(self, num_tokens: int) -> tuple[int, int]:
        """(first row, rows) of this rank's share of the tokens (c = ceil(T / ranks) rows, fewer at the end)."""
        share = -(-num_tokens // self.world)
        first = min(self.rank * share, num_tokens)
        return first, min(share, num_tokens - first)

    def _ids_on_ranks(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [n, k] of global experts -> [ranks, n, k] int32: each as rank r's id of it (-1: not on rank r)."""
        ids = ids.long()
        group = ids // self.num_local
        group_of_rank = torch.arange(self.world, device=ids.device) // self.moe_tp_size
        on_rank = group[None] == group_of_rank[:, None, None]
        return torch.where(on_rank, (ids - group * self.num_local)[None], -1).to(torch.int32)

    @staticmethod
    def _meta(ids: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """ids [..., n, k] local expert ids, slots [n], weights [n, k] -> the [..., n, 2k + 1] int32 rows that travel
        beside the hidden states: the k ids, the adapter slot, the k routing weights (as their bits)."""
        lead, k = ids.shape[:-1], ids.shape[-1]
        return torch.cat([ids, slots[:, None].to(torch.int32).expand(*lead, 1),
                          weights.contiguous().view(torch.int32).expand(*lead, k)], dim=-1)

    def _exchange(self, x: torch.Tensor, meta: torch.Tensor, send: list[int], recv: list[int]
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows of hidden states and their meta rows to the ranks (all_to_all's counts), in one all-to-all: the meta's
        int32 bits travel as x.dtype columns beside the hidden states, one collective's latency where two each paid
        theirs (a decode step's MoE layer is a few of them)."""
        cols = meta.shape[1]
        # whole 16-byte units of meta (with the hidden states' own, rows NCCL copies on its aligned path)
        meta = torch.nn.functional.pad(meta, (0, -cols % 4))
        got = all_to_all(self.dist_state, torch.cat([x, meta.view(x.dtype)], dim=1), send, recv)
        return got[:, :x.shape[1]].contiguous(), got[:, x.shape[1]:].contiguous().view(torch.int32)[:, :cols]

    @staticmethod
    def _received(got_x: torch.Tensor, got_meta: torch.Tensor, k: int, lora: LoRABatch | None, route) -> Dispatched:
        routed = TopKOutput(got_meta[:, k + 1:].contiguous().view(torch.float32), got_meta[:, :k].contiguous())
        got_lora = LoRABatch(got_meta[:, k].contiguous()) if lora is not None else None
        return Dispatched(got_x, routed, got_lora, route)

    def _dispatch_fixed(self, x: torch.Tensor, topk: TopKOutput, lora: LoRABatch | None) -> Dispatched:
        num_tokens, k = topk.ids.shape
        share = -(-num_tokens // self.world)
        first, mine = self._share(num_tokens)
        # c rows whatever this rank's share: rows past the tokens stand in as row 0, with no expert anywhere
        rows = torch.arange(share, device=x.device)
        tokens = torch.where(rows < mine, rows + first, torch.zeros_like(rows))
        ids = self._ids_on_ranks(topk.ids[tokens]).masked_fill((rows >= mine)[None, :, None], -1)
        meta = self._meta(ids, _slots(lora, tokens), topk.weights[tokens]).reshape(self.world * share, 2 * k + 1)
        even = [share] * self.world
        got_x, got_meta = self._exchange(x[tokens].repeat(self.world, 1), meta, even, even)
        return self._received(got_x, got_meta, k, lora, ("fixed", share, num_tokens))

    def _back_fixed(self, y: torch.Tensor, dispatched: Dispatched) -> torch.Tensor:
        """[ranks, c, H]: each token's partial sum from every rank, in rank order (a rank with none of its experts
        sends zeros)."""
        _, share, _ = dispatched.route
        even = [share] * self.world
        return all_to_all(self.dist_state, y, even, even).view(self.world, share, y.shape[1])

    def _dispatch_counted(self, x: torch.Tensor, topk: TopKOutput, lora: LoRABatch | None) -> Dispatched:
        num_tokens, k = topk.ids.shape
        first, rows = self._share(num_tokens)
        ids = self._ids_on_ranks(topk.ids[first:first + rows])
        needs = (ids >= 0).any(dim=2)  # [ranks, rows]: the token has an expert on the rank
        send = needs.sum(dim=1)
        # one host read of both counts, with a deadline (a peer that died holds the collectives before it for good);
        # nonzero's own read of the device then waits for nothing
        send, recv = host_values(self.dist_state, torch.stack([send, exchange_counts(self.dist_state, send)]))
        dest, token = needs.nonzero(as_tuple=True)  # by rank, then token: the order of the rows sent
        tokens = token + first
        meta = self._meta(ids[dest, token], _slots(lora, tokens), topk.weights[tokens])
        got_x, got_meta = self._exchange(x[tokens], meta, send, recv)
        return self._received(got_x, got_meta, k, lora, ("counted", dest, token, send, recv, num_tokens))

    def _back_counted(self, y: torch.Tensor, dispatched: Dispatched) -> torch.Tensor:
        """[ranks, rows, H]: each token's partial sum from every rank, in rank order (zeros from a rank that got none
        of its experts)."""
        _, dest, token, send, recv, num_tokens = dispatched.route
        back = y.new_zeros(self.world, self._share(num_tokens)[1], y.shape[1])
        back[dest, token] = all_to_all(self.dist_state, y, recv, send)
        return back


def _slots(lora: LoRABatch | None, tokens: torch.Tensor) -> torch.Tensor:
    """The adapter slots of rows `tokens` (-1: none)."""
    return lora.token_slots[tokens] if lora is not None else torch.full_like(tokens, -1, dtype=torch.int32)
