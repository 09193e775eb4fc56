"""--generation-config (vLLM's flag and default, 'auto'): the model's generation_config.json gives the sampling
fields a request leaves unset (temperature, top_p, top_k, min_p, repetition_penalty; not max_new_tokens); what
the request sets wins; 'vllm' takes none."""
from __future__ import annotations

import json
import shutil

import pytest
from fastapi.testclient import TestClient

from moelora.engine.engine import Engine
from moelora.engine.sampling_params import SamplingParams
from moelora.server.app import create_app
from tests.server.conftest import ENGINE_OPTIONS, MODEL_NAME

GENERATION = {"do_sample": True, "temperature": 1.7, "top_k": 3, "top_p": 0.9, "repetition_penalty": 1.3,
              "max_new_tokens": 5, "eos_token_id": 0}
DEFAULTS = {"temperature": 1.7, "top_p": 0.9, "top_k": 3, "repetition_penalty": 1.3}


@pytest.fixture(scope="module")
def model(demo_dir, tmp_path_factory):
    """The demo's model with a generation_config.json of sampling defaults."""
    path = tmp_path_factory.mktemp("generation-config") / "model"
    shutil.copytree(demo_dir / "model", path)
    (path / "generation_config.json").write_text(json.dumps(GENERATION))
    return path


@pytest.fixture(scope="module")
def engine(model):
    return Engine(str(model), **ENGINE_OPTIONS)


def test_the_engine_reads_the_defaults(engine, model):
    assert engine.sampling_defaults == DEFAULTS
    assert any("sampling defaults" in line and "temperature=1.7" in line for line in engine.summary())
    assert Engine(str(model), generation_config="vllm", **ENGINE_OPTIONS).sampling_defaults == {}


def test_unset_fields_take_them_and_set_ones_win(engine, model):
    """(Each server gets an engine of its own: its shutdown ends the engine; the module's is the reference.)"""
    prompt, seed = "The quick brown fox", 11
    with TestClient(create_app(Engine(str(model), **ENGINE_OPTIONS), MODEL_NAME)) as client:
        def completion(**fields) -> dict:
            r = client.post("/v1/completions", json={"prompt": prompt, "seed": seed, "max_tokens": 5, **fields})
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]

        def chat(**fields) -> dict:
            r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": prompt}],
                                                          "seed": seed, "max_tokens": 5, **fields})
            assert r.status_code == 200, r.text
            return r.json()

        unset = completion()["text"]
        chat_unset = chat()
    defaults = DEFAULTS

    def generate(params: SamplingParams, text: str) -> str:
        return engine.generate([text], params)[0].text

    assert unset == generate(SamplingParams(max_tokens=5, seed=seed, **defaults), prompt)
    assert unset != generate(SamplingParams(max_tokens=5, seed=seed), prompt)  # the API's own defaults differ
    with TestClient(create_app(Engine(str(model), **ENGINE_OPTIONS), MODEL_NAME)) as client:
        r = client.post("/v1/completions", json={"prompt": prompt, "seed": seed, "max_tokens": 5, "temperature": 0})
        assert r.json()["choices"][0]["text"] == generate(SamplingParams(max_tokens=5, temperature=0), prompt)
    chat_prompt = engine.chat_prompt([{"role": "user", "content": prompt}], None)
    assert chat_unset["choices"][0]["message"]["content"] == generate(
        SamplingParams(max_tokens=5, seed=seed, **defaults), chat_prompt)


@pytest.mark.parametrize("content, message", [
    ('{"temperature": -1}', "SamplingParams.temperature"), ("[1]", "must be a JSON object"), ("{x", "not valid JSON"),
    # it was taken as the requests' stop tokens: every request failed, blamed on a --stop-token-ids never given
    ('{"eos_token_id": "x"}', r"eos_token_id must be token ids \(ints >= 0\), got 'x'"),
    ('{"eos_token_id": [2, -1]}', r"eos_token_id must be token ids \(ints >= 0\), got -1"),
])
def test_a_bad_file_ends_the_start_naming_it(tmp_path, model, content, message):
    bad = tmp_path / "model"
    shutil.copytree(model, bad)
    (bad / "generation_config.json").write_text(content)
    with pytest.raises(ValueError, match=f"generation_config.json: .*{message}"):
        Engine(str(bad), **ENGINE_OPTIONS)


def test_a_directory_without_the_file_is_refused(tmp_path, model):
    with pytest.raises(ValueError, match="EngineConfig.generation_config must be 'auto', 'vllm' or a directory"):
        Engine(str(model), generation_config=str(tmp_path), **ENGINE_OPTIONS)
