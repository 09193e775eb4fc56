"""The model tests' per-family checkpoints and adapters, and adapters that test the expert split: one on the
experts of the first expert-parallel rank alone, and three of ranks 4, 16 and 64."""
from __future__ import annotations

import pytest
import torch
from peft import LoraConfig

from moelora.engine.engine import Engine
from tests.lora.lora_builders import PerExpertModel
from tests.models.conftest import adapters, checkpoint  # noqa: F401  (session fixtures, shared)
from tests.models.families import family_config, hf_model
from tests.support import peft_adapter


@pytest.fixture(scope="session")
def split_adapters(tmp_path_factory):
    """family -> {"first_half": rank 4 on routed experts [0, E/2) only, "last_quarter": rank 8 on [3E/4, E) only
    (transformers v4 per-expert modules, so PEFT names the experts), "r4", "r8", "r16", "r64": PEFT adapters of
    those ranks on attention and every expert}."""
    cache = {}

    def build(family: str) -> dict[str, str]:
        if family in cache:
            return cache[family]
        config = family_config(family)
        experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None) \
            or config.n_routed_experts
        mixtral = family == "mixtral"
        projections = "w[123]" if mixtral else "(gate|up|down)_proj"
        block = "block_sparse_moe" if mixtral else "mlp"
        first_half = "|".join(str(e) for e in range(experts // 2))
        last_quarter = "|".join(str(e) for e in range(experts - experts // 4, experts))
        configs = {"first_half": (LoraConfig(r=4, lora_alpha=8, target_modules=rf".*\.{block}\.experts\.({first_half})\.{projections}"),
                                  PerExpertModel(hf_model(config), mixtral)),
                   "last_quarter": (LoraConfig(r=8, lora_alpha=8, target_modules=rf".*\.{block}\.experts\.({last_quarter})\.{projections}"),
                                    PerExpertModel(hf_model(config), mixtral))}
        for rank in (4, 8, 16, 64):
            configs[f"r{rank}"] = (LoraConfig(r=rank, lora_alpha=rank, target_modules=["q_proj", "o_proj", "kv_b_proj"],
                                              target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]),
                                   hf_model(config))
        cache[family] = {}
        for i, (name, (lora_config, model)) in enumerate(configs.items()):
            path = tmp_path_factory.mktemp(f"{family}-{name}")
            peft_adapter(model, lora_config, path, seed=10 + i)
            cache[family][name] = str(path)
        return cache[family]
    return build


@pytest.fixture
def start_engine(checkpoint, adapters):  # noqa: F811  (the session fixtures imported above)
    """start_engine(family, **EngineConfig fields) -> an engine (fp32 on the CPU unless told) with the family's
    "full" and "partial" adapters; engines over several ranks are shut down after the test."""
    started = []

    def start(family: str, **options) -> Engine:
        paths = {name: str(a.path) for name, a in adapters(family).items()}
        common = dict(lora_paths=paths, device="cpu", dtype="float32", max_loras_per_batch=2, max_lora_rank=8)
        engine = Engine(str(checkpoint(family)), **{**common, **options})
        started.append(engine)
        return engine
    yield start
    for engine in started:
        engine.shutdown()


@pytest.fixture(autouse=True)
def _one_thread():
    """This process's one-rank references on one thread, as each rank runs: on a machine of few busy cores,
    torch's thread pool makes the tiny models' many small ops a hundred times slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
