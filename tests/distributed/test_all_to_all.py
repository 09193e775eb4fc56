"""The all-to-all dispatch's two ways (moelora/layers/moe/all_to_all.py) over gloo ranks: at fixed capacity (no
count read on the host) and by exchanged counts, each token reaches the ranks of its experts' groups with its routing
weights and adapter slot, and its partial sums come back summed into its row, as one process computes it; ranks with
no tokens, a share shorter than the others', and experts split over the ranks of a group (moe_tp_size 2) included.
Then the same with each rank's real Runner and LoRA laid out so that what it must not read is NaN (tests.support.
rank_runner), the rows of tokens with no expert on the rank (fixed capacity's) NaN too: the whole layer's output, the
same bits as the all-reduce Dispatcher's, whether the rows of each rank's share are all-reduced (`combine`, beside
shared experts) or gathered (`gather`)."""
import pytest
import torch

from moelora.core import LoRABatch, TopKOutput
from moelora.distributed import comm
from moelora.distributed.sharding import even_shard
from moelora.distributed.state import get_parallel
from moelora.kernels.fused_moe import fused_moe_reference
from moelora.layers.collectives import all_reduce
from moelora.layers.moe import all_to_all as all_to_all_module
from moelora.layers.moe.all_to_all import FIXED_MAX_TOKENS, AllToAllDispatcher
from moelora.layers.moe.dispatcher import Dispatched, Dispatcher
from tests.distributed.ranks import run_ranks
from tests.support import assert_rows_close, random_expert_lora, random_moe_weights, rank_runner, rel_tolerance

EXPERTS, HIDDEN, TOP_K = 8, 4, 3
INTER, SLOT_RANKS = 6, [2, 4, 8]  # the inputs' slots -1..2; one more slot, never named, is all NaN


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


def _layer():
    """The whole MoE layer's weights and LoRA slot buffers (rows past each rank NaN, and the spare slot)."""
    g = torch.Generator().manual_seed(0)
    w13, w2 = random_moe_weights(EXPERTS, HIDDEN, INTER, torch.float32, generator=g)
    lora = random_expert_lora(len(SLOT_RANKS) + 1, EXPERTS, HIDDEN, INTER, [*SLOT_RANKS, 8], torch.float32,
                              coverage=0.75, poison_unused=True, generator=g)
    for name in ("a_gate", "b_gate", "a_up", "b_up", "a_down", "b_down"):
        getattr(lora, name)[len(SLOT_RANKS)] = float("nan")
    return w13, w2, lora


def _stand_in(sent: Dispatched, dispatcher: Dispatcher, split: int) -> torch.Tensor:
    """The stand-in experts as the Runner runs them: each token's pairs on this rank in top-k order, the others (-1)
    skipped; each of a group's `split` ranks returns its share."""
    y = torch.zeros_like(sent.x)
    for ids, weights in zip(sent.topk.ids.T, sent.topk.weights.T):
        pair = _expert(sent.x, ids + dispatcher.first_local, weights, sent.lora.token_slots) / split
        y += torch.where((ids >= 0)[:, None], pair, torch.zeros_like(pair))
    return y


def _dispatch_both(token_counts: list[int]) -> list[tuple[torch.Tensor, ...]]:
    return [_dispatch_both_once(n) for n in token_counts]


