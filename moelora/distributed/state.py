"""Which rank of which parallel layout this process is: tensor parallel over all `tp_size` ranks (attention
and dense layers), and the routed experts split over `ep_size` groups of tp_size / ep_size consecutive ranks
each (expert parallel), the ranks of one group splitting their experts' intermediate dimension (SGLang's
layout: moe_tp_size = tp_size / ep_size, ep_rank = rank // moe_tp_size, moe_tp_rank = rank % moe_tp_size).

Layers read the current state when they are built: their shard, and the groups of their collectives, which
they keep (so a model runs on its own world whatever is current later). The default is one process: every
shard is the whole and every collective the identity, so the single-process path stays what it was, bit for
bit. `init_parallel` joins a torch.distributed world (gloo on CPUs, NCCL on GPUs) and returns its state;
`parallel_state` makes a state current while a model is built (one of a world's, or one without groups, to
build a rank's layers on the meta device and read their sizes).
"""
from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

from moelora.distributed.launch import host_port

DISPATCH_MODES = ("all_reduce", "all_to_all")
# the control group waits for the next command however idle the engine is; its other waits are bounded each
CONTROL_TIMEOUT = timedelta(days=365)


@dataclass(frozen=True)
class ParallelState:
    rank: int = 0
    tp_size: int = 1
    ep_size: int = 1
    # all_reduce: every rank runs its experts on every token, Combine sums over the ranks; all_to_all: each token
    # travels to the ranks holding its experts and its partial sums back (see layers/moe/all_to_all.py)
    moe_dispatch: str = "all_reduce"
    group: dist.ProcessGroup | None = None    # the model's collectives (NCCL on GPUs, gloo on CPUs)
    control: dist.ProcessGroup | None = None  # gloo: commands from rank 0 to the others, no timeout to speak of
    timeout: float = 300.0  # seconds a rank waits for the others (dist_timeout), the host's reads of the device too
    # rank 0 of an engine: why a rank is known to have failed, or None; the host's reads of the device give up then
    # (comm.wait_event's give_up), not after `timeout`
    peers_failed: Callable[[], str | None] | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.tp_size < 1 or self.ep_size < 1 or self.tp_size % self.ep_size:
            raise ValueError(f"ep_size ({self.ep_size}) must divide tp_size ({self.tp_size}), both >= 1")
        if not 0 <= self.rank < self.tp_size:
            raise ValueError(f"rank {self.rank} is not in [0, tp_size={self.tp_size})")
        if self.moe_dispatch not in DISPATCH_MODES:
            raise ValueError(f"moe_dispatch must be one of {DISPATCH_MODES}, got {self.moe_dispatch!r}")

    @property
    def moe_tp_size(self) -> int:
        """Ranks of one expert-parallel group, which split its experts' intermediate dimension."""
        return self.tp_size // self.ep_size

    @property
    def ep_rank(self) -> int:
        """The expert-parallel group of this rank: it holds that group's share of the experts."""
        return self.rank // self.moe_tp_size

    @property
    def moe_tp_rank(self) -> int:
        return self.rank % self.moe_tp_size


_current = ParallelState()


def get_parallel() -> ParallelState:
    return _current


@contextlib.contextmanager
def parallel_state(state: ParallelState) -> Iterator[ParallelState]:
    """Layers built inside take `state`'s shards (collectives need its groups: set by init_parallel)."""
    global _current
    previous, _current = _current, state
    try:
        yield state
    finally:
        _current = previous


