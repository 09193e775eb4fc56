"""EngineConfig: every knob of the engine in one place, threaded through scheduler, LoRA manager and
model runner. Names follow SGLang's server arguments where one exists; the constructor takes the flags' other
spellings (vLLM's tensor_parallel_size, max_model_len, ...) as keywords too."""
from __future__ import annotations

import numbers
import os
import re
from dataclasses import dataclass, fields
from pathlib import Path

import torch

from moelora.distributed.state import DISPATCH_MODES
from moelora.engine.fields import keyword_aliases, option
from moelora.kernels.fused_moe.config import MAX_RANK_TILE as MAX_LORA_RANK
from moelora.layers.moe.runner import BACKENDS as MOE_BACKENDS

CPU_KV_TOKENS = 16384  # KV cache size on CPU without max_total_tokens (no free-memory query there)
SCHEDULING_POLICIES = ("fcfs", "priority")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@keyword_aliases
@dataclass
class EngineConfig:
    model_path: str = option(help="local Hugging Face model directory (config.json, safetensors)")
    tokenizer_path: str | None = option(None, "local tokenizer directory (default: the model directory)")
    chat_template: str | None = option(None, "the chat template: a file, or the Jinja text itself (default: the "
                                             "tokenizer's)")
    lora_paths: dict[str, str] = option(help="adapters loaded at start, name -> directory", factory=dict)
    device: str | None = option(None, "'cuda', 'cuda:N' or 'cpu' (default: cuda when available)")
    dtype: str = option("auto", "weights and activations: 'auto' (the checkpoint's), 'float32', 'bfloat16', 'float16'")
    load_format: str = option("auto", "'auto' (safetensors) or 'dummy' (random weights, for benchmarks)")
    context_length: int | None = option(None, "tokens one request may hold, prompt + generated (default: the "
                                              "model's max_position_embeddings)", ("--max-model-len",))
    random_seed: int = option(0, "seeds dummy weights and the draws of requests without a seed")
    generation_config: str = option("auto", "defaults for the sampling fields a server request leaves unset: 'auto' "
                                            "(the model's generation_config.json: temperature, top_p, top_k, min_p, "
                                            "repetition_penalty), 'vllm' (none: the API's defaults), "
                                            "or a directory holding a generation_config.json")
    moe_runner_backend: str = option("auto", "how the routed experts run: 'triton', 'torch' (the reference), "
                                             "'auto' (triton on CUDA, torch elsewhere)")

    # Parallelism: tp_size processes (one per GPU, or CPU processes with gloo), started by the engine
    tp_size: int = option(1, "processes (GPUs) one model is split over: attention and dense layers tensor-parallel",
                          ("--tensor-parallel-size", "--tp"))
    ep_size: int = option(1, "groups of ranks the routed experts are split over (expert parallelism; divides tp_size); "
                             "inside a group the experts are tensor-parallel", ("--expert-parallel-size", "--ep"))
    enable_expert_parallel: bool = option(False, "vLLM's switch: ep_size = tp_size")
    moe_dispatch: str = option("all_reduce", "how tokens reach the experts of other ranks: 'all_reduce' (every rank runs "
                                             "its experts on every token) or 'all_to_all' (each token travels once to "
                                             "each rank holding one of its experts, its partial sums back: at a fixed "
                                             "capacity up to 256 tokens, the CUDA graphs' steps, by exchanged counts "
                                             "above)")
    dist_timeout: float = option(300.0, "seconds a collective waits for the other ranks before the engine stops with "
                                        "an error naming the rank that died or hangs")
    # several nodes without torchrun, as SGLang: the same command on each node, but for --node-rank
    nnodes: int = option(1, "machines the tp_size ranks run on, tp_size / nnodes ranks each (one process per GPU)")
    node_rank: int = option(0, "this machine's place among the nnodes: node 0 serves the engine (rank 0, HTTP), node k "
                               "runs ranks k * tp_size / nnodes .. and ends when node 0's engine shuts down")
    dist_init_addr: str | None = option(None, "host:port where the ranks meet: node 0's address and a free port "
                                              "(default: 127.0.0.1 and any free port, one node only)")

    # LoRA
    max_loras_per_batch: int = option(8, "GPU adapter slots: distinct adapters in one running batch",
                                      ("--max-loras",))
    max_lora_rank: int | None = option(None, f"rank of the GPU adapter slots, at most {MAX_LORA_RANK} (default: the "
                                             "largest rank among lora_paths)")
    max_cpu_loras: int | None = option(None, "adapters kept in host memory, least recently used dropped and re-read "
                                             "from disk (default: no limit)")
    # SGLang's flag: without it an adapter's copies into its slot sit on the step's stream, between two steps
    enable_lora_overlap_loading: bool = option(False, "put the adapters of waiting requests into GPU slots on a copy "
                                                      "stream while the running requests' steps go on; a request "
                                                      "starts once its adapter is in (the requests behind it may "
                                                      "start first)")
    # layers without slots run their plain GEMM and no LoRA kernels: the router's LoRA, which adapters seldom
    # target, ran in every layer of every step
    lora_target_modules: list[str] | str | None = option(
        None, "modules given LoRA slots, by their last name: q_proj, k_proj, v_proj, o_proj, gate (the router), "
              "gate_proj, up_proj, down_proj (dense MLPs, shared and routed experts), DeepSeek's q_a_proj, "
              "kv_a_proj_with_mqa, ..., qkv_proj and gate_up_proj (their parts), or all; adapters targeting other "
              "modules are refused (default: the modules the lora_paths adapters target; all without lora_paths)")

    # Memory and scheduling
    mem_fraction_static: float = option(0.85, "share of GPU memory for weights, LoRA slots and KV cache",
                                        ("--gpu-memory-utilization",))
    max_total_tokens: int | None = option(None, "KV cache token slots (default: what memory allows on a GPU, "
                                                f"{CPU_KV_TOKENS} on a CPU)")
    max_running_requests: int = option(256, "requests in the running batch", ("--max-num-seqs",))
    # on by default, as vLLM's automatic prefix caching and SGLang's radix cache are
    enable_prefix_caching: bool = option(True, "keep finished requests' KV cache in a radix tree per adapter and start "
                                               "new requests whose prompt begins with cached tokens from their slots "
                                               "(vLLM's automatic prefix caching, SGLang's radix cache); evicted, least "
                                               "recently used first, when the cache runs short")
    # vLLM's --scheduling-policy: lower priority values first; no running request is retracted to admit one
    scheduling_policy: str = option("fcfs", "the waiting requests' order: 'fcfs' (arrival) or 'priority' (a "
                                            "request's priority, lower values first, then arrival; when decode runs "
                                            "short of KV slots the running request of the highest value, the latest "
                                            "of them, is retracted first)")
    # 8192 as SGLang's and vLLM's defaults on large GPUs: a step's prompt pieces fill the GPU while the decode
    # rows beside them wait no more than one such piece
    chunked_prefill_size: int = option(8192, "tokens per step: decode rows plus pieces of prompts (a longer prompt "
                                             "is prefilled over several steps); -1: prompts are never split",
                                       ("--max-num-batched-tokens",))
    # a single prompt may exceed max_prefill_tokens only when chunking is disabled
    max_prefill_tokens: int = option(16384, "prompt tokens in one step")
    # off by default, as in SGLang: a step with prompt pieces is no decode batch, so it runs eagerly, not from
    # a CUDA graph, and with clients arriving all the time nearly every step would (see benchmarks/RESULTS.md)
    enable_mixed_chunk: bool = option(False, "run the running requests' decode rows in the steps that prefill "
                                             "prompt pieces (default: prompt pieces run in steps of their own, "
                                             "before the decode steps)")

    # on by default as in SGLang: the host's work between two steps hides behind the device's (benchmarks/RESULTS.md)
    disable_overlap_schedule: bool = option(False, "read each step's tokens before the next step is launched (by "
                                                   "default the next step is scheduled and launched while the device "
                                                   "computes)")

    # CUDA graphs
    cuda_graph_max_bs: int | None = option(None, "largest decode batch run from a captured CUDA graph (default: "
                                                 "max_running_requests, at most 512)")
    cuda_graph_max_prefill_tokens: int = option(8192, "largest prompt step (prompt pieces of fewer than 64 requests, no "
                                                      "decode rows) run from a captured CUDA graph, padded to the next "
                                                      "of 64, 128, ..., 1024, 1536, 2048, 3072, 4096, ... tokens; 0: "
                                                      "prompt steps run eagerly")
    disable_cuda_graph: bool = option(False, "run every step eagerly", ("--enforce-eager",))
    # SGLang's --skip-server-warmup
    skip_server_warmup: bool = option(False, "skip the prompt steps a GPU engine's start runs to compile every "
                                             "prompt-step kernel variant: the start is faster, but the first request "
                                             "of each new size class stalls the running requests for the seconds of "
                                             "a compile (for tests and benchmarks that measure no latency)")
    # vLLM's VLLM_TORCH_PROFILER_DIR, SGLang's SGLANG_TORCH_PROFILER_DIR
    profile_dir: str | None = option(None, "directory of the torch.profiler traces of every rank that start_profile / "
                                           "stop_profile write (a server has POST /start_profile and /stop_profile "
                                           "only with it)")

    def __post_init__(self) -> None:
        if self.device is None:
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        self._check_types()
        self.lora_paths = dict(self.lora_paths)
        self._check(isinstance(self.model_path, str) and self.model_path != "", "model_path", "a non-empty path")
        self._check(isinstance(self.device, str) and re.fullmatch(r"cpu|cuda(:\d+)?", self.device) is not None,
                    "device", "'cuda', 'cuda:N' or 'cpu'")
        self._check(self.dtype == "auto" or self.dtype in DTYPES, "dtype", f"'auto' or one of {sorted(DTYPES)}")
        self._check(self.load_format in ("auto", "dummy"), "load_format", "'auto' or 'dummy'")
        self._check(self.moe_runner_backend in MOE_BACKENDS, "moe_runner_backend", f"one of {MOE_BACKENDS}")
        self._check(self.moe_runner_backend != "triton" or self.device.startswith("cuda"), "moe_runner_backend",
                    f"'auto' or 'torch' on device {self.device!r} (the Triton kernels run on CUDA)")
        self._check(-2**63 <= self.random_seed < 2**63, "random_seed", "a 64-bit integer")
        self._check(self.tp_size >= 1, "tp_size", ">= 1")
        if self.enable_expert_parallel:
            self._check(self.ep_size in (1, self.tp_size), "ep_size", f"tp_size ({self.tp_size}) with enable_expert_parallel")
            self.ep_size = self.tp_size
        self._check(self.ep_size >= 1 and self.tp_size % self.ep_size == 0, "ep_size", f"a divisor of tp_size ({self.tp_size})")
        self._check(self.moe_dispatch in DISPATCH_MODES, "moe_dispatch", f"one of {DISPATCH_MODES}")
        self._check(0 < self.dist_timeout < float("inf"), "dist_timeout", "> 0 seconds and finite")
        self._check(self.nnodes >= 1, "nnodes", ">= 1")
        self._check(0 <= self.node_rank < self.nnodes, "node_rank", f"in [0, nnodes={self.nnodes})")
        self._check(self.tp_size % self.nnodes == 0, "tp_size", f"a multiple of nnodes ({self.nnodes}): as many ranks "
                                                                "on every node")
        self._check(self.dist_init_addr is not None or self.nnodes == 1, "dist_init_addr",
                    f"node 0's host:port with nnodes={self.nnodes}")
        self._check(self.dist_init_addr is None or _is_host_port(self.dist_init_addr), "dist_init_addr",
                    "host:port (a port in 1..65535)")
        self._check(self.context_length is None or self.context_length > 1, "context_length", "> 1")
        self._check(self.profile_dir is None or _writable_dir(self.profile_dir), "profile_dir",
                    "a directory this process can make and write")
        self._check(self.generation_config in ("auto", "vllm") or (Path(self.generation_config) /
                                                                  "generation_config.json").is_file(),
                    "generation_config", "'auto', 'vllm' or a directory holding a generation_config.json")
        self._check(self.max_loras_per_batch >= 1, "max_loras_per_batch", ">= 1")
        self._check(self.max_lora_rank is None or 1 <= self.max_lora_rank <= MAX_LORA_RANK, "max_lora_rank",
                    f"in 1..{MAX_LORA_RANK} (the experts' LoRA kernels' largest rank tile)")
        self._check(self.max_cpu_loras is None or self.max_cpu_loras >= self.max_loras_per_batch, "max_cpu_loras",
                    f">= max_loras_per_batch ({self.max_loras_per_batch}): every adapter in a slot is also in host memory")
        self._check(0.0 < self.mem_fraction_static < 1.0, "mem_fraction_static", "in (0, 1)")
        # a request holds a prompt token and one to generate, and the cache keeps a slot to spare (ModelRunner)
        self._check(self.max_total_tokens is None or self.max_total_tokens >= 3, "max_total_tokens", ">= 3")
        self._check(self.max_running_requests >= 1, "max_running_requests", ">= 1")
        self._check(self.scheduling_policy in SCHEDULING_POLICIES, "scheduling_policy",
                    f"one of {SCHEDULING_POLICIES}")
        self._check(self.chunked_prefill_size == -1 or self.chunked_prefill_size >= 1, "chunked_prefill_size",
                    ">= 1, or -1 to disable chunked prefill")
        self._check(self.max_prefill_tokens >= 1, "max_prefill_tokens", ">= 1")
        self._check(self.cuda_graph_max_bs is None or self.cuda_graph_max_bs >= 1, "cuda_graph_max_bs", ">= 1")
        self._check(self.cuda_graph_max_prefill_tokens >= 0, "cuda_graph_max_prefill_tokens", ">= 0")
        for name in self.lora_paths:
            self._check(adapter_name_problem(name) is None, "lora_paths", f"adapter names of at most "
                        f"{MAX_ADAPTER_NAME_CHARS} printable characters without surrounding spaces")
        if self.lora_target_modules is not None:
            names = [self.lora_target_modules] if isinstance(self.lora_target_modules, str) else \
                list(self.lora_target_modules)
            self._check(bool(names) and all(isinstance(n, str) and n for n in names) and
                        ("all" not in names or names == ["all"]), "lora_target_modules",
                        "'all' or a non-empty list of module names without 'all'")
            # the model's names are checked once it is loaded (LoRAManager)
            self.lora_target_modules = "all" if names == ["all"] else list(dict.fromkeys(names))

    def _check_types(self) -> None:
        """Each int, float, bool and str field (None where it may be) of the type it names: the range checks compare
        them, and a float where an int is meant would size a tensor or pass the checks (library use; the CLI
        converts its flags)."""
        kinds = {"int": (numbers.Integral, int), "float": (numbers.Real, float), "bool": (bool, bool),
                 "str": ((str, os.PathLike), os.fspath)}  # what a field takes, and what it holds of it
        names = {"int": "an int", "float": "a number", "bool": "a bool", "str": "a string"}
        for f in fields(self):
            kind, _, rest = f.type.partition(" | ")
            if kind not in kinds or rest not in ("", "None"):
                continue
            value = getattr(self, f.name)
            if value is None and rest == "None":
                continue
            takes, holds = kinds[kind]
            self._check(isinstance(value, takes) and (kind == "bool" or not isinstance(value, bool)), f.name,
                        names[kind] + (" or None" if rest else ""))
            setattr(self, f.name, holds(value))  # numpy's ints, a Path: as the rest of the engine reads them

    def _check(self, ok: bool, name: str, expected: str) -> None:
        if not ok:
            raise ValueError(f"EngineConfig.{name} must be {expected}, got {getattr(self, name)!r}")

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.device)

    @property
    def overlap_schedule(self) -> bool:
        """Launch each step before the previous one's tokens are read (over several ranks too: rank 0, which
        samples, broadcasts the tokens the next step needs on the device)."""
        return not self.disable_overlap_schedule

    @property
    def decode_graph_max_bs(self) -> int:
        """The largest decode batch the graphs hold: cuda_graph_max_bs, by default every batch the scheduler runs
        up to 512 (as vLLM's); eager, a decode step queues its kernels for longer than the device runs them."""
        return min(self.cuda_graph_max_bs or 512, self.max_running_requests)

    @property
    def prefill_chunk(self) -> int | None:
        """Tokens of one prompt per step, None when prompts are never split."""
        return None if self.chunked_prefill_size == -1 else self.chunked_prefill_size

    @property
    def warm_up_at_start(self) -> bool:
        """Run the start-time prompt steps (ModelRunner.warm_up): on CUDA, where they compile Triton's kernels,
        unless skip_server_warmup."""
        return self.torch_device.type == "cuda" and not self.skip_server_warmup

    @property
    def use_cuda_graph(self) -> bool:
        return self.torch_device.type == "cuda" and not self.disable_cuda_graph


