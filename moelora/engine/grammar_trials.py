"""Grammar compiles that can be stopped. A server compiles each new grammar a request brings first in a worker
process, which is killed once the grammar has taken more than a time limit, or when its request has gone; only a
grammar whose trial ended in time is then compiled in the server's own process, for its requests to use.

xgrammar's compile cannot be interrupted, and its time grows steeply with some grammars' size (a JSON schema's
optional properties on a 64k-token vocabulary: 100 take 0.8 s, 300 take 7.8 s, 1000 a minute and a half), so any
client could otherwise hold the server's compile threads, and its cores, for as long as it liked. The trial compiles
the grammar as the server would (`structured_output.compile_spec`), against the same vocabulary, on one thread, and
the limit counts the CPU time it takes: a grammar's cost, which other clients' load on the machine does not change
(a wall-clock limit failed valid grammars beside slow ones). A trial costs a second compile, not the copy of its
result: a compiled grammar's token masks are megabytes, whose serializing took 6x longer than the compile itself.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from moelora.engine.sampling_params import StructuredOutput
from moelora.engine.structured_output import GrammarBackend, compile_spec

# a worker's start: a new interpreter that imports xgrammar (and torch through it), 2 s on an idle CPU
WORKER_START_TIMEOUT = 120.0
# a trial's wall-clock time, in time limits, past which it is stopped whatever CPU time it took (a worker that gets
# no CPU at all, stopped or starved, still ends)
WALL_LIMITS = 4
_POLL_S = 0.02  # how often a waiting trial looks at its request, its worker's CPU time and the clock
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
# the worker's interpreter: this package's moelora on the path first, the current directory not on it at all (`-m`
# would put it first: a moelora or torch there would be imported instead)
_BOOT = ("import sys; sys.path[0] = sys.argv[1]; from moelora.engine.grammar_trials import _serve; "
         "_serve(int(sys.argv[2]), int(sys.argv[3]))")


class TrialCancelled(Exception):
    """The trial's request went away, or the trials were closed (the server shuts down): its worker was killed."""


class _Overtime(Exception):
    pass


