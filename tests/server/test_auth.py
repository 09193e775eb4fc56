"""--api-key: every route but /health, /metrics and /version answers 401 in OpenAI's shape without the key, and FastAPI's
docs pages are off."""
from __future__ import annotations

from importlib.metadata import version

import pytest
from fastapi.testclient import TestClient

from moelora.server.app import create_app
from tests.server.conftest import MODEL_NAME, make_engine

KEY = "s3cret"
OK = {"model": "alpha", "prompt": "Hello world", "max_tokens": 2}


@pytest.fixture(scope="module")
def client(demo_dir):
    with TestClient(create_app(make_engine(demo_dir, ["alpha"]), MODEL_NAME, api_key=KEY)) as c:
        yield c


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}])
def test_routes_need_the_key(client, demo_dir, headers):
    for method, path, body in [("GET", "/v1/models", None), ("POST", "/v1/completions", OK),
                               ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                               ("POST", "/load_lora_adapter", {"lora_name": "g", "lora_path": str(demo_dir / "gamma")}),
                               ("POST", "/v1/unload_lora_adapter", {"lora_name": "alpha"}),
                               ("POST", "/tokenize", {"prompt": "hi"}), ("POST", "/v1/detokenize", {"tokens": [1]})]:
        r = client.request(method, path, json=body, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", (path, r.text)


def test_the_key_opens_them_and_health_needs_none(client):
    auth = {"Authorization": f"Bearer {KEY}"}
    assert client.get("/v1/models", headers=auth).status_code == 200
    r = client.post("/v1/completions", json=OK, headers=auth)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    assert client.get("/health").status_code == 200 and client.get("/metrics").status_code == 200
    assert client.head("/health").status_code == 200  # (load balancers' probes may ask with HEAD)
    assert client.get("/version").json() == {"version": version("moelora")}
    for docs in ("/openapi.json", "/docs", "/redoc"):  # (FastAPI's pages would answer without the key: not served)
        assert client.get(docs, headers=auth).status_code == 404
