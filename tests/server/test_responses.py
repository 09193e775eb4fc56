"""POST /v1/responses through the official openai client: a response's text equals the chat route's for the same
messages (instructions as the system message, input items in order, earlier output items sent back), on the base
model and an adapter, streamed or not; the stream's events are typed as OpenAI's, numbered in order, and add up to
the whole response; function tools and JSON schemas as on the chat route; every refusal a 400 naming its field; a
client that leaves a stream frees what its request held."""
from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from moelora.server.app import create_app
from moelora.server.protocol import DeltaFunctionCall, DeltaMessage, DeltaToolCall
from moelora.server.responses import ResponseBuilder, ResponsesRequest, response_usage
from tests.server.conftest import MODEL_NAME, serving
from tests.server.test_tools import ADD, WEATHER, tool_engine

MAX = 8
EVENT = TypeAdapter(ResponseStreamEvent)


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)


def chat_text(client: openai.OpenAI, model: str, messages: list[dict], max_tokens: int = MAX) -> tuple[str, object]:
    out = client.chat.completions.create(model=model, messages=messages, max_completion_tokens=max_tokens,
                                         temperature=0)
    return out.choices[0].message.content, out


def events_of(lines: list[str]) -> list[dict]:
    """The data of each server-sent event, its `event:` name checked against its type."""
    out, name = [], None
    for line in lines:
        if line.startswith("event: "):
            name = line.removeprefix("event: ")
        elif line.startswith("data: "):
            data = json.loads(line.removeprefix("data: "))
            assert data["type"] == name
            out.append(data)
    return out


@pytest.mark.parametrize("model", [MODEL_NAME, "alpha"])
def test_a_response_is_the_chat_routes_answer(client, model):
    r = client.responses.create(model=model, instructions="be brief", input="Hello world", max_output_tokens=MAX,
                                temperature=0, metadata={"k": "v"})
    want, chat = chat_text(client, model, [{"role": "system", "content": "be brief"},
                                           {"role": "user", "content": "Hello world"}])
    assert r.output_text == want and r.model == model and r.id.startswith("resp_")
    assert [item.type for item in r.output] == ["message"] and r.output[0].content[0].type == "output_text"
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.usage.output_tokens == chat.usage.completion_tokens
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.instructions == "be brief" and r.max_output_tokens == MAX and r.metadata == {"k": "v"}
    if chat.choices[0].finish_reason == "length":  # cut by max_output_tokens: said so
        assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    else:
        assert r.status == "completed" and r.incomplete_details is None


def test_input_items_are_the_conversation(client):
    """Message items with text parts, a developer message (a system one to the template), and the output items of
    an earlier response sent back as they came: the chat route's answer to those messages."""
    first = client.responses.create(model="alpha", input="the quick brown fox", max_output_tokens=4, temperature=0)
    items = [{"role": "developer", "content": "be brief"},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "the quick "},
                                                             {"type": "input_text", "text": "brown fox"}]},
             *[item.model_dump(exclude_none=True) for item in first.output],
             {"role": "user", "content": "déjà vu"}]
    r = client.responses.create(model="alpha", input=items, max_output_tokens=MAX, temperature=0, store=False)
    want, _ = chat_text(client, "alpha", [{"role": "system", "content": "be brief"},
                                          {"role": "user", "content": "the quick brown fox"},
                                          {"role": "assistant", "content": first.output_text},
                                          {"role": "user", "content": "déjà vu"}])
    assert r.output_text == want


