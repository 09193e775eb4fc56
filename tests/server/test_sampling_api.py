"""Issue 19's sampling and structured-output fields through the official openai client against a
real server: each equal to Engine.generate alone with the same SamplingParams (so a field the
server dropped would fail), structured output valid and mixed with plain requests and adapters in
one batch, and every refused or unknown field a 400 naming it."""
from __future__ import annotations

import asyncio
import json
import logging
import re
import threading

import httpx
import openai
import pytest

from moelora.engine.sampling_params import SamplingParams, StructuredOutput
from tests.server.conftest import MODEL_NAME

PROMPT = "the quick brown fox"
MESSAGES = [{"role": "user", "content": "Hello world"}]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 4}, "ok": {"type": "boolean"}},
          "required": ["name", "ok"], "additionalProperties": False}


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)


def lora(model: str) -> str | None:
    return None if model == MODEL_NAME else model


def chat_ids(reference, messages) -> list[int]:
    text = reference.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return reference.tokenizer.encode(text, add_special_tokens=False)


def error(r: httpx.Response, param: str, match: str = "") -> None:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and match in err["message"], err


@pytest.mark.parametrize("fields, params", [
    ({"presence_penalty": 1.5, "frequency_penalty": 0.8}, dict(presence_penalty=1.5, frequency_penalty=0.8)),
    ({"frequency_penalty": 0.3, "extra_body": {"repetition_penalty": 3.0}},
     dict(frequency_penalty=0.3, repetition_penalty=3.0)),
    ({"logit_bias": {"300": 6.0, "12": -100}}, dict(logit_bias={300: 6.0, 12: -100})),
    ({"extra_body": {"min_tokens": 5, "allowed_token_ids": list(range(200, 260))}},
     dict(min_tokens=5, allowed_token_ids=list(range(200, 260)))),
])
@pytest.mark.parametrize("model", [MODEL_NAME, "alpha"])
def test_sampling_fields_equal_engine_generate(client, reference, model, fields, params):
    kwargs = {"model": model, "max_tokens": 10, "temperature": 0, **fields}
    out = client.completions.create(prompt=PROMPT, **kwargs)
    want = reference.generate(PROMPT, SamplingParams(max_tokens=10, temperature=0, **params), lora=lora(model))[0]
    plain = reference.generate(PROMPT, SamplingParams(max_tokens=10, temperature=0), lora=lora(model))[0]
    assert out.choices[0].text == want.text and want.text != plain.text
    chat = client.chat.completions.create(messages=MESSAGES, **kwargs).choices[0].message.content
    sp = SamplingParams(max_tokens=10, temperature=0, **params)
    assert chat == reference.generate(chat_ids(reference, MESSAGES), sp, lora=lora(model))[0].text


@pytest.mark.parametrize("fields", [
    {"add_generation_prompt": False},
    {"add_generation_prompt": False, "continue_final_message": True},
    {"chat_template_kwargs": {"enable_thinking": False, "flavor": "x"}},
])
def test_chat_prompt_options_equal_engine_generate(client, reference, fields):
    """vLLM's add_generation_prompt, continue_final_message and chat_template_kwargs shape the prompt as
    Engine.chat_prompt does with them."""
    messages = [*MESSAGES, {"role": "assistant", "content": "Once upon"}]
    out = client.chat.completions.create(model="alpha", messages=messages, max_tokens=6, temperature=0,
                                         extra_body=fields).choices[0].message.content
    text = reference.chat_prompt(messages, None, fields.get("add_generation_prompt", True),
                                 fields.get("continue_final_message", False), fields.get("chat_template_kwargs"))
    ids = reference.tokenizer.encode(text, add_special_tokens=False)
    assert out == reference.generate(ids, SamplingParams(max_tokens=6, temperature=0), lora="alpha")[0].text


