"""Runs scheduled batches through the model: loads it, sizes the KV cache, builds each step's
ForwardBatch, runs the model (decode steps from CUDA graphs where captured) and samples.

Under tensor parallelism rank 0's runner sends each step's inputs to the other ranks (engine/workers.py),
whose runners (`serve_rank`) run the same forward on their shares of the model; only rank 0 samples (with overlap
scheduling it broadcasts the sampled tokens the next step's decode rows need, on the device, as that step starts)."""
from __future__ import annotations

import contextlib
import gc
import logging
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple, TypeVar

import torch

from moelora.core import ForwardBatch, KVCache, to_device
from moelora.distributed.comm import (broadcast, broadcast_object, control_barrier, gather_over_ranks, min_over_ranks,
                                     wait_event)
from moelora.distributed.state import ParallelState, destroy_parallel, get_parallel, parallel_state
from moelora.engine.config import CPU_KV_TOKENS, DTYPES, EngineConfig
from moelora.engine.cuda_graph import CudaGraphs, GraphCapture, PromptGraphs, RankBounds
from moelora.engine.lora_manager import READ_DONE, LoRAManager
from moelora.engine.profiler import StepProfiler
from moelora.engine.request import Req
from moelora.engine.sampler import PenaltyState, SampleOutput, SamplingBatch, TokenMask, hold_back, sample
from moelora.engine.scheduler import ScheduledBatch
from moelora.engine.workers import Workers, join_world, node_config, node_ranks, share_node_cores
from moelora.layers.moe.all_to_all import FIXED_MAX_TOKENS
from moelora.layers.moe.layer import MoE
from moelora.models.config import ModelConfig
from moelora.models.loader import load_model

logger = logging.getLogger(__name__)
ALLOW_LONG_CONTEXT = "MOELORA_ALLOW_LONG_CONTEXT_LENGTH"  # vLLM's VLLM_ALLOW_LONG_MAX_MODEL_LEN
T = TypeVar("T")
PROFILE_WRITE_TIMEOUT_FACTOR = 10  # the ranks' wait for each other's profile writes: this many dist_timeouts
# the host's memory, and cgroup v2's: the process's group ("0::/path") under the unified hierarchy's root
MEMINFO, CGROUP_OF_PROCESS, CGROUP_ROOT = "/proc/meminfo", "/proc/self/cgroup", "/sys/fs/cgroup"


@dataclass
class PendingTokens:
    """The tokens a step sampled, still on the device, for the next step's decode rows."""
    token_ids: torch.Tensor   # [B] int64, a SampleOutput's
    rows: dict[Req, int]      # each sampled request's row in it


@dataclass
class StepResult:
    sampled: list[Req]                      # requests that got a new token, in batch order
    tokens: SampleOutput | None             # one row per sampled request
    prompt_logprobs: dict[int, torch.Tensor]  # batch index -> [new prompt tokens, vocab] float32, on the host
    # batch index -> (k, entries, ranks): the entries (params.prompt_logprobs) of prompt tokens k + 1, k + 2, ...,
    # and each token's rank among the vocabulary (1: the likeliest)
    prompt_entries: dict[int, tuple[int, list[dict[int, float]], list[int]]]


class StepInputs(NamedTuple):
    """A step as rank 0 sends it to the other ranks: ForwardBatch.build's arguments but the KV cache, and the
    decode rows whose tokens the step before sampled and are on the device only (overlap scheduling)."""
    rows: list[int]
    new_tokens: list[list[int]]  # a pending decode row's token stands in as 0
    prefix_lens: list[int]
    out_cache_loc: torch.Tensor  # int64, host
    logits_indices: list[int]
    token_slots: list[int]
    num_decode: int  # the first num_decode sequences are decode rows
    pending: list[tuple[int, int]]  # (input position, row of the previous step's sampled tokens) of each pending row
    num_sampled: int  # rows the previous step sampled (what rank 0 broadcasts when any row is pending)
    cached_prefixes: list[tuple[int, torch.Tensor]]  # (row, slots) of requests starting on a cached prefix


def warm_up_sizes(max_tokens: int) -> list[int]:
    """1, 2, 3, then 2^i and 2^i + 1 up to max_tokens, and max_tokens: every class of token counts whose bounds are
    at least a factor of two apart holds a power of two, a class that starts at a power of two holds 2^i + 1, and
    one that max_tokens cuts short holds max_tokens."""
    sizes = {n for n in (1, 2, 3, max_tokens) if 1 <= n <= max_tokens}
    power = 4
    while power <= max_tokens:
        sizes |= {n for n in (power, power + 1) if n <= max_tokens}
        power *= 2
    return sorted(sizes)


