"""Serving benchmark (not a test): our engine against transformers + PEFT on a dummy-weight model of
Qwen3-30B-A3B's sizes, with adapters of rank 16 on q/k/v/o and every routed expert.

  decode   B requests of --prompt-len random tokens each make --decode-tokens greedy tokens (ignore_eos),
           with LoRA off, one adapter for all, or 8 adapters (request i gets adapter i % 8). Ours: the
           median time of a step of decode rows only, the requests run through Engine.step
           (decode_step_seconds): no prefill in it; the least of REPEATS such medians. transformers,
           which has no step API: time(generate N tokens) - time(generate 1 token), each the least of REPEATS
           calls; the prefill cancels, N - 1 steps remain, but a prefill slower in the 1-token calls comes off
           them (at batch 128 up to a third).
  prefill  P prompts of L tokens (--prefill PxL), one token generated; time of the whole call, the least of
           REPEATS calls.

Both sides get the same prompts and make the same number of tokens, each checked; weights are random
on both (each its own). Timings follow a warm-up run of the same batch, CUDA synchronised. ms/step is
the time one step takes for the whole batch (prefill: the whole call).
Floors: decode, bytes a step must read (dense weights, lm_head, the experts B tokens touch under
uniform routing, the LoRA A and B of every touched (adapter, expert) pair and of attention, the KV
cache) / measured copy bandwidth; prefill, matmul FLOPs / measured matmul rate.

transformers side: sdpa attention, experts "grouped_mm" (its default; generate() switches decode
steps to "batched_mm", which it documents as faster there; "deepgemm" and "sonicmoe" fetch kernels
from the Hub, out of reach of the GPU machine), DynamicCache, no torch.compile. PEFT
cannot mix adapters of target_parameters in one batch, so the requests of each adapter run as a
sub-batch of their own, one after another. transformers runs after our engine is deleted.

    python3 benchmarks/bench_serving.py                  # both; about 5 minutes on an H200
    python3 benchmarks/bench_serving.py --impl ours      # or --impl hf
    python3 benchmarks/bench_serving.py --tiny           # a tiny model of the same kind in seconds (CPU test)
    python3 benchmarks/bench_serving.py --impl ours --adapters 0,8 --mem-fraction-static 0.93   # 8 slots on 80 GB
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import math
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import peft
import torch
import transformers
import triton
from bench_moe import machine
from transformers import AutoModelForCausalLM, PretrainedConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, for tests/support.py

from moelora import Engine, SamplingParams
from tests.support import qwen3_30b_a3b_config, write_dummy_checkpoint, write_random_peft_adapter

RANK = 16
MAX_ADAPTERS = 8
REPEATS = 3  # timed calls per measurement, the least kept


@dataclass(frozen=True)
class Workload:
    phase: str      # "decode" or "prefill"
    batch: int
    adapters: int   # 0: LoRA off
    prompt_len: int
    new_tokens: int

    def names(self) -> list[str | None]:
        return [None if not self.adapters else f"a{i % self.adapters}" for i in range(self.batch)]

    def prompts(self, vocab: int) -> list[list[int]]:
        gen = torch.Generator().manual_seed(self.batch * 1000 + self.prompt_len)
        return torch.randint(0, vocab, (self.batch, self.prompt_len), generator=gen).tolist()


Generate = Callable[[list[list[int]], list[str | None], int], None]


class Ours:
    def __init__(self, model_dir: Path, adapters: dict[str, Path], device: str, dtype: torch.dtype, max_batch: int,
                 **options):
        """options: further EngineConfig fields (tp_size, ep_size, moe_dispatch: bench_tp.py; max_lora_rank, the
        slots' rank, the adapters' by default). Prefix caching is
        off unless options turn it on: the timed calls run the warm-up's prompts again, which it would serve."""
        options.setdefault("enable_prefix_caching", False)
        options.setdefault("max_lora_rank", RANK)
        self.engine = Engine(str(model_dir), lora_paths={n: str(p) for n, p in adapters.items()}, load_format="dummy",
                             device=device, dtype=str(dtype).removeprefix("torch."),
                             # as many slots as adapters, so `--adapters 0,1` fits an 80 GB GPU (8 slots leave no KV cache)
                             max_loras_per_batch=max(1, len(adapters)),
                             cuda_graph_max_bs=max_batch, **options)

    def generate(self, prompts: list[list[int]], names: list[str | None], new_tokens: int) -> None:
        params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
        outs = self.engine.generate(prompts, params, lora=names)
        assert all(len(o.token_ids) == new_tokens for o in outs), "ours made a different number of tokens"

    def profile_decode_steps(self, prompts: list[list[int]], names: list[str | None], new_tokens: int,
                             output_dir: str) -> list[str]:
        """The requests run as in decode_step_seconds, the steps after the first step of decode rows only profiled
        on every rank (Engine.start_profile): each rank's trace, in output_dir."""
        profiling = False
        for decode_only in engine_steps(self.engine, prompts, names, new_tokens):
            if decode_only and not profiling:
                self.engine.start_profile(output_dir)
                profiling = True
        if not profiling:
            raise SystemExit(f"no decode step at batch {len(prompts)}: raise --decode-tokens")
        return [str(trace) for trace in self.engine.stop_profile()]