@pytest.mark.parametrize("fields, param, match", [
    ({"continue_final_message": True}, "continue_final_message", "continue_final_message and add_generation_prompt "
                                                                  "cannot both be true"),
    ({"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs", "chat_template_kwargs cannot set tokenize"),
    ({"chat_template_kwargs": [1]}, "chat_template_kwargs", ""),
])
def test_chat_prompt_options_that_cannot_be(server, fields, param, match):
    body = {"model": "alpha", "messages": MESSAGES, "max_tokens": 2, **fields}
    error(httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60), param, match)
    body = {"model": "alpha", "messages": MESSAGES, "max_tokens": 2, "add_generation_prompt": False,
            "continue_final_message": True}  # the last message is the user's
    error(httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60), "continue_final_message",
          "continue_final_message needs the last message to be the assistant's")


def test_include_stop_str_in_output(client, reference):
    full = reference.generate(PROMPT, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True), lora="alpha")[0].text
    stop = full.split()[2]
    out = client.completions.create(model="alpha", prompt=PROMPT, max_tokens=8, temperature=0, stop=[stop],
                                    extra_body={"include_stop_str_in_output": True})
    assert out.choices[0].text == full[:full.index(stop) + len(stop)] and out.choices[0].finish_reason == "stop"


def sse(server, path: str, body: dict) -> list[dict]:
    """The JSON chunks of a streamed response."""
    with httpx.stream("POST", f"{server.url}{path}", json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200, r.read()
        return [json.loads(line.removeprefix("data: ")) for line in r.iter_lines() if line.startswith("data: {")]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_stop_reason_is_the_stop_that_ended_the_choice(server, reference, path, stream):
    """As vLLM's: the stop string that matched (a string) or the stop_token_ids token that came (an int); null when
    EOS ended it (one stop_token_ids also holds too, unless ignore_eos) or its length. Streamed: in the chunk with
    the finish_reason, null in the others."""
    chat = path == "/v1/chat/completions"
    prompt = chat_ids(reference, MESSAGES) if chat else PROMPT
    full = reference.generate(prompt, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True), lora="alpha")[0]
    stop, token, eos = full.text[3:6], full.token_ids[3], reference.eos_token_ids[0]
    assert eos not in full.token_ids[:4]
    cases = [({"stop": ["zzz", stop], "ignore_eos": True}, "stop", stop),
             ({"stop_token_ids": [token], "ignore_eos": True}, "stop", token),
             ({"logit_bias": {str(eos): 100}, "stop_token_ids": [token]}, "stop", None),
             ({"logit_bias": {str(eos): 100}, "stop_token_ids": [eos]}, "stop", None),
             ({"logit_bias": {str(eos): 100}, "stop_token_ids": [eos], "ignore_eos": True}, "stop", eos),
             ({"ignore_eos": True}, "length", None)]
    for fields, finish_reason, stop_reason in cases:
        body = {"model": "alpha", "max_tokens": 8, "temperature": 0, **fields,
                **({"messages": MESSAGES} if chat else {"prompt": PROMPT})}
        if stream:
            choices = [c["choices"][0] for c in sse(server, path, body) if c["choices"]]
            assert all(c["stop_reason"] is None for c in choices[:-1]), choices
            choice = choices[-1]
        else:
            r = httpx.post(f"{server.url}{path}", json=body, timeout=60)
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
        assert (choice["finish_reason"], choice["stop_reason"]) == (finish_reason, stop_reason), fields
        assert type(choice["stop_reason"]) is type(stop_reason)  # the token an int, not its text


