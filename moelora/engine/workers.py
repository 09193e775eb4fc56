"""The engine over several ranks: rank 0 is the process the user talks to (it schedules, tokenizes and
samples, and runs its share of the model); ranks 1.. run their shares of the model on the steps rank 0
sends them.

`Workers` is rank 0's side: it starts the other ranks of its node (spawned CPU processes with gloo, or one process
per GPU with NCCL), joins their world, and sends each command over the gloo control group: ("step", LoRA events,
StepInputs), ("lora", LoRA events) (followed by a barrier, so a runtime load_lora or unload_lora returns once
every rank has it), ("profile", LoRA events, ("start", directory, name) or ("stop",)) (followed by a barrier
too) and ("shutdown",) (followed by a barrier on the control group, so no rank leaves the world before
every rank has the command). The other ranks run ModelRunner's `serve_rank`.

Where the ranks run, three ways, each process constructing the Engine with the same arguments:
- one node (nnodes 1): rank 0's process starts ranks 1..tp_size-1;
- nnodes > 1 (SGLang's flags): node 0's process is rank 0 and starts its node's ranks 1..tp_size/nnodes-1; node k's
  process (`follow`, from the Engine's constructor) starts ranks k*tp_size/nnodes.. , which serve rank 0's engine,
  and ends when they do (rank 0 shut down); the ranks meet at dist_init_addr, node 0's;
- under torchrun (RANK and WORLD_SIZE = tp_size in the environment, one process per GPU, on one node or several)
  nothing is started: rank 0's process is the engine, the others' construction runs serve_rank until rank 0 shuts
  down, then exits the process.

A rank that raises sends its traceback to the process that started it and exits. Rank 0 finds a rank of its node
that ended (raised or was killed) before each thing the ranks do together (`Workers.check`, cheap: no collective),
and while it joins their world, where the join would wait dist_timeout for it; of another node's rank, what its node
reported to the rendezvous store; and while it waits for a step's device work, or reads the device mid-step (on
GPUs the collectives of a dead rank's peers never end). Otherwise a rank that died or hangs makes rank 0's collective
fail at once (a closed connection) or after dist_timeout seconds, while loading as while serving. Rank 0 then raises
`WorkerFailure` naming the rank and what became of it (of another node's rank, what its node reported), stops the
ranks it started, and the engine stops taking requests (Engine.fatal).
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import threading
from collections.abc import Callable, Iterator

import torch

from moelora.distributed.comm import PeerFailed, broadcast_object, control_barrier, wait_event
from moelora.distributed.launch import (LocalRanks, name_ranks, rendezvous_store, report_failures,
                                       reported_failures, stored_failures)
from moelora.distributed.state import ParallelState, destroy_parallel, init_parallel, store_client
from moelora.engine.config import EngineConfig

_log = logging.getLogger(__name__)
JOIN_POLL_S = 0.1  # while rank 0 joins the world, how often it looks for a rank that failed meanwhile


class WorkerFailure(RuntimeError):
    """A rank died, raised or did not answer in time: the ranks are out of step and the engine cannot go on."""


def launched_rank(config: EngineConfig) -> int | None:
    """This process's rank when torchrun started the engine's tp_size processes, else None."""
    if "RANK" not in os.environ or int(os.environ.get("WORLD_SIZE", "1")) != config.tp_size:
        return None
    if config.nnodes > 1:
        raise ValueError(f"EngineConfig.nnodes must be 1 under torchrun (its own --nnodes places the ranks), got "
                         f"{config.nnodes}")
    return int(os.environ["RANK"])


def node_ranks(config: EngineConfig) -> range:
    """The ranks node_rank runs: tp_size / nnodes consecutive ones."""
    per_node = config.tp_size // config.nnodes
    return range(config.node_rank * per_node, (config.node_rank + 1) * per_node)


def share_node_cores(config: EngineConfig) -> int:
    """This rank takes its share of the node's CPU threads (torch's intra-op pool), threads // ranks on the node,
    and returns the count it had. Every rank keeping every core oversubscribes them: then a rank's CPU work (an
    adapter's parse) crawls while the others' threads spin."""
    threads = torch.get_num_threads()
    torch.set_num_threads(max(1, threads // len(node_ranks(config))))
    return threads


def node_config(config: EngineConfig, rank: int) -> EngineConfig:
    """The config of one rank: on GPUs its own device, cuda:N+i for device cuda:N, i being torchrun's LOCAL_RANK
    where torchrun started the ranks (one node or several), else the rank's place on its node. Under torchrun a
    process that sees one GPU (a scheduler bound each to its own: CUDA_VISIBLE_DEVICES, SLURM's --gpus-per-task)
    takes that one, cuda:0."""
    device = torch.device(config.device)
    if device.type != "cuda":
        return config
    if launched_rank(config) is None:
        i = rank % len(node_ranks(config))
    else:
        i = int(os.environ.get("LOCAL_RANK", rank)) if torch.cuda.device_count() != 1 else 0
    return dataclasses.replace(config, device=f"cuda:{(device.index or 0) + i}")


def join_world(config: EngineConfig, rank: int, init_method: str,
               store: torch.distributed.Store | None = None) -> ParallelState:
    return init_parallel(config.tp_size, config.ep_size, rank, init_method, timeout=config.dist_timeout,
                         moe_dispatch=config.moe_dispatch, device=node_config(config, rank).device, store=store)


def serves_engine(config: EngineConfig) -> bool:
    """Whether this process holds the engine (rank 0's, or the only one), not ranks that serve another's."""
    return config.tp_size == 1 or ((launched_rank(config) or 0) == 0 and config.node_rank == 0)


def follow(config: EngineConfig, serve: Callable[[int, EngineConfig, str], None]) -> None:
    """Serve rank 0's engine from a process that does not hold it (serves_engine is False), until rank 0 shuts
    down: as torchrun's rank, or as node node_rank's ranks, started here. WorkerFailure, naming them, when ranks of
    this node failed (rank 0 is told too, through the world's rendezvous store)."""
    rank = launched_rank(config)
    if rank is not None:
        serve(rank, config, "env://")
        return
    ranks = LocalRanks(serve, node_ranks(config), (config, f"tcp://{config.dist_init_addr}"))
    try:
        ranks.wait_started(config.dist_timeout)
    except RuntimeError as e:  # one ended before it started, or hangs in its imports
        failed, problem = {}, str(e)
    else:
        failed = ranks.wait_ended()
        problem = "; ".join(f"rank {r} {fate}" for r, fate in failed.items())
    if problem:
        if failed:
            report_failures(config.dist_init_addr, failed)
        # the tracebacks, which rank 0 does not get: this node's output has them
        _log.error("node %d's ranks failed:\n%s", config.node_rank, ranks.describe(wait=0))
        ranks.stop(timeout=0)
        raise WorkerFailure(f"node {config.node_rank} of the engine at {config.dist_init_addr}: {problem}")


class _LaunchedRanks:
    """Ranks torchrun started: nothing to start, wait for or stop from here."""

    def wait_started(self, timeout: float) -> None:
        pass

    def ended(self) -> dict[int, str]:
        return {}  # not this process's: one that died fails rank 0's next collective

    def describe(self, wait: float = 0.0) -> str:
        return "the ranks were started by torchrun: their own output says which one failed and why"

    def stop(self, timeout: float = 0.0) -> None:
        pass


class _NodeRanks:
    """The ranks of an engine over several nodes, as rank 0 sees them: its node's others, which it started, and
    the other nodes' ranks, which their nodes started (`follow`) and of which it knows what those nodes report."""

    def __init__(self, local: LocalRanks, remote: range, addr: str):
        self.local, self.remote, self.addr = local, remote, addr
        # what the other nodes reported while rank 0 joined the world (poll_reports): rank 0 gives up the join by
        # dropping the store that holds it, before describe() reads it
        self.reported: dict[int, str] = {}

    def wait_started(self, timeout: float) -> None:
        self.local.wait_started(timeout)

    def ended(self) -> dict[int, str]:
        """This node's ranks that ended (LocalRanks.ended); the other nodes' are in the store (poll_reports)."""
        return self.local.ended()

    def poll_reports(self, store: torch.distributed.TCPStore) -> None:
        """Add to `reported` what the other nodes reported so far, read at once from `store`, the rendezvous this
        process holds."""
        self.reported |= stored_failures(store, self.remote)

    def describe(self, wait: float = 2.0) -> str:
        local = self.local.describe(wait) if self.local.procs else ""
        # through the rendezvous store, which Workers holds from before the ranks start (gone: none reported since
        # poll_reports)
        reported = self.reported | reported_failures(self.addr, self.remote, wait)
        remote = "\n".join(f"rank {r} {fate} (on another node: its node's output says why)"
                           for r, fate in reported.items())
        return "\n".join(filter(None, [local, remote or f"{name_ranks(self.remote)} of the other nodes: none "
                                                        "reported a failure (one that hangs, or whose node died, "
                                                        "cannot: their nodes' output says)"]))

    def stop(self, timeout: float = 10.0) -> None:
        self.local.stop(timeout)


class Workers:
    """Ranks 1..tp_size-1 (processes of this machine and of the other nodes, or torchrun's), and this process as rank
    0 of their world."""

    def __init__(self, config: EngineConfig, serve: Callable[[int, EngineConfig, str], None]):
        """serve(rank, config, init_method): what the other ranks run (join_world, then follow rank 0)."""
        if torch.distributed.is_initialized():
            raise RuntimeError("this process is in a torch.distributed world already (another engine's that was not "
                               "shut down?): an engine over several ranks starts its own")
        self.device, self.timeout = torch.device(node_config(config, 0).device), config.dist_timeout
        self.failure: str | None = None
        self.rendezvous: torch.distributed.TCPStore | None = None  # torchrun's, where it started the ranks
        if launched_rank(config) is not None:
            init_method, self.ranks = "env://", _LaunchedRanks()
        else:
            # listening before any rank starts, for as long as the world lives (rendezvous_store says why)
            self.rendezvous, addr = rendezvous_store(config.dist_init_addr, config.dist_timeout)
            init_method, own = f"tcp://{addr}", node_ranks(config)
            local = LocalRanks(serve, own[1:], (config, init_method))
            self.ranks = local if config.nnodes == 1 else _NodeRanks(local, range(own.stop, config.tp_size), addr)
        try:
            with self.guard("starting the ranks"):
                self.ranks.wait_started(config.dist_timeout)
                # the model's host reads of the device mid-step (comm.host_values) give up as wait_for does
                self.state = dataclasses.replace(self._join(config, init_method), peers_failed=self._peers_failed)
        except BaseException:  # an interrupt too (the guard stopped them on an error)
            self.ranks.stop(timeout=0)
            self.rendezvous = None  # its port free at once, not once the traceback is dropped
            raise

    def _join(self, config: EngineConfig, init_method: str) -> ParallelState:
        """join_world, which waits up to dist_timeout for every rank, while this thread watches the ranks: one that
        ended before it joined (it raised, or was killed) fails the start within a moment, a RuntimeError naming it
        and what became of it."""
        outcome = self._watch_join(config, init_method)
        if isinstance(outcome, ParallelState):
            return outcome  # (a rank that ended since is the next guard's to find)
        failed = self._failed_ranks()  # one whose end failed the join (or gloo's connection to it, refused)
        if not failed:
            raise outcome
        fates = "; ".join(f"rank {r} {fate}" for r, fate in sorted(failed.items()))
        raise RuntimeError(f"{name_ranks(failed)} ended before joining the world: {fates}")

    def _watch_join(self, config: EngineConfig, init_method: str) -> ParallelState | BaseException:
        """join_world's outcome, run in a thread of its own until it ends or a rank failed (_failed_ranks)."""
        # the join's client of the rendezvous store is made here, at once (this process's store answers): the thread
        # then waits on nothing that dropping the store (below) does not end, where a client still connecting to it
        # would retry for dist_timeout
        client = store_client(init_method.removeprefix("tcp://"), config.dist_timeout) \
            if init_method.startswith("tcp://") else None
        joined: list[ParallelState | BaseException] = []

        def join() -> None:
            try:
                joined.append(join_world(config, 0, init_method, client))
            except BaseException as e:  # noqa: BLE001  (the caller's to raise)
                joined.append(e)
        thread = threading.Thread(target=join, name="moelora-join", daemon=True)
        thread.start()
        try:
            while thread.is_alive() and not self._failed_ranks():
                thread.join(JOIN_POLL_S)
        finally:
            if thread.is_alive():  # given up: a rank failed, or an interrupt
                # The thread is not left behind: it is inside init_process_group or new_group, which on their way out
                # set up torch.distributed's world, or reset its count of groups (init_parallel), whenever that is;
                # done under a later world of this process (a retry), either would spoil it. Dropping the rendezvous
                # store (Workers holds its only reference) closes its connections, so the thread's waits on it fail
                # at once, and frees its port for a retry: this join takes a moment (a wait not on the store, gloo
                # connecting to a rank that hangs, ends within dist_timeout, as the join did before). What the
                # thread joined, if anything, is left by the guard (_fail's destroy_parallel) once it ended.
                self.rendezvous = None
                thread.join()
        return joined[0]

    def _failed_ranks(self) -> dict[int, str]:
        """Ranks known to have failed -> what became of them: this node's that ended and, over several nodes, those
        the other nodes reported to the rendezvous store (a moment's read of it while this process holds it)."""
        failed = self.ranks.ended()
        if isinstance(self.ranks, _NodeRanks):
            if self.rendezvous is not None:
                self.ranks.poll_reports(self.rendezvous)
            failed |= {r: f"{fate} (on another node)" for r, fate in self.ranks.reported.items()}
        return failed

    def _peers_failed(self) -> str | None:
        """Why a rank is known to have failed (_failed_ranks), or None: a wait for the device's work gives up then."""
        try:
            ranks = self._failed_ranks()
        except Exception as e:  # (another node's reports unreadable: the ranks cannot be watched, the engine fails)
            return f"looking for failed ranks raised {type(e).__name__}: {e}"
        return f"{name_ranks(ranks)} failed" if ranks else None

    def rank_ended(self) -> bool:
        """Whether a rank this process started has ended while the engine could serve (the next `check` fails it):
        a waitpid per rank, no collective and no wait, safe from any thread."""
        return self.failure is None and bool(self.ranks.ended())

    def check(self, what: str = "serving requests") -> None:
        """WorkerFailure if the engine cannot go on: it failed, or a rank this process started has ended, found
        without a collective (which would fail with it, or on GPUs wait dist_timeout for it); the ranks are stopped
        then. Every guard checks first."""
        if self.failure is None and (ended := self.ranks.ended()):
            self._fail(f"{what} failed on the tensor-parallel ranks ({name_ranks(ended)} ended); "
                       f"{self.ranks.describe()}")
        if self.failure is not None:
            raise WorkerFailure(self.failure)

    @contextlib.contextmanager
    def guard(self, what: str) -> Iterator[None]:
        """Run `what` (something every rank does together); any error in it -> WorkerFailure, the ranks stopped. An
        interrupt (Ctrl-C) in it stops them too and is raised as it is: the other ranks ran on without this one, or
        wait for it in a collective, out of step with it for good."""
        self.check(what)
        try:
            yield
        except Exception as e:
            self._fail(f"{what} failed on the tensor-parallel ranks ({type(e).__name__}: {e}); {self.ranks.describe()}")
            raise WorkerFailure(self.failure) from e
        except BaseException as e:
            self._fail(f"{what} was interrupted on rank 0 ({type(e).__name__}), which left the ranks out of step")
            raise

    def _fail(self, failure: str) -> None:
        """The engine cannot go on (every later guard raises `failure`): stop the ranks and leave their world."""
        self.failure = failure
        self.ranks.stop(timeout=0)
        destroy_parallel(abort=True)

    def send(self, command: tuple) -> None:
        broadcast_object(self.state, command, self.timeout)

    def wait_for(self, event: torch.cuda.Event) -> None:
        """The host waits for a step's device work (`event`) until a rank is known to have failed (of ranks this
        process or another node started; not under torchrun), at most dist_timeout, then WorkerFailure: a rank that
        died or hangs holds the step's collectives forever (NCCL's watchdog does not see those a CUDA graph replays),
        where the event's own synchronize would never return (comm.wait_event)."""
        try:
            wait_event(event, self.timeout, give_up=self._peers_failed)
        except (TimeoutError, PeerFailed) as e:
            with self.guard("a step's device work"):
                raise e

    def barrier(self, timeout: float | None = None) -> None:
        """Returns once every rank got here (or raises within `timeout`, by default dist_timeout); over the control
        group, so the host waits whatever the backend (an NCCL barrier would only queue on the stream)."""
        control_barrier(self.state, self.timeout if timeout is None else timeout)

    def shutdown(self, orderly: bool = True) -> None:
        """Stop the other ranks (and leave their world). orderly=False kills them without the shutdown command: a
        start interrupted (Ctrl-C) left them anywhere in it, loading or at its barrier, where none reads a command and
        the command's send would wait dist_timeout for them."""
        together = False
        if self.failure is None and orderly:
            with contextlib.suppress(Exception):  # a rank that died or hangs: stopped below all the same
                self.send(("shutdown",))
                # no rank leaves the world before every rank has the command (serve_rank meets this barrier): rank
                # 0's broadcast returns once its bytes are sent, not once they are read; within dist_timeout, so a
                # rank that hangs holds the shutdown up no longer than that
                control_barrier(self.state, self.timeout)
                together = True
        if together:
            destroy_parallel()  # beside the other ranks' (serve_rank's): each NCCL destroy waits for the others
            self.ranks.stop()
        else:
            self.ranks.stop(timeout=0)
            destroy_parallel(abort=True)
        self.rendezvous = None  # the world is left: its port is free again
        self.failure = self.failure or "shut down"