def decode_step_seconds(engine: Engine, prompts: list[list[int]], names: list[str | None],
                        new_tokens: int) -> list[float]:
    """The requests run through Engine.step; the seconds between the returns of consecutive step calls that both
    launched a step of decode rows only. With overlap scheduling a call returns once the step before the one it
    launched is done, so each is one decode step's time, with no prefill in it (bench_tp.py's and bench_server.py's
    decode timing too)."""
    intervals, last = [], None
    for decode_only in engine_steps(engine, prompts, names, new_tokens):
        now = time.perf_counter()
        if decode_only and last is not None:
            intervals.append(now - last)
        last = now if decode_only else None
    return intervals


def engine_steps(engine: Engine, prompts: list[list[int]], names: list[str | None],
                 new_tokens: int) -> Iterator[bool]:
    """Adds the requests (greedy, new_tokens each) and steps the engine until they finish; after each step call,
    whether it launched a step of decode rows only."""
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    for prompt, name in zip(prompts, names):
        engine.add_request(prompt, params, lora=name, detokenize=False)
    stats = engine.step_stats
    while engine.has_unfinished():
        decode, steps = stats.decode_steps, stats.steps
        engine.step()
        yield stats.decode_steps == decode + 1 and stats.steps == steps + 1


class HF:
    """transformers + PEFT; adapters are attached by add_adapters, after the LoRA-off runs."""

    def __init__(self, config: PretrainedConfig, device: str, dtype: torch.dtype):
        self.device = device
        with torch.device(device):
            self.model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa",
                                                          experts_implementation="grouped_mm").eval()
        self.model.generation_config.eos_token_id = None  # as ignore_eos

    def add_adapters(self, adapters: dict[str, Path]) -> None:
        (first, path), *rest = adapters.items()
        # autocast off: PEFT would keep bf16 adapters in fp32 for training's sake; low_cpu_mem_usage: the
        # file's tensors are used as they are, without initialising new ones first (~10 s per adapter at 30B)
        options = dict(autocast_adapter_dtype=False, low_cpu_mem_usage=True)
        self.model = peft.PeftModel.from_pretrained(self.model, str(path), adapter_name=first, **options).eval()
        for name, path in rest:
            self.model.load_adapter(str(path), adapter_name=name, **options)

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], names: list[str | None], new_tokens: int) -> None:
        for name in dict.fromkeys(names):  # one sub-batch per adapter
            if name is not None:
                self.model.set_adapter(name)
            ids = torch.tensor([p for p, n in zip(prompts, names) if n == name], device=self.device)
            out = self.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                      do_sample=False, pad_token_id=0)
            assert out.shape[1] == ids.shape[1] + new_tokens, "transformers made a different number of tokens"


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def timed(fn: Callable[[], None], device: str) -> float:
    synchronize(device)
    t0 = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - t0


