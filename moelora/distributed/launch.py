"""Starting the ranks of a world on this machine and telling what became of them: each runs
`target(rank, *args)` in a fresh (spawned) process; an exception there is sent back with its traceback
before the process exits, so the process that started it can say why a rank stopped, not only that it did.

Ranks of other machines are not seen from here: the process that started them reports their failures
(`report_failures`) to the world's rendezvous store, which rank 0's process holds, so that rank 0 can name them
(`reported_failures`)."""
from __future__ import annotations

import contextlib
import multiprocessing as mp
import multiprocessing.connection
import os
import queue
import random
import socket
import threading
import time
import traceback
from collections.abc import Callable, Iterable
from datetime import timedelta
from multiprocessing.queues import Queue
from pathlib import Path
from typing import Any

import torch.distributed as dist


def free_port() -> int:
    """A loopback port free now, for a server another process listens on later (a world's own rendezvous holds its
    port instead: `rendezvous_store`). Below the system's ephemeral ports where there is room (Linux:
    ip_local_port_range), so that a client calling it before it listens is never handed it as its own local port
    (TCP connects such a socket to itself, and the port is lost to the server)."""
    low = _ephemeral_ports_start()
    for port in random.sample(range(low - 8192, low), 64) if low > 8192 + 1024 else []:
        with socket.socket() as s, contextlib.suppress(OSError):
            s.bind(("127.0.0.1", port))
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ephemeral_ports_start() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):  # not Linux: no room known below them
        return 0


