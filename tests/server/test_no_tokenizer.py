"""A model directory without tokenizer files, served: token-id prompts complete (the choices carry
their token ids, logprob tokens read "token_id:N"), what needs text is a 400 naming the files."""
from __future__ import annotations

import shutil

import openai
import pytest

from moelora.engine.engine import Engine
from moelora.engine.sampling_params import SamplingParams
from moelora.server.app import create_app
from tests.server.conftest import ENGINE_OPTIONS, MODEL_NAME, serving

PROMPT = [40, 41, 42, 43]


@pytest.fixture(scope="module")
def bare_model(demo_dir, tmp_path_factory):
    path = tmp_path_factory.mktemp("bare") / "model"
    shutil.copytree(demo_dir / "model", path, ignore=shutil.ignore_patterns("tokenizer*", "chat_template*"))
    return path


@pytest.fixture(scope="module")
def client(bare_model, demo_dir):
    engine = Engine(str(bare_model), lora_paths={"alpha": str(demo_dir / "alpha")}, **ENGINE_OPTIONS)
    with serving(create_app(engine, MODEL_NAME)) as server:
        yield openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)


def test_token_id_prompts_complete(client, reference):
    want = reference.generate([PROMPT], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=1),
                              lora="alpha")[0]
    out = client.completions.create(model="alpha", prompt=PROMPT, max_tokens=6, temperature=0, logprobs=1,
                                    extra_body={"ignore_eos": True})
    choice = out.choices[0]
    assert choice.text == "" and choice.model_extra["token_ids"] == want.token_ids
    assert choice.logprobs.tokens == [f"token_id:{t}" for t in want.token_ids]
    assert out.usage.prompt_tokens == len(PROMPT) and out.usage.completion_tokens == 6
    chunks = list(client.completions.create(model="alpha", prompt=PROMPT, max_tokens=6, temperature=0, stream=True,
                                            extra_body={"ignore_eos": True}))
    assert [t for c in chunks for t in c.choices[0].model_extra["token_ids"]] == want.token_ids


def test_text_needs_a_tokenizer(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL_NAME, prompt="Hello world", max_tokens=2)
    assert e.value.body["param"] == "prompt" and "has no tokenizer files (none of tokenizer.json" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}])
    assert e.value.body["param"] == "messages" and "chat needs a tokenizer" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=2, stop=["x"])
    assert e.value.body["param"] == "stop"
