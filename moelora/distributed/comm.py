"""The collectives the model and the engine use, over a ParallelState's groups. Layers keep the state they were
built under and pass it here, so a model runs on its own world whatever state is current when it runs (a
one-rank engine beside a several-rank one in one process). At one rank each is the identity (the tensor
itself is returned, nothing copied), so single-process code runs as it did."""
from __future__ import annotations

import pickle
import time
from collections import deque
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from moelora.distributed.state import ParallelState


SPIN_SECONDS = 0.005  # wait_event spins this long before it sleeps between polls
POLL_SECONDS = 2e-4  # then notices the end at most this late, a few thousand cheap polls a second
GIVE_UP_POLL_SECONDS = 0.05  # and asks wait_event's give_up this often (a waitpid per rank)


class PeerFailed(RuntimeError):
    """wait_event gave up: a peer the device work waits for is known to have failed."""


def all_reduce(state: ParallelState, x: torch.Tensor) -> torch.Tensor:
    """Sum of x over the ranks, in place; returns x."""
    if state.tp_size > 1:
        dist.all_reduce(x, group=state.group)
    return x


def broadcast(state: ParallelState, x: torch.Tensor) -> torch.Tensor:
    """Rank 0's x on every rank, in place (over the model's group: device tensors); returns x."""
    if state.tp_size > 1:
        dist.broadcast(x, 0, group=state.group)
    return x


