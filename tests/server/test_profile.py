"""POST /start_profile and /stop_profile: only on a server started with --profile-dir, each rank's trace written
between them, misuse a 400 that says why."""
from __future__ import annotations

import httpx

from moelora.engine.engine import Engine
from moelora.server.app import create_app
from tests.server.conftest import ENGINE_OPTIONS, MODEL_NAME, serving


def test_a_profile_over_http(demo_dir, tmp_path):
    engine = Engine(str(demo_dir / "model"), lora_paths={"alpha": str(demo_dir / "alpha")},
                    profile_dir=str(tmp_path), **ENGINE_OPTIONS)
    with serving(create_app(engine, MODEL_NAME)) as server, httpx.Client(base_url=server.url, timeout=60) as http:
        stop = http.post("/stop_profile")
        assert stop.status_code == 400 and "no profile is running" in stop.json()["error"]["message"]
        assert http.post("/start_profile").json()["success"] is True
        again = http.post("/start_profile")
        assert again.status_code == 400 and "running already" in again.json()["error"]["message"]
        done = http.post("/v1/completions", json={"model": "alpha", "prompt": "Hello world", "max_tokens": 4})
        assert done.status_code == 200, done.text
        stopped = http.post("/stop_profile").json()
        traces = [p for p in tmp_path.iterdir() if p.name.endswith(".trace.json.gz")]
        assert stopped["success"] is True and stopped["traces"] == [str(t) for t in traces] and len(traces) == 1
        assert traces[0].stat().st_size > 0 and server.idle()
        # the directory gone (a file in its place) while recording: a 500 that says so, and no profile running on
        assert http.post("/start_profile").status_code == 200
        for p in tmp_path.iterdir():
            p.unlink()
        tmp_path.rmdir()
        tmp_path.write_text("")
        lost = http.post("/stop_profile")
        assert lost.status_code == 500 and "could not be written" in lost.json()["error"]["message"], lost.text
        refused = http.post("/start_profile")
        assert refused.status_code == 400 and "cannot make the profile directory" in refused.json()["error"]["message"]
        assert http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 2}).status_code == 200


def test_no_profile_routes_without_a_profile_dir(server):
    with httpx.Client(base_url=server.url, timeout=30) as http:
        assert http.post("/start_profile").status_code == 404
        assert http.post("/stop_profile").status_code == 404


def test_profile_routes_take_no_body(demo_dir, tmp_path):
    """SGLang's options (num_steps, output_dir, ...) are refused by name, not ignored: a client counting on num_steps
    would leave every rank recording."""
    engine = Engine(str(demo_dir / "model"), profile_dir=str(tmp_path), **ENGINE_OPTIONS)
    with serving(create_app(engine, MODEL_NAME)) as server, httpx.Client(base_url=server.url, timeout=60) as http:
        refused = http.post("/start_profile", json={"num_steps": 5})
        assert refused.status_code == 400 and "/start_profile takes no body" in refused.json()["error"]["message"]
        assert not engine.runner.profiler.active
        assert http.post("/start_profile", json={}).status_code == 200
        assert http.post("/stop_profile", json={"output_dir": "/tmp"}).status_code == 400
        assert http.post("/stop_profile").status_code == 200