class _Worker:
    """One worker process, and the server's end of its socket. The vocabulary goes to it in a thread of its own, which
    waits for the worker's imports: a new worker (one replacing a killed one) gets ready with nobody waiting."""

    def __init__(self, tokenizer_info: str):
        ours, theirs = socket.socketpair()
        with theirs:
            root = str(Path(__file__).parents[2])
            # in a session of its own: a Ctrl-C at the terminal reaches the server alone, which ends the workers
            self.process = subprocess.Popen(
                [sys.executable, "-c", _BOOT, root, str(theirs.fileno()), str(os.getpid())],
                pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL, start_new_session=True)
        self.conn = Connection(ours.detach())
        self.tokenizer_info, self.ready = tokenizer_info, False
        threading.Thread(target=self._send_vocabulary, name="moelora-grammar-vocab", daemon=True).start()

    def _send_vocabulary(self) -> None:
        try:
            self.conn.send(self.tokenizer_info)
        except OSError:  # the worker was killed first: its trial (if any) says so
            pass

    def wait(self, deadline: float, cancelled: threading.Event | None, cpu_limit: float | None = None) -> Any:
        """The worker's next message; _Overtime past the deadline (monotonic) or once the worker has taken
        `cpu_limit` more CPU seconds, TrialCancelled once `cancelled` is set, EOFError if the process ended."""
        cpu_end = self.cpu_seconds() + cpu_limit if cpu_limit is not None else None
        while not self.conn.poll(_POLL_S):
            if cancelled is not None and cancelled.is_set():
                raise TrialCancelled
            if time.monotonic() > deadline or cpu_end is not None and self.cpu_seconds() > cpu_end:
                raise _Overtime
        return self.conn.recv()

    def cpu_seconds(self) -> float:
        """The CPU time the worker's threads have taken (Linux's /proc; elsewhere 0: only the wall-clock limit
        holds)."""
        try:
            with open(f"/proc/{self.process.pid}/stat", "rb") as f:
                fields = f.read().rpartition(b")")[2].split()
        except OSError:
            return 0.0
        return (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS  # utime, stime

    def exit_code(self) -> int | None:
        try:
            return self.process.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            return None

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()
        self.conn.close()


class GrammarTrials:
    """Trial compiles in up to `workers` processes (started when first needed, kept between trials), each grammar
    given `time_limit` CPU seconds (on one thread)."""

    def __init__(self, grammars: GrammarBackend, time_limit: float, workers: int):
        if not time_limit > 0:
            raise ValueError(f"a grammar's compile time limit is a number of seconds > 0, got {time_limit!r}")
        self.grammars, self.time_limit = grammars, time_limit
        self._slots = threading.BoundedSemaphore(workers)
        self._idle: list[_Worker] = []
        self._busy: set[_Worker] = set()
        self._lock = threading.Lock()
        self._closed = False

    def check(self, spec: StructuredOutput, cancelled: threading.Event | None = None) -> None:
        """Compile the spec's grammar in a worker, which is killed once the grammar has taken `time_limit` CPU seconds
        (or WALL_LIMITS times that in wall-clock time), or once `cancelled` is set or the trials are closed
        (TrialCancelled). Raises ValueError naming SamplingParams.structured_output when the grammar is not valid or
        takes too long; RuntimeError when a worker cannot start or fails otherwise."""
        with self._slots:
            if cancelled is not None and cancelled.is_set():  # gone while it waited for a worker: none is spent
                raise TrialCancelled
            worker = self._take()
            keep = False
            try:
                if not worker.ready:
                    self._start(worker, cancelled)
                worker.conn.send(spec)
                reply = worker.wait(time.monotonic() + WALL_LIMITS * self.time_limit, cancelled, self.time_limit)
                keep = True
            except _Overtime:
                raise ValueError(f"SamplingParams.structured_output: the grammar takes longer than the "
                                 f"{self.time_limit:g} s a grammar may take to compile") from None
            except (EOFError, OSError):  # the worker ended in the compile, or the trials were closed meanwhile
                if self._closed:
                    raise TrialCancelled from None
                raise ValueError(f"SamplingParams.structured_output: compiling the {spec.kind.replace('_', ' ')} "
                                 "ended the compiling process") from None
            finally:
                self._put(worker, keep)
        status, message = reply
        if status == "invalid":
            raise ValueError(message)
        if status == "error":
            raise RuntimeError(f"a grammar's trial compile failed: {message}")

    def close(self) -> None:
        """Kill the workers; trials under way raise TrialCancelled, later ones RuntimeError."""
        with self._lock:
            self._closed = True
            idle, self._idle, busy = self._idle, [], list(self._busy)
        for worker in idle:
            worker.kill()
        for worker in busy:  # its trial's thread closes its socket (it sees the process end, then _put)
            worker.process.kill()

    def _take(self) -> _Worker:
        with self._lock:
            if self._closed:
                raise RuntimeError("the grammar compile workers have been shut down")
            worker = self._idle.pop() if self._idle else None
        if worker is None:
            worker = _Worker(self.grammars.tokenizer_info().serialize_json())
        with self._lock:
            if not self._closed:
                self._busy.add(worker)
                return worker
        worker.kill()  # closed while it started
        raise TrialCancelled

    def _put(self, worker: _Worker, keep: bool) -> None:
        """Back to the idle ones, or killed and replaced at once (the replacement starts, and takes its vocabulary,
        while no trial waits for it)."""
        with self._lock:
            self._busy.discard(worker)
            closed = self._closed
        if not keep or closed:
            worker.kill()
            if closed:
                return
            worker = _Worker(worker.tokenizer_info)
        with self._lock:
            if not self._closed:
                self._idle.append(worker)
                return
        worker.kill()

    @staticmethod
    def _start(worker: _Worker, cancelled: threading.Event | None) -> None:
        """Wait until the worker has its vocabulary and is ready to compile."""
        try:
            worker.wait(time.monotonic() + WORKER_START_TIMEOUT, cancelled)
        except (_Overtime, EOFError, OSError) as e:
            raise RuntimeError(f"a grammar compile worker did not start ({type(e).__name__}; exit code "
                               f"{worker.exit_code()})") from None
        worker.ready = True


def _serve(fd: int, server_pid: int) -> None:
    """A worker: compile each spec received, answer ("ok" | "invalid" | "error", message); end with the server."""
    def watch() -> None:  # a server killed outright (SIGKILL, the OOM killer) leaves this one to the init process
        while os.getppid() == server_pid:
            time.sleep(0.5)
        os._exit(1)  # in a compile too (it releases the GIL): nobody waits for it
    threading.Thread(target=watch, daemon=True).start()
    import xgrammar

    conn = Connection(fd)
    info = xgrammar.TokenizerInfo.deserialize_json(conn.recv())
    compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)  # one thread: the limit is its time
    conn.send(("ready", None))
    while True:
        try:
            spec = conn.recv()
        except EOFError:  # the server has gone
            return
        try:
            compile_spec(compiler, spec)
            conn.send(("ok", None))
        except ValueError as e:
            conn.send(("invalid", str(e)))
        except Exception as e:
            conn.send(("error", f"{type(e).__name__}: {e}"))
