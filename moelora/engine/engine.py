"""The offline engine: `generate` and `prompt_logprobs` on lists of prompts, adapters loaded and
unloaded at runtime, every rank's torch.profiler traces (`start_profile`, `stop_profile`), and the step API an
HTTP server drives from its own loop (`add_request`, `step`, `abort`, `has_unfinished`). Everything runs in the
caller's thread, one step at a time (engine/stepper.py runs the steps: failures stay with their request; a device
error, or a rank of several that died, raised or hangs (engine/workers.py), makes the engine unhealthy,
`Engine.fatal`).

With tp_size > 1 the engine starts the other ranks itself (ranks 1.., processes of this machine) and this
process is rank 0; `shutdown()` stops them. Over several nodes (nnodes, node_rank, dist_init_addr) node 0's process
is rank 0 and starts its node's other ranks; on node k > 0 the constructor starts that node's ranks, which serve
rank 0's engine, and ends the process when they end (rank 0 shut down). Under torchrun (tp_size processes, one node
or several) every process constructs the Engine: rank 0 gets the engine, the others serve it from inside the
constructor and end their process when rank 0 shuts down.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import math
import numbers
import random
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypeVar

import torch
from transformers import GenerationConfig

from moelora.distributed.state import parallel_state
from moelora.engine.config import EngineConfig
from moelora.engine.detokenizer import IncrementalDetokenizer
from moelora.engine.kv_pool import KVPool
from moelora.engine.lora_manager import LoRAStats
from moelora.engine.lora_slots import RankShare
from moelora.engine.model_runner import ModelRunner, on_device, serve_rank
from moelora.engine.profiler import profile_files
from moelora.engine.request import Req
from moelora.engine.sampler import logit_bias_tensors, pack_bitmask, unpack_bitmask
from moelora.engine.sampling_params import SamplingParams, check_text, generation_defaults
from moelora.engine.scheduler import Scheduler
from moelora.engine.step_stats import StepStats
from moelora.engine.stepper import StepOutput, Stepper
from moelora.engine.structured_output import AfterReasoning, GrammarBackend
from moelora.engine.tokenizer import load_tokenizer
from moelora.engine.workers import (WorkerFailure, Workers, follow, launched_rank, node_config, node_ranks, serves_engine,
                                    share_node_cores)

Prompt = str | Sequence[int]
T = TypeVar("T")
logger = logging.getLogger(__name__)


class PromptError(ValueError):
    """A prompt the engine cannot take (empty, out-of-vocabulary ids, longer than the context, text
    without a tokenizer)."""


class RequestFailed(RuntimeError):
    """A request of `generate` or `prompt_logprobs` failed inside the engine."""


class EngineDead(RuntimeError):
    """The engine cannot run steps any more (a device error); it takes no new requests."""


@dataclass
class GenerateOutput:
    text: str
    token_ids: list[int]                  # every generated token, a stop token included
    finish_reason: str
    logprobs: list[dict[int, float]] | None
    cumulative_logprob: float = 0.0
    prompt_logprobs: list[dict[int, float] | None] | None = None  # with params.prompt_logprobs: None first
    stop_reason: str | int | None = None  # the stop string or stop_token_ids token that ended it (None: EOS, length)
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache (vLLM's RequestOutput.num_cached_tokens)


def _one_caller(method: Callable[..., T]) -> Callable[..., T]:
    """An Engine method that changes its requests or adapters, run by one thread at a time: a second thread's call
    while another's runs is a RuntimeError, where it once failed requests with internal errors and leaked their
    cache (the thread inside may call in again: generate steps)."""
    @functools.wraps(method)
    def one_at_a_time(self: Engine, *args, **kwargs):
        if not self._caller.acquire(blocking=False):
            raise RuntimeError(f"Engine.{method.__name__} was called while another thread is inside the engine: an "
                               "Engine serves one thread at a time (a server runs it on a thread of its own)")
        try:
            return method(self, *args, **kwargs)
        finally:
            self._caller.release()
    return one_at_a_time


class Engine:
    def __init__(self, model_path: str, lora_paths: dict[str, str] | None = None, **kwargs):
        self.config = EngineConfig(model_path, lora_paths=lora_paths or {}, **kwargs)
        _check_device(self.config)
        # what a server request that leaves a sampling field unset gets (vLLM's --generation-config); read before
        # the model, so a bad file ends the start at once
        self.sampling_defaults = ({} if self.config.generation_config == "vllm" else generation_defaults(
            model_path if self.config.generation_config == "auto" else self.config.generation_config))
        if not serves_engine(self.config):  # torchrun's rank r > 0, or node k > 0: it serves rank 0's engine
            follow(self.config, serve_rank)
            raise SystemExit(0)  # rank 0 shut down: this process is done
        t0 = time.perf_counter()
        # rank 0 takes its share of the cores as the other ranks do (serve_rank); shutdown gives the rest back:
        # (threads before, threads set)
        self._threads = None
        if self.config.tp_size > 1:
            self._threads = share_node_cores(self.config), torch.get_num_threads()
            if self._threads[1] != self._threads[0]:
                logger.info("torch CPU threads %d -> %d: the %d ranks of this node share its cores", *self._threads,
                            len(node_ranks(self.config)))
        self.workers = None
        try:
            self.workers = Workers(self.config, serve_rank) if self.config.tp_size > 1 else None
            # seconds of each phase of the start (summary's last line): rank 0's, and its waits for the others
            self.start_seconds = {} if self.workers is None else {"ranks started": time.perf_counter() - t0}
            self._start()
        except BaseException:
            # the guard stopped them on an error or interrupt while loading; one after the load left them waiting for
            # a first command, and no constructed engine is left to shut them down
            try:
                if self.workers is not None:
                    self.workers.shutdown(orderly=False)
            finally:
                self._give_back_threads()
            raise

    def _start(self) -> None:
        """Everything of the construction after the ranks joined: the model, the tokenizer, the scheduler."""
        if self.workers is None:
            self.runner = ModelRunner(self.config)
        else:
            with self.workers.guard("loading the model"):
                with parallel_state(self.workers.state):
                    self.runner = ModelRunner(node_config(self.config, 0), self.workers)
                t0 = time.perf_counter()
                self.workers.barrier()  # every rank loaded (serve_rank's barrier), or an error naming one
        self.start_seconds.update(self.runner.start_seconds)
        self.start_memory = dict(self.runner.start_memory)  # rank 0's, on a GPU: bytes in use after each phase
        if self.workers is not None:
            self.start_seconds["the other ranks' starts waited for"] = time.perf_counter() - t0
        # None for a model directory without tokenizer files: token ids in and out, no text
        self.tokenizer, self.missing_tokenizer = load_tokenizer(self.config)
        # characters of the vocabulary's longest token (for byte-level BPE one a byte), hence at least the text's
        # characters any one token covers
        self._longest_token = None if self.tokenizer is None else max(map(len, self.tokenizer.get_vocab()), default=1)
        self.eos_token_ids = _eos_token_ids(self.config.model_path, self.tokenizer, self.runner.model.config.vocab_size)
        # as vLLM: only the tokenizer's EOS ends a request as EOS (stop_reason None); the model's others
        # (generation_config.json: Qwen's <|endoftext|> beside <|im_end|>) end it as stop_token_ids do
        own_eos = None if self.tokenizer is None else self.tokenizer.eos_token_id
        self._tokenizer_eos = [t for t in self.eos_token_ids if t == own_eos]
        self._eos_as_stops = tuple(t for t in self.eos_token_ids if t != own_eos)
        self.vocab_size = self.runner.model.config.vocab_size
        self.scheduler = Scheduler(self.config, KVPool(self.runner.kv.num_slots, self.config.max_running_requests),
                                   self.runner.lora.ready if self.runner.lora.prefetches else None)
        self._seeds = random.Random(self.config.random_seed)  # for requests without a seed
        self.stepper = Stepper(self.scheduler, self.runner, self.config.overlap_schedule)
        self._aborted: dict[str, StepOutput] = {}  # by request id: the ends the next step reports
        self._caller = threading.RLock()  # held by the thread inside a call that changes requests or adapters
        self._token_texts: dict[int, str] = {}
        # thread-safe: a server may compile a request's grammar in a worker thread before adding it
        self.grammars = GrammarBackend(self.tokenizer, self.vocab_size, self.eos_token_ids, self.missing_tokenizer)

    # ------------------------------------------------------------------------------ adapters

    def read_lora(self, path: str) -> RankShare:
        """The adapter at `path` read and checked against the model (AdapterError lists its problems), this rank's
        share of it, for load_lora; touches no engine state, so a server reads files outside the engine's thread."""
        return self.runner.lora.read(path)

    @_one_caller
    def load_lora(self, name: str, path: str, adapter: RankShare | None = None, replace: bool = False) -> None:
        """Serve the adapter at `path` as `name` from now on; `adapter`: what read_lora(path) gave, else
        the file is read here. replace: it replaces a loaded adapter of that name no request uses (AdapterError if
        one does). Every rank holds the adapter when this returns."""
        self.runner.lora.load_lora(name, path, adapter, replace)
        self.scheduler.forget_prefixes(name)  # (the name's earlier adapter's keys and values are not this one's)
        self._sync_lora()

    @_one_caller
    def unload_lora(self, name: str) -> None:
        """Requests in flight with the adapter finish; new ones naming it are refused."""
        self.runner.lora.unload_lora(name)
        self.scheduler.forget_prefixes(name)
        self._sync_lora()

    # ---------------------------------------------------------------------------- profiling

    def start_profile(self, output_dir: str | None = None) -> None:
        """Record what every rank runs (torch.profiler: host ops, and kernels on a GPU, those of CUDA graphs too) until
        stop_profile, for a directory: output_dir, else EngineConfig.profile_dir. Start and stop it on one thread
        (the engine's, as every call). ValueError: neither directory, one that cannot be made, or a profile running
        already."""
        directory = output_dir or self.config.profile_dir
        if directory is None:
            raise ValueError("no directory for the profile: start the engine with profile_dir (--profile-dir), or "
                             "pass output_dir")
        if self.runner.profiler.active:
            raise ValueError("a profile is running already: stop_profile ends it")
        if self.fatal is not None:
            raise EngineDead(f"the engine cannot run any more: {self.fatal}")
        try:
            Path(directory).mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ValueError(f"cannot make the profile directory {directory!r}: {e}") from e
        stem = f"moelora-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
        self._on_ranks(lambda: self.runner.start_profile(Path(directory), stem))

    def stop_profile(self) -> list[Path]:
        """End the profile once the steps in flight are done: every rank writes its trace and a summary of its time
        by kernel (engine/profiler.py). Returns the traces of this node's ranks, in rank order; a rank's that is
        missing (it could not write it) is logged. ValueError: no profile is running; OSError: rank 0 could not
        write its files (every rank stops recording all the same)."""
        if not self.runner.profiler.active:
            raise ValueError("no profile is running: start_profile starts one")
        trace = self._on_ranks(self.runner.stop_profile)
        stem = trace.name.removesuffix("-rank0.trace.json.gz")
        traces = [trace] + [profile_files(trace.parent, stem, r)[0] for r in node_ranks(self.config)[1:]]
        for missing in [t for t in traces if not t.is_file()]:
            logger.warning("no profile from %s (see that rank's log)", missing)
        return [t for t in traces if t.is_file()]

    def drop_profile(self) -> None:
        """End a running profile without writing it (nothing to do without one). On the thread that started it: from
        another, rank 0's recording ends with that thread."""
        self.runner.profiler.abandon()

    def shutdown(self) -> None:
        """Stop the other ranks (tp_size > 1); the engine runs no more steps (EngineDead from then on)."""
        try:
            self.drop_profile()
            self.runner.lora.close()
            if self.workers is not None:
                with contextlib.suppress(WorkerFailure):  # a rank that hangs: the ranks are stopped, the world aborted
                    self.runner.release_graphs(wait=self.workers.failure is None)
                self.workers.shutdown()
                self.workers = None
            self.stepper.fatal = self.stepper.fatal or "the engine was shut down"
        finally:
            self._give_back_threads()

    def _give_back_threads(self) -> None:
        """The CPU threads rank 0 had before its share, unless someone (another engine) set a count since."""
        if self._threads is not None:
            before, share = self._threads
            if torch.get_num_threads() == share:
                torch.set_num_threads(before)
            self._threads = None

    # ---------------------------------------------------------------------------- offline API

    @_one_caller
    def generate(self, prompts: Prompt | Sequence[Prompt], sampling_params: SamplingParams | Sequence[SamplingParams]
                 | None = None, lora: str | None | Sequence[str | None] = None,
                 priority: int | Sequence[int] = 0) -> list[GenerateOutput]:
        """Completions of every prompt (a string or token ids), with one sampling_params for all or one
        each, an adapter name (None: base model) and a priority (scheduling_policy "priority": lower first) for all
        or one each. A prompt with n > 1 gives n outputs in a row. Run alone: outputs of requests added through
        add_request are dropped."""
        prompts = _prompt_list(prompts)
        params = _per_prompt(sampling_params if sampling_params is not None else SamplingParams(), prompts, "sampling_params")
        adapters = _per_prompt(lora, prompts, "lora")
        priorities = _per_prompt(priority, prompts, "priority")
        reqs = self._make_all([(i, p, sp, a, False, pr)
                               for i, (p, sp, a, pr) in enumerate(zip(prompts, params, adapters, priorities))])
        self._run(reqs)
        return [GenerateOutput(r.detokenizer.text, list(r.output_ids), r.finish_reason,
                               r.logprobs if r.params.logprobs is not None else None, r.cumulative_logprob,
                               [None, *r.prompt_logprob_entries] if r.params.prompt_logprobs is not None else None,
                               r.detokenizer.stop_reason, r.cached_prompt_tokens)
                for r in reqs]

    @_one_caller
    def prompt_logprobs(self, token_id_lists: Sequence[Sequence[int]], lora: str | None | Sequence[str | None] = None
                        ) -> list[torch.Tensor]:
        """Float32 [len, vocab] per prompt: row i is the log-probability of every next token after
        the prompt's first i + 1 tokens."""
        params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        token_id_lists = _prompt_list(token_id_lists)
        adapters = _per_prompt(lora, token_id_lists, "lora")
        reqs = self._make_all([(i, ids, params, a, True, 0) for i, (ids, a) in enumerate(zip(token_id_lists, adapters))])
        self._run(reqs)
        return [torch.cat(r.prompt_logprobs) for r in reqs]

    # ------------------------------------------------------------------------------- step API

    @_one_caller
    def add_request(self, prompt: Prompt, sampling_params: SamplingParams | None = None, lora: str | None = None,
                    rid: str | None = None, add_special_tokens: bool = True, detokenize: bool = True,
                    arrival_time: float | None = None, priority: int = 0) -> str:
        """Queue one request (n must be 1); raises ValueError (AdapterError for the adapter) naming the problem.
        add_special_tokens: False for a text prompt that has them already (one `chat_prompt` made).
        detokenize: False leaves its outputs' text empty and its stop strings unlooked-for, for a caller
        that detokenizes them outside the engine's thread (`output_detokenizer`) and aborts the request
        where a stop string ends it. arrival_time: time.perf_counter() when the request arrived (a server's
        HTTP arrival), from which step_stats counts its wait for admission; default now. priority: its place in the
        queue under scheduling_policy "priority" (lower values first; with "fcfs" only 0 is taken)."""
        # its fields as __post_init__ makes them (a caller may have set one since), and checked
        params = replace(sampling_params) if sampling_params is not None else SamplingParams()
        if params.n != 1:
            raise ValueError(f"add_request takes one sequence per request (SamplingParams.n=1), got n={params.n}")
        req = self._make(prompt, params, lora, False, priority, rid, add_special_tokens, detokenize)
        if arrival_time is not None:
            if not (isinstance(arrival_time, (int, float)) and math.isfinite(arrival_time)):
                raise ValueError(f"arrival_time must be a finite time.perf_counter() value, got {arrival_time!r}")
            req.arrival = arrival_time
        self._add(req)
        return req.rid

    @_one_caller
    def step(self) -> list[StepOutput]:
        """Run one step; the new tokens and text of every request in it, and the end of aborted and
        failed ones. With overlap scheduling (the default), the tokens of the step launched by the previous call
        (the first call launches one and returns none of its tokens)."""
        aborted, self._aborted = self._aborted, {}
        try:
            with on_device(self.runner.device):
                return [*aborted.values(), *self.stepper.step()]
        except BaseException:  # reported by the next step, with the ends of the requests the failed step ended
            self._aborted = aborted | self._aborted
            raise

    @_one_caller
    def abort(self, rid: str, reason: str = "abort") -> bool:
        """Stop a request; the next step reports it finished with `reason`: "abort", or "stop" when its caller found
        its stop string (a request added with detokenize=False): ended as it should, its tokens are kept for prefix
        caching as any finished request's are. False if unknown or done."""
        if reason not in ("abort", "stop"):
            raise ValueError(f"abort's reason must be 'abort' or 'stop', got {reason!r}")
        req = self.scheduler.find(rid)
        if req is None:
            return False
        req.finish_reason = reason
        try:
            self.stepper.retire(req)
        except Exception:  # an engine fault, not the caller's (accounting_error tells what stays held)
            logger.exception("releasing what request %s holds failed", rid)
        finally:  # it ended: the next step reports it, whatever its release raised
            self._aborted[rid] = StepOutput(rid, [], "", True, reason, [], len(req.prompt_ids), len(req.output_ids),
                                            cached_tokens=req.cached_prompt_tokens)
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._aborted) or self.stepper.in_flight or self.stepper.has_ends

    @property
    def fatal(self) -> str | None:
        """Why the engine cannot run steps any more (a device error, a failed rank, shut down); None while it can."""
        return self.stepper.fatal

    def rank_ended(self) -> bool:
        """Whether a rank this process started (tp_size > 1) has ended while the engine could serve, which the engine
        itself finds at its next step or check_ranks: cheap (no collective, no wait) and safe from any thread, for
        a server's /health."""
        workers = self.workers  # (once: shutdown drops it, from the engine's thread)
        return workers is not None and workers.rank_ended()

    @_one_caller
    def check_ranks(self) -> None:
        """Fail the engine now if a rank this process started has ended, as its next step would (fatal: requests are
        refused with EngineDead and those in flight fail at the next step; the other ranks are stopped), rather than
        at a step that may not come: a server calls it before each command of its engine thread, so that a request
        that comes once /health saw the rank end (rank_ended) is refused, not added."""
        if self.workers is not None and self.fatal is None:
            try:
                self._on_ranks(self.workers.check)
            except WorkerFailure as e:
                logger.error("the engine cannot serve any more: %s", e)

    # ------------------------------------------------------------------------------------ text

    def tokenize(self, prompt: Prompt, add_special_tokens: bool = True) -> list[int]:
        """The prompt's token ids (PromptError for text it cannot take); touches no engine state, so a
        server tokenizes outside the engine's thread and adds the ids."""
        if not isinstance(prompt, str):
            return _token_ids(prompt)
        check_text(prompt, "the prompt")
        if self.tokenizer is None:
            raise PromptError(f"a text prompt needs a tokenizer: {self.missing_tokenizer}")
        if len(prompt) > self.max_prompt_chars:
            raise PromptError(f"the prompt has {len(prompt)} characters, more than {self.context_len} tokens (the "
                              f"context) of at most {self._longest_token} characters each can hold; not tokenized")
        return self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)

    @property
    def max_prompt_chars(self) -> int:
        """Text prompts longer than this are refused before they are encoded: their tokens cannot fit in the
        context, and encoding megabytes would hold the tokenizer, which every request's text waits for, for
        seconds."""
        return self.context_len * (self._longest_token or 1)

    def output_detokenizer(self, prompt_ids: Sequence[int], params: SamplingParams) -> IncrementalDetokenizer:
        """Text and stop strings of the outputs of a request added with detokenize=False, for its caller's
        thread: fed every output token, and finish(reason) when the engine ends the request ("stop" by a
        grammar, "length") without it having finished on its own."""
        params = self._with_eos_stops(params).evolve(max_tokens=None)
        return IncrementalDetokenizer(self.tokenizer, prompt_ids, params, self._tokenizer_eos)

    def _with_eos_stops(self, params: SamplingParams) -> SamplingParams:
        """params with the model's EOS tokens besides the tokenizer's among its stop_token_ids (none under
        ignore_eos), as vLLM's update_from_generation_config adds them."""
        extra = [t for t in self._eos_as_stops if t not in params.stop_token_ids]
        if params.ignore_eos or not extra:
            return params
        return params.evolve(stop_token_ids=(*params.stop_token_ids, *extra))

    def check_prompt_length(self, num_tokens: int) -> None:
        """PromptError unless a prompt of num_tokens tokens leaves the context room for a new token."""
        if num_tokens >= self.context_len:
            raise PromptError(f"the prompt has {num_tokens} tokens, the context holds {self.context_len} (prompt + at "
                              "least 1 new token)")

    def check_token_ids(self, ids: Sequence[int]) -> None:
        """PromptError unless every id of a prompt is an int in [0, vocab_size)."""
        if {int}.issuperset(map(type, ids)) and (not ids or 0 <= min(ids) and max(ids) < self.vocab_size):
            return  # (at C speed: a long prompt's, for every request)
        bad = [t for t in ids if not (_is_int(t) and 0 <= t < self.vocab_size)]
        if bad:
            raise PromptError(f"prompt token ids must be ints in [0, {self.vocab_size}), got {bad[0]!r}")

    def chat_prompt(self, messages: list[dict], tools: list[dict] | None = None, add_generation_prompt: bool = True,
                    continue_final_message: bool = False, template_kwargs: dict[str, Any] | None = None) -> str:
        """The text the model's chat template makes of the messages (and the tools the model may
        call, OpenAI's tool definitions), ending where the assistant's turn begins (special tokens
        included: add it with add_special_tokens=False); or, as vLLM's, where the messages end
        (add_generation_prompt False), or inside the last message, an assistant's, for the model to go on with
        (continue_final_message). template_kwargs: more variables for the template (vLLM's chat_template_kwargs,
        e.g. Qwen3's enable_thinking), none of apply_chat_template's own arguments. ValueError if the tokenizer has
        no chat template or the template refuses the messages."""
        if self.tokenizer is None:
            raise ValueError(f"chat needs a tokenizer: {self.missing_tokenizer}")
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("the model has no chat template (none in its tokenizer files, or one that does not render: "
                             "the start logged why); start the engine with chat_template (--chat-template)")
        if add_generation_prompt and continue_final_message:
            raise ValueError("continue_final_message goes on with the last message: it cannot also add the generation "
                             "prompt (set add_generation_prompt to false)")
        if continue_final_message and (not messages or not isinstance(messages[-1], dict)
                                       or messages[-1].get("role") != "assistant"):
            raise ValueError("continue_final_message needs the last message to be the assistant's")
        own = {name for name, p in inspect.signature(self.tokenizer.apply_chat_template).parameters.items()
               if p.kind is not inspect.Parameter.VAR_KEYWORD} | {"messages"} if template_kwargs else set()
        taken = sorted(k for k in template_kwargs or {} if k in own)
        if taken:
            raise ValueError(f"chat_template_kwargs cannot set {', '.join(taken)}: arguments of the template's call, "
                             "not variables of the template")
        try:
            return self.tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                                      add_generation_prompt=add_generation_prompt,
                                                      continue_final_message=continue_final_message,
                                                      **(template_kwargs or {}))
        except Exception as e:  # the template's own errors (jinja raise_exception, missing fields)
            raise ValueError(f"the chat template failed on these messages: {e}") from e

    def token_text(self, token: int) -> str:
        """The text of one token alone (as log-probability entries show it)."""
        if not (_is_int(token) and 0 <= token < self.vocab_size):
            raise ValueError(f"token must be a token id in [0, {self.vocab_size}), got {token!r}")
        if token not in self._token_texts:  # without a tokenizer, as vLLM's return_tokens_as_token_ids
            self._token_texts[token] = self.tokenizer.decode([token]) if self.tokenizer else f"token_id:{token}"
        return self._token_texts[token]

    # ----------------------------------------------------------------- state a server reports

    @property
    def context_len(self) -> int:
        """Tokens one request may hold: prompt + generated."""
        return self.runner.context_len

    @property
    def step_stats(self) -> StepStats:
        """Counters of the steps run so far (engine/step_stats.py), updated in place."""
        return self.stepper.stats

    @property
    def num_waiting(self) -> int:
        """Requests queued for admission (retracted ones included)."""
        return len(self.scheduler.waiting)

    @property
    def lora_stats(self) -> LoRAStats:
        """The adapter slots' counters (hits, loads, evictions, disk loads), updated in place."""
        return self.runner.lora.stats

    @property
    def num_running(self) -> int:
        """Requests holding KV cache (running, or part-way through their prompt)."""
        return len(self.scheduler.running) + (self.scheduler.chunked is not None)

    @property
    def kv_cache_usage(self) -> tuple[int, int]:
        """(KV token slots in use, all of them); cached prefixes no request holds are not in use."""
        total = self.runner.kv.num_slots - 1  # slot 0 is never handed out
        return total - self.scheduler.available_slots, total

    def prefix_cache_counts(self) -> dict[str, int]:
        """Prefix caching's token counts since the start: the prompts' of the requests admitted (query_tokens), those
        found cached (hit_tokens), and the KV slots cached now (cached_tokens); empty without prefix caching."""
        cache = self.scheduler.cache
        if cache is None:
            return {}
        return {"query_tokens": cache.query_tokens, "hit_tokens": cache.hit_tokens, "cached_tokens": cache.cached}

    @property
    def lora_slots_usage(self) -> tuple[int, int]:
        """(GPU adapter slots holding an adapter, all of them)."""
        return len(self.runner.lora.pool.names), self.config.max_loras_per_batch

    def summary(self) -> list[str]:
        """What the engine serves, a line each: model, KV cache, tokenizer, LoRA slots and adapters; last, how long
        each phase of its start took (on a cold Triton cache mostly compiles: warm-up steps and graph captures)."""
        runner, config = self.runner, self.config
        model = runner.model.config
        family = ", ".join(model.architectures or (model.model_type,))
        tokens, kv_bytes = runner.kv.num_slots - 1, runner.model.kv_cache_shape.bytes_per_token(runner.dtype)
        return [f"model {config.model_path}: {family}, {str(runner.dtype).removeprefix('torch.')} on {runner.device}",
                f"KV cache: {tokens} tokens ({_size(tokens * kv_bytes)}); context {self.context_len} tokens; "
                f"up to {config.max_running_requests} running requests",
                f"tokenizer: {config.tokenizer_path or config.model_path}" if self.tokenizer is not None
                else f"no tokenizer: {self.missing_tokenizer}",
                *runner.lora.describe(),
                *(["sampling defaults for requests (generation_config.json): "
                   + ", ".join(f"{k}={v}" for k, v in self.sampling_defaults.items())] if self.sampling_defaults else []),
                *([f"parallel: {config.tp_size} ranks, tensor parallel with the experts over {config.ep_size} groups "
                   f"({config.moe_dispatch} dispatch); per rank: weights {_size(runner.weight_bytes())}, "
                   "KV cache and LoRA slots as above"] if config.tp_size > 1 else []),
                "start: " + ", ".join(self._phase_line(phase) for phase in self.start_seconds)]

    def _phase_line(self, phase: str) -> str:
        """A phase of the start for the summary: how long it took and, on a GPU, the memory in use after it."""
        memory = f" ({_size(self.start_memory[phase])} of GPU memory in use)" if phase in self.start_memory else ""
        return f"{phase} in {self.start_seconds[phase]:.1f} s{memory}"

    def accounting_error(self) -> str | None:
        """What does not add up between the KV cache pool and the requests holding it (None: all well)."""
        return self.scheduler.accounting_error()

    # ------------------------------------------------------------------------------ internals

    def _make_all(self, specs: list[tuple]) -> list[Req]:
        """Requests for (prompt index, prompt, params, lora, return_prompt_logprobs, priority) specs, params.n of each
        (the k-th with params.for_sequence(k)), added only once all are valid; errors name the prompt by its index."""
        reqs = []
        for i, prompt, params, lora, return_prompt_logprobs, priority in specs:
            try:
                params = replace(params)  # as add_request's
                for k in range(params.n):
                    req = self._make(prompt, params.for_sequence(k), lora, return_prompt_logprobs, priority)
                    req.prompt_index = i
                    reqs.append(req)
            except ValueError as e:
                raise type(e)(f"prompt {i}: {e}") from e
        for req in reqs:
            self._add(req)
        return reqs

    def _make(self, prompt: Prompt, params: SamplingParams, lora: str | None, return_prompt_logprobs: bool,
              priority: int = 0, rid: str | None = None, add_special_tokens: bool = True, detokenize: bool = True
              ) -> Req:
        """A valid request, or ValueError naming what is wrong (`params` checked by the caller); changes nothing."""
        if rid is not None and not (isinstance(rid, str) and rid):
            raise ValueError(f"a request id must be a non-empty string, got {rid!r}")
        if not isinstance(priority, numbers.Integral) or isinstance(priority, bool):
            raise ValueError(f"priority must be an int, got {priority!r}")
        if priority and self.config.scheduling_policy != "priority":
            raise ValueError(f"priority {priority} needs scheduling_policy 'priority' (--scheduling-policy priority): "
                             f"with {self.config.scheduling_policy!r} every request's priority is 0")
        if lora is not None:
            self.runner.lora.check(lora)
        if rid is not None and self.scheduler.find(rid) is not None:
            raise ValueError(f"request id {rid!r} is already in use")
        if rid is not None and (rid in self._aborted or any(o.rid == rid for o in self.stepper.unreported_ends)):
            raise ValueError(f"request id {rid!r} is still in use: its end is reported by the next step")
        if params.stop and self.tokenizer is None:
            raise ValueError(f"SamplingParams.stop strings need a tokenizer: {self.missing_tokenizer}")
        ids = self.tokenize(prompt, add_special_tokens)
        if not ids:
            raise PromptError("the prompt is empty")
        self.check_token_ids(ids)
        spec = params.structured_output
        for name, token_ids in (("stop_token_ids", params.stop_token_ids), ("logit_bias", params.logit_bias),
                                ("allowed_token_ids", params.allowed_token_ids),
                                ("structured_output.reasoning_end", [spec and spec.reasoning_end or -1]),
                                ("structured_output.reasoning_start", [spec and spec.reasoning_start or -1])):
            largest = max(token_ids or (), default=-1)  # (at C speed: a logit_bias may hold the whole vocabulary)
            if largest >= self.vocab_size:
                raise ValueError(f"SamplingParams.{name} must be token ids below the vocabulary size "
                                 f"{self.vocab_size}, got {largest}")
        self.check_prompt_length(len(ids))
        context = self.runner.context_len
        if params.max_tokens is None:
            params = params.evolve(max_tokens=context - len(ids))
        elif len(ids) + params.max_tokens > context:  # as vLLM: refused, not cut
            raise ValueError(f"SamplingParams.max_tokens={params.max_tokens} and the prompt's {len(ids)} tokens are "
                             f"{len(ids) + params.max_tokens} tokens; the context holds {context}")
        params = params.evolve(min_tokens=min(params.min_tokens, params.max_tokens))
        allowed = grammar = None
        if params.allowed_token_ids is not None:
            allowed = torch.zeros(1, self.vocab_size, dtype=torch.bool)
            allowed[0, list(params.allowed_token_ids)] = True
            allowed = pack_bitmask(allowed)[0]
        if spec is not None:
            grammar = self.grammars.matcher(spec)
            self._check_first_tokens(grammar, allowed)
            if spec.reasoning_end is not None:
                grammar = AfterReasoning(grammar, spec.reasoning_end, spec.reasoning_start)
        seed = params.seed if params.seed is not None else self._seeds.getrandbits(63)
        # without the tokenizer it decides only the stop-token and length finishes
        params = self._with_eos_stops(params)
        detokenizer = IncrementalDetokenizer(self.tokenizer if detokenize else None, ids, params, self._tokenizer_eos)
        return Req(rid if rid is not None else uuid.uuid4().hex, ids, params, lora, seed, detokenizer,
                   return_prompt_logprobs,
                   grammar=grammar, allowed_tokens=allowed, logit_bias=logit_bias_tensors(params),
                   arrival=time.perf_counter(), priority=int(priority))

    def _check_first_tokens(self, grammar, allowed: torch.Tensor | None) -> None:
        """ValueError unless the grammar (and allowed_token_ids, the packed `allowed`) lets the output start with
        some token: else every logit would be masked and the first token drawn from none."""
        first = torch.full((1, -(-self.vocab_size // 32)), -1, dtype=torch.int32)
        grammar.fill_next_token_bitmask(first, 0)
        if allowed is not None:
            first[0] &= allowed
        if not bool(unpack_bitmask(first, self.vocab_size).any()):
            raise ValueError("SamplingParams.structured_output: the grammar allows no first token"
                             + (" of allowed_token_ids" if allowed is not None else " (it matches no text)"))

    def _sync_lora(self) -> None:
        self._on_ranks(self.runner.sync_lora)

    def _on_ranks(self, command: Callable[[], T]) -> T:
        """command() (one the other ranks run too); a rank that failed in it makes the engine unhealthy."""
        try:
            return command()
        except WorkerFailure as e:
            self.stepper.fatal = str(e)
            raise

    def _add(self, req: Req) -> None:
        if self.fatal is not None:
            raise EngineDead(f"the engine cannot run any more: {self.fatal}")
        if req.lora is not None:
            self.runner.lora.acquire(req.lora)
            req.holds_adapter = True
        self.scheduler.add(req)

    def _run(self, reqs: list[Req]) -> None:
        try:
            while not all(r.finished for r in reqs):
                self.step()
        except BaseException:  # an interrupt (Ctrl-C): the call's requests still waiting end with it
            for req in reqs:
                if not req.finished:
                    self.abort(req.rid)
            raise
        failed = [(r.prompt_index, r.error) for r in reqs if r.error is not None]
        if failed:
            raise RequestFailed("; ".join(f"prompt {i}: {error}" for i, error in failed))


def _check_device(config: EngineConfig) -> None:
    """A CUDA device this machine does not have is a ValueError naming EngineConfig.device: torch would fail only
    once the model loads onto it (an AssertionError without CUDA, an invalid ordinal's RuntimeError)."""
    device = config.torch_device
    if device.type != "cuda":
        return
    if not torch.cuda.is_available():
        raise ValueError(f"EngineConfig.device {config.device!r}: no CUDA device is available here; use 'cpu'")
    if (device.index or 0) >= torch.cuda.device_count():
        raise ValueError(f"EngineConfig.device {config.device!r}: this machine has {torch.cuda.device_count()} CUDA "
                         "device(s), from cuda:0")
    # the ranks this process starts take the devices after it (torchrun's each check their own)
    last = (device.index or 0) + (len(node_ranks(config)) - 1 if launched_rank(config) is None else 0)
    if last >= torch.cuda.device_count():
        raise ValueError(f"EngineConfig.device {config.device!r} with tp_size {config.tp_size}: the ranks on this "
                         f"node take cuda:{device.index or 0}..cuda:{last}, and this machine has "
                         f"{torch.cuda.device_count()} CUDA device(s)")


def _is_int(value) -> bool:
    """An int of Python's or numpy's, not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_token_ids(prompt) -> bool:
    """A prompt of token ids rather than a list of prompts: a non-empty sequence of ints but bytes (or a 1-D integer
    array). Lists of Python ints (a long prompt's) are told at C speed: this runs for every request, on a server's
    event loop too."""
    if hasattr(prompt, "tolist") and getattr(prompt, "ndim", None) == 1:
        prompt = prompt.tolist()
    if not isinstance(prompt, Sequence) or isinstance(prompt, (str, bytes, bytearray)) or not prompt:
        return False
    return {int}.issuperset(map(type, prompt)) or all(_is_int(t) for t in prompt)


def _token_ids(prompt) -> list[int]:
    """A prompt of token ids as a list of ints; PromptError for anything else (bytes, bools, a dict, None...)."""
    if not _is_token_ids(prompt) and not (isinstance(prompt, (list, tuple)) and not prompt):
        raise PromptError(f"a prompt is a string or a list of token ids (ints), got {_describe_value(prompt)}")
    ids = prompt.tolist() if hasattr(prompt, "tolist") else prompt
    return list(ids) if {int}.issuperset(map(type, ids)) else [int(t) for t in ids]


def _prompt_list(prompts) -> list:
    """generate's and prompt_logprobs' prompts as a list: one prompt (a string, token ids), or any other collection
    of them but bytes and mappings (which would be read as token ids, or as their keys)."""
    if isinstance(prompts, str) or _is_token_ids(prompts):
        return [prompts]
    if prompts is None or isinstance(prompts, (bytes, bytearray, Mapping)) or not isinstance(prompts, Iterable):
        raise PromptError(f"prompts must be a string, a list of token ids, or a list of those; got "
                          f"{_describe_value(prompts)}")
    return list(prompts.tolist() if hasattr(prompts, "tolist") else prompts)


def _describe_value(value) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:60]}{'...' if len(text) > 60 else ''}"


def _per_prompt(value, prompts: Sequence, name: str) -> list:
    """One value per prompt from a single value or a list of them."""
    if isinstance(value, (list, tuple)):
        if len(value) != len(prompts):
            raise ValueError(f"{name} has {len(value)} entries for {len(prompts)} prompts")
        return list(value)
    return [value] * len(prompts)


def _size(num_bytes: int) -> str:
    """GiB from 1 GiB up, else MiB: a small model's weights and KV cache showed as 0.00 GiB."""
    return f"{num_bytes / 2**30:.2f} GiB" if num_bytes >= 2**30 else f"{num_bytes / 2**20:.1f} MiB"


def _eos_token_ids(model_path: str, tokenizer, vocab_size: int) -> list[int]:
    """The model's EOS tokens (generation_config.json, as transformers' generate uses), else the tokenizer's; a
    ValueError naming where they come from unless they are token ids of the model's vocabulary."""
    where = f"{Path(model_path) / 'generation_config.json'}: eos_token_id"
    try:
        eos = GenerationConfig.from_pretrained(model_path).eos_token_id
    except OSError:
        eos = None
    if eos is None and tokenizer is not None:
        eos, where = tokenizer.eos_token_id, "the tokenizer's eos_token_id"
    ids = [] if eos is None else [eos] if not isinstance(eos, (list, tuple)) else list(eos)
    bad = [t for t in ids if not (_is_int(t) and t >= 0)]
    if bad:  # they became every request's stop_token_ids, refused each time as the request's
        raise ValueError(f"{where} must be token ids (ints >= 0), got {bad[0]!r}")
    past = [t for t in ids if t >= vocab_size]
    if past:  # (tiny test models keep their family's ids) never sampled: nothing to stop at
        logger.warning("%s %s past the model's vocabulary (%d tokens): left out", where, past, vocab_size)
    return [t for t in ids if t < vocab_size]
