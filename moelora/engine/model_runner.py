"""Runs scheduled batches through the model: loads it, sizes the KV cache, builds each step's
ForwardBatch, runs the model (decode steps from CUDA graphs where captured) and samples."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from moelora.core import ForwardBatch, KVCache
from moelora.engine.config import CPU_KV_TOKENS, DTYPES, EngineConfig
from moelora.engine.cuda_graph import CudaGraphs
from moelora.engine.lora_manager import LoRAManager
from moelora.engine.request import Req
from moelora.engine.sampler import SampleOutput, SamplingBatch, sample
from moelora.engine.scheduler import ScheduledBatch
from moelora.models.config import ModelConfig
from moelora.models.loader import load_model


@dataclass
class StepResult:
    sampled: list[Req]                      # requests that got a new token, in batch order
    tokens: SampleOutput | None             # one row per sampled request
    prompt_logprobs: dict[int, torch.Tensor]  # batch index -> [new prompt tokens, vocab] float32, on the host


class ModelRunner:
    def __init__(self, config: EngineConfig):
        self.config, self.device = config, config.torch_device
        if not (Path(config.model_path) / "config.json").is_file():
            raise ValueError(f"EngineConfig.model_path {config.model_path!r} is not a local model directory (it has no "
                             "config.json); moelora reads local Hugging Face checkpoints, not Hub ids")
        model_config = ModelConfig.from_pretrained(config.model_path, moe_backend=config.moe_runner_backend)
        self.dtype = DTYPES[config.dtype] if config.dtype != "auto" else model_config.saved_dtype or torch.float32
        self.model = load_model(config.model_path, self.dtype, self.device, config.load_format, config.random_seed,
                                model_config)
        self.lora = LoRAManager(config, self.model)  # slots first: the KV cache gets what memory is left
        context = config.context_length or model_config.max_position_embeddings
        shape = self.model.kv_cache_shape
        tokens = self._kv_tokens(shape.bytes_per_token(self.dtype), context)
        # a request alone always fits, with a slot to spare for the scheduler's decode reserve
        self.context_len = min(context, tokens - 1)
        self.kv = KVCache(shape.num_layers, tokens + 1, shape.num_kv_heads, shape.k_head_dim, shape.v_head_dim,
                          config.max_running_requests, self.context_len, self.dtype, self.device)
        max_bs = min(config.cuda_graph_max_bs, config.max_running_requests)
        self.graphs = (CudaGraphs(self.logits, self.kv, max_bs, self.lora.expert_loras, self.lora.max_rank)
                       if config.use_cuda_graph else None)

    def logits(self, batch: ForwardBatch) -> torch.Tensor:
        """Float32 logits of the rows batch.logits_indices; what CUDA graphs capture too."""
        return self.model.compute_logits(self.model(batch)[batch.logits_indices])

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch, lora_slots: list[int]) -> StepResult:
        """One step: lora_slots[i] is request i's adapter slot (-1: none)."""
        forward_batch, rows = self._forward_batch(batch, lora_slots)
        if self.graphs is not None and self.graphs.can_run(forward_batch):
            logits = self.graphs.replay(forward_batch)
        else:
            logits = self.logits(forward_batch)
        prompt_logprobs, sample_rows, sampled = {}, [], []
        cursor = 0
        for i, (req, (num_prompt, num_rows)) in enumerate(zip(batch.reqs, rows)):
            if num_prompt:
                prompt_logprobs[i] = logits[cursor:cursor + num_prompt].log_softmax(-1).cpu()
            if batch.completes[i]:
                sample_rows.append(cursor + num_rows - 1)
                sampled.append(req)
            cursor += num_rows
        tokens = None
        if sampled:
            sampling = SamplingBatch.build([r.params for r in sampled], [r.seed for r in sampled],
                                           [len(r.output_ids) for r in sampled], self.device)
            num_top = max(r.params.logprobs or 0 for r in sampled)
            tokens = sample(logits[sample_rows], sampling, num_top)
        return StepResult(sampled, tokens, prompt_logprobs)

    def _forward_batch(self, batch: ScheduledBatch, lora_slots: list[int]) -> tuple[ForwardBatch, list[tuple[int, int]]]:
        """The step's ForwardBatch, and per request (prompt tokens whose logits it returns, logits rows)."""
        new_tokens, token_slots, logits_indices, rows = [], [], [], []
        start = 0
        for req, prefix, n, done, slot in zip(batch.reqs, batch.prefix_lens, batch.extend_lens, batch.completes,
                                              lora_slots):
            new_tokens.append(req.token_ids(prefix, prefix + n))
            token_slots += [slot] * n
            num_prompt = min(n, max(len(req.prompt_ids) - prefix, 0)) if req.return_prompt_logprobs else 0
            own = list(range(start, start + num_prompt)) + ([start + n - 1] if done and num_prompt < n else [])
            logits_indices += own
            rows.append((num_prompt, len(own)))
            start += n
        return ForwardBatch.build(self.kv, [r.row for r in batch.reqs], new_tokens, batch.prefix_lens, batch.out_slots,
                                  logits_indices, token_slots, batch.is_decode), rows

    def _kv_tokens(self, bytes_per_token: int, context: int) -> int:
        """KV token slots: max_total_tokens when given (on GPUs it must fit in free memory), else on CPU
        CPU_KV_TOKENS and on GPUs what is left of mem_fraction_static of the memory after weights, LoRA
        slots and req_to_token."""
        if self.device.type == "cpu":
            return self.config.max_total_tokens or CPU_KV_TOKENS
        free, total = torch.cuda.mem_get_info(self.device)
        req_to_token = self.config.max_running_requests * context * 4
        if self.config.max_total_tokens:
            if self.config.max_total_tokens * bytes_per_token + req_to_token > free:
                raise ValueError(f"max_total_tokens={self.config.max_total_tokens} needs "
                                 f"{self.config.max_total_tokens * bytes_per_token / 2**30:.2f} GiB of KV cache; "
                                 f"{free / 2**30:.2f} GiB of GPU memory is free")
            return self.config.max_total_tokens
        budget = total * self.config.mem_fraction_static - (total - free) - req_to_token
        tokens = int(budget // bytes_per_token)
        if tokens < 2:
            raise ValueError(f"no GPU memory left for the KV cache ({budget / 2**30:.2f} GiB of mem_fraction_static="
                             f"{self.config.mem_fraction_static} after weights and LoRA slots): raise mem_fraction_static, "
                             "or lower max_loras_per_batch, max_lora_rank or max_running_requests")
        return tokens