@dataclass
class Result:
    seconds: float
    steps: int   # decode steps after the first token, or 1 for the prefill call
    tokens: int  # tokens the timed part made (decode) or read (prefill)


def run(generate: Generate, w: Workload, vocab: int, device: str, ours: Ours | None = None) -> Result:
    """One workload, timed as the module docstring says: decode by our least median step where `ours` is given
    (`seconds` and `tokens` then as if each timed step took it), else by the difference of two calls."""
    prompts, names = w.prompts(vocab), w.names()
    generate(prompts, names, min(w.new_tokens, 2))  # warm-up: kernels, graphs, adapters into slots
    if w.phase == "decode" and ours is not None:
        step, steps = math.inf, 0
        for _ in range(REPEATS):
            intervals = decode_step_seconds(ours.engine, prompts, names, w.new_tokens)
            if not intervals:
                raise SystemExit(f"no two decode steps in a row at batch {w.batch}: raise --decode-tokens")
            step, steps = min(step, statistics.median(intervals)), len(intervals)
        return Result(step * steps, steps, w.batch * steps)
    first = min(timed(lambda: generate(prompts, names, 1), device) for _ in range(REPEATS))
    if w.phase == "prefill":
        return Result(first, 1, w.batch * w.prompt_len)
    full = min(timed(lambda: generate(prompts, names, w.new_tokens), device) for _ in range(REPEATS))
    return Result(full - first, w.new_tokens - 1, w.batch * (w.new_tokens - 1))


def floor_seconds(config: PretrainedConfig, w: Workload, bandwidth: float, matmul: float, itemsize: int) -> float:
    """The least time the workload's step(s) take at the measured rates (see the module docstring)."""
    h, layers, e, k, i = (config.hidden_size, config.num_hidden_layers, config.num_experts,
                          config.num_experts_per_tok, config.moe_intermediate_size)
    q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    attention, router, expert = h * (q + 2 * kv) + q * h, h * e, 3 * h * i
    lora_attention, lora_expert = RANK * (4 * h + 2 * q + 2 * kv), 3 * RANK * (h + i)
    if w.phase == "prefill":
        params = layers * (attention + router + k * expert + (lora_attention + k * lora_expert if w.adapters else 0))
        causal = layers * w.prompt_len * q  # QK^T and PV: 4 * context * q FLOPs a token, context L / 2 on average
        flops = 2 * w.batch * w.prompt_len * (params + causal) + 2 * w.batch * config.vocab_size * h
        return flops / matmul

    def touched(tokens: float) -> float:  # distinct experts `tokens` tokens pick, uniform routing
        return e * (1 - (1 - k / e) ** tokens)

    weights = layers * (attention + router + touched(w.batch) * expert) + config.vocab_size * h
    if w.adapters:
        weights += layers * w.adapters * (lora_attention + touched(w.batch / w.adapters) * lora_expert)
    cache = w.batch * (w.prompt_len + w.new_tokens / 2) * layers * 2 * kv  # keys and values read, mid-decode
    return (w.new_tokens - 1) * (weights + cache) * itemsize / bandwidth  # the timed decode steps


