"""The OpenAI API through the official client: completions and chat, streamed or not, on the base
model and each adapter, equal to Engine.generate alone; adapters loaded and unloaded over HTTP,
also under concurrent traffic; metrics and health."""
from __future__ import annotations

import asyncio
import itertools
import json
import threading
import time

import httpx
import openai
import pytest

from moelora.engine.sampling_params import SamplingParams
from moelora.server.app import create_app
from tests.server.conftest import MODEL_NAME

PROMPTS = ["Hello world", "the quick brown fox", "naïve café", "déjà vu"]
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "Hello world"}]
MODELS = [MODEL_NAME, "alpha", "beta"]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)


def lora(model: str) -> str | None:
    return None if model == MODEL_NAME else model


def alone(reference, prompt, model: str, max_tokens: int = MAX_TOKENS, **params):
    """Engine.generate of one greedy request, on an engine serving nothing else."""
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, **params)
    return reference.generate(prompt, sp, lora=lora(model))[0]


def chat_ids(reference, messages) -> list[int]:
    text = reference.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return reference.tokenizer.encode(text, add_special_tokens=False)


def test_models_lists_the_base_model_and_every_adapter(client, demo_dir, reference):
    cards = {m.id: m for m in client.models.list().data}
    assert list(cards) == MODELS
    assert cards[MODEL_NAME].parent is None and cards[MODEL_NAME].root == str(demo_dir / "model")
    assert all(cards[a].parent == MODEL_NAME and cards[a].root == str(demo_dir / a) for a in ("alpha", "beta"))
    assert {card.max_model_len for card in cards.values()} == {reference.context_len}
    # models.retrieve: GET /v1/models/{id}, each card as listed; an unknown id is the 404 of an unknown model
    assert all(client.models.retrieve(name) == card for name, card in cards.items())
    with pytest.raises(openai.NotFoundError, match="The model `nope/x` does not exist"):
        client.models.retrieve("nope/x")


@pytest.mark.parametrize("model", MODELS)
def test_completion_equals_engine_generate(client, reference, model):
    out = client.completions.create(model=model, prompt=PROMPTS[1], max_tokens=MAX_TOKENS, temperature=0)
    want = alone(reference, PROMPTS[1], model)
    assert out.choices[0].text == want.text and out.choices[0].finish_reason == want.finish_reason
    assert out.usage.completion_tokens == len(want.token_ids)
    assert out.usage.prompt_tokens == len(reference.tokenizer.encode(PROMPTS[1]))
    assert out.model == model and out.object == "text_completion"


