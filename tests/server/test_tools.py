"""Issue 19's tools / tool_choice through the official openai client against a real server whose
chat template takes tools in the hermes format (tests/server/hermes_tools.jinja, laid out as
Qwen's): calls forced by tool_choice required or named are valid against their schemas and equal
Engine.generate with the same prompt and grammar, streamed or not; auto mode parses what the model
wrote (forced here with guided_choice, as a random model writes no call by itself); multi-turn
histories with calls and tool results render; every refusal is a 400 naming its field. The parser
itself is checked on scripted text split at every point."""
from __future__ import annotations

import json
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest

from moelora.engine.engine import Engine
from moelora.engine.model_runner import ALLOW_LONG_CONTEXT
from moelora.engine.sampling_params import SamplingParams
from moelora.server.app import create_app
from moelora.server.protocol import ChatCompletionRequest
from moelora.server.tools import ChatTools, ChoiceOutput, Parsed, ToolCallParser, template_tool_format
from tests.server.conftest import ENGINE_OPTIONS, MODEL_NAME, serving
from tests.support import TINY_CHAT_TEMPLATE

TEMPLATE = Path(__file__).with_name("hermes_tools.jinja")
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6}, "unit": {"enum": ["c", "f"]}},
           "required": ["city", "unit"], "additionalProperties": False}
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                        "b": {"type": "boolean"}}, "required": ["a", "b"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "parameters": ADD}},
         {"type": "function", "function": {"name": "now", "description": "The time; no arguments"}}]
SCHEMAS = {"get_weather": WEATHER, "add": ADD, "now": {"type": "object", "maxProperties": 0}}
MESSAGES = [{"role": "user", "content": "Hello world"}]
# the tiny tokenizer spends about a token per character of the tools' JSON: past the model's 512
OPTIONS = {**ENGINE_OPTIONS, "chat_template": str(TEMPLATE), "context_length": 2048}


@pytest.fixture(scope="module")
def tool_server(demo_dir):
    with serving(create_app(tool_engine(demo_dir), MODEL_NAME)) as s:
        yield s