def workloads(args) -> list[Workload]:
    """LoRA-off runs first: transformers gets its adapters attached after them."""
    prefill_batch, prefill_len = map(int, args.prefill.split("x"))
    out = []
    for n in sorted(map(int, args.adapters.split(","))):
        out += [Workload("decode", b, n, args.prompt_len, args.decode_tokens)
                for b in map(int, args.batch_sizes.split(",")) if n <= b]
        out += [Workload("prefill", prefill_batch, n, prefill_len, 1)] if n <= prefill_batch else []
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--impl", choices=["both", "ours", "hf"], default="both")
    p.add_argument("--tiny", action="store_true", help="a tiny model of the same kind and a small workload")
    p.add_argument("--batch-sizes", default=None, help="decode batch sizes (default 1,8,32,128; tiny 1,8)")
    p.add_argument("--adapters", default="0,1,8", help="distinct adapters per batch (0: LoRA off; at most 8)")
    p.add_argument("--prompt-len", type=int, default=None, help="decode prompts' length (default 128; tiny 16)")
    p.add_argument("--decode-tokens", type=int, default=None, help="tokens each request makes (default 16; tiny 4)")
    p.add_argument("--prefill", default=None, help="PxL: P prompts of L tokens (default 8x1024; tiny 8x32)")
    p.add_argument("--cuda-graph-max-bs", type=int, default=None,
                   help="largest decode batch run from a CUDA graph (default: the largest batch; past it steps run eagerly)")
    p.add_argument("--workdir", type=Path, default=None, help="where the config and adapters go (default: a temp dir)")
    p.add_argument("--max-lora-rank", type=int, default=RANK,
                   help=f"the slots' rank (default {RANK}, the adapters'): larger, the pool of a server whose adapters' "
                        "ranks go higher")
    p.add_argument("--mem-fraction-static", type=float, default=None,
                   help="our engine's share of GPU memory for weights, LoRA slots and KV cache (default: the "
                        "engine's): 8 slots of the 30B model leave an 80 GB GPU's default share no KV cache")
    args = p.parse_args()
    if args.max_lora_rank < RANK:
        p.error(f"--max-lora-rank: at least the adapters' rank, {RANK}")
    defaults = ("1,8", 16, 4, "8x32") if args.tiny else ("1,8,32,128", 128, 16, "8x1024")
    for name, value in zip(("batch_sizes", "prompt_len", "decode_tokens", "prefill"), defaults):
        if getattr(args, name) is None:
            setattr(args, name, value)
    if max(map(int, args.adapters.split(","))) > MAX_ADAPTERS:
        p.error(f"--adapters: at most {MAX_ADAPTERS}")
    with tempfile.TemporaryDirectory() as tmp:
        bench(args, args.workdir or Path(tmp))


def bench(args, workdir: Path) -> None:
    device, dtype, name, matmul, bandwidth = machine()
    # our engine's settings given on the command line (else the engine's defaults)
    options = {} if args.mem_fraction_static is None else {"mem_fraction_static": args.mem_fraction_static}
    torch.manual_seed(0)
    config = qwen3_30b_a3b_config(tiny=args.tiny)
    t0 = time.perf_counter()
    model_dir = write_dummy_checkpoint(config, workdir / "model")
    adapters = {f"a{i}": write_random_peft_adapter(config, workdir / f"a{i}", RANK, seed=i, device=device)
                for i in range(max(map(int, args.adapters.split(","))))}
    print(f"# moelora serving benchmark, {name}, {datetime.date.today()}, torch {torch.__version__}, triton "
          f"{triton.__version__}, transformers {transformers.__version__}, peft {peft.__version__}, {dtype}")
    print(f"model: {'tiny Qwen3-MoE' if args.tiny else 'Qwen3-30B-A3B'} sizes, dummy weights; adapters rank {RANK} "
          f"(slots of rank {args.max_lora_rank}) on q/k/v/o and all routed experts (PEFT target_parameters), "
          f"written in {time.perf_counter() - t0:.0f} s"
          + "".join(f"; our engine's {name} {value}" for name, value in options.items()))
    print(f"measured copy bandwidth {bandwidth / 1e12:.2f} TB/s (read+write), {dtype} matmul {matmul / 1e12:.0f} TFLOP/s")
    print("transformers: sdpa attention, experts grouped_mm (generate() decodes with batched_mm), DynamicCache, "
          "eager; PEFT: one sub-batch per adapter\n")
    print("| impl | phase | batch | adapters | tokens | s | tokens/s | ms/step | floor ms | % of floor |")
    print("|---|---|---|---|---|---|---|---|---|---|", flush=True)
    jobs = workloads(args)
    results: dict[tuple[str, Workload], Result] = {}
    floors = {w: floor_seconds(config, w, bandwidth, matmul, dtype.itemsize) for w in jobs}

    def measure_all(impl: str, generate: Generate, ours: Ours | None = None) -> None:
        for w in jobs:
            r = results[impl, w] = run(generate, w, config.vocab_size, device, ours)
            floor = floors[w] / max(w.new_tokens - 1, 1)  # a step's
            print(f"| {impl} | {w.phase} | {w.batch} | {w.adapters} | {r.tokens} | {r.seconds:.3f} "
                  f"| {r.tokens / r.seconds:.0f} | {1e3 * r.seconds / r.steps:.2f} | {1e3 * floor:.2f} "
                  f"| {100 * floor * r.steps / r.seconds:.0f}% |", flush=True)

    if args.impl in ("both", "ours"):
        with stopwatch("ours", "start (dummy weights, adapters, CUDA graphs)"):
            ours = Ours(model_dir, adapters, device, dtype,
                        args.cuda_graph_max_bs or max(map(int, args.batch_sizes.split(","))),
                        max_lora_rank=args.max_lora_rank, **options)
        measure_all("ours", ours.generate, ours)
        del ours
        free_memory(device)
    if args.impl in ("both", "hf"):
        with stopwatch("hf", "start (random weights)"):
            hf = HF(config, device, dtype)

        def hf_generate(prompts, names, new_tokens):
            if any(names) and not isinstance(hf.model, peft.PeftModel):
                with stopwatch("hf", "PEFT loads the adapters"):
                    hf.add_adapters(adapters)
            hf.generate(prompts, names, new_tokens)
        measure_all("hf", hf_generate)
    summary(jobs, results, floors)


