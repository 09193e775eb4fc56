"""Grammar compiles that can be stopped. A server compiles each new grammar a request brings first in a worker
process, which is killed once the grammar has taken longer than a time limit, or when its request has gone; only a
grammar whose trial ended in time is then compiled in the server's own process, for its requests to use.

xgrammar's compile cannot be interrupted, and its time grows steeply with some grammars' size (a JSON schema's
optional properties on a 64k-token vocabulary: 100 take 0.8 s, 300 take 7.8 s, 1000 a minute and a half), so any
client could otherwise hold the server's compile threads, and its cores, for as long as it liked. The trial compiles
the grammar as the server would (`structured_output.compile_spec`), against the same vocabulary, so one that ends in
time bounds the compile after it. A trial costs a compile (a second one), not the copy of its result: a compiled
grammar's token masks are megabytes, whose serializing took 6x longer than the compile itself.
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
_POLL_S = 0.02  # how often a waiting trial looks whether its request has gone


class TrialCancelled(Exception):
    """The trial's request went away: its worker was killed."""


class _Overtime(Exception):
    pass


class _Worker:
    """One worker process, and the server's end of its socket."""

    def __init__(self, tokenizer_info: str):
        # a new interpreter running this module, not multiprocessing's spawn, which runs the server's main module
        # again in the child (a script without a __main__ guard would start over); in a session of its own, so that a
        # Ctrl-C at the terminal reaches the server alone, which ends the workers
        # (the same moelora as the server's, wherever that was imported from)
        path = os.pathsep.join(filter(None, [str(Path(__file__).parents[2]), os.environ.get("PYTHONPATH")]))
        ours, theirs = socket.socketpair()
        with theirs:
            self.process = subprocess.Popen([sys.executable, "-m", __name__, str(theirs.fileno())],
                                            pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL,
                                            env={**os.environ, "PYTHONPATH": path}, start_new_session=True)
        self.conn = Connection(ours.detach())
        self.tokenizer_info, self.ready = tokenizer_info, False

    def wait(self, deadline: float, cancelled: threading.Event | None) -> Any:
        """The worker's next message; _Overtime past the deadline, TrialCancelled once `cancelled` is set, EOFError if
        the process ended."""
        while not self.conn.poll(_POLL_S):
            if cancelled is not None and cancelled.is_set():
                raise TrialCancelled
            if time.monotonic() > deadline:
                raise _Overtime
        return self.conn.recv()

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()
        self.conn.close()


class GrammarTrials:
    """Trial compiles in up to `workers` processes (started when first needed, kept between trials), each grammar
    given `time_limit` seconds."""

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
        """Compile the spec's grammar in a worker, which is killed once the grammar has taken `time_limit` seconds, or
        once `cancelled` is set (TrialCancelled). Raises ValueError naming SamplingParams.structured_output when the
        grammar is not valid or takes too long; RuntimeError when a worker cannot start or fails otherwise."""
        with self._slots:
            worker = self._take()
            keep = False
            try:
                if not worker.ready:
                    self._start(worker, cancelled)
                worker.conn.send(spec)
                reply = worker.wait(time.monotonic() + self.time_limit, cancelled)
                keep = True
            except _Overtime:
                raise ValueError(f"SamplingParams.structured_output: the {spec.kind.replace('_', ' ')} takes longer "
                                 f"than the {self.time_limit:g} s a grammar may take to compile") from None
            except (EOFError, OSError):  # the worker ended in the compile (or the trials were closed meanwhile)
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
        """Kill the workers (those in a trial too: their trials fail)."""
        with self._lock:
            self._closed = True
            idle, self._idle, busy = self._idle, [], list(self._busy)
        for worker in idle:
            worker.kill()
        for worker in busy:  # its trial's thread closes its socket (see the process end, then _put)
            worker.process.kill()

    def _take(self) -> _Worker:
        with self._lock:
            if self._closed:
                raise RuntimeError("the grammar compile workers have been shut down")
            worker = self._idle.pop() if self._idle else None
        if worker is None:
            worker = _Worker(self.grammars.tokenizer_info().serialize_json())
        with self._lock:
            self._busy.add(worker)
        return worker

    def _put(self, worker: _Worker, keep: bool) -> None:
        """Back to the idle ones, or killed and replaced at once (the next trial then finds its replacement started)."""
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
        """Send the worker its vocabulary (once it has started, unless it is still importing xgrammar: then the send
        waits for it) and wait until it is ready to compile."""
        try:
            worker.conn.send(worker.tokenizer_info)
            worker.wait(time.monotonic() + WORKER_START_TIMEOUT, cancelled)
        except (_Overtime, EOFError, OSError) as e:
            raise RuntimeError(f"a grammar compile worker did not start ({type(e).__name__}: exit code "
                               f"{worker.process.poll()})") from None
        worker.ready = True


def _serve(conn: Connection) -> None:
    """A worker: compile each spec received, answer ("ok" | "invalid" | "error", message)."""
    import xgrammar

    compiler = xgrammar.GrammarCompiler(xgrammar.TokenizerInfo.deserialize_json(conn.recv()), cache_enabled=False)
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


if __name__ == "__main__":
    _serve(Connection(int(sys.argv[1])))