def tool_engine(demo_dir) -> Engine:
    """The demo model, whose 512 positions the tool prompts outgrow, with a context of 2048 (its weights are random:
    nothing to lose past the trained positions)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(ALLOW_LONG_CONTEXT, "1")
        return Engine(str(demo_dir / "model"), lora_paths={"alpha": str(demo_dir / "alpha")}, **OPTIONS)


@pytest.fixture(scope="module")
def client(tool_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{tool_server.url}/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def tool_reference(demo_dir) -> Engine:
    return tool_engine(demo_dir)


def post(server, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 4, **body},
                      timeout=120)


def error(r: httpx.Response, param: str, match: str = "") -> None:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and match in err["message"], err


def calls_of(message) -> list[tuple[str, str]]:
    return [(c.function.name, c.function.arguments) for c in message.tool_calls or []]


def streamed(client: openai.OpenAI, **kwargs) -> tuple[str | None, list[tuple[str, str]], str, list]:
    """(content, calls, finish_reason, the deltas) of a streamed chat completion, its deltas joined."""
    content, calls, reason, deltas = None, {}, None, []
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        choice = chunk.choices[0]
        deltas.append(choice.delta)
        if choice.delta.content:
            content = (content or "") + choice.delta.content
        for c in choice.delta.tool_calls or []:
            if c.index not in calls:  # a call's first delta: its id, type and name
                assert c.id.startswith("call_") and c.type == "function" and c.function.name, c
                calls[c.index] = [c.function.name, ""]
            else:
                assert c.id is None and c.function.name is None, c
            calls[c.index][1] += c.function.arguments or ""
        reason = choice.finish_reason or reason
    assert sorted(calls) == list(range(len(calls)))
    return content, [tuple(calls[i]) for i in sorted(calls)], reason, deltas


# ------------------------------------------------------------------------------- the parser

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris \\"}\\" ü", "n": [1, {"a": "]"}]}}\n</tool_call>'
WEATHER_ARGS = '{"city": "Paris \\"}\\" ü", "n": [1, {"a": "]"}]}'
SCRIPTS = [  # text, content, calls
    ("Just text, with < and <tool and a tag-like <tool_c end ", "Just text, with < and <tool and a tag-like <tool_c end ",
     []),
    ("ends in a partial tag <tool_ca", "ends in a partial tag <tool_ca", []),
    (CALL, None, [("get_weather", WEATHER_ARGS)]),
    ("Let me look.\n" + CALL + "\n" + '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>\n',
     "Let me look.", [("get_weather", WEATHER_ARGS), ("now", "{}")]),
    (CALL + "\n\nDone:  see above.\n", "Done:  see above.\n", [("get_weather", WEATHER_ARGS)]),
    ('<tool_call>{"arguments": {"x": 1},\n "name": "add"}</tool_call>', None, [("add", '{"x": 1}')]),
    ('<tool_call>{"name": "add", "arguments": {"s": "a\tb\x11"}}</tool_call>', None, [("add", '{"s": "a\\u0009b\\u0011"}')]),
    ('<tool_call>{"arguments": {"s": "\x11"}, "name": "add"}</tool_call>', None, [("add", '{"s": "\\u0011"}')]),
    ('<tool_call>\n{"name": "add", "arguments": {"a": 1}}', None, [("add", '{"a": 1}')]),  # EOS before the end tag
    ("before \n<tool_call>{\"name\": oops}</tool_call> after", "before \n<tool_call>{\"name\": oops}</tool_call> after", []),
    ('x <tool_call>{"name": "add", "arguments": [1]}</tool_call>', 'x <tool_call>{"name": "add", "arguments": [1]}'
     '</tool_call>', []),
    ("a <tool_call>not even JSON", "a <tool_call>not even JSON", []),
    # escapes of lone surrogates decode to no text a response can carry: no name; arguments re-serialised as escapes
    ('<tool_call>{"name": "\\ud800", "arguments": {}}</tool_call>',
     '<tool_call>{"name": "\\ud800", "arguments": {}}</tool_call>', []),
    ('<tool_call>{"arguments": {"s": "\\udc00"}, "name": "add"}</tool_call>', None, [("add", '{"s": "\\udc00"}')]),
]


def parse(pieces: list[str], max_calls: int | None = None) -> tuple[str | None, list[tuple[str, str]], list[Parsed]]:
    """(content, calls, each piece's result) of the text fed in these pieces."""
    parser, out = ToolCallParser(max_calls), Parsed()
    deltas = [parser.feed(p) for p in pieces] + [parser.finish()]
    for d in deltas:
        out += d
    calls = {}
    for c in out.calls:
        if c.id is not None:
            calls[c.index] = [c.function.name, ""]
        calls[c.index][1] += c.function.arguments
    return out.content or None, [tuple(calls[i]) for i in sorted(calls)], deltas


@pytest.mark.parametrize("text, content, calls", SCRIPTS)
def test_parser_gives_the_same_split_at_every_point(text, content, calls):
    assert parse([text])[:2] == (content, calls)
    by_char = parse(list(text))  # a character at a time
    assert by_char[:2] == (content, calls)
    if "<tool_c" not in (content or ""):  # no piece of a tag goes out as content
        assert not any("<" in d.content for d in by_char[2])
    for i in range(len(text) + 1):
        assert parse([text[:i], text[i:]])[:2] == (content, calls), i


def test_a_call_streams_its_name_then_its_arguments_and_never_the_tags():
    pieces = list(CALL)
    parser = ToolCallParser()
    deltas = [parser.feed(p) for p in pieces] + [parser.finish()]
    assert all(d.content == "" for d in deltas)
    first = next(i for i, d in enumerate(deltas) if d.calls)
    assert pieces[first - 1:first + 1] == [" ", "{"]  # sent when the arguments open
    assert deltas[first].calls[0].function.name == "get_weather" and deltas[first].calls[0].id.startswith("call_")
    args = [d.calls[0].function.arguments for d in deltas[first + 1:] if d.calls]
    assert len(args) > 10 and "".join(args) == WEATHER_ARGS[1:]  # a piece at a time, the "{" came with the name


def test_a_head_past_the_streamed_search_is_a_call_when_its_block_closes():
    """The head is looked for while streaming in a block's first MAX_HEAD_CHARS characters (each try reads the
    block from its start: a name never closed, fed a few characters at a time, took 20 s at 64k characters); a
    call whose head comes later is still a call, sent whole when its block ends, however the text is split."""
    from moelora.server.tools import MAX_HEAD_CHARS

    text = "<tool_call>" + " " * MAX_HEAD_CHARS + '{"name": "add", "arguments": {"a": 1}}</tool_call>'
    for pieces in ([text], list(text), [text[:MAX_HEAD_CHARS], text[MAX_HEAD_CHARS:]], [text[:-12], text[-12:]]):
        content, calls, deltas = parse(pieces)
        assert (content, calls) == (None, [("add", '{"a": 1}')])
        assert sum(bool(d.calls) for d in deltas) == 1  # the name and the arguments together, at the end tag
    name_never_closed = ['<tool_call>{"name": "'] + ["ab{c"] * (MAX_HEAD_CHARS // 2)
    assert parse(name_never_closed)[:2] == ("".join(name_never_closed), [])  # not a call: content, as written


def test_arguments_that_break_after_the_name_was_sent():
    """Whole, a broken block is content; streamed past its name, it stays a call as written."""
    text = 'ok <tool_call>\n{"name": "add", "arguments": {"a": 1</tool_call>'
    assert parse([text])[:2] == (text, [])
    cut = text.index('{"a"') + 1
    assert parse([text[:cut], text[cut:]])[:2] == ("ok", [("add", '{"a": 1')])


def test_parallel_tool_calls_false_keeps_the_first_call():
    text = CALL + "\n" + CALL.replace("get_weather", "add") + " bye"
    assert parse([text], max_calls=1)[:2] == ("bye", [("get_weather", WEATHER_ARGS)])
    assert [name for name, _ in parse(list(text), max_calls=None)[1]] == ["get_weather", "add"]


def test_finish_reason_is_tool_calls_when_calls_were_made_and_the_model_stopped():
    assert ChoiceOutput(ToolCallParser()).message(CALL, "stop")[1] == "tool_calls"
    assert ChoiceOutput(ToolCallParser()).message(CALL[:60], "length")[1] == "length"
    message, reason = ChoiceOutput(ToolCallParser()).message("no calls", "stop")
    assert (message.content, message.tool_calls, reason) == ("no calls", None, "stop")
    message, reason = ChoiceOutput(None).message(CALL, "stop")  # tool_choice none: as written
    assert (message.content, message.tool_calls, reason) == (CALL, None, "stop")


def test_a_forced_call_of_a_schema_without_type_has_object_arguments(tool_reference):
    """A parameters schema without "type" is an object's (tools are refused otherwise), so its forced
    calls' arguments are objects: xgrammar alone reads a schema without type as any value, and a call
    whose arguments are not an object is no call."""
    tools = [fn("f", parameters={"description": "anything the function takes"})]
    body = ChatCompletionRequest(messages=MESSAGES, tools=tools, tool_choice="required")
    grammar = ChatTools.of(body, tool_reference.tokenizer).grammar
    head = '<tool_call>\n{"name": "f", "arguments": '
    for arguments, valid in [('{"x": [1]}', True), ("{}", True), ("1", False), ('"s"', False), ("[1]", False),
                             ("null", False)]:
        matcher = tool_reference.grammars.matcher(grammar)
        assert matcher.accept_string(head + arguments + "}\n</tool_call>") == valid, arguments


def test_template_tool_formats():
    assert template_tool_format(TEMPLATE.read_text()) == "hermes"
    assert template_tool_format(TINY_CHAT_TEMPLATE) is None
    other = "{% for t in tools %}{{ t | tojson }}{% endfor %}{% for m in messages %}[TOOL_CALLS]{{ m.content }}{% endfor %}"
    assert template_tool_format(other) == "other"
    assert template_tool_format("{{ messages }} lists <tools> and <tool_call> in text only") is None


# ------------------------------------------------------------------------------ the server


@pytest.mark.parametrize("tool_choice, parallel, seed", [
    ("required", None, 3), ("required", False, 4), ({"type": "function", "function": {"name": "add"}}, None, 5),
    ({"type": "function", "function": {"name": "now"}}, None, 6),
])
def test_forced_calls_are_valid_and_equal_engine_generate(client, tool_server, tool_reference, tool_choice, parallel,
                                                          seed):
    kwargs = dict(model="alpha", messages=MESSAGES, tools=TOOLS, tool_choice=tool_choice, max_tokens=300,
                  temperature=1.0, seed=seed, **({} if parallel is None else {"parallel_tool_calls": parallel}))
    response = client.chat.completions.create(**kwargs)
    out = response.choices[0]
    assert out.finish_reason == "tool_calls" and out.message.content is None and out.message.tool_calls
    for call in out.message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    if not isinstance(tool_choice, str) or parallel is False:
        assert len(out.message.tool_calls) == 1
    if not isinstance(tool_choice, str):
        assert out.message.tool_calls[0].function.name == tool_choice["function"]["name"]
    # the same prompt (tools rendered) and grammar alone on the engine
    body = ChatCompletionRequest(**{k: v for k, v in kwargs.items() if k not in ("temperature", "seed", "max_tokens")})
    tools = ChatTools.of(body, tool_reference.tokenizer)
    prompt = tool_reference.tokenizer.encode(tool_reference.chat_prompt(MESSAGES, tools.specs), add_special_tokens=False)
    want = tool_reference.generate(prompt, SamplingParams(max_tokens=300, temperature=1.0, seed=seed,
                                                          structured_output=tools.grammar), lora="alpha")[0]
    message, reason = tools.output().message(want.text, want.finish_reason)
    assert (calls_of(out.message), out.finish_reason) == (calls_of(message), reason)
    # under the grammar the random model's choices hardly depend on the prompt: its length shows the tools went in
    assert response.usage.prompt_tokens == len(prompt)
    assert streamed(client, **kwargs)[:3] == (None, calls_of(out.message), "tool_calls")
    assert tool_server.idle()


def test_required_calls_of_n_sequences_are_each_valid(client):
    out = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                         max_tokens=300, temperature=1.5, seed=11, n=3)
    assert len({tuple(calls_of(c.message)) for c in out.choices}) > 1
    for choice in out.choices:
        assert choice.finish_reason == "tool_calls"
        for name, arguments in calls_of(choice.message):
            jsonschema.validate(json.loads(arguments), SCHEMAS[name])


SCRIPT = ('Let me look that up.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n'
          '</tool_call>\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": true}}\n</tool_call>')


@pytest.mark.parametrize("parallel", [None, False])
def test_auto_parses_what_the_model_wrote_streamed_or_not(client, parallel):
    """guided_choice makes the random model write SCRIPT, token by token as a model would."""
    kwargs = dict(model="alpha", messages=MESSAGES, tools=TOOLS, max_tokens=200, extra_body={"guided_choice": [SCRIPT]},
                  **({} if parallel is None else {"parallel_tool_calls": parallel}))
    want = [("get_weather", '{"city": "Paris", "unit": "c"}'), ("add", '{"a": 2, "b": true}')][:1 if parallel is False else 2]
    out = client.chat.completions.create(**kwargs)
    choice = out.choices[0]
    assert (choice.message.content, calls_of(choice.message), choice.finish_reason) == ("Let me look that up.", want,
                                                                                        "tool_calls")
    assert out.usage.completion_tokens > 20  # many tokens: the tags came in pieces
    content, calls, reason, deltas = streamed(client, **kwargs)
    assert (content, calls, reason) == ("Let me look that up.", want, "tool_calls")
    assert not any("<" in (d.content or "") or "tool_call" in (d.content or "") for d in deltas)
    assert sum(bool(d.tool_calls) for d in deltas) > 2 * len(want)  # the arguments in pieces


def test_streamed_calls_merge_in_the_openai_clients_stream_helper(client):
    """A delta carries only what it adds, as OpenAI's: the openai package's stream helper merges deltas
    key by key, and a later delta's "type": null would overwrite its call's type."""
    kwargs = dict(model="alpha", messages=MESSAGES, tools=TOOLS, max_tokens=200, extra_body={"guided_choice": [SCRIPT]})
    with client.chat.completions.stream(**kwargs) as stream:
        for _ in stream:
            pass
        choice = stream.get_final_completion().choices[0]
    assert calls_of(choice.message) == [("get_weather", '{"city": "Paris", "unit": "c"}'), ("add", '{"a": 2, "b": true}')]
    assert all(c.type == "function" and c.id.startswith("call_") for c in choice.message.tool_calls)
    assert (choice.message.content, choice.finish_reason) == ("Let me look that up.", "tool_calls")


def test_auto_leaves_text_and_broken_calls_as_content(client):
    broken = 'Maybe <tool_call>\n{"name": add, "arguments": {"a": 2}}\n</tool_call> no.'  # never a call's head
    for text in ["Just words.", broken]:
        kwargs = dict(model="alpha", messages=MESSAGES, tools=TOOLS, max_tokens=100, extra_body={"guided_choice": [text]})
        out = client.chat.completions.create(**kwargs).choices[0]
        assert (out.message.content, out.message.tool_calls, out.finish_reason) == (text, None, "stop")
        assert streamed(client, **kwargs)[:3] == (text, [], "stop")


def test_tool_choice_none_renders_the_tools_and_parses_nothing(client):
    base = dict(model="alpha", messages=MESSAGES, max_tokens=200, extra_body={"guided_choice": [SCRIPT]})
    none = client.chat.completions.create(tools=TOOLS, tool_choice="none", **base)
    auto = client.chat.completions.create(tools=TOOLS, **base)
    plain = client.chat.completions.create(**base)
    assert (none.choices[0].message.content, none.choices[0].message.tool_calls) == (SCRIPT, None)
    assert none.choices[0].finish_reason == "stop"
    assert none.usage.prompt_tokens == auto.usage.prompt_tokens > plain.usage.prompt_tokens + 50


def test_a_history_of_calls_and_results_renders(client, tool_reference):
    history = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                           "arguments": '{"city": "Paris", "unit": "c"}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21"}]
    out = client.chat.completions.create(model="alpha", messages=history, tools=TOOLS, max_tokens=3, temperature=0)
    rendered = [*MESSAGES, {**history[1], "tool_calls": [{**history[1]["tool_calls"][0], "function": {
        "name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}}]}, history[2]]
    text = tool_reference.chat_prompt(rendered, TOOLS)
    assert '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}' in text and "sunny, 21" in text
    assert out.usage.prompt_tokens == len(tool_reference.tokenizer.encode(text, add_special_tokens=False))


def test_the_tiny_template_without_tools_refuses_them(server):
    r = post(server, {"tools": TOOLS})
    error(r, "tools", "no tool format")
    error(post(server, {"tools": TOOLS, "tool_choice": "required"}), "tools", "no tool format")
    assert post(server, {"tools": TOOLS, "tool_choice": "none"}).status_code == 200


def test_a_template_of_another_tool_format_is_refused(tool_server, monkeypatch):
    other = "{% for t in tools %}{{ t | tojson }}{% endfor %}{% for m in messages %}[TOOL_CALLS]{{ m.content }}{% endfor %}"
    monkeypatch.setattr(tool_server.loop.engine.tokenizer, "chat_template", other)
    error(post(tool_server, {"tools": TOOLS}), "tools", "hermes")
    assert post(tool_server, {"tools": TOOLS, "tool_choice": "none"}).status_code == 200


def fn(name: str = "f", **function) -> dict:
    return {"type": "function", "function": {"name": name, **function}}


@pytest.mark.parametrize("body, param, match", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "not among the tools"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tool_choice": {"type": "function", "function": {"name": "add"}}}, "tool_choice", "needs tools"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", ""),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "name": "add"}}, "tool_choice", ""),
    ({"tools": [{"type": "retrieval"}]}, "tools", ""),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools", ""),
    ({"tools": [fn("has space")]}, "tools", ""),
    ({"tools": [fn(parameters={"type": "string"})]}, "tools", "type must be object"),
    ({"tools": [fn(), fn()]}, "tools", "two tools are named 'f'"),
    ({"tools": [fn(parameters=[1])]}, "tools", ""),
    ({"tools": [fn(returns={})]}, "tools", "unknown field `tools.0.function.returns`"),
    ({"tools": [fn(parameters={"type": "object", "properties": {"a": {"type": "strng"}}})], "tool_choice": "required"},
     "tools", "parameters do not compile"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice",
     "give one"),
    ({"tools": TOOLS, "parallel_tool_calls": [True]}, "parallel_tool_calls", ""),
    ({"functions": [{"name": "f"}]}, "functions", "use tools"),
    ({"function_call": "auto"}, "function_call", "use tool_choice"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{oops"}}]}]},
     "messages", "not valid JSON"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "[1]"}}]}]},
     "messages", ""),
    ({"messages": [{"role": "tool", "content": "x", "tool_call_id": 5}]}, "messages", ""),
])
def test_bad_tools_are_400s_naming_the_field(tool_server, body, param, match):
    error(post(tool_server, body), param, match)
    assert tool_server.idle()