class ModelRunner:
    def __init__(self, config: EngineConfig, workers: Workers | None = None):
        """workers: the other ranks, when this is rank 0 of several."""
        self.config, self.device, self.workers = config, _indexed(config.torch_device), workers
        with on_device(self.device):
            try:
                self._build(config)
            except BaseException:
                # the exception's frames hold this runner: a caller that catches it (a notebook's retry with smaller
                # settings) would otherwise keep the failed start's weights, slots, KV cache and graphs in memory
                self.__dict__.clear()
                raise

    @contextlib.contextmanager
    def _start_phase(self, name: str) -> Iterator[None]:
        """Times a phase of the start into start_seconds and, on a GPU, puts the device memory in use after it (by
        this process and any other) into start_memory; Engine.summary reports both."""
        t0 = time.perf_counter()
        yield
        self.start_seconds[name] = time.perf_counter() - t0
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            self.start_memory[name] = total - free

    def _room_for(self, what: str, remedy: str, phase: Callable[[], T]) -> T:
        """phase(), a start phase after the KV cache's allocation (what it does, and the settings that shrink it), whose
        running out of GPU memory fails with one message that says which and what makes room, not an allocator
        traceback: the KV cache took mem_fraction_static of the memory, or max_total_tokens, and the activations of
        the warm-up's steps and the graphs' pool share what is left. A plain call, not a context manager: a `with`
        block's __exit__ frame would hold the allocator's traceback, whose frames hold the model."""
        try:
            return phase()
        except RuntimeError as e:
            # the caching allocator's OutOfMemoryError, or the driver's error where a graph's instantiation or a
            # library's workspace allocates outside it (cudaErrorMemoryAllocation: not sticky, the process goes on)
            if not isinstance(e, torch.OutOfMemoryError) and "CUDA error: out of memory" not in str(e):
                raise
            in_use = ""
            if self.device.type == "cuda":
                free, total = torch.cuda.mem_get_info(self.device)
                tensors, reserve = torch.cuda.memory_allocated(self.device), torch.cuda.memory_reserved(self.device)
                in_use = (f" ({(total - free) / 2**30:.2f} of its {total / 2**30:.2f} GiB in use, by this process "
                          f"and any other; this process's tensors {tensors / 2**30:.2f} GiB, its allocator's reserve "
                          f"{reserve / 2**30:.2f} GiB)")
            kv = (f"EngineConfig.max_total_tokens (KV cache slots, {self.config.max_total_tokens} now)"
                  if self.config.max_total_tokens else
                  f"EngineConfig.mem_fraction_static (the share of the GPU for the weights, LoRA slots and KV cache, "
                  f"{self.config.mem_fraction_static} now)")
            # where the memory went, phase by phase (on a GPU)
            phases = "; ".join(f"{name}: {used / 2**30:.2f} GiB" for name, used in self.start_memory.items())
            phases = f" (in use after each phase of the start: {phases})" if phases else ""
            # (the allocator's error without its frames, which hold the model's layers and the step's tensors)
            raise ValueError(f"the GPU ran out of memory {what}{in_use}: {remedy}, or leave it more memory with a "
                             f"smaller {kv}{phases}") from e.with_traceback(None)

    def _build(self, config: EngineConfig) -> None:
        self.dist_state = get_parallel()  # the world it is built in: its model's, whatever is current later
        # seconds of each phase of the start: on a cold Triton cache mostly compiles (warm-up and graph captures)
        self.start_seconds: dict[str, float] = {}
        self.start_memory: dict[str, int] = {}
        if not (Path(config.model_path) / "config.json").is_file():
            raise ValueError(f"EngineConfig.model_path {config.model_path!r} is not a local model directory (it has no "
                             "config.json); moelora reads local Hugging Face checkpoints, not Hub ids")
        model_config = ModelConfig.from_pretrained(config.model_path, moe_backend=config.moe_runner_backend)
        if config.context_length is not None and config.context_length > (limit := _positions(model_config)):
            # as vLLM and SGLang: positions past the trained ones give garbage, not an error; their environment
            # variable lets a user who knows better (a RoPE scaling the config does not say) go on
            what = (f"EngineConfig.context_length {config.context_length} is longer than the model's positions, "
                    f"{limit} by its config.json (max_position_embeddings, rope_scaling)")
            if os.environ.get(ALLOW_LONG_CONTEXT) != "1":
                raise ValueError(f"{what}; set {ALLOW_LONG_CONTEXT}=1 to serve it all the same")
            logger.warning("%s: served as %s=1 asks; outputs past the trained positions may be garbage", what,
                           ALLOW_LONG_CONTEXT)
        # "auto": the checkpoint's dtype where the engine serves it (float64, which --dtype refuses, is served in float32)
        saved = model_config.saved_dtype if model_config.saved_dtype in DTYPES.values() else torch.float32
        self.dtype = DTYPES[config.dtype] if config.dtype != "auto" else saved
        with self._start_phase("model loaded"):
            self.model = load_model(config.model_path, self.dtype, self.device, config.load_format,
                                    config.random_seed, model_config)
        # slots first: the KV cache gets what memory is left
        loaded = len(config.lora_paths)
        with self._start_phase(f"LoRA slots allocated, {loaded} adapter{'s' * (loaded != 1)} loaded"):
            self.lora = LoRAManager(config, self.model, record_events=self.workers is not None,
                                    check_memory=self._check_slot_memory)
        context = config.context_length or model_config.max_position_embeddings
        shape = self.model.kv_cache_shape
        tokens = self._kv_tokens(shape.bytes_per_token(self.dtype), context)
        # every rank's cache alike: rank 0 schedules for all
        if self.dist_state.tp_size > 1:
            with self._start_phase("the other ranks' loads waited for"):
                # each rank read the adapters given at start from its own disk: every rank fails the start where one
                # read other files than rank 0 (a digest of each, as a runtime load_lora's read is checked)
                if config.lora_paths:
                    self.lora.check_start_digests(gather_over_ranks(self.dist_state, self.lora.start_digests(),
                                                                    config.dist_timeout))
                tokens, = min_over_ranks(self.dist_state, [tokens], config.dist_timeout)
        # a request alone always fits, with a slot to spare for the scheduler's decode reserve
        self.context_len = min(context, tokens - 1)
        with self._start_phase("KV cache allocated"):
            self.kv = KVCache(shape.num_layers, tokens + 1, shape.num_kv_heads, shape.k_head_dim, shape.v_head_dim,
                              config.max_running_requests, self.context_len, self.dtype, self.device)
        max_step_tokens = min(config.max_prefill_tokens, config.prefill_chunk or config.max_prefill_tokens,
                              self.context_len)
        if config.warm_up_at_start:
            with self._start_phase(f"prompt steps of {len(warm_up_sizes(max_step_tokens))} sizes run"):
                self._room_for(f"running the start's prompt steps of up to {max_step_tokens} tokens",
                               "lower EngineConfig.chunked_prefill_size or EngineConfig.max_prefill_tokens",
                               lambda: self.warm_up(max_step_tokens))
        max_bs = config.decode_graph_max_bs
        prompt_graph_tokens = min(config.cuda_graph_max_prefill_tokens, max_step_tokens)
        if config.tp_size > 1 and config.moe_dispatch == "all_to_all":  # it reads counts on the host above that
            max_bs, prompt_graph_tokens = min(max_bs, FIXED_MAX_TOKENS), min(prompt_graph_tokens, FIXED_MAX_TOKENS)
        self.graphs = self.prompt_graphs = None
        if config.use_cuda_graph:
            capture = GraphCapture(self.device)
            with self._start_phase(f"decode graphs to batch {max_bs} captured"):
                self.graphs = self._room_for(
                    f"capturing the decode CUDA graphs to batch {max_bs}",
                    "lower EngineConfig.cuda_graph_max_bs, or set EngineConfig.disable_cuda_graph",
                    lambda: CudaGraphs(self.logits, self.kv, max_bs, self.lora.slot_buffers, self.lora.max_rank,
                                       capture))
            if prompt_graph_tokens > 0:
                with self._start_phase(f"prompt graphs to {prompt_graph_tokens} tokens captured"):
                    self.prompt_graphs = self._room_for(
                        f"capturing the prompt CUDA graphs to {prompt_graph_tokens} tokens",
                        "lower EngineConfig.cuda_graph_max_prefill_tokens (0: prompt steps run eagerly)",
                        lambda: PromptGraphs(self.logits, self.kv, prompt_graph_tokens, self.lora.slot_buffers,
                                             self.lora.max_rank, capture))
        self.vocab_size = self.model.config.vocab_size
        self.penalties = PenaltyState(config.max_running_requests, self.vocab_size, self.device)
        self.profiler = StepProfiler(self.dist_state.rank, self.device)

    def wait_for(self, event: torch.cuda.Event) -> None:
        """The host waits for `event` (a step's device work); over several ranks at most dist_timeout
        (Workers.wait_for on rank 0, TimeoutError on the others)."""
        if self.workers is not None:
            self.workers.wait_for(event)
        elif self.dist_state.tp_size > 1:
            wait_event(event, self.dist_state.timeout)
        else:
            event.synchronize()

    def release_graphs(self, wait: bool = True) -> None:
        """Before leaving the world: wait for the device's work (wait_for, with its deadline over several ranks;
        not after a rank failed: its collectives may never end), then drop the CUDA graphs. NCCL cannot destroy a
        communicator whose collectives a live graph holds (it hangs: pytorch issue 115388). No step runs after."""
        if wait:
            self.wait_for_device()
        self.graphs = self.prompt_graphs = None

    def wait_for_device(self) -> None:
        """The host waits for the device's work queued so far (wait_for: at most dist_timeout over several ranks)."""
        if self.device.type == "cuda":
            with on_device(self.device):
                done = torch.cuda.Event()
                done.record()
            self.wait_for(done)

    @torch.inference_mode()
    def warm_up(self, max_tokens: int) -> None:
        """Run a prompt step of each of `warm_up_sizes(max_tokens)` tokens, without and with an adapter slot, so
        that Triton compiles every kernel variant a prompt step can pick now, not while serving: the kernels'
        tiles follow the number of tokens in classes (linear's by rows, fused_moe's by rows per expert and
        pairs; the row counts themselves are not specialised, kernels/__init__.py); a request that first
        brings a new class otherwise stalls every running request for the seconds of a compile. The steps
        write only slot 0, which no request ever holds, and record it in request row 0, as padded graph rows do.
        With an adapter slot, once with each rank bound a step can run with (the LoRA tile is a variant too).
        Under the all-to-all dispatch a rank's experts run the rows routed to it, any number up to the step's tokens,
        and the steps' prompts (one token repeated) all route alike: each size also runs on the experts alone.
        Then one decode step, for the decode attention kernels (of decode and mixed steps): the graph captures run
        them too, but not with the graphs off, nor past their sizes."""
        bounds = RankBounds(self.lora.slot_buffers, self.lora.max_rank)
        routed = self._routed_moe_shapes()
        for tokens in warm_up_sizes(max_tokens):
            for key in bounds.keys:
                slot = 0 if bounds.set(key) else -1
                batch = ForwardBatch.build(self.kv, [0], [[0] * tokens], [0], [0] * tokens, [tokens - 1],
                                           [slot] * tokens, 0)
                self.logits(batch)
                for moe in routed:
                    moe.run_experts_alone(tokens, slot)
        bounds.set(0)
        if max_tokens >= 1 and self.context_len >= 2:  # a row whose one cached token the prompt steps wrote
            self.logits(ForwardBatch.build(self.kv, [0], [[0]], [1], [0], [0], [-1], 1))

    def _routed_moe_shapes(self) -> list[MoE]:
        """One MoE layer of each shape among those whose experts run the rows the routing sends this rank
        (MoE.rows_follow_routing): the kernels' variants are the same in every layer of a shape."""
        layers = {}
        for moe in self.model.modules():
            if isinstance(moe, MoE) and moe.rows_follow_routing:
                layers.setdefault((moe.experts.w13.shape, moe.experts.w2.shape, moe.experts.lora is None), moe)
        return list(layers.values())

    def logits(self, batch: ForwardBatch) -> torch.Tensor:
        """Float32 logits of the rows batch.logits_indices; what CUDA graphs capture too."""
        return self.model.compute_logits(self.model(batch)[batch.logits_indices])

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch, lora_slots: list[int], pending: PendingTokens | None = None) -> StepResult:
        """One step: lora_slots[i] is request i's adapter slot (-1: none). The sampled tokens stay on the
        device (no host sync here, except for prompt log-probabilities). pending: where the tokens of
        decode rows whose last token is not on the host yet (overlap scheduling) are on the device."""
        inputs, rows = self._step_inputs(batch, lora_slots, pending)
        sampled_before = pending.token_ids if inputs.pending else None
        if self.workers is None:
            logits = self.execute(inputs, sampled_before)
        else:
            with self.workers.guard("a step"):
                self._send("step", inputs)
                logits = self.execute(inputs, sampled_before)
        prompt_logprobs, prompt_entries, sample_rows, sampled = {}, {}, [], []
        cursor = 0
        for i, (req, prefix, (num_prompt, num_rows)) in enumerate(zip(batch.reqs, batch.prefix_lens, rows)):
            if num_prompt and req.return_prompt_logprobs:
                prompt_logprobs[i] = logits[cursor:cursor + num_prompt].log_softmax(-1).cpu()
            elif num_prompt:
                prompt_entries[i] = (prefix, *_prompt_entries(logits[cursor:cursor + num_prompt], req, prefix))
            if batch.completes[i]:
                sample_rows.append(cursor + num_rows - 1)
                sampled.append(req)
            # its first piece since it was (re)admitted, after the cached prefix it took if any: (re)starts on its row
            if prefix == req.cached_len and req.params.has_penalties:
                self.penalties.reset(req.row, req.prompt_ids, req.output_ids)
            cursor += num_rows
        tokens = None
        if sampled:
            sampling = self._sampling_batch(sampled)
            num_top = max(r.params.logprobs or 0 for r in sampled)
            # (a list index would be copied to the device blocking: the host would wait for the step)
            tokens = sample(logits[to_device(sample_rows, torch.int64, self.device)], sampling, num_top)
            if sampling.penalties is not None:
                self.penalties.count(sampling.penalties.state_rows, tokens.token_ids[sampling.penalties.rows])
        return StepResult(sampled, tokens, prompt_logprobs, prompt_entries)

    @torch.inference_mode()
    def execute(self, inputs: StepInputs, sampled_before: torch.Tensor | None = None) -> torch.Tensor:
        """The step's logits (every rank runs it; a view of a graph's output: use before the next step).
        sampled_before: on rank 0, the previous step's sampled tokens (on the device) when inputs.pending; the
        other ranks get them from rank 0 here, over the model's group, in stream order after that step."""
        forward_batch = ForwardBatch.build(self.kv, inputs.rows, inputs.new_tokens, inputs.prefix_lens,
                                           inputs.out_cache_loc, inputs.logits_indices, inputs.token_slots,
                                           inputs.num_decode, inputs.cached_prefixes)
        if inputs.pending:
            if sampled_before is None:
                sampled_before = torch.empty(inputs.num_sampled, dtype=torch.int64, device=self.device)
            broadcast(self.dist_state, sampled_before)
            at, source = (to_device(list(i), torch.int64, self.device) for i in zip(*inputs.pending))
            forward_batch.input_ids[at] = sampled_before[source]  # one gather on the device
        if self.graphs is not None and self.graphs.can_run(forward_batch):
            return self.graphs.replay(forward_batch)
        if self.prompt_graphs is not None and (size := self.prompt_graphs.size(forward_batch)) is not None:
            return self.prompt_graphs.replay(forward_batch, size)
        return self.logits(forward_batch)

    def weight_bytes(self) -> int:
        """The model's parameters on this rank."""
        return sum(p.numel() * p.element_size() for p in self.model.parameters())

    def start_profile(self, directory: Path, stem: str) -> None:
        """Every rank records from now on (engine/profiler.py), rank 0 first: one that cannot start leaves no other
        rank recording."""
        self.profiler.start(directory, stem)
        if self.workers is not None:
            try:
                with self.workers.guard("starting a profile"):
                    self._send("profile", ("start", str(directory), stem))
                    self.workers.barrier()
            except BaseException:
                self.profiler.abandon()
                raise

    def stop_profile(self) -> Path:
        """Every rank waits for its device's work, then writes its trace and summary (profile_files), all at once;
        returns once all have, with rank 0's trace. Rank 0's that cannot be written stops the others' all the same."""
        self.profiler.check_thread()
        self.wait_for_device()
        if self.workers is None:
            return self.profiler.stop()[0]
        sent = False
        try:
            with self.workers.guard("writing the profile"):
                self._send("profile", ("stop",))
            sent = True
            return self.profiler.stop()[0]
        finally:
            self.profiler.abandon()  # a failed send: rank 0 records no more either
            if sent:
                with self.workers.guard("writing the profile"):
                    # the traces take a while to write, as long as their events are many: a long profile's, minutes
                    self.workers.barrier(PROFILE_WRITE_TIMEOUT_FACTOR * self.workers.timeout)

    def sync_lora(self, wait: float = 0.0) -> None:
        """Make the other ranks' adapters what rank 0's are now (after load_lora / unload_lora, or to start their reads
        for prefetch at once), and learn how far their reads for rank 0 got, each rank waiting up to `wait` seconds
        for one to finish."""
        if self.workers is not None:
            with self.workers.guard("changing adapters"):
                self._send("lora", wait=wait)
                self.workers.barrier()

    def _send(self, kind: str, *args: object, wait: float = 0.0) -> None:
        """Send the other ranks a command with rank 0's adapter events; where those poll the other ranks' reads of
        adapters (LoRAManager.take_events), every rank answers at once (_serve_commands)."""
        self.workers.send((kind, self.lora.take_events(wait), *args))
        if self.lora.polled:
            answer = min_over_ranks(self.workers.state, [READ_DONE] * len(self.lora.polled), self.workers.timeout)
            self.lora.others_read(answer)

    def _sampling_batch(self, reqs: list[Req]) -> SamplingBatch:
        """The sampling options of the requests, with their penalties and token masks. The grammars'
        bitmasks are filled on the host while the device runs the step's forward."""
        masked = [i for i, r in enumerate(reqs) if r.masked]
        stops = [r.detokenizer.stop_token_ids if r.num_generated < r.params.min_tokens else () for r in reqs]
        bitmask = torch.full((len(masked), -(-self.vocab_size // 32)), -1, dtype=torch.int32)
        for j, i in enumerate(masked):
            if reqs[i].grammar is not None:
                reqs[i].grammar.fill_next_token_bitmask(bitmask, j)
            if reqs[i].allowed_tokens is not None:
                bitmask[j] &= reqs[i].allowed_tokens
            # min_tokens in the mask, where it leaves a token: a grammar that allows only its end wins
            bitmask[j], stops[i] = hold_back(bitmask[j], stops[i]), ()
        params = [r.params for r in reqs]
        sampling = SamplingBatch.build(params, [r.seed for r in reqs], [r.num_generated for r in reqs], self.device,
                                       stops, [r.logit_bias for r in reqs])
        if masked:
            sampling.token_mask = TokenMask(to_device(masked, torch.int64, self.device),
                                            to_device(bitmask, torch.int32, self.device))
        penalised = [i for i, p in enumerate(params) if p.has_penalties]
        if penalised:
            sampling.penalties = self.penalties.gather(penalised, [reqs[i].row for i in penalised],
                                                       [params[i] for i in penalised])
        return sampling

    def _step_inputs(self, batch: ScheduledBatch, lora_slots: list[int], pending: PendingTokens | None
                     ) -> tuple[StepInputs, list[tuple[int, int]]]:
        """The step's inputs, and per request (prompt tokens whose logits it returns, logits rows)."""
        new_tokens, token_slots, logits_indices, rows, pending_rows, cached = [], [], [], [], [], []
        start = 0
        for req, prefix, n, done, slot in zip(batch.reqs, batch.prefix_lens, batch.extend_lens, batch.completes,
                                              lora_slots):
            if prefix and prefix == req.cached_len:  # its first step since it took a cached prefix: into its row
                cached.append((req.row, req.kv_slots[:prefix]))
            if req.num_pending:  # a decode row whose token is still on the device: filled in by run
                pending_rows.append((start, pending.rows[req]))
                new_tokens.append([0])
            else:
                new_tokens.append(req.token_ids(prefix, prefix + n))
            token_slots += [slot] * n
            wants_prompt = req.return_prompt_logprobs or req.params.prompt_logprobs is not None
            num_prompt = min(n, max(len(req.prompt_ids) - prefix, 0)) if wants_prompt else 0
            own = list(range(start, start + num_prompt)) + ([start + n - 1] if done and num_prompt < n else [])
            logits_indices += own
            rows.append((num_prompt, len(own)))
            start += n
        num_sampled = pending.token_ids.shape[0] if pending is not None else 0
        return StepInputs([r.row for r in batch.reqs], new_tokens, list(batch.prefix_lens), batch.out_slots,
                          logits_indices, token_slots, batch.num_decode, pending_rows, num_sampled, cached), rows

    def _check_slot_memory(self, num_bytes: int, rank: int) -> None:
        """ValueError unless LoRA slot buffers of num_bytes (slots of `rank`) fit in the memory this rank's device has
        free: a request for more was an allocation error's traceback, or a process the out-of-memory killer ended."""
        if self.device.type == "cpu":
            available, where = _host_memory_available(), "host"
            if available is not None:  # the ranks of a node allocate theirs at once
                available //= len(node_ranks(self.config))
        else:
            available, where = torch.cuda.mem_get_info(self.device)[0], "GPU"
        if available is not None and num_bytes > available:
            raise ValueError(f"the LoRA slots need {num_bytes / 2**30:.2f} GiB (EngineConfig.max_loras_per_batch "
                             f"{self.config.max_loras_per_batch} of EngineConfig.max_lora_rank {rank}); "
                             f"{available / 2**30:.2f} GiB of {where} memory is available")

    def _kv_tokens(self, bytes_per_token: int, context: int) -> int:
        """KV token slots: max_total_tokens when given (on GPUs it must fit in free memory), else on CPU
        CPU_KV_TOKENS and on GPUs what is left of mem_fraction_static of the memory after weights, LoRA
        slots and req_to_token."""
        req_to_token = self.config.max_running_requests * context * 4
        if self.device.type == "cpu":
            tokens = self.config.max_total_tokens or CPU_KV_TOKENS
            # the ranks of a node allocate theirs at once, each from what is available to all
            available, ranks = _host_memory_available(), len(node_ranks(self.config))
            if available is not None and tokens * bytes_per_token + req_to_token > available // ranks:
                raise ValueError(f"the KV cache of {tokens} tokens (max_total_tokens) needs "
                                 f"{tokens * bytes_per_token / 2**30:.2f} GiB and the rows of max_running_requests="
                                 f"{self.config.max_running_requests} x {context} tokens {req_to_token / 2**30:.2f} "
                                 f"GiB; {available / 2**30:.2f} GiB of host memory is available"
                                 + (f", to {ranks} ranks of this node" if ranks > 1 else ""))
            return tokens
        free, total = torch.cuda.mem_get_info(self.device)
        if self.config.max_total_tokens:
            if self.config.max_total_tokens * bytes_per_token + req_to_token > free:
                raise ValueError(f"max_total_tokens={self.config.max_total_tokens} needs "
                                 f"{self.config.max_total_tokens * bytes_per_token / 2**30:.2f} GiB of KV cache; "
                                 f"{free / 2**30:.2f} GiB of GPU memory is free")
            return self.config.max_total_tokens
        budget = total * self.config.mem_fraction_static - (total - free) - req_to_token
        tokens = int(budget // bytes_per_token)
        if tokens < 3:
            raise ValueError(f"no GPU memory left for the KV cache ({budget / 2**30:.2f} GiB of mem_fraction_static="
                             f"{self.config.mem_fraction_static} after weights and LoRA slots): raise mem_fraction_static, "
                             "or lower max_loras_per_batch, max_lora_rank or max_running_requests")
        return tokens


def _positions(model_config: ModelConfig) -> int:
    """The longest context the model serves as configured: max_position_embeddings, or a RoPE scaling's factor times
    its original positions where that is more (as vLLM derives max_model_len)."""
    rope = model_config.rope_parameters or {}
    factor = rope.get("factor") if rope.get("rope_type", "default") not in ("default", "llama3") else None
    scaled = int(factor * rope.get("original_max_position_embeddings", model_config.max_position_embeddings)) \
        if factor else 0
    return max(model_config.max_position_embeddings, scaled)


def _host_memory_available() -> int | None:
    """Bytes of host memory available for new allocations: Linux's MemAvailable, or what this process's cgroup (v2)
    allows where that is less (memory.max less memory.current: a container's limit); None where unknown."""
    available = None
    try:
        with open(MEMINFO) as f:
            available = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError, IndexError):
        pass
    try:
        line = next(line for line in Path(CGROUP_OF_PROCESS).read_text().splitlines() if line.startswith("0::"))
        group = Path(CGROUP_ROOT, line[3:].lstrip("/"))
        limit = (group / "memory.max").read_text().strip()
        if limit != "max":
            left = int(limit) - int((group / "memory.current").read_text())
            available = left if available is None else min(available, left)
    except (OSError, ValueError, StopIteration):  # no cgroup v2 (v1, another OS), or no limit files
        pass
    return available


def serve_rank(rank: int, config: EngineConfig, init_method: str) -> None:
    """A rank other than 0: load its share of the model, then run what rank 0 sends until it says stop."""
    share_node_cores(config)
    with parallel_state(join_world(config, rank, init_method)) as state:
        runner = ModelRunner(node_config(config, rank))
    control_barrier(state, config.dist_timeout)  # loaded: rank 0's Engine waits for every rank's (Workers.barrier)
    # the model's, kernels' and graphs' objects live as long as the rank: out of the cyclic collector's scans, whose
    # full collections would pause this rank's steps, and every rank's collectives with them (as `moelora serve`
    # freezes rank 0's); collectable again for the interpreter's exit (cli.serve says why)
    gc.collect()
    gc.freeze()
    try:
        _serve_commands(state, runner, config)
    finally:
        gc.unfreeze()


def _serve_commands(state: ParallelState, runner: ModelRunner, config: EngineConfig) -> None:
    """serve_rank's loop: what rank 0 sends, until it says stop."""
    while True:
        kind, *args = broadcast_object(state)
        if kind == "shutdown":
            # rank 0's Workers.shutdown: no rank leaves the world while another still reads the command
            try:
                control_barrier(state, config.dist_timeout)
            except Exception:  # rank 0 gave up on a rank that hangs: leave all the same, waiting for no one
                runner.release_graphs(wait=False)
                destroy_parallel(abort=True)
                return
            break
        status = runner.lora.replay(args[0])
        if status is not None:  # rank 0's poll of this rank's adapter reads (ModelRunner._send)
            min_over_ranks(state, status, config.dist_timeout)
        if kind == "step":
            runner.execute(args[1])
            continue
        if kind == "profile":
            _profile_command(runner, *args[1])
            control_barrier(state, PROFILE_WRITE_TIMEOUT_FACTOR * config.dist_timeout)  # ModelRunner.stop_profile's
            continue
        control_barrier(state, config.dist_timeout)  # rank 0's Workers.barrier
    runner.profiler.abandon()
    runner.release_graphs()
    destroy_parallel()


def _profile_command(runner: ModelRunner, action: str, *where: str) -> None:
    """A rank's part of start_profile / stop_profile. A profile that fails here (a directory this node cannot write)
    is logged and left out: rank 0's stop_profile names the missing files, and the rank serves on."""
    try:
        if action == "start":
            runner.profiler.start(Path(where[0]), where[1])
        else:
            runner.wait_for_device()
            runner.profiler.stop()
    except Exception:
        logger.exception("rank %d could not %s its profile", runner.dist_state.rank, action)
        runner.profiler.abandon()


def on_device(device: torch.device) -> contextlib.AbstractContextManager:
    """device the current CUDA device inside (the calling thread's is restored after): Triton launches, CUDA graph
    captures and new streams go to the current device, whatever their tensors'. A server's engine thread starts on
    device 0."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def _indexed(device: torch.device) -> torch.device:
    """cuda -> cuda:N, N the current device (where torch puts a tensor of "cuda"), so that the engine's device stays
    the same whatever thread, with whatever current device, runs its steps."""
    return torch.device("cuda", torch.cuda.current_device()) if device.type == "cuda" and device.index is None \
        else device


def _prompt_entries(logits: torch.Tensor, req: Req, prefix: int) -> tuple[list[dict[int, float]], list[int]]:
    """logits [n, vocab] of prompt positions prefix.. -> the entry of each prompt token they predict
    (the last prompt position predicts the output: none): its log-probability, then the top k; and its rank (1 + the
    tokens of higher log-probability)."""
    targets = req.prompt_ids[prefix + 1:prefix + 1 + logits.shape[0]]
    if not targets:
        return [], []
    log_probs = logits[:len(targets)].float().log_softmax(-1)
    chosen = log_probs.gather(1, torch.tensor(targets, device=logits.device)[:, None])
    ranks = ((log_probs > chosen).sum(-1) + 1).tolist()
    chosen = chosen[:, 0].tolist()
    top_ids = top_values = [[] for _ in targets]
    if req.params.prompt_logprobs:
        top = log_probs.topk(req.params.prompt_logprobs, dim=-1)
        top_ids, top_values = top.indices.tolist(), top.values.tolist()
    return ([{t: lp, **dict(zip(ids, values))} for t, lp, ids, values in zip(targets, chosen, top_ids, top_values)],
            ranks)
