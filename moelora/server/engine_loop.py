"""The engine in its own thread beside the HTTP event loop, and the text work in a third.

Everything that touches the engine's state (adding and aborting requests, installing adapters) runs
in the engine thread, as a command queued from the event loop and answered through a concurrent
Future. Between commands the thread steps the engine while it has work. A command that raises fails
only its own Future.

The engine thread never waits on text or files: prompts are tokenized (and chat templates rendered)
in the tokenize thread before their requests are added; outputs are detokenized after their step in the text
thread. Each is one worker that takes its jobs in order: a request's stream is registered in the text thread
before its request is added, so before its first output comes, and its outputs come in order. Two threads, so
that a long prompt's tokenization (seconds for megabytes of text) never holds up the other requests' outputs.
Adapter files are read in workers of their own (read_lora) and only installed between steps. The text thread
detokenizes each request's tokens (stop strings included:
one ends the request there, and the engine is told to abort it), and hands each request's outputs
to its asyncio.Queue with loop.call_soon_threadsafe, one call per step. Threads and not processes:
the step spends most of its wall time in torch calls that release the GIL (kernel launches, the
device-to-host copy of the sampled tokens that waits for the GPU), which is when the text and tokenize threads
run.

A request the engine fails gets an EngineError in its queue; a step that raises past the engine's
own isolation fails the requests in flight and the thread goes on, unless the engine's books no
longer balance or its device failed: then `healthy` turns False (and /health says 503). So it does once a rank the
engine started has ended, idle as the engine may be: `healthy` sees it at once, and the engine thread fails the
engine (Engine.check_ranks) before its next command, so a request that comes then is refused as after a failed step.

The watchdog (SGLang's --watchdog-timeout): when the engine thread has been in one step for longer than
watchdog_timeout, the device is taken to hang (a kernel that never ends: nothing in the process can stop it, and
the thread waits on it for good). It logs the engine thread's stack, turns `healthy` False, ends every stream with
an error, and after WATCHDOG_EXIT_DELAY seconds (for those errors to reach their clients) kills the other ranks and
exits the process with status 1, so that whatever runs the server can start it again. Commands are not timed (a
long profile's export may legitimately take minutes).

When the server shuts down, `drain` refuses new requests, gives those in flight a while to finish, and fails the
rest ("the server is shutting down"), so that their responses end and the server can stop.
"""
from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import sys
import threading
import time
import traceback
import uuid
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace
from typing import Any, TypeVar

from moelora.engine import (Engine, GrammarTrials, IncrementalDetokenizer, RankShare, SamplingParams, StepOutput,
                            StructuredOutput)
from moelora.server.metrics import Metrics
from moelora.server.stats_log import StatsLog

logger = logging.getLogger(__name__)
T = TypeVar("T")
GRAMMAR_COMPILE_WORKERS = 4
ADAPTER_READ_WORKERS = 2  # adapter loads read at once; more wait their turn
WATCHDOG_EXIT_DELAY = 2.0  # seconds between the watchdog's error events and the process's exit


@dataclass
class Submission:
    """One sequence to generate."""
    prompt: str | list[int]
    params: SamplingParams
    lora: str | None
    add_special_tokens: bool = True  # False for chat prompts: the template wrote the special tokens
    priority: int = 0  # the queue's order under scheduling_policy "priority"


@dataclass
class Delta:
    """One step's output of one sequence, as its queue receives it (or several steps' merged: merge_deltas)."""
    index: int               # the sequence's position in its submit call
    out: StepOutput
    pieces: dict[int, str]   # text of every token in out.logprobs, out.prompt_token_ids and out.prompt_logprobs


def merge_deltas(items: list[Delta | Exception]) -> list[Delta | Exception]:
    """The items a queue held at once, each sequence's Deltas merged into one (in the order the sequences first
    appear), up to the first exception, which ends the list. A consumer that fell behind the steps (the event
    loop busy, or its client not reading) then sends one chunk per sequence for what it missed instead of one per
    step, as vLLM merges a request's outputs its consumer has not taken yet: its work per token shrinks as its load
    grows. Linear in the items (merged pair by pair, each step copied all before it: a client that read nothing for
    9500 steps held the event loop 10 s)."""
    runs: dict[int, list[Delta]] = {}
    for item in items:
        if isinstance(item, Exception):
            return [*map(_merged, runs.values()), item]
        runs.setdefault(item.index, []).append(item)
    return list(map(_merged, runs.values()))