@pytest.mark.parametrize("model", MODELS)
def test_streamed_completion_equals_engine_generate(client, reference, model):
    chunks = list(client.completions.create(model=model, prompt=PROMPTS[2], max_tokens=MAX_TOKENS, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    want = alone(reference, PROMPTS[2], model)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == want.finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(want.token_ids)
    assert len({c.id for c in chunks}) == 1


def test_every_chunk_of_a_stream_has_the_same_id_and_created(client, monkeypatch):
    """As OpenAI's: the chunks of one completion share its id and its creation time, however long the stream."""
    clock = itertools.count(int(time.time()))  # a second later at every reading
    monkeypatch.setattr(time, "time", lambda: float(next(clock)))
    kwargs = dict(model="alpha", max_tokens=4, temperature=0, n=2, stream=True, stream_options={"include_usage": True})
    for chunks in (list(client.completions.create(prompt=PROMPTS[0], **kwargs)),
                   list(client.chat.completions.create(messages=MESSAGES, **kwargs))):
        assert len(chunks) > 4 and len({(c.id, c.created) for c in chunks}) == 1, chunks


def sse(server, path: str, body: dict) -> list[dict]:
    """The JSON chunks of a streamed response."""
    with httpx.stream("POST", f"{server.url}{path}", json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200, r.read()
        return [json.loads(line.removeprefix("data: ")) for line in r.iter_lines() if line.startswith("data: {")]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_continuous_usage_stats_put_the_usage_so_far_in_every_chunk(server, reference, path):
    """vLLM's stream_options.continuous_usage_stats, with include_usage: every chunk has the usage of its sequence so
    far (a chat's role chunks too, before any token), then the last chunk the whole request's. Without include_usage
    it adds nothing, as vLLM's."""
    chat = path == "/v1/chat/completions"
    prompt_tokens = len(chat_ids(reference, MESSAGES) if chat else reference.tokenizer.encode(PROMPTS[1]))
    body = {"model": "alpha", "max_tokens": 5, "temperature": 0, "n": 2, "logprobs": True if chat else 0,
            "ignore_eos": True, **({"messages": MESSAGES} if chat else {"prompt": PROMPTS[1]})}
    chunks = sse(server, path, {**body, "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    tokens, cached = [0, 0], chunks[-1]["usage"]["prompt_tokens_details"]  # (the prefix cache's share of the prompt)
    assert 0 <= cached["cached_tokens"] < prompt_tokens
    for chunk in chunks[:-1]:
        (choice,) = chunk["choices"]
        if (logprobs := choice["logprobs"]) is not None:  # an entry per token (a role chunk has none)
            tokens[choice["index"]] += len(logprobs["content"] if chat else logprobs["tokens"])
        assert chunk["usage"] == {"prompt_tokens": prompt_tokens, "completion_tokens": tokens[choice["index"]],
                                  "total_tokens": prompt_tokens + tokens[choice["index"]],
                                  "prompt_tokens_details": cached if tokens[choice["index"]] else None}, chunk
    assert tokens == [5, 5] and chunks[-1]["choices"] == []
    assert chunks[-1]["usage"] == {"prompt_tokens": prompt_tokens, "completion_tokens": 10,
                                   "total_tokens": prompt_tokens + 10, "prompt_tokens_details": cached}
    if chat:
        assert [c["usage"]["completion_tokens"] for c in chunks[:2]] == [0, 0]  # the role chunks
    for options in ({"continuous_usage_stats": True}, {"include_usage": False, "continuous_usage_stats": True},
                    {"include_usage": None, "continuous_usage_stats": None}):  # null: the default, as vLLM's
        assert all(c["usage"] is None for c in sse(server, path, {**body, "stream_options": options}))


@pytest.mark.parametrize("model", MODELS)
def test_chat_equals_engine_generate_on_the_chat_template(client, reference, model):
    want = alone(reference, chat_ids(reference, MESSAGES), model)
    out = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0)
    assert out.choices[0].message.content == want.text and out.choices[0].message.role == "assistant"
    assert out.usage.prompt_tokens == len(chat_ids(reference, MESSAGES))
    chunks = list(client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0,
                                                 stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want.text
    assert chunks[-1].choices[0].finish_reason == want.finish_reason and chunks[-1].usage is None


def test_chat_content_parts_and_max_completion_tokens(client, reference):
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hello "}, {"type": "text", "text": "world"}]}]
    out = client.chat.completions.create(model="alpha", messages=parts, max_completion_tokens=3, temperature=0)
    plain = [{"role": "user", "content": "Hello \nworld"}]  # the parts one a line, as vLLM joins them
    assert out.choices[0].message.content == alone(reference, chat_ids(reference, plain), "alpha", 3).text
    assert out.usage.prompt_tokens == len(chat_ids(reference, plain)) != len(chat_ids(reference, [
        {"role": "user", "content": "Hello world"}]))


def test_completion_logprobs(client, reference):
    out = client.completions.create(model="beta", prompt=PROMPTS[0], max_tokens=4, temperature=0, logprobs=2)
    lp = out.choices[0].logprobs
    want = alone(reference, PROMPTS[0], "beta", 4, logprobs=2)
    assert lp.tokens == [reference.tokenizer.decode([t]) for t in want.token_ids]
    assert "".join(lp.tokens) == out.choices[0].text
    for token, chosen, top, ref in zip(want.token_ids, lp.token_logprobs, lp.top_logprobs, want.logprobs):
        assert chosen == pytest.approx(ref[token], abs=1e-5)
        assert len(top) == 2 and max(top.values()) == pytest.approx(chosen, abs=1e-6)  # greedy: the best one
    assert lp.text_offset[0] == 0 and lp.text_offset[1] == len(lp.tokens[0])


def test_chat_logprobs_streamed_and_not(client):
    kwargs = dict(model="alpha", messages=MESSAGES, max_tokens=4, temperature=0, logprobs=True, top_logprobs=3)
    content = client.chat.completions.create(**kwargs).choices[0].logprobs.content
    assert len(content) == 4
    for entry in content:
        assert [t.logprob for t in entry.top_logprobs] == sorted((t.logprob for t in entry.top_logprobs), reverse=True)
        assert len(entry.top_logprobs) == 3 and entry.top_logprobs[0].token == entry.token  # greedy
        assert bytes(entry.bytes).decode() == entry.token
    streamed = [e for c in client.chat.completions.create(**kwargs, stream=True) if c.choices and c.choices[0].logprobs
                for e in c.choices[0].logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]


def test_logprobs_a_model_makes_infinite_or_nan_are_sent_as_the_floor(client, monkeypatch):
    """JSON has no -inf or NaN (a broken model's or adapter's logits give them): such a log-probability is sent as
    vLLM's floor, -9999, in a whole response as in a stream, not a 500 after the generation."""
    import torch

    from moelora.engine import model_runner
    from moelora.engine.sampler import SampleOutput
    from moelora.server.app import LOGPROB_FLOOR
    real = model_runner.sample

    def sample(logits, batch, k=0):
        out = real(logits, batch, k)
        top = out.top_logprobs
        return SampleOutput(out.token_ids, torch.full_like(out.logprobs, float("-inf")), out.top_ids,
                            None if top is None else torch.full_like(top, float("nan")))
    monkeypatch.setattr(model_runner, "sample", sample)
    kwargs = dict(model="alpha", prompt=PROMPTS[0], max_tokens=3, temperature=0, logprobs=2)
    whole = client.completions.create(**kwargs).choices[0].logprobs
    assert whole.token_logprobs == [LOGPROB_FLOOR] * 3
    assert all(set(top.values()) == {LOGPROB_FLOOR} for top in whole.top_logprobs)
    streamed = [lp for c in client.completions.create(**kwargs, stream=True) if c.choices and c.choices[0].logprobs
                for lp in c.choices[0].logprobs.token_logprobs]
    assert streamed == [LOGPROB_FLOOR] * 3
    chat = client.chat.completions.create(model="alpha", messages=MESSAGES, max_tokens=2, temperature=0, logprobs=True,
                                          top_logprobs=2).choices[0].logprobs.content
    assert [e.logprob for e in chat] == [LOGPROB_FLOOR] * 2


def test_n_choices_and_seeds(client):
    kwargs = dict(model="alpha", prompt=PROMPTS[3], max_tokens=6, temperature=1.0, seed=11)
    both = client.completions.create(**kwargs, n=2)
    assert [c.index for c in both.choices] == [0, 1]
    second = client.completions.create(**{**kwargs, "seed": 12})
    assert both.choices[1].text == second.choices[0].text  # choice k draws with seed + k, as Engine.generate
    assert both.choices[0].text == client.completions.create(**kwargs).choices[0].text
    assert both.usage.prompt_tokens == second.usage.prompt_tokens  # the prompt counts once
    batch = client.completions.create(model="beta", prompt=PROMPTS[:2], max_tokens=3, temperature=0, n=2)
    assert len(batch.choices) == 4 and batch.choices[0].text == batch.choices[1].text != batch.choices[2].text


def test_stop_string_cuts_the_text(client, reference):
    full = alone(reference, PROMPTS[1], "alpha", ignore_eos=True).text
    stop = full.split()[2]
    out = client.completions.create(model="alpha", prompt=PROMPTS[1], max_tokens=MAX_TOKENS, temperature=0, stop=[stop])
    assert out.choices[0].text == full[:full.index(stop)] and out.choices[0].finish_reason == "stop"


def test_load_use_unload_adapter(client, reference, server, demo_dir):
    r = httpx.post(f"{server.url}/v1/load_lora_adapter", json={"lora_name": "gamma", "lora_path": str(demo_dir / "gamma")})
    assert r.status_code == 200, r.text
    assert client.models.list().data[-1].id == "gamma" and client.models.list().data[-1].parent == MODEL_NAME
    out = client.completions.create(model="gamma", prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0)
    assert out.choices[0].text == alone(reference, PROMPTS[0], "gamma").text
    assert out.choices[0].text != alone(reference, PROMPTS[0], "alpha").text
    r = httpx.post(f"{server.url}/unload_lora_adapter", json={"lora_name": "gamma"})  # the un-prefixed route
    assert r.status_code == 200, r.text
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gamma", prompt=PROMPTS[0], max_tokens=2)
    assert e.value.body["code"] == "model_not_found" and e.value.body["param"] == "model"
    assert "gamma" not in {m.id for m in client.models.list().data}
    r = httpx.post(f"{server.url}/v1/unload_lora_adapter", json={"lora_name": "gamma"})
    assert r.status_code == 404 and "unknown adapter 'gamma'" in r.json()["error"]["message"]


def test_load_inplace_replaces_an_adapter_and_unknown_fields_are_refused(client, reference, server, demo_dir):
    """vLLM's load_inplace: the name serves the new files; without it the name is taken. Other fields (a typo, or
    SGLang's pinned) are a 400 naming them, not ignored."""
    load = f"{server.url}/v1/load_lora_adapter"
    assert httpx.post(load, json={"lora_name": "gamma", "lora_path": str(demo_dir / "gamma")}).status_code == 200
    try:
        again = httpx.post(load, json={"lora_name": "gamma", "lora_path": str(demo_dir / "alpha")})
        assert again.status_code == 400 and "load_inplace" in again.json()["error"]["message"], again.text
        for extra in ({"pinned": True}, {"load_in_place": True}):
            r = httpx.post(load, json={"lora_name": "gamma", "lora_path": str(demo_dir / "alpha"), **extra})
            assert r.status_code == 400 and r.json()["error"]["param"] == next(iter(extra)), r.text
        r = httpx.post(load, json={"lora_name": "gamma", "lora_path": str(demo_dir / "alpha"), "load_inplace": True})
        assert r.status_code == 200, r.text
        out = client.completions.create(model="gamma", prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0)
        assert out.choices[0].text == alone(reference, PROMPTS[0], "alpha").text
        assert next(m.root for m in client.models.list().data if m.id == "gamma") == str(demo_dir / "alpha")
    finally:
        r = httpx.post(f"{server.url}/v1/unload_lora_adapter", json={"lora_name": "gamma", "lora_int_id": 3})
        assert r.status_code == 200, r.text


def test_adapter_files_are_read_in_threads_of_their_own(server, demo_dir, monkeypatch):
    """Not in asyncio's default executor, which encodes the non-streamed responses: a few slow reads held up every
    such response (the default executor has min(32, CPUs + 4) threads)."""
    engine = server.loop.engine
    read, threads = engine.read_lora, []
    monkeypatch.setattr(engine, "read_lora", lambda path: threads.append(threading.current_thread().name) or read(path))
    body = {"lora_name": "gamma", "lora_path": str(demo_dir / "gamma")}
    r = httpx.post(f"{server.url}/v1/load_lora_adapter", json=body)
    assert r.status_code == 200, r.text
    assert len(threads) == 1 and threads[0].startswith("moelora-adapter-read"), threads
    assert httpx.post(f"{server.url}/v1/unload_lora_adapter", json={"lora_name": "gamma"}).status_code == 200


def test_unloading_an_adapter_lets_its_requests_finish(client, reference, server, demo_dir):
    assert httpx.post(f"{server.url}/load_lora_adapter",
                      json={"lora_name": "gamma", "lora_path": str(demo_dir / "gamma")}).status_code == 200
    stream = client.completions.create(model="gamma", prompt=PROMPTS[2], max_tokens=40, temperature=0, stream=True)
    text = next(iter(stream)).choices[0].text
    assert httpx.post(f"{server.url}/v1/unload_lora_adapter", json={"lora_name": "gamma"}).status_code == 200
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gamma", prompt=PROMPTS[2], max_tokens=2)
    # its name is not free before its requests finish: a 400 that names lora_name, not the (valid) path
    again = httpx.post(f"{server.url}/v1/load_lora_adapter",
                       json={"lora_name": "gamma", "lora_path": str(demo_dir / "gamma")})
    assert again.status_code == 400 and again.json()["error"]["param"] == "lora_name", again.text
    assert "still being unloaded" in again.json()["error"]["message"]
    text += "".join(c.choices[0].text for c in stream)
    assert text == alone(reference, PROMPTS[2], "gamma", 40).text
    assert server.idle()
    assert "gamma" not in server.on_engine(lambda: server.loop.engine.runner.lora.pool.names)  # its slot is free


def test_concurrent_streams_with_adapters_loaded_and_unloaded(server, reference, demo_dir):
    """64 streamed requests over the base model and both adapters; while they run, beta is unloaded
    and gamma loaded and used. Every request gets the tokens it gets alone."""
    jobs = [(MODELS[i % 3], PROMPTS[i % 4], 20 + i % 8) for i in range(64)]
    done = [False] * len(jobs)

    async def run() -> tuple[list[str], tuple[int, list[str]]]:
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0) as client:
            return await traffic(client)

    async def traffic(client: openai.AsyncOpenAI) -> tuple[list[str], tuple[int, list[str]]]:
        started = asyncio.Event()

        async def one(model: str, prompt: str, max_tokens: int, i: int | None = None) -> str:
            stream = await client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                                     stream=True, extra_body={"ignore_eos": True})
            text = ""
            async for chunk in stream:
                started.set()
                text += chunk.choices[0].text
            if i is not None:
                done[i] = True
            return text

        async def churn() -> tuple[int, list[str]]:
            await started.wait()
            beta_running = sum(not d for (model, _, _), d in zip(jobs, done) if model == "beta")
            async with httpx.AsyncClient(base_url=server.url) as http:
                assert (await http.post("/v1/unload_lora_adapter", json={"lora_name": "beta"})).status_code == 200
                r = await http.post("/v1/load_lora_adapter", json={"lora_name": "gamma",
                                                                   "lora_path": str(demo_dir / "gamma")})
                assert r.status_code == 200, r.text
            return beta_running, await asyncio.gather(*(one("gamma", p, 5) for p in PROMPTS))

        return await asyncio.gather(asyncio.gather(*(one(*job, i) for i, job in enumerate(jobs))), churn())

    texts, (beta_running, gamma_texts) = asyncio.run(run())
    assert beta_running > 0, "beta was unloaded only after its requests finished"
    longest = {(m, p): alone(reference, p, m, 28, ignore_eos=True).token_ids for m, p, _ in jobs}  # greedy: prefixes
    assert texts == [reference.tokenizer.decode(longest[m, p][:n]) for m, p, n in jobs]
    assert gamma_texts == [alone(reference, p, "gamma", 5, ignore_eos=True).text for p in PROMPTS]
    assert server.idle()
    assert sorted(server.loop.adapters) == ["alpha", "gamma"]
    assert httpx.post(f"{server.url}/v1/load_lora_adapter",  # back to the module's adapters
                      json={"lora_name": "beta", "lora_path": str(demo_dir / "beta")}).is_success
    assert httpx.post(f"{server.url}/v1/unload_lora_adapter", json={"lora_name": "gamma"}).is_success


def test_health_and_metrics(server, client, reference):
    assert httpx.get(f"{server.url}/health").status_code == 200
    before = httpx.get(f"{server.url}/metrics").text
    prompt = "a prompt no other request sends"  # (so that the prefix cache holds none of it: computed whole)
    client.completions.create(model="alpha", prompt=prompt, max_tokens=3, temperature=0, extra_body={"ignore_eos": True})
    after = httpx.get(f"{server.url}/metrics").text

    def value(text: str, name: str) -> float:
        return next(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " "))

    def grew(name: str) -> float:
        # a labelled counter appears with its first increment: 0 before it, when this test runs first
        before_value = value(before, name) if "{" not in name or f"\n{name} " in before else 0.0
        return value(after, name) - before_value
    assert grew("moelora:generation_tokens_total") == 3
    assert grew("moelora:prompt_tokens_total") == len(reference.tokenizer.encode(prompt))
    assert grew("moelora:time_to_first_token_seconds_count") == 1
    assert grew("moelora:inter_token_latency_seconds_count") == 2
    assert grew('moelora:requests_finished_total{finish_reason="length"}') == 1
    assert grew("moelora:lora_slot_hits_total") + grew("moelora:lora_slot_loads_total") == 3  # one per step
    stats = server.on_engine(lambda: vars(server.loop.engine.runner.lora.stats).copy())
    for name, count in stats.items():
        assert value(after, f"moelora:lora_{name}_total") == count
    assert value(after, "moelora:num_running_reqs") == 0 and value(after, "moelora:num_queue_reqs") == 0
    # the engine's step counters and the server threads' (moelora/engine/step_stats.py, EngineLoop's ThreadStats):
    # one prompt step, then a decode step for each of the two tokens after the first
    assert (grew("moelora:engine_prefill_steps_total"), grew("moelora:engine_decode_steps_total")) == (1, 2)
    assert grew("moelora:engine_decode_rows_total") == 2 and grew("moelora:engine_admitted_total") == 1
    assert grew("moelora:engine_prompt_tokens_total") == len(reference.tokenizer.encode(prompt))
    assert grew("moelora:server_added_total") == 1
    assert 0 < grew("moelora:server_add_delay_seconds_total") <= grew("moelora:engine_admission_wait_seconds_total")
    for name in ("engine_launch_seconds", "server_steps_seconds", "server_text_seconds", "server_event_loop_cpu_seconds",
                 "server_engine_cpu_seconds", "server_text_cpu_seconds", "server_tokenize_seconds",
                 "server_tokenize_cpu_seconds"):
        assert grew(f"moelora:{name}_total") > 0, name


def test_the_served_name_cannot_be_an_adapters(reference):
    with pytest.raises(ValueError, match="'alpha' is also an adapter's name"):
        create_app(reference, "alpha")