def test_echo_with_prompt_logprobs(client, reference):
    out = client.completions.create(model="beta", prompt=PROMPT, max_tokens=4, temperature=0, echo=True, logprobs=2)
    ids = reference.tokenizer.encode(PROMPT)
    want = reference.generate(PROMPT, SamplingParams(max_tokens=4, temperature=0, logprobs=2), lora="beta")[0]
    full = reference.prompt_logprobs([ids], lora="beta")[0]
    choice = out.choices[0]
    assert choice.text == PROMPT + want.text
    lp = choice.logprobs
    assert lp.tokens[:len(ids)] == [reference.tokenizer.decode([t]) for t in ids] and len(lp.tokens) == len(ids) + 4
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for i in range(1, len(ids)):
        assert lp.token_logprobs[i] == pytest.approx(full[i - 1, ids[i]].item(), abs=1e-5)
        assert max(lp.top_logprobs[i].values()) == pytest.approx(full[i - 1].max().item(), abs=1e-5)
    assert lp.text_offset[len(ids)] == len("".join(lp.tokens[:len(ids)]))
    token_ids = client.completions.create(model="beta", prompt=ids, max_tokens=4, temperature=0, echo=True)
    assert token_ids.choices[0].text == reference.tokenizer.decode(ids) + want.text
    chunks = list(client.completions.create(model="beta", prompt=PROMPT, max_tokens=4, temperature=0, echo=True,
                                            logprobs=2, stream=True))
    assert chunks[0].choices[0].text.startswith(PROMPT)
    assert "".join(c.choices[0].text for c in chunks) == choice.text
    assert [t for c in chunks for t in c.choices[0].logprobs.tokens] == lp.tokens


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_echo_with_max_tokens_0_is_the_prompt_alone(server, reference, stream):
    """As vLLM's: the prompt is the text, with its logprobs when asked, finish_reason "length" and no completion
    tokens (the one the engine generates to run the prompt is not part of the output)."""
    prompts = [PROMPT, "naïve café"]
    lengths = [len(reference.tokenizer.encode(p)) for p in prompts]
    body = {"model": "beta", "prompt": prompts, "echo": True, "logprobs": 2, "temperature": 0}
    generated = httpx.post(f"{server.url}/v1/completions", json={**body, "max_tokens": 4}, timeout=60).json()
    usage = {"prompt_tokens": sum(lengths), "completion_tokens": 0, "total_tokens": sum(lengths),
             "prompt_tokens_details": {"cached_tokens": 0}}  # (its prompt log-probabilities: computed)
    if stream:
        chunks = sse(server, "/v1/completions", {**body, "max_tokens": 0, "stream_options": {"include_usage": True}})
        choices = sorted((c["choices"][0] for c in chunks if c["choices"]), key=lambda c: c["index"])
        assert chunks[-1]["usage"] == usage
    else:
        r = httpx.post(f"{server.url}/v1/completions", json={**body, "max_tokens": 0}, timeout=60)
        assert r.status_code == 200, r.text
        choices, usage_got = r.json()["choices"], r.json()["usage"]
        assert usage_got == usage
    assert [(c["index"], c["finish_reason"], c["stop_reason"]) for c in choices] == [(0, "length", None),
                                                                                    (1, "length", None)]
    assert [c["text"] for c in choices] == prompts
    for choice, whole, n in zip(choices, generated["choices"], lengths):  # the prompt's, as with a completion after it
        assert choice["logprobs"] == {k: v[:n] for k, v in whole["logprobs"].items()}
    plain = httpx.post(f"{server.url}/v1/completions", json={"model": "beta", "prompt": PROMPT, "echo": True,
                                                             "max_tokens": 0}, timeout=60).json()["choices"][0]
    assert (plain["text"], plain["logprobs"]) == (PROMPT, None)
    error(httpx.post(f"{server.url}/v1/completions", json={"model": "beta", "prompt": PROMPT, "max_tokens": 0}),
          "max_tokens", ">= 1")  # without echo, as vLLM: nothing to return
    error(httpx.post(f"{server.url}/v1/completions", json={"model": "beta", "prompt": PROMPT, "echo": True,
                                                           "max_tokens": 0, "min_tokens": 2}),
          "min_tokens", "max_tokens=0")  # the user's max_tokens, not the one the echo asks the engine for


def test_best_of_returns_the_n_most_likely(client, reference):
    out = client.completions.create(model="alpha", prompt=PROMPT, max_tokens=6, temperature=1.2, seed=40, n=2, best_of=5)
    seqs = [reference.generate(PROMPT, SamplingParams(max_tokens=6, temperature=1.2, seed=40 + k), lora="alpha")[0]
            for k in range(5)]
    best = sorted(seqs, key=lambda s: -s.cumulative_logprob)[:2]
    assert [c.text for c in out.choices] == [s.text for s in best] and [c.index for c in out.choices] == [0, 1]
    assert out.usage.completion_tokens == sum(len(s.token_ids) for s in seqs)
    assert len({s.text for s in seqs}) > 2  # the choice mattered


