"""Running the scheduler's steps: each batch through the model runner, its sampled tokens appended
to their requests, finished requests released; failures isolated; and, with overlap scheduling (EngineConfig.overlap_schedule),
each step launched before the previous step's tokens are read.

A failure stays with the request it belongs to. One that fails while its row and KV slots are
allocated, while its tokens are detokenized, or (found by running the step's batch again in
halves) while the LoRA slots are prepared, the model runs or the batch samples, finishes that
request with reason "error" and frees what it held; the rest of the step goes on. Reading a step's
tokens is not retried (its launch has started its prompts decoding): a failure there fails the step's
requests. A device error (the accelerator's state is lost) or a failed rank of several cannot be
isolated: it fails every request and the engine stays unhealthy (`fatal`). What escapes a step otherwise (an
interrupt: Ctrl-C in `generate`) ends the requests of the steps it was running and releases what they hold; the
engine serves on.

Overlap scheduling: step n + 1 is scheduled and launched before step n's tokens are copied to the
host, its decode rows' input tokens gathered on the device from step n's samples (PendingTokens), so
the host's work between two steps (scheduling, building the batch, reading and appending tokens) runs
while the device computes. Nothing on that path waits for the device: host-to-device copies go through
pinned memory (core.to_device), and a step's tokens are copied to the host without blocking, the host
waiting on an event recorded after that copy, not on the steps queued behind it (a blocking copy
synchronises the whole stream); an adapter goes into a GPU slot from its staged host copy
(lora_slots.staged_share) without waiting either. What it costs: a request that step n ends with a stop token
still has a row in step n + 1, whose token is dropped. A step reads the previous one first (no overlap) when a
request of it has a grammar (the next bitmask needs its token), and a launch that raises is run again after
it, synchronously and isolated as above. Each step first starts reading the waiting requests' adapters back from
disk where they left host memory (max_cpu_loras), and with enable_lora_overlap_loading putting them into GPU slots
(LoRAManager.prefetch); when nothing else can run, the host waits for those reads and copies.
"""
from __future__ import annotations

import itertools
import logging
import os
import time
from dataclasses import dataclass

import torch

from moelora.engine.model_runner import ModelRunner, PendingTokens, StepResult
from moelora.engine.request import Req
from moelora.engine.sampler import SampleOutput
from moelora.engine.scheduler import ScheduledBatch, Scheduler
from moelora.engine.step_stats import StepStats, StepTrace
from moelora.engine.workers import WorkerFailure

logger = logging.getLogger(__name__)
# a step with nothing to run but adapters being read from disk waits for them this long at most: then the step ends,
# and the next one takes the requests that came meanwhile
PREFETCH_WAIT_S = 0.05


@dataclass
class StepOutput:
    """What one request got in one step (or its end, when aborted or failed)."""
    rid: str
    token_ids: list[int]                  # new tokens
    text: str                             # new text (held back while it may be the start of a stop string)
    finished: bool
    finish_reason: str | None             # "stop", "length", "abort" or "error" once finished
    logprobs: list[dict[int, float]]      # per new token, if asked: the chosen and top tokens' log-probabilities
    prompt_tokens: int
    completion_tokens: int
    error: str | None = None              # why the request failed (finish_reason "error")
    cumulative_logprob: float = 0.0       # of every output token so far, under the raw logits
    error_is_input: bool = False          # the failure is the request's input's (a server's 400), not the engine's
    # with params.prompt_logprobs, in the first output: the prompt, and per prompt token its entry (None for the first)
    prompt_token_ids: list[int] | None = None
    prompt_logprobs: list[dict[int, float] | None] | None = None
    prompt_logprob_ranks: list[int | None] | None = None  # each prompt token's rank (1: the likeliest; None first)
    # finished "stop" by a stop string (its text) or a token of stop_token_ids (its id); None otherwise (EOS, a grammar's
    # end). A request added with detokenize=False has no stop strings here: its caller's detokenizer finds them
    stop_reason: str | int | None = None
    cached_tokens: int = 0                # of prompt_tokens, those found in the prefix cache (not computed)


@dataclass
class _Launched:
    """A step whose device work is queued; its tokens not read yet."""
    batch: ScheduledBatch
    result: StepResult
    tokens: SampleOutput | None     # result.tokens on their way to the host
    copied: torch.cuda.Event | None  # recorded after that copy: the host waits for it, not for later steps


