"""Reasoning models (`--reasoning-parser`): the parser on scripted outputs split at every point, where the prompt
leaves the output (thinking or not), and a real server over a tiny model whose tokenizer has <think> and </think>:
its reasoning_content and content, streamed or not, are the reference engine's text split at </think>, and a
grammar applies to the answer after the thinking (as the engine's gate does) or from the first token when the
prompt closed the thinking."""
from __future__ import annotations

import httpx
import openai
import pytest

from moelora.engine.engine import Engine
from moelora.engine.sampling_params import SamplingParams, StructuredOutput
from moelora.server.app import create_app
from moelora.server.reasoning import END, START, OutputStart, Reasoning, ReasoningParser
from moelora.server.tools import ChoiceOutput, ToolCallParser
from tests.server.conftest import ENGINE_OPTIONS, MODEL_NAME, serving
from tests.support import build_random_demo, tiny_tokenizer

# (where the output starts, output) -> (reasoning, content)
CASES = [
    (None, "<think>\nLet me see.\n</think>\n\nThe answer.", ("Let me see.", "The answer.")),
    (None, "The answer, no thinking.", ("", "The answer, no thinking.")),
    (None, "\n <think>x\n\ny </think>y", ("x\n\ny", "y")),
    (None, "\n\nAn answer after newlines <think>", ("", "\n\nAn answer after newlines <think>")),
    (None, "<thi", ("", "<thi")),
    (None, "", ("", "")),
    (True, "Let me see.\n</think>\n\nAnswer", ("Let me see.", "Answer")),
    (True, "<think>\nhmm</think>ok", ("hmm", "ok")),
    (True, "<think><think>", ("<think>", "")),
    (True, "cut off while thinking \n", ("cut off while thinking", "")),
    (True, "a < b </think> c <think> d </think>", ("a < b", "c <think> d </think>")),
    (True, "x</thi", ("x</thi", "")),
    (True, "</think>", ("", "")),
    (False, "<think>x</think>y", ("", "<think>x</think>y")),
    # going on with a thought or answer of the prompt's final message: its first whitespace is the model's
    (OutputStart(True, goes_on=True), " the <think> fox </think>\n x", (" the <think> fox", "x")),
    (OutputStart(False, goes_on=True), "\n\nx <think>y</think>", ("", "\n\nx <think>y</think>")),
    (OutputStart(None, goes_on=True), " so <think>y</think>", ("", " so <think>y</think>")),
]


def start_of(thinking: bool | None | OutputStart) -> OutputStart:
    return thinking if isinstance(thinking, OutputStart) else OutputStart(thinking)


def run(parser: ReasoningParser, pieces: list[str]) -> tuple[str, str]:
    reasoning, content = "", ""
    for piece in pieces:
        r, c = parser.feed(piece)
        reasoning, content = reasoning + r, content + c
    r, c = parser.finish()
    return reasoning + r, content + c


@pytest.mark.parametrize("thinking, text, want", CASES)
def test_the_split_is_the_same_however_the_text_comes(thinking, text, want):
    start = start_of(thinking)
    assert run(ReasoningParser(start), [text]) == want
    assert run(ReasoningParser(start), list(text)) == want
    for i in range(len(text) + 1):
        for j in range(i, len(text) + 1):
            assert run(ReasoningParser(start), [text[:i], text[i:j], text[j:]]) == want, (i, j)


def test_reasoning_goes_out_as_it_comes():
    """Streamed, the thinking goes out piece by piece (not at its end); only a possible tag or whitespace waits."""
    parser = ReasoningParser(OutputStart(None))
    assert parser.feed("<think>") == ("", "")
    assert parser.feed("\nFirst") == ("First", "")
    assert parser.feed(" step.\n") == (" step.", "")
    assert parser.feed("Second</") == ("\nSecond", "")
    assert parser.feed("think>\n\nDone") == ("", "Done")
    assert parser.finish() == ("", "")


@pytest.fixture(scope="module")
def reasoning() -> Reasoning:
    tokenizer = tiny_tokenizer()
    tokenizer.add_tokens([START, END])
    return Reasoning.of("qwen3", tokenizer)