def valid(spec: StructuredOutput, text: str) -> bool:
    if spec.kind == "json_schema":
        value = json.loads(text)
        return set(value) == {"name", "ok"} and isinstance(value["name"], str) and type(value["ok"]) is bool
    if spec.kind == "json_object":
        return isinstance(json.loads(text), dict)
    if spec.kind == "choice":
        return text in spec.choices
    return re.fullmatch(spec.spec, text) is not None


# request fields -> the StructuredOutput they ask for
STRUCTURED = [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}},
     StructuredOutput("json_schema", json.dumps(SCHEMA))),
    ({"extra_body": {"guided_json": SCHEMA}}, StructuredOutput("json_schema", json.dumps(SCHEMA))),
    ({"extra_body": {"guided_regex": "(cat|dog)s? [0-9]{2}"}}, StructuredOutput("regex", "(cat|dog)s? [0-9]{2}")),
    ({"extra_body": {"guided_choice": ["left", "right", "up \"down\""]}},
     StructuredOutput("choice", choices=("left", "right", "up \"down\""))),
    ({"extra_body": {"structured_outputs": {"regex": "[a-c]{3}"}}}, StructuredOutput("regex", "[a-c]{3}")),
]


def test_structured_output_mixed_with_plain_requests_and_adapters(server, reference):
    """Constrained and plain requests, chat and completions, on every model at once: each equals its
    solo output, and the constrained ones are valid."""
    jobs = [(route, model, fields, spec) for i, (fields, spec) in enumerate([*STRUCTURED, ({}, None), ({}, None)])
            for route, model in [("chat", (MODEL_NAME, "alpha", "beta")[i % 3]), ("completions", ("beta", "alpha")[i % 2])]]

    async def one(client: openai.AsyncOpenAI, route: str, model: str, fields: dict) -> tuple[str, str]:
        kwargs = {"model": model, "max_tokens": 60, "temperature": 0.7, "seed": 9, **fields}
        if route == "chat":
            out = (await client.chat.completions.create(messages=MESSAGES, **kwargs)).choices[0]
            return out.message.content, out.finish_reason
        if "response_format" in kwargs:  # vLLM's extension on completions: not in the client's signature
            kwargs["extra_body"] = {"response_format": kwargs.pop("response_format")}
        out = (await client.completions.create(prompt=PROMPT, **kwargs)).choices[0]
        return out.text, out.finish_reason

    async def run() -> list[tuple[str, str]]:
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0) as client:
            return await asyncio.gather(*(one(client, r, m, f) for r, m, f, _ in jobs))

    for (route, model, _, spec), (text, reason) in zip(jobs, asyncio.run(run())):
        prompt = chat_ids(reference, MESSAGES) if route == "chat" else PROMPT
        want = reference.generate(prompt, SamplingParams(max_tokens=60, temperature=0.7, seed=9, structured_output=spec),
                                  lora=lora(model))[0]
        assert (text, reason) == (want.text, want.finish_reason)
        if spec is not None:
            assert reason == "stop" and valid(spec, text), (spec, text)
    assert server.idle()


def test_json_object(client):
    out = client.chat.completions.create(model="alpha", messages=MESSAGES, max_tokens=80, temperature=0,
                                         response_format={"type": "json_object"}).choices[0]
    if out.finish_reason == "stop":  # a random model may keep writing a key until max_tokens
        assert isinstance(json.loads(out.message.content), dict)
    assert out.message.content.startswith("{")
    text = client.chat.completions.create(model="alpha", messages=MESSAGES, max_tokens=5, temperature=0,
                                          response_format={"type": "text"}).choices[0].message.content
    plain = client.chat.completions.create(model="alpha", messages=MESSAGES, max_tokens=5, temperature=0)
    assert text == plain.choices[0].message.content