def _merged(run: list[Delta]) -> Delta:
    """One sequence's Deltas, in order, as one: the last one's output with all their tokens, text and logprobs, and
    the first prompt they carry."""
    if len(run) == 1:
        return run[0]
    outs = [d.out for d in run]

    def first(name: str) -> Any:
        return next((v for o in outs if (v := getattr(o, name))), getattr(outs[-1], name))
    out = replace(outs[-1], token_ids=[t for o in outs for t in o.token_ids], text="".join(o.text for o in outs),
                  logprobs=[e for o in outs for e in o.logprobs], prompt_token_ids=first("prompt_token_ids"),
                  prompt_logprobs=first("prompt_logprobs"), prompt_logprob_ranks=first("prompt_logprob_ranks"))
    return Delta(run[0].index, out, {k: v for d in run for k, v in d.pieces.items()})


@dataclass
class ThreadStats:
    """Where the server's threads spend their time (seconds, summed), beside the engine's own StepStats;
    /metrics exposes them as moelora:server_<name>."""
    idle_seconds: float = 0.0       # engine thread: waiting for work (nothing to step)
    commands_seconds: float = 0.0   # engine thread: running commands (adding and aborting requests, adapters)
    steps_seconds: float = 0.0      # engine thread: in Engine.step (StepStats breaks it down)
    tokenize_seconds: float = 0.0   # tokenize thread: prompts' tokens
    text_seconds: float = 0.0       # text thread: registering streams, detokenizing, handing outputs to the event loop
    added: int = 0                  # requests added
    add_delay_seconds: float = 0.0  # from each one's HTTP arrival to its add in the engine thread, summed

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


class EngineError(RuntimeError):
    """The engine failed the request (a failed step, or shutdown); put in its queue."""


class RequestInputError(EngineError):
    """The request failed on its own input (its structured output allows no token where it goes on): a 400."""


class Overloaded(RuntimeError):
    """More requests wait than max_queued_requests allows."""


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    index: int
    arrival: float
    detokenizer: IncrementalDetokenizer
    last_token: float | None = None