def init_parallel(tp_size: int, ep_size: int = 1, rank: int | None = None, init_method: str | None = None,
                  backend: str | None = None, timeout: float = 300.0, moe_dispatch: str = "all_reduce",
                  device: torch.device | str = "cpu", store: dist.Store | None = None) -> ParallelState:
    """Join a world of tp_size processes; returns its state (build the model under parallel_state(it)). rank and init_method default to the
    environment torchrun sets (RANK, MASTER_ADDR, MASTER_PORT); "tcp://host:port" joins the store that listens there
    (`launch.rendezvous_store`) as a client, rank 0 too; `store`, a client of it made already (`store_client`), in
    place of init_method. backend defaults to NCCL on a CUDA device, else gloo.
    timeout (seconds): how long a collective waits for the other ranks before it raises, which is how a rank
    that hangs or died is noticed."""
    rank = int(os.environ["RANK"]) if rank is None else rank
    state = ParallelState(rank, tp_size, ep_size, moe_dispatch)  # checks the layout before joining anything
    if tp_size == 1:
        return state
    device = torch.device(device)
    backend = backend or ("nccl" if device.type == "cuda" else "gloo")
    kwargs = {"device_id": device} if backend == "nccl" else {}
    if device.type == "cuda":
        torch.cuda.set_device(device)  # Triton launches on the current device, NCCL binds to it
    init_method = init_method or "env://"
    if store is not None:
        kwargs["store"] = store
    elif init_method.startswith("tcp://"):
        kwargs["store"] = store_client(init_method.removeprefix("tcp://"), timeout)
    else:
        kwargs["init_method"] = init_method
    try:
        dist.init_process_group(backend, rank=rank, world_size=tp_size, timeout=timedelta(seconds=timeout), **kwargs)
    except BaseException:
        # torch counted the default group it failed to make: this process's next world would name its groups
        # one up from its fresh ranks' and never meet them (destroy_process_group resets it, when there is a group)
        distributed_c10d._world.group_count = 0
        raise
    group = dist.group.WORLD
    if backend == "nccl":
        # the NCCL watchdog ends the process when an eager collective outlasts the group's timeout; rank 0 notices a
        # step that does not end first (Workers.wait_for, after dist_timeout) and stops the ranks, the server alive;
        # a host read of the device mid-step (comm.host_values: the counted all-to-all's counts) raises after it too
        distributed_c10d._set_pg_timeout(timedelta(seconds=max(2 * timeout, timeout + 60)), group)
    # connecting waits for every rank as long as a collective would (a rank that hangs here is noticed), then
    # its ops get CONTROL_TIMEOUT (torchtitan changes a group's timeout the same way once its world is up)
    control = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout))
    distributed_c10d._set_pg_timeout(CONTROL_TIMEOUT, control)
    return ParallelState(rank, tp_size, ep_size, moe_dispatch, group, control, timeout)


def store_client(addr: str, timeout: float) -> dist.TCPStore:
    """A client of the rendezvous store at addr (host:port). TCPStore's first exchange with a store waits for its
    answer without a limit: at an address that takes connections but is no store (another program's port) the rank
    would hang for good, whatever its timeout. So the client is made in a thread, given the timeout and a margin."""
    host, port = host_port(addr)
    made: dict[str, object] = {}

    def make() -> None:
        try:
            made["store"] = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout))
        except Exception as e:
            made["error"] = e
    thread = threading.Thread(target=make, name="rendezvous client", daemon=True)  # a hung one blocks no exit
    thread.start()
    thread.join(timeout + 5)
    if "store" in made:
        return made["store"]
    reason = (str(made.get("error", "")).strip() or "no answer").splitlines()[0]
    raise ValueError(f"{addr} does not answer as the rendezvous store of rank 0 (--dist-init-addr) within {timeout:g} "
                     f"s: {reason}")


def destroy_parallel(abort: bool = False) -> None:
    """Leave the world, if this process joined one: with every rank leaving too (NCCL's destroy of a communicator
    waits for the other ranks'), or, abort, at once, waiting for no rank and no work in flight (a rank died or
    hangs)."""
    if not dist.is_initialized():
        return
    if abort:
        try:
            distributed_c10d._abort_process_group()
            return
        except Exception:  # experimental in torch ("NCCL only"): a backend that cannot abort is destroyed instead
            if not dist.is_initialized():
                return
    dist.destroy_process_group()