def test_items_become_chat_messages():
    """Calls join the assistant message before them, their outputs are tool messages, a reasoning item goes with
    the assistant message after it; instructions lead."""
    body = ResponsesRequest.model_validate({"instructions": "sys", "input": [
        {"role": "user", "content": "hi"},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "hmm"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "let me see",
                                                              "annotations": []}], "id": "msg_1",
         "status": "completed"},
        {"type": "function_call", "call_id": "c1", "name": "add", "arguments": '{"a": 1}'},
        {"type": "function_call", "call_id": "c2", "name": "now", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "2"},
        {"type": "function_call_output", "call_id": "c2", "output": "noon"},
        {"type": "function_call", "call_id": "c3", "name": "now", "arguments": "{}"}]})
    call = {"type": "function", "function": {}}
    assert body.chat_body()["messages"] == [
        {"role": "system", "content": "sys"}, {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "let me see", "reasoning_content": "hmm", "tool_calls": [
            {**call, "id": "c1", "function": {"name": "add", "arguments": '{"a": 1}'}},
            {**call, "id": "c2", "function": {"name": "now", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "2"},
        {"role": "tool", "tool_call_id": "c2", "content": "noon"},
        {"role": "assistant", "content": "", "tool_calls": [{**call, "id": "c3",
                                                             "function": {"name": "now", "arguments": "{}"}}]}]


@pytest.mark.parametrize("model", [MODEL_NAME, "alpha"])
def test_a_stream_adds_up_to_the_response(client, server, model):
    whole = client.responses.create(model=model, input="naïve café", max_output_tokens=MAX, temperature=0)
    with httpx.stream("POST", f"{server.url}/v1/responses", json={
            "model": model, "input": "naïve café", "max_output_tokens": MAX, "temperature": 0, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = events_of(list(r.iter_lines()))
    for e in events:
        EVENT.validate_python(e)  # each one is an event of OpenAI's types
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    kinds = [e["type"] for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          f"response.{whole.status}"]
    assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == whole.output_text
    last = Response.model_validate(events[-1]["response"])
    assert last.output_text == whole.output_text  # (the usage's cached tokens differ: the first call cached them)
    assert (last.usage.input_tokens, last.usage.output_tokens) == (whole.usage.input_tokens, whole.usage.output_tokens)
    assert len({e["response"]["id"] for e in events if "response" in e}) == 1
    # the client's stream helper takes the events in order into the same response (whose last event is
    # response.incomplete when max_output_tokens cut it: the helper's final response is a completed one's only)
    with client.responses.stream(model=model, input="naïve café", max_output_tokens=MAX, temperature=0) as stream:
        last = list(stream)[-1]
    assert last.type == f"response.{whole.status}" and last.response.output_text == whole.output_text


def test_the_stream_opens_and_closes_each_item_in_output_order():
    """Reasoning, then text, then two calls whose arguments come in pieces: each item added, added to and done
    before the next is added; the last event's response holds them all, as OpenAI's types read it."""
    builder = ResponseBuilder(ResponsesRequest(input="x"), "m")
    deltas = [DeltaMessage(reasoning_content="think"), DeltaMessage(reasoning_content="ing"),
              DeltaMessage(content="ans"), DeltaMessage(content="wer"),
              DeltaMessage(tool_calls=[DeltaToolCall(index=0, id="c0", type="function",
                                                     function=DeltaFunctionCall(name="add", arguments='{"a"'))]),
              DeltaMessage(tool_calls=[DeltaToolCall(index=0, function=DeltaFunctionCall(arguments=": 1}"))]),
              DeltaMessage(tool_calls=[DeltaToolCall(index=1, id="c1", type="function",
                                                     function=DeltaFunctionCall(name="now", arguments="{}"))])]
    lines = "".join(builder.start() + [e for d in deltas for e in builder.events(d)]
                    + builder.finish("stop", response_usage(1, None, 2, prefix_caching=True))).splitlines()
    events = events_of(lines)
    for e in events:
        EVENT.validate_python(e)
    opened = [e["output_index"] for e in events if e["type"] == "response.output_item.added"]
    closed = [e["output_index"] for e in events if e["type"] == "response.output_item.done"]
    assert opened == closed == [0, 1, 2, 3]
    order = [(e["type"], e.get("output_index")) for e in events if e["type"].startswith("response.output_item")]
    assert order == [(f"response.output_item.{k}", i) for i in range(4) for k in ("added", "done")]
    final = Response.model_validate(events[-1]["response"])
    assert final.status == "completed"
    assert [item.type for item in final.output] == ["reasoning", "message", "function_call", "function_call"]
    assert final.output[0].content[0].text == "thinking" and final.output_text == "answer"
    assert [(c.call_id, c.name, c.arguments) for c in final.output[2:]] == [("c0", "add", '{"a": 1}'),
                                                                            ("c1", "now", "{}")]


def test_a_json_schema_text_format_holds(client):
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["n"], "additionalProperties": False}
    r = client.responses.create(model="alpha", input="a number", max_output_tokens=40, temperature=0,
                                text={"format": {"type": "json_schema", "name": "num", "schema": schema}})
    jsonschema.validate(json.loads(r.output_text), schema)
    assert r.text.format.type == "json_schema"


@pytest.fixture(scope="module")
def tool_client(demo_dir):
    with serving(create_app(tool_engine(demo_dir), MODEL_NAME)) as s:
        yield openai.OpenAI(base_url=f"{s.url}/v1", api_key="none", max_retries=0)


@pytest.mark.parametrize("stream", [False, True])
def test_forced_calls_are_function_call_items(tool_client, stream):
    tools = [{"type": "function", "name": "get_weather", "parameters": WEATHER},
             {"type": "function", "name": "add", "parameters": ADD}]
    kwargs = dict(model="alpha", input="Hello world", tools=tools, tool_choice={"type": "function", "name": "add"},
                  max_output_tokens=200, temperature=0)
    if stream:
        with tool_client.responses.stream(**kwargs) as s:
            r = s.get_final_response()
    else:
        r = tool_client.responses.create(**kwargs)
    calls = [item for item in r.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "add" and calls[0].call_id
    jsonschema.validate(json.loads(calls[0].arguments), ADD)
    assert r.tool_choice.name == "add" and [t.name for t in r.tools] == ["get_weather", "add"]


@pytest.mark.parametrize("body, param, code", [
    ({"input": "hi", "previous_response_id": "resp_1"}, "previous_response_id", "unsupported_parameter"),
    ({"input": "hi", "include": ["message.output_text.logprobs"]}, "include", "unsupported_parameter"),
    ({"input": "hi", "store": True}, "store", "unsupported_parameter"),
    ({"input": "hi", "background": True}, "background", None),
    ({"input": "hi", "truncation": "auto"}, "truncation", None),
    ({"input": "hi", "verbosity": "low"}, "verbosity", "unknown_parameter"),
    ({"input": []}, "input", None),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input", "invalid_value"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{"}]}, "input", None),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input", None),
    ({"input": [{"type": "web_search_call", "id": "w"}]}, "input", None),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools", None),
    ({"input": "hi", "tool_choice": "required"}, "tool_choice", "invalid_value"),
    ({"input": "hi", "max_output_tokens": 100000}, "max_output_tokens", "context_length_exceeded"),
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens", "invalid_value"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}}, "text", "missing_required_parameter"),
    ({"input": "hi", "text": {"format": {"type": "json_object", "schema": {"type": "object"}}}}, "text",
     "unsupported_parameter"),  # (the schema was ignored: the output not held to it)
    ({"input": "hi", "temperature": -1}, "temperature", "invalid_value"),
    # OpenAI's limits: echoed three times in a stream, 60 MiB of it came back as 180 MiB
    ({"input": "hi", "metadata": {f"k{i}": "v" for i in range(17)}}, "metadata", "invalid_value"),
    ({"input": "hi", "metadata": {"k": "v" * 513}}, "metadata", "invalid_value"),
    ({"input": "hi", "metadata": {"k" * 65: "v"}}, "metadata", "invalid_value"),
])
def test_refusals_name_their_field(server, body, param, code):
    r = httpx.post(f"{server.url}/v1/responses", json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error


def test_an_unknown_model_is_a_404(client):
    with pytest.raises(openai.NotFoundError, match="The model `nope` does not exist"):
        client.responses.create(model="nope", input="hi")


def test_a_client_that_leaves_a_stream_frees_its_request(server):
    with httpx.stream("POST", f"{server.url}/v1/responses", json={
            "input": "Hello world", "max_output_tokens": 400, "stream": True}) as r:
        for line in r.iter_lines():
            if "response.output_text.delta" in line:
                break
    assert server.idle()
