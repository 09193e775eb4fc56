import pytest

from moelora.engine.config import EngineConfig


def test_defaults_resolve():
    config = EngineConfig("model", device="cpu")
    assert config.prefill_chunk == 8192 and not config.use_cuda_graph
    assert EngineConfig("model", device="cpu", chunked_prefill_size=-1).prefill_chunk is None
    assert config.cuda_graph_max_prefill_tokens == 8192
    # decode graphs: every batch the scheduler runs, up to 512, unless given
    assert config.decode_graph_max_bs == 256
    assert EngineConfig("model", max_running_requests=1000).decode_graph_max_bs == 512
    assert EngineConfig("model", max_running_requests=1000, cuda_graph_max_bs=600).decode_graph_max_bs == 600
    assert EngineConfig("model", max_running_requests=20, cuda_graph_max_bs=64).decode_graph_max_bs == 20


def test_the_start_warms_up_on_cuda_unless_skipped():
    """The prompt steps of each size class compile Triton's kernels: on CUDA only, unless skip_server_warmup."""
    assert EngineConfig("model", device="cuda").warm_up_at_start
    assert EngineConfig("model", device="cuda:1").warm_up_at_start
    assert not EngineConfig("model", device="cuda", skip_server_warmup=True).warm_up_at_start
    assert not EngineConfig("model", device="cpu").warm_up_at_start


@pytest.mark.parametrize("field, value", [
    ("dtype", "float64"), ("device", "tpu"), ("load_format", "pt"), ("max_loras_per_batch", 0), ("max_lora_rank", 0),
    ("max_lora_rank", 512),  # past the LoRA kernels' largest rank tile
    ("max_cpu_loras", 2), ("mem_fraction_static", 1.0), ("max_total_tokens", 1), ("max_running_requests", 0),
    ("chunked_prefill_size", 0), ("max_prefill_tokens", 0), ("cuda_graph_max_bs", 0), ("context_length", 1),
    ("max_total_tokens", 2),  # a request holds 2 at least, and the cache keeps one to spare
    # of the wrong type (library use): compared, or sizing a tensor, they failed with a TypeError or were taken
    ("max_running_requests", "4"), ("max_running_requests", 4.5), ("context_length", 100.5), ("tp_size", 2.0),
    ("dist_timeout", "3"), ("enable_mixed_chunk", 1), ("random_seed", True), ("profile_dir", 5),
    ("lora_paths", {"": "/x"}), ("lora_paths", {"a\nb": "/x"}), ("lora_paths", {"a ": "/x"}), ("tp_size", 0),
    ("ep_size", 3), ("moe_dispatch", "deepep"), ("dist_timeout", 0),
    ("scheduling_policy", "lifo"),
    ("lora_target_modules", []), ("lora_target_modules", ["all", "q_proj"]), ("lora_target_modules", ["q_proj", ""]),
    ("nnodes", 0), ("node_rank", -1), ("node_rank", 1), ("dist_init_addr", "node0"), ("dist_init_addr", ":5000"),
    ("dist_init_addr", "node0:http"), ("dist_init_addr", "node0:0"), ("dist_init_addr", "node0:65536"),
    ("device", "cuda:x"), ("device", "cuda:"), ("device", "cpu:-1"), ("moe_runner_backend", "triton"),
    ("random_seed", 2**64), ("dist_timeout", float("inf")), ("dist_timeout", float("nan")),
    ("profile_dir", "/dev/null/profiles"),
])
def test_bad_field_is_named(field, value):
    with pytest.raises(ValueError, match=f"EngineConfig.{field} must be"):
        EngineConfig("model", **{"device": "cpu", "max_loras_per_batch": 4, field: value})


def test_parallel_options():
    assert EngineConfig("model", device="cpu", tp_size=4, enable_expert_parallel=True).ep_size == 4
    assert EngineConfig("model", device="cpu", tp_size=4, ep_size=2).ep_size == 2
    with pytest.raises(ValueError, match="EngineConfig.ep_size must be tp_size"):
        EngineConfig("model", device="cpu", tp_size=4, ep_size=2, enable_expert_parallel=True)
    # the all-to-all dispatch runs inside graphs too (at fixed capacity: ModelRunner caps their sizes)
    assert EngineConfig("model", device="cuda", tp_size=2, moe_dispatch="all_to_all").use_cuda_graph
    # overlap scheduling is the default, on one rank and over several (rank 0 broadcasts the sampled tokens)
    assert EngineConfig("model", device="cpu").overlap_schedule
    assert not EngineConfig("model", device="cpu", disable_overlap_schedule=True).overlap_schedule
    assert EngineConfig("model", device="cpu", tp_size=2).overlap_schedule


