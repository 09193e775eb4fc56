"""Starting the other ranks of a world on this machine and telling what became of them: each runs
`target(rank, *args)` in a fresh (spawned) process; an exception there is sent back with its traceback
before the process exits, so rank 0 can say why a rank stopped, not only that it did."""
from __future__ import annotations

import multiprocessing as mp
import os
import queue
import socket
import traceback
from collections.abc import Callable
from typing import Any


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(target: Callable[..., Any], rank: int, messages: Any, args: tuple) -> None:
    messages.put((rank, None))  # started: its imports (unpickling target) went well
    try:
        target(rank, *args)
    except BaseException:  # noqa: BLE001  (whatever it was, rank 0 hears of it)
        messages.put((rank, traceback.format_exc()))
        messages.close()
        messages.join_thread()
        os._exit(1)


class LocalRanks:
    """`ranks` as daemon processes of this machine (they end with this process)."""

    def __init__(self, target: Callable[..., Any], ranks: range, args: tuple):
        ctx = mp.get_context("spawn")
        self.messages = ctx.Queue()  # (rank, None) once started, (rank, traceback) when it raised
        self.procs = {r: ctx.Process(target=_entry, args=(target, r, self.messages, args), daemon=True,
                                     name=f"moelora-rank{r}") for r in ranks}
        for p in self.procs.values():
            p.start()
        self._started: set[int] = set()
        self._errors: dict[int, str] = {}

    def wait_started(self) -> None:
        """Return once every rank runs its target; raise RuntimeError if one ended before (so rank 0 does not
        wait for it to join a world)."""
        while len(self._started) < len(self.procs):
            self._read(timeout=0.2)
            if any(r not in self._started for r in self.dead()):
                raise RuntimeError(f"a rank ended before it started: {self.describe(wait=0)} (spawned ranks import "
                                   "the main module again: start the engine under `if __name__ == '__main__':`)")

    def _read(self, timeout: float) -> None:
        try:
            while True:
                rank, text = self.messages.get(timeout=timeout)
                if text is None:
                    self._started.add(rank)
                else:
                    self._errors[rank] = text
                timeout = 0
        except queue.Empty:
            pass

    def dead(self) -> dict[int, int]:
        """Ranks whose process has ended -> exit code (negative: killed by that signal)."""
        return {r: p.exitcode for r, p in self.procs.items() if p.exitcode is not None}

    def describe(self, wait: float = 2.0) -> str:
        """What became of the ranks, for an error message: the traceback of a rank that raised, or the exit
        code of one that ended, or that all still run (one hangs, or a collective timed out). Waits up to
        `wait` seconds for a failing rank's process to end."""
        for p in self.procs.values():
            p.join(wait / len(self.procs))
        self._read(timeout=0)
        lines = []
        for r, code in sorted(self.dead().items()):
            why = self._errors.get(r)
            lines.append(f"rank {r} failed:\n{why}" if why else f"rank {r} exited with code {code}"
                         + (f" (signal {-code})" if code < 0 else ""))
        return "\n".join(lines) or "every rank is still running: one did not answer in time"

    def stop(self, timeout: float = 10.0) -> None:
        """Wait for the ranks to end (after a shutdown command), then kill what is left."""
        for p in self.procs.values():
            p.join(timeout)
        for p in self.procs.values():
            if p.is_alive():
                p.kill()
                p.join()
