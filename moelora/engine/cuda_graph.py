"""Decode steps replayed from CUDA graphs, captured once at start on static input buffers: one
graph per padded batch size (1, 2, 4, 8, then every 8 up to cuda_graph_max_bs), with and without
LoRA. A batch runs in the graph of the next size up; its padded rows read token 0 at position 0,
write their key and value to slot 0 (never handed out) and use no adapter, so real rows see nothing
of them. The experts' LoRA rank tile is baked into the graphs at the slots' full rank."""
from __future__ import annotations

from collections.abc import Callable

import torch

from moelora.core import ExpertLoRASlots, ForwardBatch, KVCache, LoRABatch


class CudaGraphs:
    def __init__(self, logits: Callable[[ForwardBatch], torch.Tensor], kv: KVCache, max_bs: int,
                 expert_loras: list[ExpertLoRASlots], lora_rank: int):
        """logits(batch): the step the graphs capture; lora_rank: the slots' rank (0: no LoRA graphs)."""
        self.logits, self.kv, self.max_bs = logits, kv, max_bs
        self.sizes = sorted({s for s in (1, 2, 4, 8, *range(16, self.max_bs, 8), self.max_bs) if s <= self.max_bs})
        n, device = self.max_bs, kv.req_to_token.device
        # static inputs: the graphs read these addresses, so they live as long as the graphs
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.req_pool_indices = torch.zeros(n, dtype=torch.int32, device=device)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.out_cache_loc = torch.zeros(n, dtype=torch.int64, device=device)
        self.token_slots = torch.full((n,), -1, dtype=torch.int32, device=device)
        self.ones = torch.ones(n, dtype=torch.int32, device=device)
        self.arange = torch.arange(n, dtype=torch.int32, device=device)
        self.arange64 = torch.arange(n, dtype=torch.int64, device=device)
        self.graphs: dict[tuple[int, bool], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        for expert_lora in expert_loras:
            expert_lora.max_rank_in_use = lora_rank
        pool = torch.cuda.graph_pool_handle()
        with torch.inference_mode():
            for bs in reversed(self.sizes):  # largest first: the smaller graphs reuse its memory
                for with_lora in (False, True) if lora_rank else (False,):
                    self.graphs[bs, with_lora] = self._capture(bs, with_lora, pool)

    def can_run(self, batch: ForwardBatch) -> bool:
        return batch.is_decode and batch.batch_size <= self.max_bs

    def replay(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits [bs, vocab] of a decode batch (a view of the graph's output: use before the next step)."""
        bs = batch.batch_size
        padded = next(s for s in self.sizes if s >= bs)
        inputs = [(self.input_ids, batch.input_ids, 0), (self.positions, batch.positions, 0),
                  (self.req_pool_indices, batch.req_pool_indices, 0), (self.seq_lens, batch.seq_lens, 1),
                  (self.out_cache_loc, batch.out_cache_loc, 0)]
        if batch.lora is not None:
            inputs.append((self.token_slots, batch.lora.token_slots, -1))
        for buf, value, pad in inputs:  # pad: what padded rows read
            buf[:bs].copy_(value)
            buf[bs:padded].fill_(pad)
        graph, logits = self.graphs[padded, batch.lora is not None]
        graph.replay()
        return logits[:bs]

    def _batch(self, bs: int, with_lora: bool) -> ForwardBatch:
        return ForwardBatch(
            input_ids=self.input_ids[:bs], positions=self.positions[:bs], req_pool_indices=self.req_pool_indices[:bs],
            seq_lens=self.seq_lens[:bs], extend_lens=self.ones[:bs], extend_starts=self.arange[:bs],
            out_cache_loc=self.out_cache_loc[:bs], logits_indices=self.arange64[:bs], kv=self.kv,
            lora=LoRABatch(self.token_slots[:bs]) if with_lora else None, num_decode=bs, max_extend_len=1)

    def _capture(self, bs: int, with_lora: bool, pool) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        # warm up on a side stream, as torch.cuda.graphs asks: Triton compiles outside the capture
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                self.logits(self._batch(bs, with_lora))
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            # a batch of its own: what a step derives once from the slots (LoRABatch.derived) is then in the graph
            logits = self.logits(self._batch(bs, with_lora))
        return graph, logits
