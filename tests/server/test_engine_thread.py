"""The engine thread only steps: chat templates, tokenization and detokenization run in the text
thread, adapter files are read in a worker, so none of them holds up the steps of running requests."""
from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from moelora.engine.engine import Engine
from moelora.engine.sampling_params import SamplingParams
from moelora.server.app import create_app
from tests.server.conftest import ENGINE_OPTIONS, MODEL_NAME, SERVED, serving

IDS = [5, 6, 7, 8]


def post(server, path: str, body: dict, timeout: float = 60) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=timeout)


def test_tokenizer_work_runs_in_the_text_thread(server, monkeypatch):
    tokenizer, calls = server.loop.engine.tokenizer, []
    for name in ("encode", "decode", "apply_chat_template"):
        def recorded(*args, real=getattr(tokenizer, name), name=name, **kwargs):
            calls.append((name, threading.current_thread().name))
            return real(*args, **kwargs)
        monkeypatch.setattr(tokenizer, name, recorded)
    chat = post(server, "/v1/chat/completions", {"model": "alpha", "messages": [{"role": "user", "content": "Hi"}],
                                                 "max_tokens": 6, "logprobs": True, "top_logprobs": 2})
    echo = post(server, "/v1/completions", {"model": MODEL_NAME, "prompt": IDS, "max_tokens": 4, "echo": True,
                                            "logprobs": 1})
    assert chat.status_code == echo.status_code == 200
    assert {name for name, _ in calls} == {"encode", "decode", "apply_chat_template"}
    assert {thread for _, thread in calls} == {"moelora-text_0"}


def test_a_stop_string_ends_the_request_and_frees_it(server):
    full = post(server, "/v1/completions", {"model": "beta", "prompt": IDS, "max_tokens": 12, "temperature": 0,
                                            "ignore_eos": True}).json()["choices"][0]["text"]
    stop = full.split()[1]
    out = post(server, "/v1/completions", {"model": "beta", "prompt": IDS, "max_tokens": 12, "temperature": 0,
                                           "ignore_eos": True, "stop": [stop]}).json()
    assert out["choices"][0]["text"] == full[:full.index(stop)] and out["choices"][0]["finish_reason"] == "stop"
    assert out["usage"]["completion_tokens"] < 12
    assert server.idle()


@pytest.mark.parametrize("slow", ["read_lora", "tokenize"])
def test_slow_file_or_text_work_does_not_hold_up_the_steps(server, demo_dir, monkeypatch, slow):
    """An adapter file or a prompt that takes long to read or tokenize (held here until the test lets
    go): a request already running goes on stepping meanwhile."""
    engine, entered, release = server.loop.engine, threading.Event(), threading.Event()
    real, step, steps = getattr(engine, slow), engine.step, []

    def held(*args, **kwargs):
        if slow == "read_lora" or isinstance(args[0], str):  # the running request's prompt is token ids
            entered.set()
            release.wait(30)
        return real(*args, **kwargs)
    monkeypatch.setattr(engine, slow, held)
    monkeypatch.setattr(engine, "step", lambda: steps.append(1) or step())
    results: dict[str, httpx.Response] = {}

    def request(key: str, path: str, body: dict) -> threading.Thread:
        thread = threading.Thread(target=lambda: results.__setitem__(key, post(server, path, body)))
        thread.start()
        return thread
    running = request("running", "/v1/completions", {"model": "alpha", "prompt": IDS, "max_tokens": 120,
                                                     "ignore_eos": True})
    deadline = time.monotonic() + 30
    while not steps:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    other = request("other", "/v1/load_lora_adapter", {"lora_name": "gamma", "lora_path": str(demo_dir / "gamma")}) \
        if slow == "read_lora" else request("other", "/v1/completions", {"model": "beta", "prompt": "Hello world",
                                                                          "max_tokens": 2})
    assert entered.wait(30)
    before = len(steps)
    while len(steps) < before + 5:
        assert time.monotonic() < deadline, "the steps stopped while the other request's work was held"
        time.sleep(0.01)
    release.set()
    running.join()
    other.join()
    assert results["running"].status_code == results["other"].status_code == 200, results["other"].text
    assert results["running"].json()["usage"]["completion_tokens"] == 120
    if slow == "read_lora":
        assert post(server, "/v1/unload_lora_adapter", {"lora_name": "gamma"}).status_code == 200
    assert server.idle()


def test_an_engine_scheduling_ahead_serves_the_same_completions(demo_dir, reference):
    """overlap scheduling behind the server: streamed and whole completions, a stop string among
    them, as the engine gives them alone."""
    engine = Engine(str(demo_dir / "model"), lora_paths={n: str(demo_dir / n) for n in SERVED},
                    disable_overlap_schedule=False, **ENGINE_OPTIONS)
    greedy = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    with serving(create_app(engine, MODEL_NAME)) as server:
        for model, prompt in [("alpha", "Hello world"), (MODEL_NAME, "the quick brown fox"), ("beta", "Hello")]:
            lora = None if model == MODEL_NAME else model
            want = reference.generate(prompt, greedy, lora=lora)[0].text
            body = {"model": model, "prompt": prompt, "max_tokens": 10, "temperature": 0, "ignore_eos": True}
            assert post(server, "/v1/completions", body).json()["choices"][0]["text"] == want
            with httpx.stream("POST", f"{server.url}/v1/completions", json={**body, "stream": True}) as r:
                chunks = [line.removeprefix("data: ") for line in r.iter_lines() if line.startswith("data: {")]
            assert "".join(json.loads(c)["choices"][0]["text"] for c in chunks) == want
            stop = want.split()[1]
            out = post(server, "/v1/completions", {**body, "stop": [stop]}).json()["choices"][0]
            assert out["text"] == want[:want.index(stop)] and out["finish_reason"] == "stop"
        assert server.idle()