class EngineLoop:
    def __init__(self, engine: Engine, metrics: Metrics, max_queued_requests: int | None = None,
                 stats_interval: float = 10.0, watchdog_timeout: float = 300.0, grammar_compile_timeout: float = 10.0):
        """watchdog_timeout: seconds the engine thread may spend in one step before the watchdog ends the process
        (the module's docstring); 0: no watchdog. grammar_compile_timeout: seconds a request's grammar may take to
        compile, tried first in a process that is then killed (GrammarTrials); 0: no limit, and no such process."""
        self.engine, self.metrics, self.max_queued_requests = engine, metrics, max_queued_requests
        self.grammar_trials = GrammarTrials(engine.grammars, grammar_compile_timeout, GRAMMAR_COMPILE_WORKERS) \
            if grammar_compile_timeout > 0 else None
        self.watchdog_timeout = watchdog_timeout
        self.stats = StatsLog(stats_interval)
        self.thread_stats = ThreadStats()
        metrics.expose("moelora:engine_", engine.step_stats.as_dict)
        if engine.config.enable_prefix_caching:  # (its counters: cached_tokens goes down too)
            metrics.expose("moelora:prefix_cache_", lambda: {k: v for k, v in engine.prefix_cache_counts().items()
                                                              if k != "cached_tokens"})
        self._thread_ids: dict[str, int] = {}  # the threads whose CPU time /metrics reports, once started
        metrics.expose("moelora:server_", self._thread_counters)
        self.context_len = engine.context_len
        # published by the engine thread for the event loop; replaced whole, never mutated
        self.adapters: dict[str, str] = {n: str(p) for n, p in engine.config.lora_paths.items()}
        self.num_waiting = 0
        self._text = ThreadPoolExecutor(1, thread_name_prefix="moelora-text")  # one worker: jobs in order
        # one worker: concurrent encodes on one fast tokenizer can fail ("Already borrowed": transformers sets its
        # truncation state in a call whose options differ from the last); an encode beside the text thread's decodes
        # only reads it
        self._tokenize = ThreadPoolExecutor(1, thread_name_prefix="moelora-tokenize")
        # grammars compile here, not in asyncio's default executor: a slow compile (GrammarTrials bounds it) then holds
        # up other grammars only, not adapter loads
        self._grammars = ThreadPoolExecutor(GRAMMAR_COMPILE_WORKERS, thread_name_prefix="moelora-grammar")
        # adapter files are read here, not in asyncio's default executor, which encodes the non-streamed responses
        # (OpenAIServing._json): a few slow reads (gigabytes, a stalled network disk) held every such response up
        self._adapter_reads = ThreadPoolExecutor(ADAPTER_READ_WORKERS, thread_name_prefix="moelora-adapter-read")
        self._streams: dict[str, _Stream] = {}  # text thread only: requests whose outputs it delivers
        self._rids: set[str] = set()  # engine thread only: requests added and not yet seen finished
        self._commands: list[tuple[Callable[[], Any], Future]] = []
        self._pending = 0  # sequences submitted and not yet added to the engine
        self._compiling = 0  # requests waiting for their grammar (compile_grammar), not yet submitted
        self._cv = threading.Condition()
        self._draining = False  # the server shuts down: no request is added any more
        self._stopping = False
        self.failure: str | None = None  # why the engine cannot serve any more
        self._thread = threading.Thread(target=self._run, name="moelora-engine", daemon=True)
        self._busy_since: float | None = None  # engine thread: when the step it runs began (monotonic)
        self._watchdog = threading.Thread(target=self._watch, name="moelora-watchdog", daemon=True)
        self._watchdog_stop = threading.Event()

    # ------------------------------------------------------------------------- event-loop side

    def start(self) -> None:
        """Start the engine thread; called from the server's event loop (whose thread's CPU time /metrics reports)."""
        self._thread.start()
        if self.watchdog_timeout > 0:
            self._watchdog.start()
        self._thread_ids = {"event_loop": threading.get_ident(), "engine": self._thread.ident,
                            "text": self._text.submit(threading.get_ident).result(),
                            "tokenize": self._tokenize.submit(threading.get_ident).result()}

    def stop(self) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify()
        self._thread.join()
        self._watchdog_stop.set()  # after the join: an engine thread that hangs still ends the process
        self._text.shutdown()  # after the engine thread's last deliveries
        self._tokenize.shutdown()
        self._grammars.shutdown(wait=False, cancel_futures=True)
        self._adapter_reads.shutdown(wait=False, cancel_futures=True)
        if self.grammar_trials is not None:
            self.grammar_trials.close()

    async def drain(self, timeout: float, cut: Callable[[], bool]) -> None:
        """The server shuts down: refuse new requests (/health says 503), wait up to `timeout` seconds for those in
        flight to finish (or until cut(): a second Ctrl-C), then fail the rest with "the server is shutting down"
        (a streamed response ends with that error event, another gets a 500), so that their connections close."""
        with self._cv:
            self._draining = True
        if self.grammar_trials is not None:  # no request waiting for its grammar could be added any more
            self.grammar_trials.close()
        deadline = time.monotonic() + timeout
        if self._in_flight():
            logger.info("shutting down: %d requests in flight; %s", self._in_flight(),
                        f"waiting up to {timeout:g} s for them (--shutdown-timeout)" if timeout > 0 else
                        "ending them (--shutdown-timeout 0)")
        while self._in_flight() and time.monotonic() < deadline and not cut():
            await asyncio.sleep(0.1)
        if self._in_flight() and self._thread.is_alive():  # (a dead engine thread would never run the command)
            if timeout > 0:
                logger.info("shutting down: ending the %d requests still in flight", self._in_flight())
            await self.run(lambda: self._fail_all(EngineError("the server is shutting down"), "abort"))

    def _in_flight(self) -> int:
        """Sequences submitted and not yet finished (read outside the engine thread: a moment's count)."""
        return self._pending + len(self._rids)

    @property
    def healthy(self) -> bool:
        """The engine thread runs, the engine can serve, and the server is not shutting down. A rank the engine started
        that has ended is seen here at once (cheaply, as /health is polled often), where the engine finds it only at
        its next step or command: the engine thread is woken to fail the engine (Engine.check_ranks)."""
        if self.engine.rank_ended():
            with self._cv:
                self._cv.notify()
            return False
        return self._thread.is_alive() and self.failure is None and self.engine.fatal is None and not self._draining

    def call(self, fn: Callable[[], T]) -> Future:
        """Run fn in the engine thread; its result or exception comes back in the Future."""
        future: Future = Future()
        with self._cv:
            if self._stopping:
                raise EngineError("the server is shutting down")
            self._commands.append((fn, future))
            self._cv.notify()
        return future

    def _thread_counters(self) -> dict[str, float]:
        """ThreadStats, and the CPU seconds of the event loop's, engine's, text and tokenize threads so far: how much of
        the one GIL each takes (read when scraped, nothing per step)."""
        cpu = {}
        for name, ident in self._thread_ids.items():
            try:
                cpu[f"{name}_cpu_seconds"] = time.clock_gettime(time.pthread_getcpuclockid(ident))
            except OSError:  # the thread has ended
                pass
        return self.thread_stats.as_dict() | cpu

    async def run(self, fn: Callable[[], T]) -> T:
        return await asyncio.wrap_future(self.call(fn))

    async def run_tokenize(self, fn: Callable[[], T]) -> T:
        """Run fn in the tokenize thread (a request's tokenizer work: chat templates, encoding, echo's decoding)."""
        return await asyncio.wrap_future(self._tokenize.submit(fn))

    async def compile_grammar(self, spec: StructuredOutput, cancelled: threading.Event) -> Any:
        """The spec's grammar compiled in a grammar thread, and first tried in a GrammarTrials process (one that takes
        too long is a ValueError); setting `cancelled` (its request has gone) stops the trial (TrialCancelled). A
        request waiting for its grammar is a queued one for max_queued_requests (Overloaded): the grammar threads
        take a few at a time, and slow grammars would otherwise queue up behind them without bound."""
        with self._cv:
            waiting = self._pending + self.num_waiting + self._compiling
            if self.max_queued_requests is not None and waiting >= self.max_queued_requests:
                raise Overloaded(f"{waiting} requests are queued (max_queued_requests={self.max_queued_requests})")
            self._compiling += 1
        trials = self.grammar_trials
        trial = (lambda s: trials.check(s, cancelled)) if trials is not None else None
        try:
            return await asyncio.wrap_future(self._grammars.submit(self.engine.grammars.compile, spec, trial))
        finally:
            with self._cv:
                self._compiling -= 1

    async def submit(self, subs: list[Submission], queue: asyncio.Queue) -> tuple[list[str], list[int]]:
        """Add the sequences (all or none); their Deltas, or an EngineError, go to `queue`. Returns their request
        ids and their prompts' token counts (a stream's first chunks report them before any Delta comes). Raises
        Overloaded, or ValueError / AdapterError naming what is wrong with a sequence."""
        if self.failure is not None:
            raise EngineError(f"the engine cannot serve any more: {self.failure}")
        with self._cv:
            if self._stopping or self._draining:
                raise EngineError("the server is shutting down")
            waiting = self._pending + self.num_waiting + self._compiling
            if self.max_queued_requests is not None and len(subs) > self.max_queued_requests:  # never admitted
                raise ValueError(f"SamplingParams.n: the request has {len(subs)} sequences (n x prompts), more than "
                                 f"max_queued_requests={self.max_queued_requests} lets wait at once")
            if self.max_queued_requests is not None and waiting + len(subs) > self.max_queued_requests:
                raise Overloaded(f"{waiting} requests are queued (max_queued_requests={self.max_queued_requests})")
            self._pending += len(subs)
        loop, arrival, rids = asyncio.get_running_loop(), time.perf_counter(), [uuid.uuid4().hex for _ in subs]
        try:
            # token ids need no tokenizer: they do not wait behind another request's long text
            prompts = await self.run_tokenize(lambda: self._tokenize_prompts(subs)) \
                if any(isinstance(sub.prompt, str) for sub in subs) else \
                [self.engine.tokenize(sub.prompt, sub.add_special_tokens) for sub in subs]
            await asyncio.wrap_future(self._text.submit(self._register, rids, subs, prompts, loop, queue, arrival))
            future = self.call(lambda: self._add(rids, subs, prompts, arrival))
        except BaseException:  # refused before any reached the engine (or the client left meanwhile)
            self._unpend(len(subs))
            self._text.submit(self._forget, rids)
            raise
        future.add_done_callback(lambda _: self._unpend(len(subs)))  # added, refused or cancelled
        try:
            return await asyncio.wrap_future(future), [len(p) for p in prompts]
        except asyncio.CancelledError:  # the client left while the sequences were being added
            future.add_done_callback(lambda f: self._text.submit(self._forget, rids) if f.cancelled() or f.exception()
                                     else self.abort(f.result()))
            raise

    async def load_lora(self, name: str, path: str, replace: bool = False) -> None:
        """Read and validate the adapter (AdapterError lists its problems) in an adapter-read thread, then
        install it there between steps; it serves from now on. replace: Engine.load_lora's."""
        adapter = await asyncio.wrap_future(self._adapter_reads.submit(self.engine.read_lora, path))
        await self.run(lambda: self._load_lora(name, path, adapter, replace))

    async def unload_lora(self, name: str) -> None:
        """Requests in flight with the adapter finish; new ones are refused (AdapterError if unknown)."""
        await self.run(lambda: self._unload_lora(name))

    def abort(self, rids: list[str], reason: str = "abort") -> None:
        """Abort the requests (those still running): their KV cache is freed at the next step. reason "stop": they
        ended on a stop string (Engine.abort)."""
        try:
            self.call(lambda: [self.engine.abort(rid, reason) for rid in rids])
        except EngineError:
            pass  # shutting down: everything is dropped anyway

    # ---------------------------------------------------------------------------- engine thread

    def _run(self) -> None:
        times = self.thread_stats
        while True:
            with self._cv:
                if not (self._commands or self._stopping or self.engine.has_unfinished()):
                    start = time.perf_counter()
                    self._cv.wait(self.stats.interval or None)  # woken by work, or for the stats line
                    times.idle_seconds += time.perf_counter() - start
                if self._stopping:
                    break
                commands, self._commands = self._commands, []
            start = time.perf_counter()
            self.engine.check_ranks()  # (the module's docstring: a request that comes once a rank ended is refused)
            for fn, future in commands:
                if future.set_running_or_notify_cancel():
                    try:
                        future.set_result(fn())
                    except Exception as e:  # the caller's error, not the engine's
                        future.set_exception(e)
            stepped = time.perf_counter()
            times.commands_seconds += stepped - start
            if self.engine.has_unfinished():
                self._busy_since = time.monotonic()
                self._step()
                self._busy_since = None
                times.steps_seconds += time.perf_counter() - stepped
            self.num_waiting = self.engine.num_waiting
            self.metrics.set_queues(len(self._rids) - self.num_waiting, self.num_waiting)
            self.stats.tick(self.engine, self.engine.num_running, self.num_waiting)
        with self._cv:
            commands, self._commands = self._commands, []
        for _, future in commands:
            future.cancel()
        self.engine.drop_profile()  # on the thread that started it (torch's profiler is the thread's)
        self._fail_all(EngineError("the server is shutting down"), "abort")

    # ---------------------------------------------------------------------------- watchdog thread

    def _watch(self) -> None:
        """Look at the engine thread every so often; once it has been busy past watchdog_timeout, end the process
        (the module's docstring)."""
        while not self._watchdog_stop.wait(min(1.0, self.watchdog_timeout / 4)):
            since = self._busy_since
            if since is not None and time.monotonic() - since > self.watchdog_timeout:
                self._hung(time.monotonic() - since)
                return

    def _hung(self, seconds: float) -> None:
        self.failure = (f"the engine thread has been in one step for {seconds:.0f} s, more than the watchdog's "
                        f"{self.watchdog_timeout:g} s (--watchdog-timeout): the device hangs; the server exits")
        frame = sys._current_frames().get(self._thread.ident)
        stack = "".join(traceback.format_stack(frame)) if frame is not None else "(the engine thread has ended)\n"
        logger.critical("%s. The engine thread is at:\n%s", self.failure, stack.rstrip())
        self._text.submit(self._fail_streams, EngineError(self.failure), "error")
        time.sleep(WATCHDOG_EXIT_DELAY)
        _exit_process()

    def _unpend(self, n: int) -> None:
        with self._cv:
            self._pending -= n

    def _add(self, rids: list[str], subs: list[Submission], prompts: list[list[int]], arrival: float) -> list[str]:
        added: list[str] = []
        try:
            if self._draining:  # submitted as the shutdown began: it never starts (its client gets a 503)
                raise EngineError("the server is shutting down")
            for rid, sub, prompt in zip(rids, subs, prompts):
                self.engine.add_request(prompt, sub.params, sub.lora, rid=rid, detokenize=False, arrival_time=arrival,
                                        priority=sub.priority)
                added.append(rid)
        except Exception:
            for rid in added:
                self.engine.abort(rid)
            self._text.submit(self._forget, rids)  # before the aborts' outputs reach the text thread
            raise
        self._rids.update(added)
        # counted as waiting before they stop counting as pending (the future's callback, once this returns): the
        # queue limit in between would not see them
        with self._cv:
            self.num_waiting = self.engine.num_waiting
        self.thread_stats.added += len(added)
        self.thread_stats.add_delay_seconds += len(added) * (time.perf_counter() - arrival)
        return rids

    def _load_lora(self, name: str, path: str, adapter: RankShare, replace: bool) -> None:
        self.engine.load_lora(name, path, adapter, replace)
        self.adapters = {**self.adapters, name: path}

    def _unload_lora(self, name: str) -> None:
        self.engine.unload_lora(name)
        self.adapters = {n: p for n, p in self.adapters.items() if n != name}

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as e:
            logger.exception("engine step failed; failing the requests in flight")
            self._fail_all(EngineError(f"the engine failed: {e}"), "error")
            if (problem := self.engine.accounting_error()) is not None:
                self.failure = f"the KV cache accounting is off after a failed step: {problem}"
                logger.error("the engine cannot serve any more: %s", self.failure)
            return
        now = time.perf_counter()
        for out in outputs:
            if out.finished:
                self._rids.discard(out.rid)
            first = out.completion_tokens == len(out.token_ids)  # the request's first tokens
            self.stats.count(out.prompt_tokens if out.token_ids and first else 0, len(out.token_ids))
        if outputs:
            self._text.submit(self._deliver_outputs, outputs, now)

    def _fail_all(self, error: EngineError, reason: str) -> None:
        """End every request in flight with `error`; each sequence counts as finished for `reason`."""
        for rid in self._rids:
            try:
                self.engine.abort(rid)
            except Exception:
                logger.exception("aborting %s failed", rid)
        self._rids.clear()
        self._text.submit(self._fail_streams, error, reason)

    # ------------------------------------------------------------------------------ tokenize and text threads

    def _tokenize_prompts(self, subs: list[Submission]) -> list[list[int]]:
        """Each sequence's prompt ids (tokenize thread); the n sequences of one text prompt tokenize it once."""
        start = time.perf_counter()
        done: dict[tuple[str, bool], list[int]] = {}
        try:
            prompts = []
            for sub in subs:
                if not isinstance(sub.prompt, str):
                    prompts.append(self.engine.tokenize(sub.prompt, sub.add_special_tokens))
                    continue
                key = (sub.prompt, sub.add_special_tokens)
                if key not in done:
                    done[key] = self.engine.tokenize(sub.prompt, sub.add_special_tokens)
                prompts.append(list(done[key]))
            return prompts
        finally:
            self.thread_stats.tokenize_seconds += time.perf_counter() - start

    def _register(self, rids: list[str], subs: list[Submission], prompts: list[list[int]],
                  loop: asyncio.AbstractEventLoop, queue: asyncio.Queue, arrival: float) -> None:
        """Each sequence's stream registered (all: nothing here fails but the detokenizer's start)."""
        start = time.perf_counter()
        try:
            for index, (rid, sub, prompt) in enumerate(zip(rids, subs, prompts)):
                detokenizer = self.engine.output_detokenizer(prompt, sub.params)
                self._streams[rid] = _Stream(loop, queue, index, arrival, detokenizer)
        finally:
            self.thread_stats.text_seconds += time.perf_counter() - start

    def _forget(self, rids: list[str]) -> None:
        for rid in rids:
            self._streams.pop(rid, None)

    def _deliver_outputs(self, outputs: list[StepOutput], now: float) -> None:
        """Detokenize one step's outputs (now: when it ended) and hand each to its request's queue."""
        start = time.perf_counter()
        deliveries: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, Any]]] = {}
        for out in outputs:
            stream = self._streams.get(out.rid)
            if stream is None:  # ended already (a stop string, a failure) or refused while being added
                continue
            try:
                item = self._delta(stream, out, now)
            except Exception as e:  # the tokenizer's, on this request's tokens: its failure alone
                logger.exception("detokenizing request %s failed", out.rid)
                item = EngineError(f"detokenizing its output failed: {type(e).__name__}: {e}")
                self.metrics.finished("error")
                self.abort([out.rid])
            if isinstance(item, EngineError) or item.out.finished:
                del self._streams[out.rid]
            deliveries.setdefault(stream.loop, []).append((stream.queue, item))
        for loop, items in deliveries.items():
            _deliver(loop, items)
        self.thread_stats.text_seconds += time.perf_counter() - start

    def _delta(self, stream: _Stream, out: StepOutput, now: float) -> Delta | EngineError:
        """What the request's queue gets of one output: its text and the text of its logprob tokens."""
        if out.error is not None:
            self.metrics.finished(out.finish_reason)
            return (RequestInputError if out.error_is_input else EngineError)(out.error)
        detok = stream.detokenizer
        text = "".join(detok.add(t) for t in out.token_ids)
        if out.finished and out.finish_reason in ("stop", "length") and not detok.finished:
            text += detok.finish(out.finish_reason)  # a grammar's end, or max_tokens
        if detok.finished and not out.finished:  # a stop string: the engine goes on until it hears
            self.abort([out.rid], "stop")
        # the stop reason is this detokenizer's: it sees every token, and the stop strings the engine does not look for
        out = replace(out, text=text, finished=out.finished or detok.finished,
                      finish_reason=detok.finish_reason if detok.finished else out.finish_reason,
                      stop_reason=detok.stop_reason)
        if out.token_ids:
            if stream.last_token is None:
                self.metrics.first_token(now - stream.arrival, out.prompt_tokens)
            else:
                self.metrics.next_token(now - stream.last_token)
            self.metrics.generated(len(out.token_ids))
            stream.last_token = now
        if out.finished:
            self.metrics.finished(out.finish_reason)
        tokens = {t for lp in (*out.logprobs, *(out.prompt_logprobs or ())) if lp for t in lp}
        pieces = {t: self.engine.token_text(t) for t in tokens.union(out.prompt_token_ids or ())}
        return Delta(stream.index, out, pieces)

    def _fail_streams(self, error: EngineError, reason: str) -> None:
        deliveries: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, Any]]] = {}
        for stream in self._streams.values():
            deliveries.setdefault(stream.loop, []).append((stream.queue, error))
            self.metrics.finished(reason)  # its abort's output finds no stream left to count it
        self._streams.clear()
        for loop, items in deliveries.items():
            _deliver(loop, items)



def _exit_process() -> None:
    """The watchdog's end: the other ranks killed (they wait on this one), the logs flushed, status 1 at once (no
    clean-up: the engine thread waits on the device for good, and a normal exit would join it)."""
    for child in multiprocessing.active_children():
        child.kill()
    logging.shutdown()
    os._exit(1)


def _deliver(loop: asyncio.AbstractEventLoop, items: list[tuple[asyncio.Queue, Any]]) -> None:
    def put_all() -> None:
        for queue, item in items:
            queue.put_nowait(item)
    try:
        loop.call_soon_threadsafe(put_all)
    except RuntimeError:  # the event loop is closed: nobody is listening
        pass
