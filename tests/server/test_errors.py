"""Bad input gets its error in OpenAI's shape with the right status; clients that leave have their
requests aborted and their KV cache freed; a failing engine step fails only the requests in it.
After each test the server answers a normal request and holds nothing."""
from __future__ import annotations

import json
import time

import httpx
import pytest

from moelora.engine import model_runner
from moelora.engine.engine import Engine
from moelora.server.app import create_app
from tests.server.conftest import ENGINE_OPTIONS, MODEL_NAME, serving

OK = {"model": "alpha", "prompt": "Hello world", "max_tokens": 2}
CHAT = {"model": "beta", "messages": [{"role": "user", "content": "Hello world"}], "max_tokens": 2}
LONG = {"model": "alpha", "prompt": "Hello world", "max_tokens": 400, "ignore_eos": True}


@pytest.fixture(autouse=True)
def still_serving(server):
    yield
    r = httpx.post(f"{server.url}/v1/completions", json=OK)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    assert server.idle()


def post(server, path: str, body=None, **kwargs) -> httpx.Response:
    """httpx's 5 s default is too short for the few requests that generate hundreds of tokens on a busy CPU."""
    return httpx.post(f"{server.url}{path}", json=body, **{"timeout": 60, **kwargs})


def error(r: httpx.Response, status: int, param: str | None = None, match: str = "", code: str | None = None) -> dict:
    """The error in OpenAI's shape (param and code present, null or not); every 400 has a code."""
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert isinstance(err["message"], str) and isinstance(err["type"], str) and match in err["message"]
    assert err["param"] == param, err
    assert err["code"] == code if code is not None else (status != 400 or isinstance(err["code"], str)), err
    return err


def finished(server, reason: str) -> float:
    line = f'moelora:requests_finished_total{{finish_reason="{reason}"}} '
    text = httpx.get(f"{server.url}/metrics").text
    return next((float(s.split()[-1]) for s in text.splitlines() if s.startswith(line)), 0.0)


def test_malformed_json_and_bodies_that_are_not_objects(server):
    r = httpx.post(f"{server.url}/v1/completions", content=b'{"model": "alpha", "prompt": ',
                   headers={"content-type": "application/json"})
    err = error(r, 400, code="invalid_json")
    assert err["type"] == "invalid_request_error" and err["message"].startswith("the request body is not valid JSON: ")
    error(post(server, "/v1/chat/completions", [1, 2]), 400)
    error(post(server, "/v1/load_lora_adapter", "alpha"), 400)


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {**OK, "max_tokens": "many"}, "max_tokens"),
    ("/v1/completions", {**OK, "prompt": None}, "prompt"),
    ("/v1/completions", {"model": "alpha"}, "prompt"),
    ("/v1/completions", {**OK, "stop": 5}, "stop"),
    ("/v1/chat/completions", {**CHAT, "messages": "hi"}, "messages"),
    ("/v1/chat/completions", {**CHAT, "messages": []}, "messages"),
    ("/v1/chat/completions", {**CHAT, "logprobs": "yes please"}, "logprobs"),
    ("/v1/load_lora_adapter", {"lora_name": "x"}, "lora_path"),
    ("/v1/completions", {**OK, "n": 300}, "n"),
    ("/v1/completions", {**OK, "prompt": ["a"] * 200, "n": 2}, "n"),
])
def test_wrong_types_name_the_field(server, path, body, param):
    error(post(server, path, body), 400, param)


@pytest.mark.parametrize("path, body, param", [
    ("/v1/load_lora_adapter", {"lora_name": "", "lora_path": "/x"}, "lora_name"),
    ("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": ""}, "lora_path"),
    ("/v1/unload_lora_adapter", {"lora_name": ""}, "lora_name"),
])
def test_an_empty_name_or_path_is_an_invalid_value(server, path, body, param):
    assert error(post(server, path, body), 400, param)["code"] == "invalid_value"


@pytest.mark.parametrize("field, value", [("max_tokens", -1), ("max_tokens", 0), ("temperature", -0.5), ("top_p", 2.0),
                                          ("top_k", -3), ("seed", 2**70), ("logprobs", 21), ("n", 0),
                                          ("presence_penalty", 2.5)])
def test_out_of_range_parameters(server, field, value):
    error(post(server, "/v1/completions", {**OK, field: value}), 400, field)