def _writable_dir(path: str) -> bool:
    """Whether `path` is a directory this process writes, or one it could make (its nearest existing ancestor a
    writable directory): an unusable one is an error at the start rather than at the first profile. Nothing is made
    here (start_profile makes it)."""
    existing = Path(path).absolute()
    while not existing.exists():
        existing = existing.parent
    return existing.is_dir() and os.access(existing, os.W_OK | os.X_OK)


def _is_host_port(addr: object) -> bool:
    host, _, port = addr.rpartition(":") if isinstance(addr, str) else ("", "", "")
    return host != "" and port.isdigit() and 0 < int(port) < 65536


MAX_ADAPTER_NAME_CHARS = 256


def adapter_name_problem(name: object) -> str | None:
    """Why `name` cannot name an adapter (None: it can). A name is what a request's `model` field gives and
    /v1/models lists: printable, without surrounding spaces, of at most MAX_ADAPTER_NAME_CHARS characters (a name with a
    newline was listed, and no request could name it)."""
    if isinstance(name, str) and name and name.isprintable() and name == name.strip() and \
            len(name) <= MAX_ADAPTER_NAME_CHARS:
        return None
    shown = f"{name[:60]!r}..." if isinstance(name, str) and len(name) > 60 else repr(name)
    return (f"an adapter's name must be a non-empty string of at most {MAX_ADAPTER_NAME_CHARS} printable characters "
            f"without surrounding spaces, got {shown}")
