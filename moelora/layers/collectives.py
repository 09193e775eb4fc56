"""The tensor-parallel sum of the layers' partial outputs (row-parallel projections, the experts' shares of a token,
the vocabulary-parallel embedding), with each row's bits independent of the rows around it.

NCCL's all-reduce adds an element's ranks in an order that follows the message's chunking: past two ranks a row
would round one way in a batch of 3 run eagerly and another in a CUDA graph padded to 4, or alone. Here the ranks'
shares are exchanged and every element is summed in rank order (kernels/sum_in_order.py), whatever the size."""
from __future__ import annotations

import torch

from moelora.distributed import comm
from moelora.distributed.state import ParallelState
from moelora.kernels.sum_in_order import sum_in_order

# Past this many bytes saved a tensor's sum is split over the ranks, each summing one chunk of every rank's share
# before the sums are gathered: the ranks receive 2 (tp - 1) / tp of its bytes instead of tp - 1 times them, for a
# second collective's latency. An estimate, not a measurement: about 15 us of NVLink at ~400 GB/s a direction.
SPLIT_MIN_SAVED_BYTES = 6 * 2**20


def all_reduce(state: ParallelState, x: torch.Tensor) -> torch.Tensor:
    """Sum of x over the tp ranks, in place; returns x. Each element is the ranks' values added in rank order, in
    fp32, rounded once to x's dtype. Two ranks take the backend's all-reduce: a + b rounds as b + a."""
    tp = state.tp_size
    if tp <= 2:
        return comm.all_reduce(state, x)
    if not x.is_contiguous():
        return x.copy_(all_reduce(state, x.contiguous()))
    if x.dim() > 2:  # sum_in_order takes rows of columns
        all_reduce(state, x.view(-1, x.shape[-1]))
        return x
    if (tp - 1) * (1 - 2 / tp) * x.nbytes < SPLIT_MIN_SAVED_BYTES or x.numel() % tp:
        return gathered_sum(state, x)
    return split_sum(state, x)


def gathered_sum(state: ParallelState, x: torch.Tensor) -> torch.Tensor:
    """all_reduce by one all-gather: every rank sums every rank's x (x contiguous)."""
    return sum_in_order(comm.gather_stacked(state, x), x)


def split_sum(state: ParallelState, x: torch.Tensor) -> torch.Tensor:
    """all_reduce by an all-to-all and an all-gather: rank r sums chunk r of every rank's x, then the ranks gather
    the sums (x contiguous, its elements a multiple of tp_size); the same bits as gathered_sum."""
    chunks = comm.exchange_chunks(state, x.view(state.tp_size, -1))
    mine = sum_in_order(chunks, torch.empty(chunks.shape[1:], dtype=x.dtype, device=x.device))
    comm.gather_into(state, x.view(-1), mine)
    return x