@pytest.mark.parametrize("path, body, param, match", [
    ("/v1/completions", {"suffix": "x"}, "suffix", "not supported"),
    ("/v1/completions", {"an_unknown_field": 1}, "an_unknown_field", "unknown field"),
    ("/v1/chat/completions", {"functions_x": []}, "functions_x", "unknown field"),
    ("/v1/completions", {"stream_options": {"include_usage": True, "x": 1}}, "stream_options", "stream_options.x"),
    ("/v1/chat/completions", {"stream_options": {"include_usage": True}}, "stream_options", "only allowed with stream"),
    ("/v1/completions", {"use_beam_search": True}, "use_beam_search", "beam search"),
    ("/v1/completions", {"length_penalty": 0.5}, "length_penalty", "beam search"),
    ("/v1/completions", {"prompt_logprobs": 1, "stream": True}, "prompt_logprobs", "not available with stream"),
    ("/v1/completions", {"guided_decoding_backend": "outlines"}, "guided_decoding_backend", "xgrammar"),
    ("/v1/chat/completions", {"audio": {"voice": "x"}}, "audio", "not supported"),
    ("/v1/chat/completions", {"echo": True}, "echo", "completions"),
    ("/v1/chat/completions", {"store": True}, "store", "not supported"),
    ("/v1/completions", {"presence_penalty": 2.5}, "presence_penalty", "[-2, 2]"),
    ("/v1/completions", {"repetition_penalty": 0}, "repetition_penalty", "> 0"),
    ("/v1/completions", {"logit_bias": {"5": 101}}, "logit_bias", "[-100, 100]"),
    ("/v1/completions", {"logit_bias": {"100000": 1}}, "logit_bias", "vocabulary"),
    ("/v1/completions", {"logit_bias": {"x": 1}}, "logit_bias", "token ids"),
    ("/v1/completions", {"min_tokens": 10, "max_tokens": 2}, "min_tokens", "max_tokens"),
    ("/v1/completions", {"allowed_token_ids": [10**6]}, "allowed_token_ids", "vocabulary"),
    ("/v1/completions", {"best_of": 1, "n": 2}, "best_of", ">= n"),
    ("/v1/completions", {"best_of": 3, "stream": True}, "best_of", "streamed"),
    ("/v1/completions", {"best_of": 10**4}, "best_of", "max_running_requests"),
    ("/v1/completions", {"guided_regex": "(a"}, "guided_regex", "regex is not valid"),
    ("/v1/completions", {"guided_json": '{"type": "nope"}'}, "guided_json", "json schema is not valid"),
    ("/v1/completions", {"guided_grammar": "root ::="}, "guided_grammar", "grammar is not valid"),
    ("/v1/completions", {"guided_choice": []}, "guided_choice", "at least one choice"),
    ("/v1/completions", {"guided_grammar": "root ::= root"}, "guided_grammar", "allows no first token"),
    # xgrammar before 0.2.9 compiles it and the first-token check refuses it; later ones refuse the circular $ref
    ("/v1/completions", {"guided_json": {"$ref": "#"}}, "guided_json", "SamplingParams.structured_output: the "),
    ("/v1/completions", {"stop": [f"s{i}" for i in range(65)]}, "stop", "at most 64 strings"),
    ("/v1/completions", {"top_p": 1e-46}, "top_p", "float32"),
    ("/v1/completions", {"temperature": 1e39}, "temperature", "float32"),
    ("/v1/completions", {"prompt": [True, False]}, "prompt", ""),
    ("/v1/completions", {"guided_regex": "a", "guided_choice": ["a"]}, "guided_regex", "give one"),
    ("/v1/completions", {"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "exactly one"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema"}}, "response_format", "needs the json_schema"),
    ("/v1/chat/completions", {"response_format": {"type": "xml"}}, "response_format", ""),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"type": "strng"}}}}}}, "response_format", "json schema is not valid"),
])
def test_refused_and_unknown_fields_are_named(server, path, body, param, match):
    base = {"model": "alpha", "max_tokens": 2, **({"prompt": PROMPT} if path == "/v1/completions" else
                                                  {"messages": MESSAGES})}
    error(httpx.post(f"{server.url}{path}", json={**base, **body}), param, match)