class Stepper:
    def __init__(self, scheduler: Scheduler, runner: ModelRunner, overlap: bool):
        self.scheduler, self.runner, self.overlap = scheduler, runner, overlap
        self.fatal: str | None = None  # why the engine cannot go on, once it cannot
        self._touched: list[Req] = []  # the requests of the step being run, and of the one it reads
        self._ends: list[StepOutput] = []  # the ends of the requests a failed step ended, for the next step to report
        self._produced: list[StepOutput] = []  # the outputs of the step being run, so far
        self._in_flight: _Launched | None = None  # overlap scheduling: the step launched last
        self.stats = StepStats()
        trace = os.environ.get("MOELORA_STEP_TRACE")
        self._trace = StepTrace(trace) if trace else None

    @property
    def in_flight(self) -> bool:
        """A launched step has tokens to read for requests still going."""
        return self._in_flight is not None and any(not r.finished for r in self._in_flight.batch.reqs)

    def step(self) -> list[StepOutput]:
        """Run (or, overlapping, launch) the next step; the outputs of the step that finished. What escapes it (an
        interrupt, a fault outside the request-isolated parts) first fails the requests of the steps it was running
        (_fail_touched): one scheduled but not yet launched is in no queue, where nothing would find it again. Their
        ends are the next step's first outputs."""
        self._touched, self._produced = [], []
        ends, self._ends = self._ends, []
        try:
            started, before = time.perf_counter(), self.stats.as_dict() if self._trace is not None else None
            self._step()
            if self._trace is not None:
                self._write_trace(started, before)
        except BaseException as e:  # (the outputs the step made before it are reported too)
            self._ends = ends + self._produced + self._fail_touched(e)
            raise
        return ends + self._produced

    def _write_trace(self, started: float, before: dict[str, float]) -> None:
        try:
            self._trace.write(started, before, self.stats.as_dict(), len(self._produced),
                              len(self.scheduler.waiting), len(self.scheduler.running))
        except Exception:  # a debugging aid (a full disk): not a reason to fail the step's requests
            logger.exception("writing MOELORA_STEP_TRACE failed; the trace stops")
            self._trace.close()
            self._trace = None

    @property
    def has_ends(self) -> bool:
        """A failed step ended requests whose ends the next step reports."""
        return bool(self._ends)

    @property
    def unreported_ends(self) -> list[StepOutput]:
        """The ends a failed step made, which the next step reports."""
        return list(self._ends)

    def _step(self) -> None:
        """The step; its outputs go to self._produced as they are made."""
        prev, self._in_flight = self._in_flight, None
        outputs = self._produced
        if self.fatal is not None:
            outputs += [self.fail(r, self.fatal) for r in self.scheduler.unfinished()]
            return
        if prev is not None:
            self._touched += prev.batch.reqs
        if prev is not None and any(r.grammar is not None for r in prev.result.sampled):
            outputs += self._read(prev, [])  # their next bitmasks need these tokens
            prev = None
        start = time.perf_counter()
        if self.scheduler.adapter_ready is not None:
            outputs += self._prefetch_adapters()
            if self.fatal is not None:
                return
        try:
            batch = self.scheduler.schedule()
            if batch is None and prev is None and self._prefetching():
                # nothing else can run: the waiting requests' adapters are on their way into host memory or slots
                outputs += self._wait_for_adapters()
                batch = self.scheduler.schedule()
        except BaseException:  # (an interrupt) the requests it took may be in no queue: they end with the step's
            self._touched += self.scheduler.taken
            raise
        if batch is not None:
            self._touched += [*batch.reqs, *(req for req, _ in batch.failed)]
        scheduled = time.perf_counter()
        self.stats.seconds["schedule"] += scheduled - start
        if batch is None:
            # (a step without a batch while adapters are still read: the caller's next step goes on waiting, taking
            # the new requests meanwhile)
            assert prev is not None or not self.scheduler.has_unfinished() or self._prefetching(), \
                "the scheduler found nothing to run for its unfinished requests"
            outputs += self._read(prev, []) if prev is not None else []
            return
        outputs += [self.fail(req, f"scheduling it failed: {_describe(e)}") for req, e in batch.failed]
        if batch.reqs:
            self._count(batch, scheduled)
        if self.overlap and batch.reqs:
            try:
                self._in_flight = self._launch(batch, prev)
            except Exception as e:  # run again below, synchronously, to find the request it belongs to
                if _is_device_error(e):
                    outputs += self._device_failed(e, batch.reqs)
                    return
        if prev is not None:
            outputs += self._read(prev, batch.reqs)
        live = [i for i, r in enumerate(batch.reqs) if not r.finished]  # not ended by the step just read
        if live and self._in_flight is None:  # (that step may have ended every one of them)
            outputs += self._run_isolated(batch if len(live) == len(batch.reqs) else batch.subset(live), batch.reqs)

    def retire(self, req: Req) -> None:
        """Release the request's cache, row, grammar and adapter reference (each once, whatever was released, and
        each whatever the others' release raises)."""
        try:
            self.scheduler.remove(req)
        finally:
            req.grammar = None
            self._release_adapter(req)

    def _release_adapter(self, req: Req) -> None:
        if req.holds_adapter:
            req.holds_adapter = False  # first: a release that raised after counting down is never counted twice
            self.runner.lora.release(req.lora)

    def _retire_all(self, reqs: list[Req]) -> None:
        """retire each; one that raises is logged (what it held may stay held: accounting_error tells) and the
        others are released all the same, their outputs delivered."""
        for req in reqs:
            try:
                self.retire(req)
            except Exception:
                logger.exception("releasing what request %s holds failed", req.rid)

    def fail(self, req: Req, error: str) -> StepOutput:
        """Finish the request with reason "error", freeing what it holds."""
        self.retire(req)
        req.finish_reason, req.error = "error", error
        return _error_end(req)

    # --------------------------------------------------------------------------------- internals

    def _prefetch_adapters(self) -> list[StepOutput]:
        """Start getting the waiting requests' adapters ready (LoRAManager.prefetch: read from disk, put into GPU
        slots); the waiting requests of an adapter whose read or write failed end with the error (and prefetch looks
        again at the queue without them), a device error ends every request."""
        outputs = []
        while True:
            # the queue's first max_running_requests requests: those behind them start no sooner than a batch later
            head = itertools.islice(self.scheduler.waiting, self.scheduler.config.max_running_requests)
            failed = self.runner.lora.prefetch((r.lora for r in head if r.lora is not None),
                                               self.scheduler.active_adapters())
            if not failed:
                return outputs
            for name, what, e in failed:
                if _is_device_error(e):
                    return outputs + self._device_failed(e, [])
                logger.error("adapter %r: %s failed: %s", name, what, _describe(e))
                outputs += [self.fail(r, f"{what} failed: {_describe(e)}")
                            for r in list(self.scheduler.waiting) if r.lora == name]

    def _prefetching(self) -> bool:
        """Requests wait while prefetch's reads or copies for them go on."""
        return bool(self.scheduler.waiting) and self.scheduler.adapter_ready is not None and self.runner.lora.pending()

    def _wait_for_adapters(self) -> list[StepOutput]:
        """Wait for prefetch's copies and, a while at most, for the first of its reads; prefetch again (what was read
        goes into host memory, with overlap loading into a slot) and wait for the copies that starts."""
        lora = self.runner.lora
        try:  # (the other ranks start their reads now, not with the next step, and tell how far theirs got)
            self.runner.sync_lora(PREFETCH_WAIT_S)
        except WorkerFailure as e:
            return self._device_failed(e, [])
        lora.wait_for_prefetch(PREFETCH_WAIT_S)
        outputs = self._prefetch_adapters()
        lora.wait_for_prefetch(0.0)
        return outputs

    def _fail_touched(self, e: BaseException) -> list[StepOutput]:
        """After `e` escaped a step: the requests of the steps it ran or read end with an error (their ends
        returned), and those it had finished but not yet released are released; a launched step left in flight reads
        as usual (its requests' tokens dropped, as an abort's)."""
        error = f"its step was interrupted: {_describe(e)}"
        touched = list(dict.fromkeys(self._touched))
        ended = [req for req in touched if not req.finished]
        for req in ended:
            req.finish_reason, req.error = "error", error
        self._retire_all(touched)
        logger.error("a step failed outside its requests (%s); %d requests ended", _describe(e), len(ended))
        return [_error_end(req) for req in ended]

    def _count(self, batch: ScheduledBatch, scheduled: float) -> None:
        """The step's shape in the stats, and the wait of each request it starts (scheduled: when it was planned)."""
        self.stats.count_step(batch.num_decode, batch.extend_lens, batch.num_stalled)
        for i in range(batch.num_decode, len(batch.reqs)):
            req = batch.reqs[i]
            # its start (on its cached prefix, with prefix caching), not a recomputation
            if batch.prefix_lens[i] == req.cached_len and req.num_retractions == 0:
                self.stats.count_admission(scheduled - req.arrival)

    def _run_isolated(self, batch: ScheduledBatch, step_reqs: list[Req]) -> list[StepOutput]:
        """Run the batch (part of the step's `step_reqs`); if its launch raises, run its halves the same
        way, down to the request that fails. Nothing of a request changes before its part of the batch has
        launched, so launching it again is safe; reading its tokens is not retried (see _read)."""
        if self.fatal is not None:  # failed already, with every other request
            return []
        try:
            launched = self._launch(batch, None)
        except Exception as e:
            if _is_device_error(e):
                return self._device_failed(e, step_reqs)
            if len(batch.reqs) == 1:
                logger.exception("request %s failed", batch.reqs[0].rid)
                return [self.fail(batch.reqs[0], _describe(e))]
            half = len(batch.reqs) // 2
            return (self._run_isolated(batch.subset(list(range(half))), step_reqs)
                    + self._run_isolated(batch.subset(list(range(half, len(batch.reqs)))), step_reqs))
        return self._read(launched, step_reqs)

    def _device_failed(self, e: Exception, step_reqs: list[Req]) -> list[StepOutput]:
        self.fatal = str(e) if isinstance(e, WorkerFailure) else f"device error: {_describe(e)}"
        logger.exception("the device failed; failing every request")
        # the step's new prompts are in no queue of the scheduler until their part has run
        unfinished = [r for r in dict.fromkeys([*step_reqs, *self.scheduler.unfinished()]) if not r.finished]
        return [self.fail(r, self.fatal) for r in unfinished]

    def _launch(self, batch: ScheduledBatch, prev: _Launched | None) -> _Launched:
        """Queue the batch's device work (decode rows of prev's requests read prev's tokens on the
        device); nothing of a request changes unless it succeeds."""
        lora = self.runner.lora
        in_use = self.scheduler.active_adapters() | {r.lora for r in batch.reqs if r.lora is not None}
        pending = None
        if prev is not None and prev.result.tokens is not None:
            pending = PendingTokens(prev.result.tokens.token_ids, {r: i for i, r in enumerate(prev.result.sampled)})
        start = time.perf_counter()
        result = self.runner.run(batch, lora.prepare([r.lora for r in batch.reqs], in_use), pending)
        tokens, copied = _copy_to_host(result.tokens) if result.tokens is not None else (None, None)
        self.stats.seconds["launch"] += time.perf_counter() - start
        for req in result.sampled:
            req.num_pending += 1
        self.scheduler.start_decoding(batch)
        return _Launched(batch, result, tokens, copied)

    def _read(self, launched: _Launched, step_reqs: list[Req]) -> list[StepOutput]:
        """_finish of a launched step: a device error there fails everything, the requests of the step
        being run (`step_reqs`) included; any other fails the launched step's requests (their device work
        is done and their launch has changed them: nothing to run again)."""
        try:
            return self._finish(launched)
        except Exception as e:
            if _is_device_error(e):
                return self._device_failed(e, step_reqs)
            logger.exception("reading a step's tokens failed")
            return [self.fail(r, _describe(e)) for r in launched.batch.reqs if not r.finished]

    def _finish(self, launched: _Launched) -> list[StepOutput]:
        """Read the step's tokens (the host waits for its device work here), append them, release the
        requests that end."""
        batch, result = launched.batch, launched.result
        start = time.perf_counter()
        if launched.copied is not None:
            self.runner.wait_for(launched.copied)
        copied = time.perf_counter()
        self.stats.seconds["wait"] += copied - start
        ended = {r for r in batch.reqs if r.finished}  # aborted while it ran ahead: released already
        for req in result.sampled:
            req.num_pending -= 1
        for i, (start, entries, ranks) in result.prompt_entries.items():
            req = batch.reqs[i]
            if len(req.prompt_logprob_entries) == start:  # not when a retracted request computes its prompt again
                req.prompt_logprob_entries += entries
                req.prompt_logprob_ranks += ranks
        outputs: list[StepOutput] = []
        try:
            try:
                if launched.tokens is not None:
                    self._append_tokens(result.sampled, launched.tokens, outputs)
                for i, logprobs in result.prompt_logprobs.items():
                    batch.reqs[i].prompt_logprobs.append(logprobs)
            finally:  # the requests that ended here release what they hold, whatever raised after their end
                self._retire_all([r for r in batch.reqs if r.finished and r not in ended])
        except BaseException:  # the outputs made before it (ends among them) go out with the step's
            self._produced += outputs
            raise
        self.stats.seconds["postprocess"] += time.perf_counter() - copied
        return outputs

    def _append_tokens(self, reqs: list[Req], tokens: SampleOutput, outputs: list[StepOutput]) -> None:
        """Each request's token appended, its output added to `outputs` as it is made."""
        ids, logprobs = tokens.token_ids.tolist(), tokens.logprobs.tolist()
        top_ids = tokens.top_ids.tolist() if tokens.top_ids is not None else None
        top_logprobs = tokens.top_logprobs.tolist() if tokens.top_logprobs is not None else None
        for i, req in enumerate(reqs):
            if req.finished:  # aborted while its step ran ahead (overlap scheduling): the token is dropped
                continue
            token = ids[i]
            req.output_ids.append(token)
            new_logprobs = []
            if req.params.logprobs is not None:
                k = req.params.logprobs
                new_logprobs = [{token: logprobs[i], **dict(zip(top_ids[i][:k], top_logprobs[i][:k]))} if k
                                else {token: logprobs[i]}]
                req.logprobs += new_logprobs
            req.cumulative_logprob += logprobs[i]
            try:
                if req.grammar is not None and not req.grammar.accept_token(token):
                    raise UnmetConstraints(f"its structured output allows no token after {len(req.output_ids) - 1} "
                                           "tokens: the grammar (with allowed_token_ids, logit_bias or min_tokens, "
                                           "if given) cannot be met")
                text = req.detokenizer.add(token)
                if req.grammar is not None and req.grammar.is_terminated() and not req.detokenizer.finished:
                    text += req.detokenizer.finish("stop")  # complete (its stop token came under ignore_eos)
                req.finish_reason = req.detokenizer.finish_reason
            except UnmetConstraints as e:  # the request's own input: no engine fault, no traceback logged
                text, req.finish_reason, req.error, req.error_is_input = "", "error", str(e), True
            except Exception as e:  # finished like any other request: _finish releases it
                logger.exception("appending a token to request %s failed", req.rid)
                text, req.finish_reason, req.error = "", "error", f"appending its token failed: {_describe(e)}"
            out = StepOutput(req.rid, [token], text, req.finished, req.finish_reason, new_logprobs,
                             len(req.prompt_ids), len(req.output_ids), req.error, req.cumulative_logprob,
                             stop_reason=req.detokenizer.stop_reason, cached_tokens=req.cached_prompt_tokens,
                             error_is_input=req.error_is_input)
            if req.params.prompt_logprobs is not None and len(req.output_ids) == 1:
                out.prompt_token_ids, out.prompt_logprobs = list(req.prompt_ids), [None, *req.prompt_logprob_entries]
                out.prompt_logprob_ranks = [None, *req.prompt_logprob_ranks]
            outputs.append(out)


