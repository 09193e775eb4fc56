"""The engine over several ranks: rank 0 is the process the user talks to (it schedules, tokenizes and
samples, and runs its share of the model); ranks 1.. run their shares of the model on the steps rank 0
sends them.

`Workers` is rank 0's side: it starts the other ranks (spawned CPU processes with gloo, or one process per GPU
with NCCL), joins their world, and sends each command over the gloo control group: ("step", LoRA events,
StepInputs), ("lora", LoRA events) (followed by a barrier, so a runtime load_lora or unload_lora returns once
every rank has it) and ("shutdown",). The other ranks run ModelRunner's `serve_rank`.

Under torchrun (RANK and WORLD_SIZE = tp_size in the environment, one process per GPU, on one node or several)
nothing is started: every process constructs the Engine, rank 0's is the engine and the others' construction
runs serve_rank until rank 0 shuts down, then exits the process.

A rank that raises sends its traceback to rank 0 and exits; one killed or hung makes rank 0's next collective
fail at once (a closed connection) or after dist_timeout seconds, while loading as while serving. Rank 0 then
raises `WorkerFailure` naming the rank and what became of it, stops the other ranks, and the engine stops taking
requests (Engine.fatal).
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Callable, Iterator

import torch

from moelora.distributed.comm import barrier, broadcast_object
from moelora.distributed.launch import LocalRanks, free_port
from moelora.distributed.state import ParallelState, destroy_parallel, init_parallel
from moelora.engine.config import EngineConfig


class WorkerFailure(RuntimeError):
    """A rank died, raised or did not answer in time: the ranks are out of step and the engine cannot go on."""


def launched_rank(config: EngineConfig) -> int | None:
    """This process's rank when torchrun started the engine's tp_size processes, else None."""
    if "RANK" not in os.environ or int(os.environ.get("WORLD_SIZE", "1")) != config.tp_size:
        return None
    return int(os.environ["RANK"])


def node_config(config: EngineConfig, rank: int) -> EngineConfig:
    """The config of one rank: on GPUs its own device, cuda:N+i for device cuda:N, i being torchrun's LOCAL_RANK
    where torchrun started the ranks (one node or several), else the rank (the engine started them all here)."""
    device = torch.device(config.device)
    if device.type != "cuda":
        return config
    i = int(os.environ.get("LOCAL_RANK", rank)) if launched_rank(config) is not None else rank
    return dataclasses.replace(config, device=f"cuda:{(device.index or 0) + i}")


def join_world(config: EngineConfig, rank: int, init_method: str) -> ParallelState:
    return init_parallel(config.tp_size, config.ep_size, rank, init_method, timeout=config.dist_timeout,
                         moe_dispatch=config.moe_dispatch, device=node_config(config, rank).device)


class _LaunchedRanks:
    """Ranks torchrun started: nothing to start, wait for or stop from here."""

    def wait_started(self, timeout: float) -> None:
        pass

    def describe(self, wait: float = 0.0) -> str:
        return "the ranks were started by torchrun: their own output says which one failed and why"

    def stop(self, timeout: float = 0.0) -> None:
        pass


class Workers:
    """Ranks 1..tp_size-1 (processes of this machine, or torchrun's), and this process as rank 0 of their world."""

    def __init__(self, config: EngineConfig, serve: Callable[[int, EngineConfig, str], None]):
        """serve(rank, config, init_method): what the other ranks run (join_world, then follow rank 0)."""
        if torch.distributed.is_initialized():
            raise RuntimeError("this process is in a torch.distributed world already (another engine's that was not "
                               "shut down?): an engine over several ranks starts its own")
        launched = launched_rank(config) is not None
        init_method = "env://" if launched else f"tcp://127.0.0.1:{free_port()}"
        self.device, self.timeout = torch.device(node_config(config, 0).device), config.dist_timeout
        self.ranks = _LaunchedRanks() if launched else LocalRanks(serve, range(1, config.tp_size), (config, init_method))
        self.failure: str | None = None
        try:
            with self.guard("starting the ranks"):
                self.ranks.wait_started(config.dist_timeout)
                self.state = join_world(config, 0, init_method)
        except BaseException:  # an interrupt too (the guard stopped them on an error)
            self.ranks.stop(timeout=0)
            raise

    @contextlib.contextmanager
    def guard(self, what: str) -> Iterator[None]:
        """Run `what` (something every rank does together); any error in it -> WorkerFailure, the ranks stopped."""
        if self.failure is not None:
            raise WorkerFailure(self.failure)
        try:
            yield
        except Exception as e:
            self.failure = f"{what} failed on the tensor-parallel ranks ({type(e).__name__}: {e}); {self.ranks.describe()}"
            self.ranks.stop(timeout=0)
            destroy_parallel()
            raise WorkerFailure(self.failure) from e

    def send(self, command: tuple) -> None:
        broadcast_object(self.state, command, self.timeout)

    def barrier(self) -> None:
        """Returns once every rank got here (or raises within dist_timeout)."""
        barrier(self.state, self.device)

    def shutdown(self) -> None:
        """Stop the other ranks (and leave their world)."""
        if self.failure is None:
            with contextlib.suppress(Exception):
                self.send(("shutdown",))
        self.ranks.stop()
        destroy_parallel()
        self.failure = self.failure or "shut down"
