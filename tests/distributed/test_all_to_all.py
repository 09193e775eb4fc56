"""The all-to-all dispatch's two ways (moelora/layers/moe/all_to_all.py) over gloo ranks: at fixed capacity (no
count read on the host) and by exchanged counts, each pair reaches its expert's ranks with its routing weight and
adapter slot and comes back summed into its token, as one process computes it; ranks with no tokens, a share
shorter than the others', and experts split over the ranks of a group (moe_tp_size 2) included."""
import pytest
import torch

from moelora.core import LoRABatch, TopKOutput
from moelora.distributed import comm
from moelora.distributed.state import get_parallel
from moelora.layers.moe.all_to_all import AllToAllDispatcher
from tests.distributed.ranks import run_ranks

EXPERTS, HIDDEN, TOP_K = 8, 4, 3


def _inputs(num_tokens: int) -> tuple[torch.Tensor, TopKOutput, LoRABatch]:
    """The same on every rank (the hidden states are replicated)."""
    g = torch.Generator().manual_seed(num_tokens)
    x = torch.randn(num_tokens, HIDDEN, generator=g)
    weights, ids = torch.randn(num_tokens, EXPERTS, generator=g).softmax(-1).topk(TOP_K)
    return x, TopKOutput(weights, ids.to(torch.int32)), LoRABatch(torch.randint(-1, 3, (num_tokens,), dtype=torch.int32,
                                                                                  generator=g))


def _expert(x: torch.Tensor, global_ids: torch.Tensor, weights: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """A stand-in for the experts: expert e of adapter slot s scales by (e + 1) + 10 (s + 1), times the weight."""
    return x * (weights * ((global_ids + 1) + 10 * (slots + 1)).to(x.dtype))[:, None]


def _dispatch_both(token_counts: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [_dispatch_both_once(n) for n in token_counts]


def _dispatch_both_once(num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    state = get_parallel()
    x, topk, lora = _inputs(num_tokens)
    dispatcher = AllToAllDispatcher(EXPERTS, state)
    split = state.moe_tp_size  # a group's ranks each return a share: each returns 1 / moe_tp_size of the output
    outs = []
    for dispatch, combine in ((dispatcher._dispatch_fixed, dispatcher._combine_fixed),
                              (dispatcher._dispatch_counted, dispatcher._combine_counted)):
        sent = dispatch(x, topk, lora)
        local = sent.topk.ids[:, 0]
        y = torch.where((local >= 0)[:, None],
                        _expert(sent.x, local + dispatcher.first_local, sent.topk.weights[:, 0], sent.lora.token_slots) / split,
                        torch.zeros_like(sent.x))  # as the Runner: a row of no expert here gives 0
        outs.append(comm.all_reduce(state, combine(y, sent)))
    return tuple(outs)


@pytest.mark.parametrize("world, ep_size", [(2, 2), (4, 4), (4, 2)], ids=["tp2-ep2", "tp4-ep4", "tp4-ep2"])
def test_fixed_and_counted_dispatch_give_each_token_its_experts(world, ep_size):
    counts = [1, 5, 9]
    per_rank = run_ranks(world, _dispatch_both, counts, ep_size=ep_size, moe_dispatch="all_to_all")
    for i, num_tokens in enumerate(counts):
        x, topk, lora = _inputs(num_tokens)
        want = sum(_expert(x, topk.ids[:, j], topk.weights[:, j], lora.token_slots) for j in range(TOP_K))
        for rank, results in enumerate(per_rank):
            fixed, counted = results[i]
            torch.testing.assert_close(fixed, want, msg=f"fixed capacity, {num_tokens} tokens, rank {rank}")
            torch.testing.assert_close(counted, want, msg=f"counted, {num_tokens} tokens, rank {rank}")