def _dispatch_both_once(num_tokens: int) -> tuple[torch.Tensor, ...]:
    """(fixed, counted) with the stand-in experts, then (fixed, counted) with the rank's Runner."""
    state = get_parallel()
    x, topk, lora = _inputs(num_tokens)
    dispatcher = AllToAllDispatcher(EXPERTS, state)
    split = state.moe_tp_size  # a group's ranks each return a share: each returns 1 / moe_tp_size of the output
    experts = slice(dispatcher.first_local, dispatcher.first_local + dispatcher.num_local)
    runner = rank_runner(*_layer(), experts, even_shard(INTER, split, state.moe_tp_rank, "inter"))

    def stand_in(sent: Dispatched) -> torch.Tensor:
        return _stand_in(sent, dispatcher, split)

    def run(sent: Dispatched) -> torch.Tensor:
        # a token with no expert on this rank (at fixed capacity: tokens of the other groups' experts only, and the
        # padding rows past a short share) must not be read: its hidden state NaN, its slot the NaN one
        elsewhere = (sent.topk.ids < 0).all(dim=1)
        x_here = sent.x.masked_fill(elsewhere[:, None], float("nan"))
        slots = sent.lora.token_slots.masked_fill(elsewhere, len(SLOT_RANKS))
        return runner(x_here, sent.topk, LoRABatch(slots))

    outs, gathered = [], []
    for experts_of in (stand_in, run):
        for dispatch in (dispatcher._dispatch_fixed, dispatcher._dispatch_counted):
            sent = dispatch(x, topk, lora)
            assert sent.x.shape[0] <= state.tp_size * -(-num_tokens // state.tp_size), "a token sent twice to a rank"
            y = experts_of(sent)
            # combine's rows all-reduced (beside shared experts' partial sums), or the shares gathered (without)
            outs.append(comm.all_reduce(state, dispatcher.combine(y, sent)))
            gathered.append(dispatcher.gather(y, sent))
    # the all-reduce Dispatcher: every rank runs every token's pairs on its experts, the partial sums in rank order
    by_all_reduce = Dispatcher(EXPERTS, dispatcher.first_local, dispatcher.num_local)
    outs.append(all_reduce(state, runner(x, by_all_reduce(topk), lora)))
    return (*outs, *gathered)


def _host_reads(token_counts: list[int], dtype: torch.dtype) -> list[tuple[str, int, bool]]:
    """(way, host reads through comm.host_values, output equal to the all-reduce Dispatcher's) of dispatch() on each
    count of tokens, with the stand-in experts, hidden states in dtype (the int32 meta rows travel as its columns)."""
    state = get_parallel()
    dispatcher = AllToAllDispatcher(EXPERTS, state)
    by_all_reduce = Dispatcher(EXPERTS, dispatcher.first_local, dispatcher.num_local)
    reads = []
    original = all_to_all_module.host_values
    all_to_all_module.host_values = lambda *args: reads.append(1) or original(*args)
    try:
        out = []
        for num_tokens in token_counts:
            reads.clear()
            x, topk, lora = _inputs(num_tokens)
            x = x.to(dtype)
            sent = dispatcher.dispatch(x, topk, lora)
            got = dispatcher.gather(_stand_in(sent, dispatcher, state.moe_tp_size), sent)
            local = by_all_reduce.dispatch(x, topk, lora)
            want = all_reduce(state, _stand_in(local, by_all_reduce, state.moe_tp_size))
            out.append((sent.route[0], len(reads), torch.equal(got, want)))
        return out
    finally:
        all_to_all_module.host_values = original


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_steps_past_the_fixed_capacity_go_by_counts_read_with_a_deadline(dtype):
    """dispatch() takes the counted way past FIXED_MAX_TOKENS, and its one host read of the counts goes through
    comm.host_values (a peer that died makes it raise after dist_timeout instead of waiting for good); the fixed way
    reads nothing on the host. Either way, in bf16 too, the all-reduce Dispatcher's bits."""
    counts = [FIXED_MAX_TOKENS, FIXED_MAX_TOKENS + 45]
    for rank, results in enumerate(run_ranks(2, _host_reads, counts, dtype, ep_size=2, moe_dispatch="all_to_all")):
        assert results == [("fixed", 0, True), ("counted", 1, True)], f"rank {rank}: {results}"


@pytest.mark.parametrize("world, ep_size", [(2, 2), (4, 4), (4, 2)], ids=["tp2-ep2", "tp4-ep4", "tp4-ep2"])
def test_fixed_and_counted_dispatch_give_each_token_its_experts(world, ep_size):
    counts = [1, 5, 9, 0]
    per_rank = run_ranks(world, _dispatch_both, counts, ep_size=ep_size, moe_dispatch="all_to_all")
    for i, num_tokens in enumerate(counts):
        x, topk, lora = _inputs(num_tokens)
        want = sum(_expert(x, topk.ids[:, j], topk.weights[:, j], lora.token_slots) for j in range(TOP_K))
        w13, w2, buffers = _layer()
        whole = fused_moe_reference(x, w13, w2, topk, buffers, lora.token_slots)
        for rank, results in enumerate(per_rank):
            fixed, counted, fixed_runner, counted_runner, all_reduce_runner, *gathered = results[i]
            for got, reduced in zip(gathered, (fixed, counted, fixed_runner, counted_runner)):
                assert torch.equal(got, reduced), f"{num_tokens} tokens, rank {rank}: gathered shares differ"
            torch.testing.assert_close(fixed, want, msg=f"fixed capacity, {num_tokens} tokens, rank {rank}")
            torch.testing.assert_close(counted, want, msg=f"counted, {num_tokens} tokens, rank {rank}")
            assert torch.equal(fixed, counted), f"{num_tokens} tokens, rank {rank}: the two ways sum otherwise"
            assert torch.equal(fixed_runner, counted_runner), f"Runner, {num_tokens} tokens, rank {rank}"
            assert torch.equal(fixed_runner, all_reduce_runner), \
                f"Runner, {num_tokens} tokens, rank {rank}: all-to-all and all-reduce dispatch sum otherwise"
            for way, got in (("fixed capacity", fixed_runner), ("counted", counted_runner)):
                assert_rows_close(got, whole, rel_tolerance(torch.float32),
                                  f"Runner, {way}, {num_tokens} tokens, rank {rank}")
