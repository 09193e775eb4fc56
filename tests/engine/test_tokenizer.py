"""The engine's tokenizer: a model directory without tokenizer files serves token ids (Mixtral and
DeepSeek configs too, which transformers cannot build a tokenizer for), --tokenizer-path overrides,
Hub ids are refused without network, and --chat-template replaces the tokenizer's template."""
import shutil

import pytest

from moelora.engine.sampling_params import SamplingParams
from moelora.engine.tokenizer import TOKENIZER_FILES

PROMPT = [5, 9, 2, 17, 30]
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
TEMPLATE = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}[assistant]"


@pytest.mark.parametrize("family", ["mixtral", "deepseek_v2", "qwen3_moe"])
def test_a_model_without_tokenizer_files_serves_token_ids(family, make_engine):
    bare, with_tokenizer = make_engine(family, tokenizer_path=None), make_engine(family)
    assert bare.tokenizer is None
    out = bare.generate([PROMPT], GREEDY, lora="full")[0]
    want = with_tokenizer.generate([PROMPT], GREEDY, lora="full")[0]
    assert out.token_ids == want.token_ids and out.text == "" and out.finish_reason == "length"
    assert bare.prompt_logprobs([PROMPT])[0].equal(with_tokenizer.prompt_logprobs([PROMPT])[0])
    assert bare.token_text(7) == "token_id:7"  # as vLLM's return_tokens_as_token_ids
    for files in TOKENIZER_FILES[:2]:
        with pytest.raises(ValueError, match=f"a text prompt needs a tokenizer: .* has no tokenizer files .*{files}"):
            bare.generate("hello", GREEDY)
    with pytest.raises(ValueError, match="SamplingParams.stop strings need a tokenizer"):
        bare.generate([PROMPT], SamplingParams(stop=["x"]))
    with pytest.raises(ValueError, match="chat needs a tokenizer"):
        bare.chat_prompt([{"role": "user", "content": "hi"}])


def test_tokenizer_paths_that_are_not_local_tokenizers(make_engine, tmp_path):
    with pytest.raises(ValueError, match="EngineConfig.tokenizer_path 'Qwen/Qwen3-8B' is not a local directory"):
        make_engine("qwen3_moe", tokenizer_path="Qwen/Qwen3-8B")
    with pytest.raises(ValueError, match="EngineConfig.tokenizer_path: .* has no tokenizer files"):
        make_engine("qwen3_moe", tokenizer_path=str(tmp_path))


def test_chat_template_file_or_inline(make_engine, tmp_path):
    messages = [{"role": "user", "content": "hi"}]
    inline = make_engine("qwen3_moe", chat_template=TEMPLATE)
    assert inline.chat_prompt(messages) == "[user] hi\n[assistant]"
    (tmp_path / "t.jinja").write_text(TEMPLATE.replace("[assistant]", "<assistant>"))
    from_file = make_engine("qwen3_moe", chat_template=str(tmp_path / "t.jinja"))
    assert from_file.chat_prompt(messages) == "[user] hi\n<assistant>"
    with pytest.raises(ValueError, match="EngineConfig.chat_template 'missing.jinja' is neither a readable file"):
        make_engine("qwen3_moe", chat_template="missing.jinja")
    with pytest.raises(ValueError, match="EngineConfig.chat_template does not render a user message: "
                                         "TemplateSyntaxError"):
        make_engine("qwen3_moe", chat_template="{% for m in messages %}")
    with pytest.raises(ValueError, match="EngineConfig.chat_template: .* has no tokenizer files"):
        make_engine("qwen3_moe", tokenizer_path=None, chat_template=TEMPLATE)


def test_chat_prompt_options_as_vllms(make_engine):
    """add_generation_prompt false ends the prompt with the messages, continue_final_message inside the last one
    (an assistant's), and chat_template_kwargs are the template's variables (Qwen3's enable_thinking), never
    apply_chat_template's own arguments."""
    template = ("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
                "{% if add_generation_prompt %}[assistant]{% if not enable_thinking %}<no-think>{% endif %}{% endif %}")
    engine = make_engine("qwen3_moe", chat_template=template)
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello, wor"}]
    assert engine.chat_prompt(messages[:1]) == "[user] hi\n[assistant]<no-think>"
    assert engine.chat_prompt(messages[:1], template_kwargs={"enable_thinking": True}) == "[user] hi\n[assistant]"
    assert engine.chat_prompt(messages[:1], add_generation_prompt=False) == "[user] hi\n"
    assert engine.chat_prompt(messages, add_generation_prompt=False, continue_final_message=True) == \
        "[user] hi\n[assistant] Hello, wor"
    with pytest.raises(ValueError, match="cannot also add the generation prompt"):
        engine.chat_prompt(messages, continue_final_message=True)
    with pytest.raises(ValueError, match="continue_final_message needs the last message to be the assistant's"):
        engine.chat_prompt(messages[:1], add_generation_prompt=False, continue_final_message=True)
    for key in ("tokenize", "chat_template", "messages", "add_generation_prompt"):
        with pytest.raises(ValueError, match=f"chat_template_kwargs cannot set {key}: arguments of the template's"):
            engine.chat_prompt(messages[:1], template_kwargs={key: False, "enable_thinking": True})


def test_a_broken_chat_template_of_the_tokenizer_is_logged_and_chat_refused(make_engine, tokenizer_dir, tmp_path,
                                                                          caplog):
    """The tokenizer directory's own template is rendered at the start as --chat-template's is: broken, the start logs
    why and chat requests are refused saying so (not as the client's fault), while completions serve on.
    --chat-template replaces it."""
    broken = tmp_path / "tokenizer"
    shutil.copytree(tokenizer_dir, broken)
    (broken / "chat_template.jinja").write_text("{% for m in messages %}")
    with caplog.at_level("WARNING", logger="moelora.engine.tokenizer"):
        engine = make_engine("qwen3_moe", tokenizer_path=str(broken))
    assert "its chat template does not render a user message: TemplateSyntaxError" in caplog.text
    assert "replace it with chat_template, --chat-template" in caplog.text
    with pytest.raises(ValueError, match="the model has no chat template .* the start logged why"):
        engine.chat_prompt([{"role": "user", "content": "hi"}])
    assert engine.generate([PROMPT], GREEDY)[0].token_ids  # completions serve on
    assert make_engine("qwen3_moe", tokenizer_path=str(broken), chat_template=TEMPLATE).chat_prompt(
        [{"role": "user", "content": "hi"}]) == "[user] hi\n[assistant]"