def all_gather(state: ParallelState, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """The ranks' x concatenated along dim, in rank order (every rank's x of one shape)."""
    if state.tp_size == 1:
        return x
    return torch.cat(gather_stacked(state, x).unbind(0), dim=dim)


# all_gather_single is all_gather_into_tensor's newer name (torch 2.13 warns at the old one)
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def gather_stacked(state: ParallelState, x: torch.Tensor) -> torch.Tensor:
    """[tp_size, *x.shape]: the ranks' x (at least 1-D, one shape on every rank) in rank order, in one tensor."""
    return gather_into(state, x.new_empty((state.tp_size, *x.shape)), x)


def gather_into(state: ParallelState, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """out (contiguous, tp_size times x's elements) = the ranks' x concatenated in rank order; returns out."""
    # gloo takes the concatenated shape alone
    _all_gather_single(out.view(state.tp_size * x.shape[0], *x.shape[1:]), x.contiguous(), group=state.group)
    return out


def exchange_chunks(state: ParallelState, chunks: torch.Tensor) -> torch.Tensor:
    """chunks [tp_size, ...]: chunk r goes to rank r; returns [tp_size, ...], what rank r sent this one at r."""
    out = torch.empty_like(chunks)
    dist.all_to_all_single(out, chunks.contiguous(), group=state.group)
    return out


def all_to_all(state: ParallelState, x: torch.Tensor, send_counts: list[int], recv_counts: list[int]) -> torch.Tensor:
    """Rows of x, send_counts[r] of them in turn to rank r; returns the rows received, recv_counts[r] from rank r
    in rank order."""
    out = x.new_empty((sum(recv_counts), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), recv_counts, send_counts, group=state.group)
    return out


def wait_event(event: torch.cuda.Event, timeout: float, give_up: Callable[[], str | None] | None = None) -> None:
    """Returns once the device work before `event` is done; TimeoutError after `timeout` seconds, or PeerFailed as soon
    as `give_up` (asked every GIVE_UP_POLL_SECONDS) names a reason, such as a peer that died: its collectives never
    end, and the event's own synchronize (or a read of a tensor) would wait for good. Polled: spinning the first
    milliseconds (a step's usual wait, on the token's critical path), then every POLL_SECONDS."""
    start = time.monotonic()
    asked = start
    while not event.query():
        now = time.monotonic()
        if now - start > timeout:
            raise TimeoutError(f"it did not end within dist_timeout ({timeout:g} s)")
        if give_up is not None and now - asked > GIVE_UP_POLL_SECONDS:
            asked = now
            if (reason := give_up()) is not None:
                raise PeerFailed(reason)
        time.sleep(0 if now - start < SPIN_SECONDS else POLL_SECONDS)


def host_values(state: ParallelState, x: torch.Tensor) -> list:
    """x.tolist(), the host waiting for the work so far on x's device (its current stream) at most the world's
    timeout, or until state.peers_failed names a reason (wait_event)."""
    if x.is_cuda:
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(x.device))
        wait_event(done, state.timeout, state.peers_failed)
    return x.tolist()


def exchange_counts(state: ParallelState, send_counts: torch.Tensor) -> torch.Tensor:
    """send_counts [world] int64 (rows this rank sends to each rank) -> the rows each rank sends to this one."""
    recv = torch.empty_like(send_counts)
    dist.all_to_all_single(recv, send_counts, group=state.group)
    return recv


# The handles of the last control-group works. A gloo worker thread drops its own reference to a work just after
# the work completes; were that the last reference, the thread would free the work's tensors, which Python made, and
# that takes the GIL: in a process whose interpreter is finalizing by then (rank 0's script ending right after
# Engine.shutdown, a rank ending after the shutdown command) the thread is made to exit inside C++ and the process
# aborts ("terminate called without an active exception"). Held here, the handle is the last reference, dropped by a
# Python thread several collectives later or as the interpreter clears this module.
_recent_works: deque = deque(maxlen=8)


def _wait(work: dist.Work, timeout: timedelta) -> None:
    """A control-group work's wait (timeout 0: the group's own), its handle kept (_recent_works)."""
    _recent_works.append(work)
    work.wait(timeout)


def broadcast_object(state: ParallelState, obj: Any = None, timeout: float | None = None) -> Any:
    """Rank 0's obj on every rank (pickled, over the gloo control group); the others pass nothing. timeout:
    seconds to wait for the other ranks (None: the control group's, as good as forever: a rank waiting for
    the next command waits however idle rank 0 is; rank 0 sending one gives up on a rank that hangs)."""
    wait = timedelta(0) if timeout is None else timedelta(seconds=timeout)  # 0: the group's own timeout
    if state.rank == 0:
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        size = torch.tensor([data.numel()], dtype=torch.int64)
    else:
        size = torch.zeros(1, dtype=torch.int64)
    _wait(dist.broadcast(size, 0, group=state.control, async_op=True), wait)
    if state.rank != 0:
        data = torch.empty(int(size.item()), dtype=torch.uint8)
    _wait(dist.broadcast(data, 0, group=state.control, async_op=True), wait)
    return obj if state.rank == 0 else pickle.loads(data.numpy().tobytes())


def control_barrier(state: ParallelState, timeout: float) -> None:
    """Returns once every rank got here, the host waiting whatever the device (over the gloo control group: an
    NCCL collective would only queue on the stream); raises after `timeout` seconds without every rank's."""
    if state.tp_size > 1:
        _wait(dist.all_reduce(torch.zeros(1), group=state.control, async_op=True), timedelta(seconds=timeout))


def min_over_ranks(state: ParallelState, values: list[int], timeout: float) -> list[int]:
    """The smallest of the ranks' values, element by element (the KV cache size every rank can hold; how far every
    rank's adapter reads got); raises after `timeout` seconds without every rank's (one hangs, or died)."""
    if state.tp_size == 1:
        return values
    t = torch.tensor(values, dtype=torch.int64)
    _wait(dist.all_reduce(t, op=dist.ReduceOp.MIN, group=state.control, async_op=True), timedelta(seconds=timeout))
    return t.tolist()


def gather_over_ranks(state: ParallelState, values: list[int], timeout: float) -> list[list[int]]:
    """Every rank's values (int64, as many on every rank), in rank order, over the control group (the digests of
    what each rank read, for all to see which ranks differ); raises after `timeout` seconds without every rank's."""
    if state.tp_size == 1:
        return [values]
    t = torch.tensor(values, dtype=torch.int64)
    out = t.new_empty(state.tp_size * len(values))
    _wait(_all_gather_single(out, t, group=state.control, async_op=True), timedelta(seconds=timeout))
    return out.view(state.tp_size, len(values)).tolist()
