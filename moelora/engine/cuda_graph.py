"""Steps replayed from CUDA graphs, captured once at start on static input buffers, with and without LoRA.

Decode steps (`CudaGraphs`): one graph per padded batch size (decode_graph_sizes: 1, 2, 4, then every 8 up to
256 and every 16 past it, up to cuda_graph_max_bs). A batch runs in the graph of the next size up; its padded
rows read token 0 at position 0, write their key and value to slot 0 (never handed out) and use no adapter, so
real rows see nothing of them. Eager, a decode step spends about as long queueing its kernels as a prompt step
(below), longer than the device takes at any batch the graphs cover.

Prompt steps (`PromptGraphs`): steps of prompt pieces only, up to cuda_graph_max_prefill_tokens new tokens.
Eager, such a step spends 45-60 ms queueing its ~700 kernels, longer than the device takes to run them up to
~2000 tokens: every newcomer's time to first token, and in a server time the running requests wait (the
engine thread shares the GIL with the event loop there, so the launches take longer still). One graph per
padded token count (64, 128, ..., 1024, 1536, 2048, 3072, ...), for fewer than PROMPT_ROWS sequences
(PaddedPrompt says how a step is padded).

A graph bakes in the LoRA layers' rank tile, so with LoRA there is one for each rank bound a step can run with
(lora_tiles.step_rank_bounds: the smallest tile's and the slots' rank), and a step replays the one that
LoRAManager.prepare set for its adapters."""
from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable, Iterator

import torch

from moelora.core import ExpertLoRASlots, ForwardBatch, KVCache, LinearLoRASlots, LoRABatch
from moelora.kernels.lora_tiles import step_rank_bounds

PROMPT_ROWS = 64  # sequences (real ones, the padding one, empty ones) of a prompt graph with at least as many tokens
Logits = Callable[[ForwardBatch], torch.Tensor]


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """No cyclic garbage collection while graphs are captured, what was garbage before collected first: a collection
    during a capture may destroy another engine's CUDA graphs (or free what their steps used), which a capture does not
    permit: it fails ("operation failed due to a previous error during capture"). torch.cuda.graph collects before a
    capture only where torch.compiler.config.force_cudagraph_gc says so."""
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


class GraphCapture:
    """The capture of all an engine's graphs, decode and prompt alike: one private memory pool and one side stream.

    A graph's scratch memory stays in its pool as long as the graph lives, and a later capture reuses what an earlier
    one freed only when it allocates on the same stream (the caching allocator keys free blocks by stream): with a
    stream per capture (torch hands out 32 in turn) the pool kept the scratch of 32 graphs, not of one. Graphs of
    one pool never run at once (they replay on one stream, one step at a time) and leave nothing in it between
    replays (each copies its output into a buffer outside), so the sets share it too: it holds about the largest
    decode graph's scratch and the largest prompt graph's (the decode graphs, captured first, keep theirs).
    Captures run with `device` current (the engine's start runs on its device)."""

    def __init__(self, device: torch.device):
        self.pool = torch.cuda.graph_pool_handle()
        # a stream of the engine's own: torch.cuda.graph's default capture stream is one per process, made on the
        # device current at its first use, so a second engine on another device would capture (and Triton launch) on
        # the first one's
        self.stream = torch.cuda.Stream(device)

    def __call__(self, run: Callable[[], torch.Tensor]) -> torch.cuda.CUDAGraph:
        """The graph of run(), which copies its output into a buffer of the caller's. run builds its batch itself:
        what a step derives once from its inputs (ForwardBatch.derived, LoRABatch.derived) is then inside the graph."""
        # warm up on the side stream, as torch.cuda.graphs asks: Triton compiles outside the capture
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            for _ in range(2):
                run()
        torch.cuda.current_stream().wait_stream(self.stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, stream=self.stream):
            run()
        return graph


class RankBounds:
    """The graphs' keys beside their size: 0 for a step without LoRA, else the rank bound its LoRA layers run with."""

    def __init__(self, slot_buffers: list[LinearLoRASlots | ExpertLoRASlots], lora_rank: int):
        """slot_buffers: every LoRA layer's; lora_rank: the slots' rank (0: no LoRA graphs)."""
        self.slot_buffers, self.lora_rank = slot_buffers, lora_rank
        self.keys = [0, *(step_rank_bounds(lora_rank) if slot_buffers else [lora_rank] if lora_rank else [])]

    def set(self, key: int) -> bool:
        """Make the layers run with the key's rank bound (for a capture); whether the key is a LoRA step's."""
        for lora in self.slot_buffers:
            lora.max_rank_in_use = key or self.lora_rank
        return key > 0

    def key(self, batch: ForwardBatch) -> int:
        """The key of the graph the step replays."""
        if batch.lora is None:
            return 0
        return (self.slot_buffers[0].max_rank_in_use or self.lora_rank) if self.slot_buffers else self.lora_rank


