"""The engine in its own thread beside the HTTP event loop.

Everything that touches the engine (adding and aborting requests, loading adapters, tokenizing)
runs in the engine thread, as a command queued from the event loop and answered through a
concurrent Future. Between commands the thread steps the engine while it has work and hands each
request's outputs to that request's asyncio.Queue with loop.call_soon_threadsafe, one call per
step. A command that raises fails only its own Future. A request the engine fails gets an
EngineError in its queue; a step that raises past the engine's own isolation fails the requests in
flight and the thread goes on, unless the engine's books no longer balance or its device failed:
then `healthy` turns False (and /health says 503).
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, TypeVar

from moelora.engine.engine import Engine, StepOutput
from moelora.engine.sampling_params import SamplingParams
from moelora.server.metrics import Metrics
from moelora.server.stats_log import StatsLog

logger = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass
class Submission:
    """One sequence to generate."""
    prompt: str | list[int]
    params: SamplingParams
    lora: str | None
    add_special_tokens: bool = True  # False for chat prompts: the template wrote the special tokens


@dataclass
class Delta:
    """One step's output of one sequence, as its queue receives it."""
    index: int               # the sequence's position in its submit call
    out: StepOutput
    pieces: dict[int, str]   # text of every token in out.logprobs, out.prompt_token_ids and out.prompt_logprobs


class EngineError(RuntimeError):
    """The engine failed the request (a failed step, or shutdown); put in its queue."""


class Overloaded(RuntimeError):
    """More requests wait than max_queued_requests allows."""


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    index: int
    arrival: float
    last_token: float | None = None