GO_ON = OutputStart(True, goes_on=True)
ANSWER = OutputStart(False, goes_on=True)


@pytest.mark.parametrize("prompt, continued, qwen3, deepseek_r1", [
    ("<|im_start|>assistant\n", None, OutputStart(None), OutputStart(True)),
    ("<|im_start|>assistant\n<think>\n", None, OutputStart(True), OutputStart(True)),
    ("<|im_start|>assistant\n<think>\n\n</think>\n\n", None, OutputStart(False), OutputStart(False)),
    # an earlier turn's thinking, then a new turn: not the output's
    ("<think>a</think>b<|im_end|>\n<|im_start|>assistant\n", None, OutputStart(None), OutputStart(True)),
    # going on with the final message: its tags decide, not a tag a question quotes
    ("Is <think> a tag?<|im_start|>assistant\n<think>\n", {"content": "<think>\n"}, OutputStart(True),
     OutputStart(True)),
    ("Is </think> a tag?<|im_start|>assistant\n<think>\nI see", {"content": "<think>\nI see"}, GO_ON, GO_ON),
    ("x<|im_start|>assistant\n<think>\nI see</think>\n\nSo", {"content": "<think>\nI see</think>\n\nSo"},
     ANSWER, ANSWER),
    ("Is <think> a tag?<|im_start|>assistant\nSo", {"content": "So"}, OutputStart(None, goes_on=True), GO_ON),
    ("<|im_start|>assistant\n<think>\nhm\n</think>\n\nSo", {"content": "So", "reasoning_content": "hm"}, ANSWER,
     ANSWER),
])
def test_where_the_prompt_leaves_the_output(reasoning, prompt, continued, qwen3, deepseek_r1):
    assert reasoning.output_start(prompt, continued) == qwen3
    r1 = Reasoning("deepseek_r1", reasoning.start_id, reasoning.end_id)
    assert r1.output_start(prompt, continued) == deepseek_r1


@pytest.mark.parametrize("prompt, want", [
    ("<｜Assistant｜><think>", OutputStart(True)),    # DeepSeek-V3.1, thinking asked for
    ("<｜Assistant｜></think>", OutputStart(False)),  # not asked for
    ("<｜Assistant｜>", OutputStart(False)),          # a template that writes neither: the answer
])
def test_deepseek_v3_thinks_when_the_prompt_opens_the_thinking(reasoning, prompt, want):
    v3 = Reasoning("deepseek_v3", reasoning.start_id, reasoning.end_id)
    assert v3.output_start(prompt) == want
    assert v3.output_start("x", {"content": "<think>\nI see"}) == GO_ON


def test_the_grammar_waits_for_the_thinking(reasoning):
    end, start = reasoning.end_id, reasoning.start_id
    assert reasoning.grammar_gate(OutputStart(True)) == {"reasoning_end": end, "reasoning_start": None}
    assert reasoning.grammar_gate(GO_ON) == {"reasoning_end": end, "reasoning_start": None}
    assert reasoning.grammar_gate(OutputStart(None)) == {"reasoning_end": end, "reasoning_start": start}
    assert reasoning.grammar_gate(ANSWER) == {}


def test_a_reasoning_parser_needs_a_reasoning_tokenizer():
    with pytest.raises(ValueError, match=r"--reasoning-parser qwen3: the tokenizer has no token <think> or </think>"):
        Reasoning.of("qwen3", tiny_tokenizer())
    with pytest.raises(ValueError, match=r"--reasoning-parser must be one of deepseek_r1, deepseek_v3, qwen3, got 'r2'"):
        Reasoning.of("r2", tiny_tokenizer())
    with pytest.raises(ValueError, match=r"--reasoning-parser needs the model's tokenizer"):
        Reasoning.of("qwen3", None)


