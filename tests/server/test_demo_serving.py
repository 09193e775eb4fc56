"""The README's `moelora serve` and curl example on the bundled demo model, read from the README itself
so the two cannot drift apart: the flags parse, and the request answers in upper case with `shout`."""
from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

from fastapi.testclient import TestClient

from moelora.cli import _fields_of, build_parser
from moelora.engine.config import EngineConfig
from moelora.engine.engine import Engine
from moelora.server.app import create_app
from tests.support import upper_share

REPO = Path(__file__).resolve().parents[2]


def readme_example() -> tuple[list[str], str, dict]:
    """(the serve command's arguments after `moelora`, the curl request's route, its JSON body)."""
    readme = (REPO / "README.md").read_text().replace("\\\n", " ")
    serve = re.search(r"^moelora (serve --model-path moelora/demo_assets/model .*?) &$", readme, re.M)
    curl = re.search(r"^curl -s localhost:30000(/v1/\S+) .*? -d '(\{.*?\})'$", readme, re.M)
    assert serve and curl, "README.md: the demo's serve and curl example are not there"
    return shlex.split(serve[1]), curl[1], json.loads(curl[2])


def test_the_readme_curl_example_on_the_demo_model(monkeypatch):
    argv, route, body = readme_example()
    monkeypatch.chdir(REPO)  # the README's paths are relative to the checkout
    args = build_parser().parse_args(argv)
    engine = Engine(**_fields_of(args, EngineConfig))
    with TestClient(create_app(engine, Path(args.model_path).name)) as client:
        reply = client.post(route, json=body)
        assert reply.status_code == 200, reply.text
        text = reply.json()["choices"][0]["text"]
        base = client.post(route, json={**body, "model": "model"}).json()["choices"][0]["text"]
    assert body["model"] == "shout" and upper_share(text) >= 0.9, text
    assert upper_share(base) < 0.2, base