@contextlib.contextmanager
def stopwatch(impl: str, what: str) -> Iterator[None]:
    """A row of the measurements table with the seconds something took."""
    t0 = time.perf_counter()
    yield
    print(f"| {impl} | {what} | | | | {time.perf_counter() - t0:.1f} | | | | |", flush=True)


def free_memory(device: str) -> None:
    """Our engine's memory back before transformers loads its own copy of the model."""
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
        left = torch.cuda.memory_allocated()
        if left > 4 * 2**30:  # a few buffers (Triton's, the caching allocator's) may outlive the engine
            raise RuntimeError(f"{left / 2**30:.1f} GiB still allocated after the engine was deleted")


def summary(jobs: list[Workload], results: dict[tuple[str, Workload], Result], floors: dict[Workload, float]) -> None:
    """Ours with LoRA against ours without, same phase and batch, beside the most two floors allow: both runs at their
    floors (LoRA off's floor over LoRA on's), and LoRA off as measured with the adapters' work at its floor added
    (the adapters' bytes or FLOPs alone); ours against transformers where both ran."""
    def tokens_per_second(impl: str, w: Workload) -> float | None:
        r = results.get((impl, w))
        return r.tokens / r.seconds if r else None

    print("\n| phase | batch | adapters | ours tokens/s | LoRA-on / LoRA-off | at the floors | LoRA work at its floor "
          "| HF tokens/s | ours / HF |")
    print("|---|---|---|---|---|---|---|---|---|")
    for w in jobs:
        ours, hf = tokens_per_second("ours", w), tokens_per_second("hf", w)
        off = next((v for v in jobs if (v.phase, v.batch, v.adapters) == (w.phase, w.batch, 0)), None)
        off_speed = tokens_per_second("ours", off) if off is not None else None
        lora = " | | "
        if w.adapters and ours and off_speed:
            r = results["ours", off]
            step, lora_floor = r.seconds / r.steps, (floors[w] - floors[off]) / max(w.new_tokens - 1, 1)  # a step's
            lora = f"{ours / off_speed:.2f} | {floors[off] / floors[w]:.2f} | {step / (step + lora_floor):.2f}"
        versus = f"{hf:.0f} | {ours / hf:.2f}" if ours and hf else " | "
        print(f"| {w.phase} | {w.batch} | {w.adapters} | {f'{ours:.0f}' if ours else ''} | {lora} | {versus} |")


if __name__ == "__main__":
    main()
