"""`moelora serve --tp-size 2 --ep-size 2` on the demo's tiny Qwen3-MoE: the flags parse into an engine that
starts its second rank, and completions (an adapter loaded over HTTP among them) are those of one rank."""
from __future__ import annotations

from fastapi.testclient import TestClient

from moelora.cli import _fields_of, build_parser
from moelora.engine.config import EngineConfig
from moelora.engine.engine import Engine
from moelora.engine.sampling_params import SamplingParams
from moelora.server.app import create_app
from tests.server.conftest import ENGINE_OPTIONS, demo_dir  # noqa: F401  (session fixture, shared)

PROMPT = "the quick brown fox"


def test_serve_over_two_ranks(demo_dir):  # noqa: F811
    argv = ["serve", "--model-path", str(demo_dir / "model"), "--lora-paths", f"alpha={demo_dir / 'alpha'}",
            "--tp-size", "2", "--ep-size", "2", "--device", "cpu", "--dtype", "float32", "--max-lora-rank", "8",
            "--max-loras-per-batch", "2"]
    args = build_parser().parse_args(argv)
    engine = Engine(**_fields_of(args, EngineConfig))
    assert (engine.config.tp_size, engine.config.ep_size) == (2, 2)
    one = Engine(str(demo_dir / "model"), lora_paths={n: str(demo_dir / n) for n in ("alpha", "gamma")},
                 **ENGINE_OPTIONS)
    try:
        with TestClient(create_app(engine, "tiny-moe")) as client:
            loaded = client.post("/v1/load_lora_adapter", json={"lora_name": "gamma", "lora_path": str(demo_dir / "gamma")})
            assert loaded.status_code == 200, loaded.text
            for model in ("alpha", "gamma", "tiny-moe"):
                reply = client.post("/v1/completions", json={"model": model, "prompt": PROMPT, "max_tokens": 8,
                                                              "temperature": 0})
                assert reply.status_code == 200, reply.text
                lora = None if model == "tiny-moe" else model
                want = one.generate([PROMPT], SamplingParams(max_tokens=8, temperature=0.0), lora=lora)[0].text
                assert reply.json()["choices"][0]["text"] == want, model
    finally:
        engine.shutdown()