def test_tool_calls_after_the_thinking():
    call = '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>'
    text = f"<think>\nI need the time.\n</think>\n\n{call}"
    message, reason = ChoiceOutput(ToolCallParser(), ReasoningParser(OutputStart(None))).message(text, "stop")
    assert message.reasoning_content == "I need the time." and message.content is None and reason == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in message.tool_calls] == [("now", "{}")]
    streamed = ChoiceOutput(ToolCallParser(), ReasoningParser(OutputStart(None)))
    deltas = [streamed.delta(c, None)[0] for c in text] + [streamed.delta("", "stop")[0]]
    assert "".join(d.reasoning_content or "" for d in deltas) == "I need the time."
    assert not any(d.content for d in deltas) and any(d.tool_calls for d in deltas)
    hidden, _ = ChoiceOutput(None, ReasoningParser(OutputStart(None)), include_reasoning=False).message(text, "stop")
    assert hidden.reasoning_content is None and hidden.content == call


# ------------------------------------------------------------------------------------ served

# Qwen3's layout: enable_thinking false writes an empty thinking after the assistant's turn begins
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
            "{% if not (loop.last and continue_final_message) %}<|im_end|>\n{% endif %}{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n"
            "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
            "{% endif %}")
MESSAGES = [{"role": "user", "content": "Hello world"}]
THINKING = [*MESSAGES, {"role": "assistant", "content": "<think>\n"}]  # the output goes on thinking


@pytest.fixture(scope="module")
def think_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("reasoning-demo")
    build_random_demo(root, {}, extra_tokens=[START, END])
    (root / "model" / "chat_template.jinja").write_text(TEMPLATE)
    return root


def think_engine(root) -> Engine:
    return Engine(str(root / "model"), **ENGINE_OPTIONS)


@pytest.fixture(scope="module")
def think_server(think_dir):
    with serving(create_app(think_engine(think_dir), MODEL_NAME, reasoning_parser="qwen3")) as s:
        yield s


@pytest.fixture(scope="module")
def think_reference(think_dir) -> Engine:
    return think_engine(think_dir)