class EngineLoop:
    def __init__(self, engine: Engine, metrics: Metrics, max_queued_requests: int | None = None,
                 stats_interval: float = 10.0):
        self.engine, self.metrics, self.max_queued_requests = engine, metrics, max_queued_requests
        self.stats = StatsLog(stats_interval)
        self.context_len = engine.context_len
        # published by the engine thread for the event loop; replaced whole, never mutated
        self.adapters: dict[str, str] = {n: str(p) for n, p in engine.config.lora_paths.items()}
        self.num_waiting = 0
        self._streams: dict[str, _Stream] = {}
        self._commands: list[tuple[Callable[[], Any], Future]] = []
        self._pending = 0  # sequences submitted and not yet added to the engine
        self._cv = threading.Condition()
        self._stopping = False
        self.failure: str | None = None  # why the engine cannot serve any more
        self._thread = threading.Thread(target=self._run, name="moelora-engine", daemon=True)

    # ------------------------------------------------------------------------- event-loop side

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify()
        self._thread.join()

    @property
    def healthy(self) -> bool:
        """The engine thread runs and the engine can serve."""
        return self._thread.is_alive() and self.failure is None and self.engine.fatal is None

    def call(self, fn: Callable[[], T]) -> Future:
        """Run fn in the engine thread; its result or exception comes back in the Future."""
        future: Future = Future()
        with self._cv:
            if self._stopping:
                raise EngineError("the server is shutting down")
            self._commands.append((fn, future))
            self._cv.notify()
        return future

    async def run(self, fn: Callable[[], T]) -> T:
        return await asyncio.wrap_future(self.call(fn))

    async def submit(self, subs: list[Submission], queue: asyncio.Queue) -> list[str]:
        """Add the sequences (all or none); their Deltas, or an EngineError, go to `queue`. Raises
        Overloaded, or ValueError / AdapterError naming what is wrong with a sequence."""
        if self.failure is not None:
            raise EngineError(f"the engine cannot serve any more: {self.failure}")
        with self._cv:
            waiting = self._pending + self.num_waiting
            if self.max_queued_requests is not None and waiting + len(subs) > self.max_queued_requests:
                raise Overloaded(f"{waiting} requests are queued (max_queued_requests={self.max_queued_requests})")
            self._pending += len(subs)
        loop, arrival = asyncio.get_running_loop(), time.perf_counter()
        try:
            future = self.call(lambda: self._add(subs, loop, queue, arrival))
        except EngineError:
            self._unpend(len(subs))
            raise
        future.add_done_callback(lambda _: self._unpend(len(subs)))  # added, refused or cancelled
        try:
            return await asyncio.wrap_future(future)
        except asyncio.CancelledError:  # the client left while the sequences were being added
            future.add_done_callback(lambda f: f.cancelled() or f.exception() or self.abort(f.result()))
            raise

    async def load_lora(self, name: str, path: str) -> None:
        """Read and validate the adapter (AdapterError lists its problems); it serves from now on."""
        await self.run(lambda: self._load_lora(name, path))

    async def unload_lora(self, name: str) -> None:
        """Requests in flight with the adapter finish; new ones are refused (AdapterError if unknown)."""
        await self.run(lambda: self._unload_lora(name))

    def abort(self, rids: list[str]) -> None:
        """Abort the requests (those still running): their KV cache is freed at the next step."""
        try:
            self.call(lambda: [self.engine.abort(rid) for rid in rids])
        except EngineError:
            pass  # shutting down: everything is dropped anyway

    # ---------------------------------------------------------------------------- engine thread

    def _run(self) -> None:
        while True:
            with self._cv:
                if not (self._commands or self._stopping or self.engine.has_unfinished()):
                    self._cv.wait(self.stats.interval or None)  # woken by work, or for the stats line
                if self._stopping:
                    break
                commands, self._commands = self._commands, []
            for fn, future in commands:
                if future.set_running_or_notify_cancel():
                    try:
                        future.set_result(fn())
                    except Exception as e:  # the caller's error, not the engine's
                        future.set_exception(e)
            if self.engine.has_unfinished():
                self._step()
            self.num_waiting = self.engine.num_waiting
            self.metrics.set_queues(len(self._streams) - self.num_waiting, self.num_waiting)
            self.stats.tick(self.engine, self.engine.num_running, self.num_waiting)
        with self._cv:
            commands, self._commands = self._commands, []
        for _, future in commands:
            future.cancel()
        self._fail_all(EngineError("the server is shutting down"))

    def _unpend(self, n: int) -> None:
        with self._cv:
            self._pending -= n

    def _add(self, subs: list[Submission], loop: asyncio.AbstractEventLoop, queue: asyncio.Queue,
             arrival: float) -> list[str]:
        rids: list[str] = []
        try:
            for index, sub in enumerate(subs):
                rids.append(self.engine.add_request(sub.prompt, sub.params, sub.lora,
                                                    add_special_tokens=sub.add_special_tokens))
                self._streams[rids[-1]] = _Stream(loop, queue, index, arrival)
        except Exception:
            for rid in rids:
                self.engine.abort(rid)
                del self._streams[rid]
            raise
        return rids

    def _load_lora(self, name: str, path: str) -> None:
        self.engine.load_lora(name, path)
        self.adapters = {**self.adapters, name: path}

    def _unload_lora(self, name: str) -> None:
        self.engine.unload_lora(name)
        self.adapters = {n: p for n, p in self.adapters.items() if n != name}

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as e:
            logger.exception("engine step failed; failing the requests in flight")
            self._fail_all(EngineError(f"the engine failed: {e}"))
            if (problem := self.engine.accounting_error()) is not None:
                self.failure = f"the KV cache accounting is off after a failed step: {problem}"
                logger.error("the engine cannot serve any more: %s", self.failure)
            return
        now = time.perf_counter()
        deliveries: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, Any]]] = {}
        for out in outputs:
            stream = self._streams.get(out.rid)
            if stream is None:  # aborted after its request was failed
                continue
            if out.error is not None:
                self.metrics.finished(out.finish_reason)
                del self._streams[out.rid]
                deliveries.setdefault(stream.loop, []).append((stream.queue, EngineError(out.error)))
                continue
            if out.token_ids:
                if stream.last_token is None:
                    self.metrics.first_token(now - stream.arrival, out.prompt_tokens)
                else:
                    self.metrics.next_token(now - stream.last_token)
                self.metrics.generated(len(out.token_ids))
                self.stats.count(out.prompt_tokens if stream.last_token is None else 0, len(out.token_ids))
                stream.last_token = now
            if out.finished:
                self.metrics.finished(out.finish_reason)
                del self._streams[out.rid]
            tokens = {t for lp in (*out.logprobs, *(out.prompt_logprobs or ())) if lp for t in lp}
            pieces = {t: self.engine.token_text(t) for t in tokens.union(out.prompt_token_ids or ())}
            deliveries.setdefault(stream.loop, []).append((stream.queue, Delta(stream.index, out, pieces)))
        for loop, items in deliveries.items():
            _deliver(loop, items)

    def _fail_all(self, error: EngineError) -> None:
        deliveries: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, Any]]] = {}
        for rid, stream in self._streams.items():
            try:
                self.engine.abort(rid)
            except Exception:
                logger.exception("aborting %s failed", rid)
            deliveries.setdefault(stream.loop, []).append((stream.queue, error))
        self._streams.clear()
        for loop, items in deliveries.items():
            _deliver(loop, items)



def _deliver(loop: asyncio.AbstractEventLoop, items: list[tuple[asyncio.Queue, Any]]) -> None:
    def put_all() -> None:
        for queue, item in items:
            queue.put_nowait(item)
    try:
        loop.call_soon_threadsafe(put_all)
    except RuntimeError:  # the event loop is closed: nobody is listening
        pass