def decode_graph_sizes(max_bs: int) -> list[int]:
    """The padded batch sizes of the decode graphs up to max_bs: 1, 2, 4, every 8 up to 256, every 16 past it (as
    vLLM's), then max_bs. Past a few rows a decode step's time grows slowly with its batch, so padding costs little."""
    steps = (1, 2, 4, *range(8, 256, 8), *range(256, max_bs, 16))
    return sorted({s for s in steps if s < max_bs} | {max_bs})


class CudaGraphs:
    def __init__(self, logits: Logits, kv: KVCache, max_bs: int, slot_buffers: list[LinearLoRASlots | ExpertLoRASlots],
                 lora_rank: int, capture: GraphCapture):
        """logits(batch): the step the graphs capture; lora_rank: the slots' rank (0: no LoRA graphs)."""
        self.logits, self.kv, self.max_bs = logits, kv, max_bs
        self.bounds = RankBounds(slot_buffers, lora_rank)
        self.sizes = decode_graph_sizes(max_bs)
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
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        with torch.inference_mode(), collector_paused():
            # one output for every graph, each copying its logits there: a graph's own would hold memory per graph
            probe = self.logits(self._batch(1, False))
            self.out = probe.new_empty(n, *probe.shape[1:])
            for bs in reversed(self.sizes):  # largest first: the smaller graphs reuse its memory
                for key in self.bounds.keys:
                    with_lora = self.bounds.set(key)

                    def run(bs: int = bs, with_lora: bool = with_lora) -> torch.Tensor:
                        return self.out[:bs].copy_(self.logits(self._batch(bs, with_lora)))
                    self.graphs[bs, key] = capture(run)
        self.bounds.set(0)

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
        self.graphs[padded, self.bounds.key(batch)].replay()
        return self.out[:bs]

    def _batch(self, bs: int, with_lora: bool) -> ForwardBatch:
        return ForwardBatch(
            input_ids=self.input_ids[:bs], positions=self.positions[:bs], req_pool_indices=self.req_pool_indices[:bs],
            seq_lens=self.seq_lens[:bs], extend_lens=self.ones[:bs], extend_starts=self.arange[:bs],
            out_cache_loc=self.out_cache_loc[:bs], logits_indices=self.arange64[:bs], kv=self.kv,
            lora=LoRABatch(self.token_slots[:bs]) if with_lora else None, num_decode=bs)


def prompt_graph_sizes(max_tokens: int) -> list[int]:
    """The padded token counts of the prompt graphs below max_tokens, then max_tokens: doubling from 64 to 1024,
    then 1.5 and 2 times each power of two (1536, 2048, 3072, 4096, ...), so that above 1024 tokens, where the
    device's work grows with the tokens, padding adds at most half."""
    sizes = {64 << i for i in range(5)} | {s << i for s in (1536, 2048) for i in range(max(max_tokens, 1).bit_length())}
    return [*sorted(s for s in sizes if s < max_tokens), max_tokens]