@pytest.mark.parametrize("path, field", [("/v1/completions", "guided_choice"),
                                         ("/v1/chat/completions", "response_format")])
def test_a_grammar_that_allows_none_of_allowed_token_ids_first_is_refused(server, path, field):
    """Every first token the grammar allows is outside allowed_token_ids: refused up front, not failed at its first
    token with every logit masked."""
    z = server.loop.engine.tokenizer.encode("z", add_special_tokens=False)
    assert len(z) == 1
    body = {"model": "alpha", "max_tokens": 2, "allowed_token_ids": z,
            **({"prompt": PROMPT, "guided_choice": ["yes", "no"]} if path == "/v1/completions" else
               {"messages": MESSAGES, "response_format": {"type": "json_object"}})}
    error(httpx.post(f"{server.url}{path}", json=body), field, "allows no first token of allowed_token_ids")
    body["allowed_token_ids"] = None
    assert httpx.post(f"{server.url}{path}", json=body, timeout=60).status_code == 200


@pytest.mark.parametrize("stream", [False, True])
def test_a_grammar_with_no_way_on_after_its_first_token_is_a_400_naming_it(server, caplog, stream):
    """'<' and then nothing (no character is in [^\\s\\S]): the first token passes the check up front, the second
    has none to draw. It was a 500 with the engine's traceback logged; it is the request's input, as the check up
    front's refusal is (streamed: an invalid_request_error in the stream)."""
    body = {"model": "alpha", "prompt": PROMPT, "max_tokens": 5, "guided_regex": "<[^\\s\\S]", "stream": stream}
    with caplog.at_level(logging.ERROR):
        r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
    message = "its structured output allows no token after 1 tokens"
    if stream:
        errors = [json.loads(line[6:])["error"] for line in r.text.splitlines() if line.startswith('data: {"error"')]
        assert r.status_code == 200 and errors[0]["type"] == "invalid_request_error" and message in errors[0]["message"]
    else:
        error(r, "guided_regex", message)
    assert not [rec for rec in caplog.records if rec.levelno >= logging.ERROR]
    assert httpx.post(f"{server.url}/v1/completions", json={**body, "guided_regex": "<a", "stream": False},
                      timeout=60).status_code == 200


def test_grammars_compile_in_their_own_threads(server, monkeypatch):
    """A grammar compiles in the server's grammar threads, not in asyncio's default executor (which adapter loads
    use): a slow compile holds up other grammars only. It would fail if the compile ran anywhere else first."""
    grammars = server.loop.engine.grammars
    compile_grammar, threads = grammars.compile, []
    monkeypatch.setattr(grammars, "compile", lambda spec, trial=None: threads.append(threading.current_thread().name)
                        or compile_grammar(spec, trial))
    body = {"model": "alpha", "max_tokens": 2, "prompt": PROMPT, "guided_regex": "[ab]+"}
    assert httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).status_code == 200
    # (the engine thread then takes it from the compiler's cache, to start the request's matcher)
    assert threads[0].startswith("moelora-grammar") and threads[1:] == ["moelora-engine"], threads


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_the_engine_thread_never_compiles_a_grammar_the_server_compiled(server, monkeypatch, path):
    """The server holds the request's compiled grammar until the engine thread has started its matchers, which then
    find it whatever other grammars pushed out of the caches meanwhile (here the recent ones hold none)."""
    from moelora.engine import structured_output
    monkeypatch.setattr(structured_output, "RECENT_GRAMMARS", 0)
    compile_spec, threads = structured_output.compile_spec, []
    monkeypatch.setattr(structured_output, "compile_spec", lambda compiler, spec:
                        threads.append(threading.current_thread().name) or compile_spec(compiler, spec))
    body = {"model": "alpha", "max_tokens": 2, "guided_regex": f"[ab]+{path[-4:]}", "n": 2,
            **({"prompt": PROMPT} if path == "/v1/completions" else {"messages": MESSAGES})}
    assert httpx.post(f"{server.url}{path}", json=body, timeout=60).status_code == 200
    assert len(threads) == 1 and threads[0].startswith("moelora-grammar"), threads


