"""vLLM's /tokenize and /detokenize: a prompt's or a chat's token ids as the completion routes count them, each
token's string, the ids' text; every misuse a 400 naming its field."""
from __future__ import annotations

import httpx
import pytest

from tests.server.conftest import MODEL_NAME

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "naïve café 🙂"}]


def post(server, route: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{route}", json=body, timeout=60)


@pytest.mark.parametrize("prefix", ["", "/v1"])
def test_a_prompts_tokens_are_those_a_completion_counts(server, reference, prefix):
    text = "Hello world, déjà vu 🎉"
    r = post(server, f"{prefix}/tokenize", {"model": MODEL_NAME, "prompt": text, "return_token_strs": True})
    assert r.status_code == 200, r.text
    ids = reference.tokenizer.encode(text)
    assert r.json() == {"count": len(ids), "max_model_len": reference.context_len, "tokens": ids,
                        "token_strs": reference.tokenizer.convert_ids_to_tokens(ids)}
    completion = post(server, "/v1/completions", {"model": "alpha", "prompt": text, "max_tokens": 1}).json()
    assert completion["usage"]["prompt_tokens"] == len(ids)
    back = post(server, f"{prefix}/detokenize", {"model": "alpha", "tokens": ids})
    assert back.status_code == 200 and back.json() == {"prompt": text}


def test_a_chats_tokens_are_those_a_chat_completion_counts(server, reference):
    r = post(server, "/tokenize", {"messages": MESSAGES})
    prompt = reference.chat_prompt(MESSAGES)
    assert r.status_code == 200 and r.json()["tokens"] == reference.tokenizer.encode(prompt, add_special_tokens=False)
    assert r.json()["token_strs"] is None
    chat = post(server, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 1}).json()
    assert chat["usage"]["prompt_tokens"] == r.json()["count"]
    cont = post(server, "/tokenize", {"messages": [*MESSAGES, {"role": "assistant", "content": "Sure"}],
                                      "add_generation_prompt": False, "continue_final_message": True})
    assert cont.status_code == 200 and reference.tokenizer.decode(cont.json()["tokens"]).endswith("assistant\nSure")


@pytest.mark.parametrize("route, body, param, match", [
    ("/tokenize", {}, "prompt", "give a prompt or messages"),
    ("/tokenize", {"prompt": "hi", "messages": MESSAGES}, "prompt", "give a prompt or messages"),
    ("/tokenize", {"messages": []}, "messages", "at least 1"),
    ("/tokenize", {"messages": MESSAGES, "continue_final_message": True}, "continue_final_message",
     "cannot both be true"),
    ("/tokenize", {"prompt": "hi", "temperature": 0}, "temperature", "unknown field `temperature`"),
    ("/tokenize", {"prompt": "x" * 100_000}, "prompt", "characters, more than"),
    ("/detokenize", {"tokens": [1, 10**6]}, "tokens", "1000000"),
    ("/detokenize", {"tokens": [1, True]}, "tokens", "valid integer"),
    ("/detokenize", {}, "tokens", "Field required"),
])
def test_misuses_are_400s_naming_the_field(server, route, body, param, match):
    r = post(server, route, body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param and match in r.json()["error"]["message"], r.text


def test_an_unknown_model_is_a_404(server):
    for route, body in (("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [1]})):
        r = post(server, route, {"model": "nope", **body})
        assert r.status_code == 404, r.text
