"""vLLM's prompt_logprobs on both routes: each prompt token's log-probability and rank among the vocabulary, and the
top prompt_logprobs tokens with ranks 1..k, as the full distribution computed apart has them (Engine.prompt_logprobs);
beside echo with its own logprobs count; refused with stream or out of range."""
from __future__ import annotations

import threading

import httpx
import pytest

from tests.server.conftest import MODEL_NAME

TOL = 1e-4


def post(server, route: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{route}", json={"model": "alpha", **body}, timeout=60)


def check(entries: list, ids: list[int], full, k: int, tokenizer) -> None:
    """entries (vLLM's prompt_logprobs) against full [len(ids), vocab] log-probabilities."""
    assert entries[0] is None and len(entries) == len(ids)
    for i, entry in enumerate(entries[1:]):
        row, token = full[i], ids[i + 1]
        mine = entry[str(token)]
        assert mine["logprob"] == pytest.approx(row[token].item(), abs=TOL)
        assert mine["rank"] == int((row > row[token]).sum()) + 1
        top = row.topk(k)
        for r, (u, v) in enumerate(zip(top.indices.tolist(), top.values.tolist()), 1):
            assert entry[str(u)]["logprob"] == pytest.approx(v, abs=TOL)
            assert entry[str(u)]["rank"] == (r if u != token else mine["rank"])
        assert set(entry) == {str(token), *map(str, top.indices.tolist())}
        assert all(e["decoded_token"] == tokenizer.decode([int(u)]) for u, e in entry.items())


def test_completions_prompt_logprobs(server, reference):
    text = "the quick brown fox jumps over the lazy dog"
    ids = reference.tokenizer.encode(text)
    r = post(server, "/v1/completions", {"prompt": text, "max_tokens": 2, "temperature": 0, "prompt_logprobs": 3})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    check(choice["prompt_logprobs"], ids, reference.prompt_logprobs([ids], lora="alpha")[0], 3, reference.tokenizer)
    assert choice["logprobs"] is None and not choice["text"].startswith(text)  # no echo


def test_echo_keeps_its_own_count_beside_prompt_logprobs(server, reference):
    text = "Hello world, déjà vu"
    echo = {"prompt": text, "max_tokens": 2, "temperature": 0, "echo": True, "logprobs": 1}
    alone = post(server, "/v1/completions", echo).json()["choices"][0]
    both = post(server, "/v1/completions", {**echo, "prompt_logprobs": 5}).json()["choices"][0]
    assert alone["prompt_logprobs"] is None
    assert both["logprobs"] == alone["logprobs"] and both["text"] == alone["text"]
    ids = reference.tokenizer.encode(text)
    check(both["prompt_logprobs"], ids, reference.prompt_logprobs([ids], lora="alpha")[0], 5, reference.tokenizer)


def test_chat_prompt_logprobs(server, reference):
    messages = [{"role": "user", "content": "naïve café"}]
    r = post(server, "/v1/chat/completions", {"messages": messages, "max_tokens": 2, "prompt_logprobs": 0})
    assert r.status_code == 200, r.text
    ids = reference.tokenizer.encode(reference.chat_prompt(messages), add_special_tokens=False)
    body = r.json()
    assert len(body["prompt_logprobs"]) == body["usage"]["prompt_tokens"] == len(ids)
    check(body["prompt_logprobs"], ids, reference.prompt_logprobs([ids], lora="alpha")[0], 0, reference.tokenizer)


@pytest.mark.parametrize("route, extra, match", [
    ("/v1/completions", {"prompt": "hi", "stream": True}, "not available with stream"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "stream": True},
     "not available with stream"),
    ("/v1/completions", {"prompt": "hi", "prompt_logprobs": 21}, "must be in [0, 20], got 21"),
    ("/v1/completions", {"prompt": "hi", "prompt_logprobs": -1, "echo": True, "logprobs": 2},
     "must be in [0, 20], got -1"),
])
def test_refused(server, route, extra, match):
    r = post(server, route, {"prompt_logprobs": 2, "max_tokens": 1, **extra})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs", r.text
    assert match in r.json()["error"]["message"], r.text


def test_the_base_model_too(server, reference):
    ids = [5, 6, 7, 8, 9]
    r = post(server, "/v1/completions", {"model": MODEL_NAME, "prompt": ids, "max_tokens": 1, "prompt_logprobs": 2})
    check(r.json()["choices"][0]["prompt_logprobs"], ids, reference.prompt_logprobs([ids])[0], 2, reference.tokenizer)


@pytest.mark.parametrize("route, body", [
    ("/v1/completions", {"prompt": "the quick brown fox jumps", "prompt_logprobs": 3, "echo": True, "logprobs": 2}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "the quick brown fox"}], "prompt_logprobs": 3}),
])
def test_a_responses_entries_are_made_off_the_event_loop(server, monkeypatch, route, body):
    """Each prompt token's entry costs tens of microseconds: a long prompt's held every other client's stream."""
    from moelora.server import app

    add, threads = app._Choice.add, []
    monkeypatch.setattr(app._Choice, "add", lambda self, d: threads.append(threading.current_thread().name)
                        or add(self, d))
    r = post(server, route, {**body, "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200, r.text
    assert threads and all(name.startswith("asyncio") for name in threads), threads