class PaddedPrompt:
    """Static input buffers of the prompt graphs, and a prompt step padded into them. A step of T tokens in S
    sequences becomes one of `size` tokens in rows(size) sequences: the size - T padding tokens form sequence
    S, of request row 0 (never a request's) at positions 0.., writing their keys and values to slot 0 (never
    handed out) with no adapter, so every row the layers see holds finite values computed apart from the real
    ones; the sequences after it are empty (no new tokens, no keys), and the logits rows past the step's read
    row 0."""

    def __init__(self, kv: KVCache, max_tokens: int):
        device = kv.req_to_token.device
        self.kv, rows = kv, self.rows(max_tokens)
        self.input_ids = torch.zeros(max_tokens, dtype=torch.int64, device=device)
        self.positions = torch.zeros(max_tokens, dtype=torch.int64, device=device)
        self.out_cache_loc = torch.zeros(max_tokens, dtype=torch.int64, device=device)
        self.token_slots = torch.full((max_tokens,), -1, dtype=torch.int32, device=device)
        self.arange = torch.arange(max_tokens, dtype=torch.int64, device=device)
        self.req_pool_indices = torch.zeros(rows, dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(rows, dtype=torch.int32, device=device)
        self.extend_lens = torch.zeros(rows, dtype=torch.int32, device=device)
        self.extend_starts = torch.zeros(rows, dtype=torch.int32, device=device)
        self.logits_indices = torch.zeros(rows, dtype=torch.int64, device=device)

    @staticmethod
    def rows(size: int) -> int:
        return min(size, PROMPT_ROWS)

    def fits(self, batch: ForwardBatch, size: int) -> bool:
        """The step pads to `size` tokens: prompt pieces only, at most size tokens, a row to spare for the padding
        sequence, a logits row for each of its own."""
        rows = self.rows(size)
        return (batch.num_decode == 0 and batch.num_tokens <= size and batch.batch_size < rows
                and batch.logits_indices.shape[0] <= rows)

    def batch(self, size: int, with_lora: bool) -> ForwardBatch:
        """The padded step of `size` tokens on the buffers (as they are filled)."""
        rows = self.rows(size)
        return ForwardBatch(
            input_ids=self.input_ids[:size], positions=self.positions[:size],
            req_pool_indices=self.req_pool_indices[:rows], seq_lens=self.seq_lens[:rows],
            extend_lens=self.extend_lens[:rows], extend_starts=self.extend_starts[:rows],
            out_cache_loc=self.out_cache_loc[:size], logits_indices=self.logits_indices[:rows], kv=self.kv,
            lora=LoRABatch(self.token_slots[:size]) if with_lora else None, num_decode=0)

    def fill(self, batch: ForwardBatch | None, size: int) -> None:
        """Copy the step into the buffers, padded to `size` tokens (fits(batch, size)); None: a step of padding
        only (what captures run). Device copies and fills, no sync."""
        def given(name: str) -> torch.Tensor | None:
            return getattr(batch, name) if batch is not None else None

        slots = batch.lora.token_slots if batch is not None and batch.lora is not None else None
        tokens, seqs, outs = (batch.num_tokens, batch.batch_size, batch.logits_indices.shape[0]) if batch is not None \
            else (0, 0, 0)
        rows, pad = self.rows(size), size - tokens
        for buf, value, count, end, fill in (
                (self.input_ids, given("input_ids"), tokens, size, 0),
                (self.out_cache_loc, given("out_cache_loc"), tokens, size, 0), (self.token_slots, slots, tokens, size, -1),
                (self.req_pool_indices, given("req_pool_indices"), seqs, rows, 0),
                (self.seq_lens, given("seq_lens"), seqs, rows, 0), (self.extend_lens, given("extend_lens"), seqs, rows, 0),
                (self.extend_starts, given("extend_starts"), seqs, rows, tokens),
                (self.logits_indices, given("logits_indices"), outs, rows, 0)):
            if value is not None:
                buf[:count].copy_(value)
            buf[count:end].fill_(fill)
        if batch is not None:
            self.positions[:tokens].copy_(batch.positions)
        self.positions[tokens:size].copy_(self.arange[:pad])
        self.seq_lens[seqs:seqs + 1].fill_(pad)  # the padding sequence
        self.extend_lens[seqs:seqs + 1].fill_(pad)


class PromptGraphs:
    def __init__(self, logits: Logits, kv: KVCache, max_tokens: int,
                 slot_buffers: list[LinearLoRASlots | ExpertLoRASlots], lora_rank: int, capture: GraphCapture):
        """logits(batch): the step the graphs capture; lora_rank: the slots' rank (0: no LoRA graphs)."""
        self.sizes = prompt_graph_sizes(max_tokens)
        self.inputs = PaddedPrompt(kv, max_tokens)
        self.bounds = RankBounds(slot_buffers, lora_rank)
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        with torch.inference_mode(), collector_paused():
            # one output for every graph, each copying its logits there: a graph's own would hold memory per graph
            self.inputs.fill(None, self.sizes[0])
            vocab = logits(self.inputs.batch(self.sizes[0], False)).shape[-1]
            self.logits = torch.empty(PaddedPrompt.rows(max_tokens), vocab, dtype=torch.float32,
                                      device=kv.req_to_token.device)
            for size in reversed(self.sizes):  # largest first: the smaller graphs reuse its memory
                self.inputs.fill(None, size)  # before the capture: the graph must not contain these fills
                for key in self.bounds.keys:
                    with_lora = self.bounds.set(key)

                    def run(size: int = size, with_lora: bool = with_lora) -> torch.Tensor:
                        out = logits(self.inputs.batch(size, with_lora))
                        return self.logits[:out.shape[0]].copy_(out)
                    self.graphs[size, key] = capture(run)
            self.bounds.set(0)

    def size(self, batch: ForwardBatch) -> int | None:
        """The padded token count of the graph the step runs in; None: it runs eagerly."""
        size = next((s for s in self.sizes if s >= batch.num_tokens), None)
        return size if size is not None and self.inputs.fits(batch, size) else None

    def replay(self, batch: ForwardBatch, size: int) -> torch.Tensor:
        """Logits [len(logits_indices), vocab] of the step (a view of the graphs' output: use before the next step)."""
        self.inputs.fill(batch, size)
        self.graphs[size, self.bounds.key(batch)].replay()
        return self.logits[:batch.logits_indices.shape[0]]
