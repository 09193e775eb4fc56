"""A model directory without tokenizer files, served: token-id prompts complete (the choices carry
their token ids, logprob tokens read "token_id:N"), with every sampling option that needs no text;
what needs text (text prompts, chat, stop strings, echo, structured output) is a 400 naming the files."""
from __future__ import annotations

import shutil

import openai
import pytest

from moelora.engine.engine import Engine
from moelora.engine.sampling_params import SamplingParams, StructuredOutput
from moelora.server.app import create_app
from tests.server.conftest import ENGINE_OPTIONS, MODEL_NAME, serving

PROMPT = [40, 41, 42, 43]


@pytest.fixture(scope="module")
def bare_model(demo_dir, tmp_path_factory):
    path = tmp_path_factory.mktemp("bare") / "model"
    shutil.copytree(demo_dir / "model", path, ignore=shutil.ignore_patterns("tokenizer*", "chat_template*"))
    return path


@pytest.fixture(scope="module")
def engine(bare_model, demo_dir):
    return Engine(str(bare_model), lora_paths={"alpha": str(demo_dir / "alpha")}, **ENGINE_OPTIONS)


@pytest.fixture(scope="module")
def client(engine):
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
    for route, body in (("tokenize", {"prompt": "hi"}), ("detokenize", {"tokens": PROMPT})):
        with pytest.raises(openai.BadRequestError) as e:
            client.post(f"/{route}", body=body, cast_to=dict)
        assert f"/{route} needs a tokenizer: " in e.value.message


def test_sampling_options_need_no_tokenizer(client, reference):
    """Penalties, logit_bias, min_tokens, allowed_token_ids and best_of act on token ids alone."""
    options = dict(presence_penalty=0.5, frequency_penalty=0.4, repetition_penalty=1.3, min_tokens=4,
                   allowed_token_ids=[7, 40, 41, 50, 60, 61])
    want = reference.generate([PROMPT], SamplingParams(max_tokens=6, temperature=0.0, logit_bias={50: 3.0}, **options),
                              lora="alpha")[0]
    out = client.completions.create(model="alpha", prompt=PROMPT, max_tokens=6, temperature=0, best_of=2,
                                    presence_penalty=0.5, frequency_penalty=0.4, logit_bias={"50": 3.0},
                                    extra_body={k: v for k, v in options.items() if "presence" not in k
                                                and "frequency" not in k})
    assert [c.model_extra["token_ids"] for c in out.choices] == [want.token_ids]
    assert set(want.token_ids) <= set(options["allowed_token_ids"]) and out.usage.completion_tokens == 12


@pytest.mark.parametrize("field, value", [("guided_regex", "a+"), ("guided_choice", ["x", "y"]),
                                          ("response_format", {"type": "json_object"}), ("echo", True)])
def test_text_options_need_a_tokenizer(client, field, value):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="alpha", prompt=PROMPT, max_tokens=2, extra_body={field: value})
    assert e.value.body["param"] == field and "needs a tokenizer" in e.value.message
    assert "has no tokenizer files" in e.value.message


def test_the_engine_refuses_a_grammar_without_a_tokenizer(engine):
    with pytest.raises(ValueError, match=r"SamplingParams.structured_output needs a tokenizer: .* has no tokenizer files"):
        engine.generate(PROMPT, SamplingParams(max_tokens=2, structured_output=StructuredOutput("regex", "a+")))
