"""The collectives the model and the engine use, over the current state's groups. At one rank each is the
identity (the tensor itself is returned, nothing copied), so single-process code runs as it did."""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from moelora.distributed.state import get_parallel


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum of x over the ranks, in place; returns x."""
    state = get_parallel()
    if state.tp_size > 1:
        dist.all_reduce(x, group=state.group)
    return x


def all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """The ranks' x concatenated along dim, in rank order (every rank's x of one shape)."""
    state = get_parallel()
    if state.tp_size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(state.tp_size)]
    dist.all_gather(parts, x.contiguous(), group=state.group)
    return torch.cat(parts, dim=dim)


def all_to_all(x: torch.Tensor, send_counts: list[int], recv_counts: list[int]) -> torch.Tensor:
    """Rows of x, send_counts[r] of them in turn to rank r; returns the rows received, recv_counts[r] from rank r
    in rank order."""
    state = get_parallel()
    out = x.new_empty((sum(recv_counts), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), recv_counts, send_counts, group=state.group)
    return out


def exchange_counts(send_counts: torch.Tensor) -> torch.Tensor:
    """send_counts [world] int64 (rows this rank sends to each rank) -> the rows each rank sends to this one."""
    recv = torch.empty_like(send_counts)
    dist.all_to_all_single(recv, send_counts, group=get_parallel().group)
    return recv


def broadcast_object(obj: Any = None) -> Any:
    """Rank 0's obj on every rank (pickled, over the gloo control group); the others pass nothing."""
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=get_parallel().control)
    return box[0]


def min_over_ranks(value: int) -> int:
    """The smallest of the ranks' values (the KV cache size every rank can hold)."""
    state = get_parallel()
    if state.tp_size == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=state.control)
    return int(t.item())