def rendezvous_store(addr: str | None, timeout: float) -> tuple[dist.TCPStore, str]:
    """The store a world's ranks meet at, listening from now until it is dropped, and its address (host:port, an
    IPv6 host in brackets): at addr, or on a loopback port the system picks. Every rank, this process's too, joins
    it as a client (`init_parallel` with "tcp://" and the address). The port is held before any rank starts: a
    port probed free, then bound by rank 0 once the ranks had started, could meanwhile be taken by another
    process, or by a rank's own connect to it (TCP connects a socket to itself when the system hands it, as its
    local port, the very port it calls and nothing listens on yet), after which no rank could use it."""
    host, port = host_port(addr or "127.0.0.1:0")
    try:
        # bound once first: a host that is not this machine's would have the store retry connecting for `timeout`
        info = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        with socket.socket(info[0], socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind(info[4])
        store = dist.TCPStore(host, port, is_master=True, timeout=timedelta(seconds=timeout), wait_for_workers=False)
    except (dist.DistNetworkError, OSError) as e:  # a port in use, a host that is not this machine's
        reason = (str(e).strip() or type(e).__name__).splitlines()[0]
        raise ValueError(f"cannot listen on {host}:{port}{' (--dist-init-addr)' if addr else ''}: {reason}") from None
    return store, f"{addr.rpartition(':')[0] if addr else host}:{store.port}"


def host_port(addr: str) -> tuple[str, int]:
    """"host:port" -> (host, port), an IPv6 host given in brackets (as in a URL) without them, as sockets take it."""
    host, _, port = addr.rpartition(":")
    return host.strip("[]"), int(port)


# a rank's imports (torch, Triton, transformers) take tens of seconds on a busy machine: starting one is given
# at least this long, whatever short timeout its collectives have
START_TIMEOUT = 120.0


def _end_with_parent() -> None:
    """End this process as soon as the one that started it has ended. A process that a signal ends (`moelora serve`
    by SIGTERM while it starts, or any SIGKILL) runs no cleanup: multiprocessing does not terminate its daemon
    processes then, and a rank left behind would wait for its world, or for rank 0's next command, for good. The
    parent's sentinel (a pipe the parent holds open) becomes ready once the parent is gone, whatever ended it."""
    parent = mp.parent_process()

    def watch() -> None:
        mp.connection.wait([parent.sentinel])
        os._exit(1)  # nobody is left to tell, or to wait for: as abruptly as its parent ended
    threading.Thread(target=watch, name="moelora-parent-watch", daemon=True).start()


def _entry(target: Callable[..., Any], rank: int, started: Any, messages: Any, args: tuple) -> None:
    _end_with_parent()
    started.set()  # its imports (unpickling target) went well; at once, as a queue's feeder thread might not
    try:
        target(rank, *args)
    except BaseException:  # noqa: BLE001  (whatever it was, rank 0 hears of it)
        messages.put((rank, traceback.format_exc()))
        messages.close()
        messages.join_thread()
        os._exit(1)


class LocalRanks:
    """`ranks` as daemon processes of this machine: they end with this process, however it ends (_end_with_parent)."""

    def __init__(self, target: Callable[..., Any], ranks: range, args: tuple):
        ctx = mp.get_context("spawn")
        self.messages: Queue | None = ctx.Queue()  # (rank, traceback) when it raised; None once stopped
        self.started = {r: ctx.Event() for r in ranks}
        self.procs = {r: ctx.Process(target=_entry, args=(target, r, self.started[r], self.messages, args),
                                     daemon=True, name=f"moelora-rank{r}") for r in ranks}
        for p in self.procs.values():
            p.start()
        self._errors: dict[int, str] = {}

    def wait_started(self, timeout: float) -> None:
        """Return once every rank runs its target; raise RuntimeError if one ended before (so rank 0 does not
        wait for it to join a world), or did not start within `timeout` seconds (at least START_TIMEOUT: it hangs
        in its imports)."""
        deadline = time.monotonic() + max(timeout, START_TIMEOUT)
        while waiting := [r for r, started in self.started.items() if not started.is_set()]:
            if any(r in self.dead() for r in waiting):
                raise RuntimeError("a rank ended before it started (spawned ranks import the main module again: "
                                   "start the engine under `if __name__ == '__main__':`)")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{name_ranks(waiting)} did not start within {max(timeout, START_TIMEOUT):g} s")
            time.sleep(0.05)

    def wait_ended(self) -> dict[int, str]:
        """Block until every rank ended, or one failed (an exception, or an exit code other than 0): then each rank
        that did not end well (failed, or still running) -> what became of it (`fate`); empty when all ended well."""
        while len(self.dead()) < len(self.procs) and not any(self.dead().values()):
            self._read(timeout=0.5)  # reading as it waits: a rank sending a long traceback is not held up
        for p in self.procs.values():  # a moment for those that lost a peer to fail too: all of them are told
            p.join(0.5 / len(self.procs))
        self._read(timeout=0)
        return {r: self.fate(r) for r, p in self.procs.items() if p.exitcode != 0}

    def _read(self, timeout: float) -> None:
        messages = self.messages  # (once: stop() may drop it meanwhile, from another thread than ended()'s)
        if messages is None:  # stopped: what they sent was read then
            return
        try:
            while True:
                rank, text = messages.get(timeout=timeout)
                self._errors[rank] = text
                timeout = 0
        except queue.Empty:
            pass

    def dead(self) -> dict[int, int]:
        """Ranks whose process has ended -> exit code (negative: killed by that signal)."""
        return {r: p.exitcode for r, p in self.procs.items() if p.exitcode is not None}

    def ended(self) -> dict[int, str]:
        """Ranks whose process has ended -> what became of them (`fate`), at once: no process is waited for, and what
        they sent is read only once one has ended. Cheap (a waitpid per rank) and safe from any thread: a server's
        /health asks at every poll."""
        dead = self.dead()
        if dead:
            self._read(timeout=0)  # the traceback of one that raised: sent before it exited
        return {r: self.fate(r) for r in dead}

    def fate(self, rank: int) -> str:
        """What became of one rank, in a line: "raised <the traceback's last line>", "exited with code N"."""
        if rank in self._errors:
            return "raised " + self._errors[rank].strip().splitlines()[-1]
        code = self.procs[rank].exitcode
        if code is None:
            return "is still running"
        return f"exited with code {code}" + (f" (signal {-code})" if code < 0 else "")

    def describe(self, wait: float = 2.0) -> str:
        """What became of the ranks, for an error message: the traceback of a rank that raised, or the exit
        code of one that ended, or which still run (one hangs, or a collective timed out). Waits up to
        `wait` seconds for a failing rank's process to end."""
        for p in self.procs.values():
            p.join(wait / len(self.procs))
        self._read(timeout=0)
        lines = [f"rank {r} failed:\n{self._errors[r]}" if r in self._errors else f"rank {r} {self.fate(r)}"
                 for r in sorted(self.dead())]
        alive = sorted(set(self.procs) - set(self.dead()))
        return "\n".join(lines) or f"{name_ranks(alive)} {'is' if len(alive) == 1 else 'are'} still running: " \
            f"{'it' if len(alive) == 1 else 'one'} did not answer in time"

    def stop(self, timeout: float = 10.0) -> None:
        """Wait for the ranks to end (after a shutdown command), then kill what is left, and let go of the queue and
        events shared with them (describe() still says what became of the ranks)."""
        for p in self.procs.values():
            p.join(timeout)
        for p in self.procs.values():
            if p.is_alive():
                p.kill()
                p.join()
        self._read(timeout=0)
        # let go of here, their named semaphores are unlinked now rather than at this process's exit: a process that a
        # signal ends (`moelora serve` by SIGTERM) runs no finalizers, and the resource tracker then unlinks them itself
        # with a warning of "leaked semaphore objects"
        self.messages = None
        self.started.clear()


def name_ranks(ranks: Iterable[int]) -> str:
    """For messages: "rank 1", "ranks 2, 3"."""
    ranks = sorted(ranks)
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def _failure_key(rank: int) -> str:
    return f"moelora/failed/{rank}"


def _store(addr: str, timeout: float) -> dist.TCPStore:
    """A client of the rendezvous store at addr (host:port, the init_method tcp:// address rank 0 listens on);
    OSError at once where nothing listens there (rank 0's world is gone), not after TCPStore's retries."""
    host, port = host_port(addr)
    socket.create_connection((host, port), timeout=timeout).close()
    return dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout), wait_for_workers=False)


def report_failures(addr: str, fates: dict[int, str], timeout: float = 5.0) -> None:
    """Tell rank 0 what became of ranks of this machine (`LocalRanks.fate`), through the rendezvous store at addr."""
    with contextlib.suppress(Exception):  # rank 0's process, and its store with it, is gone: nobody to tell
        store = _store(addr, timeout)
        for rank, fate in fates.items():
            store.set(_failure_key(rank), fate)


def reported_failures(addr: str, ranks: Iterable[int], wait: float) -> dict[int, str]:
    """What the other machines reported (`report_failures`) of `ranks`: rank -> fate. Waits up to `wait` seconds
    for a first report (the other machine notices a failed rank a moment after rank 0 lost it)."""
    ranks, deadline = list(ranks), time.monotonic() + wait
    with contextlib.suppress(Exception):  # the store is gone (the world was never formed): nothing was reported
        store = _store(addr, wait)
        while True:
            got = stored_failures(store, ranks)
            if got or time.monotonic() > deadline:
                return got
            time.sleep(0.1)
    return {}


def stored_failures(store: dist.Store, ranks: Iterable[int]) -> dict[int, str]:
    """What the other machines reported (`report_failures`) of `ranks` so far, read from `store` (the rendezvous
    store, or a client of it) at once: rank -> fate."""
    keys = {rank: _failure_key(rank) for rank in ranks}
    return {rank: store.get(key).decode() for rank, key in keys.items() if store.check([key])}