def test_harmless_values_of_refused_fields_are_accepted(server):
    body = {"model": "alpha", "prompt": PROMPT, "max_tokens": 2, "use_beam_search": False, "length_penalty": 1,
            "guided_decoding_backend": "xgrammar", "spaces_between_special_tokens": True, "best_of": 1}
    assert httpx.post(f"{server.url}/v1/completions", json=body).status_code == 200
    chat = {"model": "alpha", "messages": MESSAGES, "max_tokens": 2, "store": False, "modalities": ["text"],
            "service_tier": "auto", "add_generation_prompt": True}
    assert httpx.post(f"{server.url}/v1/chat/completions", json=chat).status_code == 200


@pytest.mark.parametrize("path, field", [("/v1/completions", "n"), ("/v1/completions", "stream"),
                                         ("/v1/completions", "echo"), ("/v1/completions", "ignore_eos"),
                                         ("/v1/chat/completions", "n"), ("/v1/chat/completions", "stream"),
                                         ("/v1/chat/completions", "logprobs")])
def test_a_null_is_the_fields_default(server, path, field):
    """OpenAI's API takes null for its optional fields (n, stream, echo, logprobs: "or null"), as vLLM does: the
    response is the one without the field."""
    body = {"model": "alpha", "max_tokens": 4, "temperature": 0,
            **({"prompt": PROMPT} if path == "/v1/completions" else {"messages": MESSAGES})}
    plain = httpx.post(f"{server.url}{path}", json=body, timeout=60)
    r = httpx.post(f"{server.url}{path}", json={**body, field: None}, timeout=60)
    assert r.status_code == 200, r.text
    counts = [{k: v for k, v in x.json()["usage"].items() if k != "prompt_tokens_details"} for x in (r, plain)]
    assert r.json()["choices"] == plain.json()["choices"] and counts[0] == counts[1]  # (r's prompt may be cached)


@pytest.mark.parametrize("fields, want", [
    ({"response_format": {"type": "text"}}, None),
    ({"response_format": {"type": "json_object"}}, StructuredOutput("json_object")),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA, "strict": True}}},
     StructuredOutput("json_schema", json.dumps(SCHEMA))),
    ({"guided_json": json.dumps(SCHEMA)}, StructuredOutput("json_schema", json.dumps(SCHEMA))),
    ({"guided_regex": "a+"}, StructuredOutput("regex", "a+")),
    ({"guided_choice": ["x", "y"]}, StructuredOutput("choice", choices=("x", "y"))),
    ({"guided_grammar": 'root ::= "a"'}, StructuredOutput("grammar", 'root ::= "a"')),
    ({"structured_outputs": {"json": SCHEMA}}, StructuredOutput("json_schema", json.dumps(SCHEMA))),
    ({"structured_outputs": {"choice": ["x"]}}, StructuredOutput("choice", choices=("x",))),
    ({"structured_outputs": {"grammar": 'root ::= "a"'}}, StructuredOutput("grammar", 'root ::= "a"')),
    ({"structured_outputs": {"json_object": True}}, StructuredOutput("json_object")),
])
def test_each_structured_output_field_gives_its_grammar(fields, want):
    from moelora.server.protocol import CompletionRequest
    assert CompletionRequest(prompt="x", **fields).sampling_params(4, None).structured_output == want


def test_n_sequences_each_follow_the_grammar(client):
    choices = ["alpha beta", "gamma", "delta epsilon zeta"]
    out = client.completions.create(model="beta", prompt=PROMPT, max_tokens=30, temperature=1.5, seed=2, n=4,
                                    extra_body={"guided_choice": choices})
    assert all(c.text in choices and c.finish_reason == "stop" for c in out.choices)
    assert len({c.text for c in out.choices}) > 1  # independent matchers, not one shared