def test_lora_target_modules():
    """'all' alone, or names (checked against the model once it is loaded); None: inferred at start."""
    assert EngineConfig("model", device="cpu").lora_target_modules is None
    assert EngineConfig("model", device="cpu", lora_target_modules=["all"]).lora_target_modules == "all"
    assert EngineConfig("model", device="cpu", lora_target_modules="q_proj").lora_target_modules == ["q_proj"]
    targets = EngineConfig("model", device="cpu", lora_target_modules=("qkv_proj", "gate", "qkv_proj"))
    assert targets.lora_target_modules == ["qkv_proj", "gate"]


def test_several_nodes():
    addr = dict(dist_init_addr="10.0.0.1:5000")
    config = EngineConfig("model", device="cpu", tp_size=8, ep_size=8, nnodes=2, node_rank=1, **addr)
    assert (config.nnodes, config.node_rank, config.dist_init_addr) == (2, 1, "10.0.0.1:5000")
    assert EngineConfig("model", device="cpu", tp_size=2, dist_init_addr="[::1]:5000").nnodes == 1
    with pytest.raises(ValueError, match="EngineConfig.tp_size must be a multiple of nnodes \\(2\\)"):
        EngineConfig("model", device="cpu", tp_size=3, nnodes=2, **addr)
    with pytest.raises(ValueError, match="EngineConfig.node_rank must be in \\[0, nnodes=2\\), got 2"):
        EngineConfig("model", device="cpu", tp_size=2, nnodes=2, node_rank=2, **addr)
    with pytest.raises(ValueError, match="EngineConfig.dist_init_addr must be node 0's host:port with nnodes=2, got None"):
        EngineConfig("model", device="cpu", tp_size=2, nnodes=2)


def test_flag_aliases_are_keywords():
    """vLLM's keywords, the Python spelling of the flags' aliases, name the same fields; a field under two spellings
    with different values is refused, naming both."""
    config = EngineConfig("model", device="cpu", tensor_parallel_size=4, enable_expert_parallel=True, max_model_len=64,
                          gpu_memory_utilization=0.5, max_num_seqs=3, max_loras=2, max_num_batched_tokens=32)
    assert (config.tp_size, config.ep_size, config.context_length, config.mem_fraction_static) == (4, 4, 64, 0.5)
    assert (config.max_running_requests, config.max_loras_per_batch, config.chunked_prefill_size) == (3, 2, 32)
    assert EngineConfig("model", device="cpu", tp=4, ep=2).ep_size == 2  # --tp, --ep
    assert EngineConfig("model", device="cpu", tp_size=2, tensor_parallel_size=2).tp_size == 2  # agreeing: fine
    with pytest.raises(ValueError, match="EngineConfig.tp_size is given twice, as tp_size=4 and as "
                                         "tensor_parallel_size=2: give one"):
        EngineConfig("model", device="cpu", tp_size=4, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="EngineConfig.ep_size is given twice, as ep=2 and as expert_parallel_size=1"):
        EngineConfig("model", device="cpu", tp_size=2, ep=2, expert_parallel_size=1)
    with pytest.raises(TypeError, match="tensor_parallel"):  # no flag spells it so
        EngineConfig("model", device="cpu", tensor_parallel=2)


def test_a_profile_dir_is_checked_at_the_start(tmp_path):
    """Found writable (or makeable) when the engine is configured, not at the first profile; a file there, or under
    its path, is an error. Nothing is made before a profile starts."""
    EngineConfig("model", device="cpu", profile_dir=str(tmp_path / "a" / "b"))
    assert not (tmp_path / "a").exists()
    (tmp_path / "file").write_text("")
    for bad in (tmp_path / "file", tmp_path / "file" / "under"):
        with pytest.raises(ValueError, match="EngineConfig.profile_dir must be a directory this process can make"):
            EngineConfig("model", device="cpu", profile_dir=str(bad))