@pytest.fixture(scope="module")
def client(think_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{think_server.url}/v1", api_key="none", max_retries=0)


def words(engine: Engine, *pieces: str) -> list[int]:
    ids = [engine.tokenizer.encode(p) for p in pieces]
    assert all(len(i) == 1 for i in ids), ids
    return [i[0] for i in ids]


def split(text: str) -> tuple[str | None, str | None]:
    """The reasoning and content of an output that starts thinking, by hand."""
    reasoning, _, content = text.partition(END)
    return reasoning.strip() or None, content.lstrip() or None


def body(engine: Engine, seed: int, end_bias: float = 98, **more) -> dict:
    """Draws between two words and (less often, at the default end_bias) </think>, at random (seeded)."""
    the, fox, end = words(engine, " the", " fox", END)
    return {"model": MODEL_NAME, "messages": THINKING, "continue_final_message": True, "add_generation_prompt": False,
            "max_tokens": 12, "temperature": 1.0, "seed": seed, "logit_bias": {str(the): 100, str(fox): 100, str(end): end_bias},
            **more}


EXTRA = ("continue_final_message", "add_generation_prompt", "chat_template_kwargs", "guided_choice")


def create(client: openai.OpenAI, request: dict, **more):
    """The request through the openai client: vLLM's fields in its extra_body."""
    request = {**request, **more}
    return client.chat.completions.create(**{k: v for k, v in request.items() if k not in EXTRA},
                                          extra_body={k: v for k, v in request.items() if k in EXTRA})


def reference_text(engine: Engine, request: dict, spec: StructuredOutput | None = None) -> str:
    prompt = engine.chat_prompt(request["messages"], continue_final_message=request.get("continue_final_message", False),
                                add_generation_prompt=request.get("add_generation_prompt", True),
                                template_kwargs=request.get("chat_template_kwargs"))
    params = SamplingParams(max_tokens=request["max_tokens"], temperature=request["temperature"],
                            seed=request["seed"], logit_bias={int(k): v for k, v in request["logit_bias"].items()},
                            structured_output=spec)
    return engine.generate(prompt, params)[0].text


@pytest.mark.parametrize("seed", range(4))
def test_served_reasoning_is_the_text_before_the_end_of_thinking(client, think_reference, seed):
    request = body(think_reference, seed)
    want = split(reference_text(think_reference, request))
    message = create(client, request).choices[0].message
    assert (message.reasoning_content, message.content) == want
    stream = create(client, request, stream=True)
    deltas = [c.choices[0].delta for c in stream if c.choices]
    assert ("".join(getattr(d, "reasoning_content", None) or "" for d in deltas) or None,
            "".join(d.content or "" for d in deltas) or None) == want


def test_some_seeds_think_and_answer(think_reference):
    """The draws above cover thinking followed by an answer, and thinking cut off by max_tokens."""
    splits = [split(reference_text(think_reference, body(think_reference, s))) for s in range(4)]
    assert any(r and c for r, c in splits) and any(r and not c for r, c in splits), splits


@pytest.mark.parametrize("seed", range(3))
def test_a_grammar_applies_to_the_answer_after_the_thinking(client, think_reference, seed):
    request = body(think_reference, seed, end_bias=100, max_tokens=30)
    spec = StructuredOutput("choice", choices=("yes", "no"), reasoning_end=words(think_reference, END)[0])
    want = split(reference_text(think_reference, request, spec))
    message = create(client, request, guided_choice=["yes", "no"]).choices[0].message
    assert (message.reasoning_content, message.content) == want and want[1] in ("yes", "no")


def test_a_closed_thinking_leaves_the_grammar_from_the_first_token(client, think_reference):
    """enable_thinking false: the prompt ends with an empty thinking, so the output is all answer and the grammar
    applies from its first token (</think>, biased, cannot be drawn)."""
    request = {**body(think_reference, 0), "messages": MESSAGES, "continue_final_message": False,
               "add_generation_prompt": True, "chat_template_kwargs": {"enable_thinking": False}}
    message = create(client, request, guided_choice=["yes", "no"]).choices[0].message
    assert message.reasoning_content is None and message.content in ("yes", "no")
    assert message.content == reference_text(think_reference, request, StructuredOutput("choice", choices=("yes", "no")))


def test_include_and_separate_reasoning(think_server, think_reference):
    request = body(think_reference, 0, end_bias=100)
    raw = reference_text(think_reference, request)
    reasoning, content = split(raw)

    def message(**more) -> dict:
        r = httpx.post(f"{think_server.url}/v1/chat/completions", json={**request, **more}, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["message"]
    assert message(include_reasoning=False) == {"role": "assistant", "reasoning_content": None, "content": content,
                                                "tool_calls": None}
    assert reasoning and content  # (the draw thinks, then answers)
    assert message(separate_reasoning=False)["content"] == raw
    assert message()["reasoning_content"] == reasoning


def test_a_model_without_thinking_tokens_cannot_serve_a_reasoning_parser(demo_dir):
    from tests.server.conftest import make_engine

    engine = make_engine(demo_dir, [])
    with pytest.raises(ValueError, match="the tokenizer has no token <think> or </think>"):
        create_app(engine, MODEL_NAME, reasoning_parser="deepseek_r1")


def test_going_on_with_a_thought_keeps_its_first_space(client, think_reference):
    """A request that continues a thought the final message began: the output is reasoning as the model wrote it."""
    the = words(think_reference, " the")[0]
    request = {"model": MODEL_NAME, "messages": [*MESSAGES, {"role": "assistant", "content": "<think>\nI saw"}],
               "continue_final_message": True, "add_generation_prompt": False, "max_tokens": 4, "temperature": 0,
               "seed": 0, "logit_bias": {str(the): 100}}
    text = reference_text(think_reference, request)
    assert text == " the the the the"
    message = create(client, request).choices[0].message
    assert (message.reasoning_content, message.content) == (text, None)


def test_a_tag_a_question_quotes_does_not_decide(client, think_reference):
    """Going on with an answer that has no tags: a <think> in the user's question leaves the grammar (and the
    answer) as they are without it."""
    start = words(think_reference, START)[0]
    for question in ("What does the tag mean?", "What does the <think> tag mean?"):
        request = {**body(think_reference, 0), "continue_final_message": True,
                   "messages": [{"role": "user", "content": question}, {"role": "assistant", "content": "The answer:"}]}
        request["logit_bias"][str(start)] = -100
        message = create(client, request, guided_choice=[" yes", " no"]).choices[0].message
        assert message.reasoning_content is None and message.content in (" yes", " no"), (question, message)