class UnmetConstraints(ValueError):
    """A request's grammar allows no token where it goes on: sampling drew one it rejects."""


def _copy_to_host(tokens: SampleOutput) -> tuple[SampleOutput, torch.cuda.Event | None]:
    """The sampled tokens copied to (pinned) host memory without waiting, and an event to wait for that
    copy alone: a blocking copy synchronises the stream, so it would also wait for the steps launched
    after this one (overlap scheduling)."""
    if tokens.token_ids.device.type != "cuda":
        return tokens, None
    host = SampleOutput(*(t if t is None else t.to("cpu", non_blocking=True) for t in tokens))
    copied = torch.cuda.Event()
    copied.record()
    return host, copied


def _error_end(req: Req) -> StepOutput:
    """The last output of a request that failed (req.error says why)."""
    return StepOutput(req.rid, [], "", True, "error", [], len(req.prompt_ids), len(req.output_ids), req.error,
                      cached_tokens=req.cached_prompt_tokens)


def _describe(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


def _is_device_error(e: BaseException) -> bool:
    """An error of the accelerator itself (illegal address, launch failure: its context is lost), or a
    rank of several that died, raised or hangs: no request can go on."""
    accelerator_error = getattr(torch, "AcceleratorError", ())  # torch >= 2.8
    return isinstance(e, (WorkerFailure, accelerator_error)) or "CUDA error" in str(e)