@pytest.mark.parametrize("chunk, steps", [(-1, 300), (64, 64)])
def test_the_warm_up_reaches_the_largest_prompt_step(monkeypatch, chunk, steps):
    """chunked_prefill_size -1 (prompts never split) warms up to the largest step the context allows; the warm-up
    once took the -1 as its bound and ran no prompt step at all."""
    from moelora.demo import ASSETS
    from moelora.engine.engine import Engine
    from moelora.engine.model_runner import ModelRunner

    warmed = []
    monkeypatch.setattr(EngineConfig, "warm_up_at_start", property(lambda self: True))
    monkeypatch.setattr(ModelRunner, "warm_up", lambda self, max_tokens: warmed.append(max_tokens))
    Engine(str(ASSETS / "model"), device="cpu", dtype="float32", chunked_prefill_size=chunk, max_prefill_tokens=4096,
           context_length=300).shutdown()
    assert warmed == [steps]


@pytest.mark.parametrize("option", [dict(max_total_tokens=10**11), dict(max_running_requests=10**9)])
def test_a_cache_larger_than_the_host_memory_is_an_error_naming_it(option):
    """On the CPU the KV cache and the request rows are checked against the memory available, as on GPUs against the
    free memory: torch's allocator error, a traceback from deep inside, named neither."""
    from moelora.demo import ASSETS
    from moelora.engine.engine import Engine

    name = next(iter(option))
    with pytest.raises(ValueError, match=f"{name}.* GiB of host memory is available"):
        Engine(str(ASSETS / "model"), device="cpu", dtype="float32", **option)


def test_host_memory_is_the_least_of_the_host_and_its_cgroup(tmp_path, monkeypatch):
    """On the CPU the KV cache is checked against MemAvailable, or the process's cgroup (v2) limit less its use where
    that is less (a container's); a cgroup without a limit, or none, leaves MemAvailable."""
    import moelora.engine.model_runner as model_runner

    host = 5 * 2**30
    (tmp_path / "meminfo").write_text(f"MemTotal: {2 * host // 1024} kB\nMemAvailable: {host // 1024} kB\n")
    monkeypatch.setattr(model_runner, "MEMINFO", str(tmp_path / "meminfo"))
    (tmp_path / "proc").write_text("1:memory:/v1-only\n0::/box/inner\n")
    group = tmp_path / "root" / "box" / "inner"
    group.mkdir(parents=True)
    monkeypatch.setattr(model_runner, "CGROUP_OF_PROCESS", str(tmp_path / "proc"))
    monkeypatch.setattr(model_runner, "CGROUP_ROOT", str(tmp_path / "root"))
    (group / "memory.max").write_text("max\n")
    assert model_runner._host_memory_available() == host
    (group / "memory.max").write_text(f"{3 * 2**30}\n")
    (group / "memory.current").write_text(f"{2**30}\n")
    assert model_runner._host_memory_available() == 2 * 2**30
    (tmp_path / "proc").write_text("4:memory:/v1-only\n")  # cgroup v1 only
    assert model_runner._host_memory_available() == host


def test_the_context_limit_follows_a_rope_scaling():
    """A YaRN or linear scaling serves its factor times the original positions (as vLLM's max_model_len); llama3's
    factor is no context extension (its config's max_position_embeddings says it)."""
    from types import SimpleNamespace

    from moelora.engine.model_runner import _positions
    config = lambda rope: SimpleNamespace(max_position_embeddings=40960, rope_parameters=rope)  # noqa: E731
    assert _positions(config({"rope_type": "default", "rope_theta": 1e6})) == 40960
    assert _positions(config({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768})) == 131072
    assert _positions(config({"rope_type": "linear", "factor": 2.0})) == 81920
    assert _positions(config({"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 8192})) == 40960
    assert _positions(config(None)) == 40960


def test_paths_and_numpy_numbers_are_taken_as_what_they_stand_for():
    import numpy as np
    from pathlib import Path
    config = EngineConfig(Path("model"), device="cpu", tokenizer_path=Path("/tmp"), random_seed=np.int64(3),
                          dist_timeout=np.float32(2.5), max_loras_per_batch=np.int32(4))
    assert (config.model_path, config.tokenizer_path, config.random_seed, config.dist_timeout) == ("model", "/tmp", 3, 2.5)
    assert type(config.random_seed) is int and type(config.max_loras_per_batch) is int
    assert type(config.dist_timeout) is float