def test_chat_parameters(server, monkeypatch):
    error(post(server, "/v1/chat/completions", {**CHAT, "top_logprobs": 2}), 400, "top_logprobs")
    error(post(server, "/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 50}), 400, "top_logprobs")
    image = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}
    error(post(server, "/v1/chat/completions", {**CHAT, "messages": [image]}), 400, "messages", "only text")
    monkeypatch.setattr(server.loop.engine.tokenizer, "chat_template", None)
    error(post(server, "/v1/chat/completions", CHAT), 400, "messages", "has no chat template")


def test_unknown_model_or_route(server):
    err = error(post(server, "/v1/completions", {**OK, "model": "nope"}), 404, "model", "`nope` does not exist")
    assert err["code"] == "model_not_found"
    error(post(server, "/v1/chat/completions", {**CHAT, "model": "nope"}), 404, "model")
    error(post(server, "/v1/unload_lora_adapter", {"lora_name": "nope"}), 404, "lora_name", "unknown adapter 'nope'")
    error(post(server, "/v1/unload_lora_adapter", {"lora_name": MODEL_NAME}), 404, "lora_name")
    error(httpx.get(f"{server.url}/v1/nothing-here"), 404)


def test_adapters_that_cannot_load(server, demo_dir):
    err = error(post(server, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": str(demo_dir / "missing")}),
                400, "lora_path", "missing: does not exist (an adapter directory expected)")
    assert err["problems"] == [err["message"]]
    err = error(post(server, "/load_lora_adapter", {"lora_name": "x", "lora_path": str(demo_dir / "broken")}),
                400, "lora_path", "problem(s)")
    assert len(err["problems"]) > 1 and all("adapter_config.json gives r=4" in p for p in err["problems"])
    error(post(server, "/v1/load_lora_adapter", {"lora_name": "alpha", "lora_path": str(demo_dir / "gamma")}),
          400, "lora_name", "already loaded")
    error(post(server, "/v1/load_lora_adapter", {"lora_name": MODEL_NAME, "lora_path": str(demo_dir / "gamma")}),
          400, "lora_name")
    assert {m["id"] for m in httpx.get(f"{server.url}/v1/models").json()["data"]} == {MODEL_NAME, "alpha", "beta"}


def test_an_adapter_of_modules_without_slots_is_a_400(demo_dir):
    """A server with LoRA slots on attention alone refuses gamma (attention and experts), every module
    without slots named, and goes on serving."""
    engine = Engine(str(demo_dir / "model"), lora_target_modules=["qkv_proj", "o_proj"], **ENGINE_OPTIONS)
    with serving(create_app(engine, MODEL_NAME)) as other:
        err = error(post(other, "/v1/load_lora_adapter", {"lora_name": "gamma", "lora_path": str(demo_dir / "gamma")}),
                    400, "lora_path", f"adapter {demo_dir / 'gamma'} cannot be served by this engine: 3 problem(s)")
        assert err["problems"] == [f"mlp.experts.{p} (layers 0-1): this engine has no LoRA slots for it; start the "
                                   f"engine with --lora-target-modules including {p} (or all)"
                                   for p in ("gate_proj", "up_proj", "down_proj")]
        assert [m["id"] for m in httpx.get(f"{other.url}/v1/models").json()["data"]] == [MODEL_NAME]
        r = post(other, "/v1/completions", {**OK, "model": MODEL_NAME})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


def test_prompts_the_context_cannot_hold(server):
    too_long = "context_length_exceeded"
    error(post(server, "/v1/completions", {**OK, "prompt": "Hello " * 600}), 400, "prompt", "the context holds 512",
          too_long)
    error(post(server, "/v1/completions", {**OK, "prompt": [1, 10**6]}), 400, "prompt", "token ids must be")
    error(post(server, "/v1/completions", {**OK, "prompt": []}), 400, "prompt")
    error(post(server, "/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "Hello " * 600}]}),
          400, "messages", "the context holds 512", too_long)


def test_max_tokens_beyond_the_context_is_refused_not_cut(server):
    """As vLLM: prompt + max_tokens over the context is a 400 naming both numbers; without max_tokens a
    chat completion may fill the context."""
    prompt = [1] * 500
    error(post(server, "/v1/completions", {**OK, "prompt": prompt, "max_tokens": 13}), 400, "max_tokens",
          "max_tokens=13 and the prompt's 500 tokens are 513 tokens; the context holds 512", "context_length_exceeded")
    r = post(server, "/v1/completions", {**OK, "prompt": prompt, "max_tokens": 12, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 12
    messages = [{"role": "user", "content": "Hello " * 200}]
    err = error(post(server, "/v1/chat/completions", {**CHAT, "messages": messages, "max_completion_tokens": 400}),
                400, "max_completion_tokens", "the context holds 512", "context_length_exceeded")
    chat_prompt = int(err["message"].split("the prompt's ")[1].split()[0])
    r = post(server, "/v1/chat/completions", {**CHAT, "messages": messages, "max_tokens": None, "ignore_eos": True})
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    assert usage.pop("prompt_tokens_details")["cached_tokens"] < chat_prompt  # (what the prefix cache held of it)
    assert usage == {"prompt_tokens": chat_prompt, "completion_tokens": 512 - chat_prompt, "total_tokens": 512}


def test_overload_is_503(server, monkeypatch):
    monkeypatch.setattr(server.loop, "max_queued_requests", 1)
    monkeypatch.setattr(server.loop, "_pending", 1)  # one sequence submitted, not yet added
    assert error(post(server, "/v1/completions", OK), 503)["code"] == "overloaded"


@pytest.mark.parametrize("route, body", [("load_lora_adapter", {"lora_name": "g", "lora_path": "/nowhere"}),
                                         ("unload_lora_adapter", {"lora_name": "alpha"})])
def test_an_adapter_route_on_an_engine_whose_rank_died_is_503(server, monkeypatch, route, body):
    """As the requests' routes: the engine's failure, not the request's (it was a 500 with a traceback logged)."""
    from moelora.engine import WorkerFailure

    async def rank_died(*args):
        raise WorkerFailure("rank 1 exited with code -9")
    monkeypatch.setattr(server.loop, route.removesuffix("_adapter"), rank_died)
    err = error(post(server, f"/v1/{route}", body), 503)
    assert err["type"] == "server_error" and "rank 1 exited with code -9" in err["message"]


def test_more_sequences_than_may_ever_wait_is_400_naming_n_or_prompt(server, monkeypatch):
    """n x prompts past max_queued_requests could never be admitted: a 400 naming n (or, with n = 1, the prompts),
    not a 503 a client retries."""
    monkeypatch.setattr(server.loop, "max_queued_requests", 2)
    error(post(server, "/v1/completions", {**OK, "n": 3}), 400, "n", "max_queued_requests (2)")
    error(post(server, "/v1/completions", {**OK, "prompt": ["a", "b", "c"]}), 400, "prompt", "got n=1 for 3 prompts")
    assert post(server, "/v1/completions", {**OK, "n": 2}).status_code == 200
    assert post(server, "/v1/completions", {**OK, "prompt": ["a", "b"]}).status_code == 200


def test_client_leaving_mid_stream_aborts_its_request(server):
    aborts = finished(server, "abort")
    with httpx.stream("POST", f"{server.url}/v1/completions", json={**LONG, "stream": True}) as r:
        chunks = 0
        for line in r.iter_lines():
            chunks += line.startswith("data: ")
            if chunks == 3:
                break  # and close the connection
    assert chunks == 3
    assert server.idle()  # nothing in flight, every KV slot and row free
    assert finished(server, "abort") == aborts + 1


def test_client_leaving_before_a_whole_response_aborts_its_request(server):
    aborts = finished(server, "abort")
    with pytest.raises(httpx.ReadTimeout):
        post(server, "/v1/chat/completions", {**CHAT, "max_tokens": 400, "ignore_eos": True}, timeout=0.3)
    assert server.idle()
    assert finished(server, "abort") == aborts + 1


@pytest.mark.parametrize("stream", [True, False])
def test_client_leaving_while_its_request_is_queued_aborts_it(server, stream):
    aborts = finished(server, "abort")
    busy = server.loop.call(lambda: time.sleep(1.0))  # the engine thread takes the request only after the client left
    with pytest.raises(httpx.ReadTimeout):
        post(server, "/v1/completions", {**LONG, "stream": stream}, timeout=0.3)
    busy.result()
    assert server.idle()
    assert finished(server, "abort") == aborts + 1


def test_a_failing_step_fails_only_the_requests_in_it(server, monkeypatch):
    step, calls = server.loop.engine.step, []

    def failing():
        calls.append(1)
        if len(calls) == 2:  # the first decode step of the stream
            raise RuntimeError("boom")
        return step()
    monkeypatch.setattr(server.loop.engine, "step", failing)
    errors = finished(server, "error")
    with httpx.stream("POST", f"{server.url}/v1/completions", json={**OK, "max_tokens": 5, "stream": True}) as r:
        events = [line.removeprefix("data: ") for line in r.iter_lines() if line]
    assert r.status_code == 200 and events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["message"] == "the engine failed: boom"
    assert finished(server, "error") == errors + 1  # counted though its stream ended outside the engine's outputs
    r = post(server, "/v1/completions", OK)  # steps work again
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize("stream", [True, False])
def test_a_failed_sequence_aborts_its_siblings(server, monkeypatch, stream):
    """n=2: sampling fails for the batches holding the first sequence's seed (the engine isolates the fault to it);
    the request fails, and its second sequence (seed + 1) is aborted at once rather than run to max_tokens."""
    victim_seed, real = 987654321, model_runner.sample

    def sample(logits, batch, k=0):
        if victim_seed in batch.seed.tolist():
            raise RuntimeError("injected sampling fault")
        return real(logits, batch, k)
    monkeypatch.setattr(model_runner, "sample", sample)
    aborts, lengths = finished(server, "abort"), finished(server, "length")
    body = {**LONG, "n": 2, "seed": victim_seed, "temperature": 1.0, "stream": stream}
    r = post(server, "/v1/completions", body, timeout=60)
    if stream:
        assert r.status_code == 200 and "injected sampling fault" in r.text
    else:
        assert r.status_code == 500 and "injected sampling fault" in r.json()["error"]["message"]
    assert server.idle()
    assert (finished(server, "abort"), finished(server, "length")) == (aborts + 1, lengths)
