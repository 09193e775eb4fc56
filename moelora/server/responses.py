"""OpenAI's Responses API (POST /v1/responses) over the chat route: a request's input items become chat messages
(instructions first, as the system message), its function tools and text format the chat request's tools and
response_format; the chat route's output (reasoning, text, tool calls) comes back as the response's output items,
whole or as the stream's typed events. Nothing is stored: previous_response_id is refused, and a client carries a
conversation on by sending the earlier output items back in `input`, as the API allows."""
from __future__ import annotations

import copy
import json
import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, StrictInt, Tag, field_validator, model_validator
from pydantic_core import PydanticCustomError

from moelora.server.protocol import ChatMessageOut, DeltaMessage, FunctionDefinition, RequestBody

# chat request fields -> the Responses request's names for them (in the errors the chat route raises)
CHAT_ALIASES = {"messages": "input", "prompt": "input", "max_completion_tokens": "max_output_tokens",
                "max_tokens": "max_output_tokens", "response_format": "text", "structured_output": "text"}
# sampling fields a Responses request passes to the chat route as they are (OpenAI's, then vLLM's extensions)
_PASSED = ("model", "temperature", "top_p", "user", "parallel_tool_calls",
           "seed", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "stop",
           "priority", "chat_template_kwargs")


class _Item(BaseModel):
    model_config = ConfigDict(extra="forbid")
    id: str | None = None  # an earlier response's output item sent back carries its id and status
    status: str | None = None


class InputPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[Any] | None = None  # an earlier output_text's
    logprobs: list[Any] | None = None


class ReasoningPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["reasoning_text", "summary_text"]
    text: str


class MessageItem(_Item):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: list[InputPart]

    @field_validator("content", mode="before")
    @classmethod
    def _text_is_one_part(cls, value: Any) -> Any:
        return [{"type": "input_text", "text": value}] if isinstance(value, str) else value


class FunctionCallItem(_Item):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputItem(_Item):
    type: Literal["function_call_output"]
    call_id: str
    output: str


class ReasoningItem(_Item):
    type: Literal["reasoning"]
    summary: list[ReasoningPart] = Field(default_factory=list)
    content: list[ReasoningPart] | None = None


def _item_type(item: Any) -> str | None:
    """An input item's type; a message may leave it out."""
    return item.get("type", "message") if isinstance(item, dict) else getattr(item, "type", None)


InputItem = Annotated[Annotated[MessageItem, Tag("message")] | Annotated[FunctionCallItem, Tag("function_call")]
                      | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
                      | Annotated[ReasoningItem, Tag("reasoning")], Discriminator(_item_type)]


class FunctionTool(FunctionDefinition):
    type: Literal["function"]


class NamedFunctionChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    name: str


class TextFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None  # json_schema's
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None

    @model_validator(mode="after")
    def _schema_with_json_schema(self) -> TextFormat:
        if self.type == "json_schema" and self.schema_ is None:
            raise PydanticCustomError("missing", "type json_schema needs the schema field", {"param": "text"})
        if self.type != "json_schema" and self.schema_ is not None:  # (it was ignored: output not held to it)
            raise PydanticCustomError("unsupported_field", "text.format.schema is for type json_schema, not {kind}",
                                      {"kind": self.type, "param": "text"})
        return self


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    format: TextFormat = TextFormat(type="text")


METADATA_PAIRS, METADATA_KEY_CHARS, METADATA_VALUE_CHARS = 16, 64, 512  # OpenAI's limits of a response's metadata


class ResponsesRequest(RequestBody):
    """POST /v1/responses. An unknown field is a 400 naming it; of the API's fields those with no meaning here
    (stored responses, hosted tools, background runs) are refused by name unless given their no-op value."""
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    input: list[InputItem]  # (a text is one user message)
    instructions: str | None = None
    max_output_tokens: int | None = None  # None: up to the context
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    store: bool | None = None  # (the API's default is true; nothing is stored here, the response says false)
    previous_response_id: str | None = None
    include: list[str] | None = None
    truncation: str = "disabled"
    background: bool = False
    prompt_cache_key: str | None = None  # a routing hint of OpenAI's: the prefix cache here needs none
    # vLLM's extensions, as on the chat route
    seed: int | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stop: str | list[str] | None = None
    priority: StrictInt = 0
    chat_template_kwargs: dict[str, Any] | None = None

    @field_validator("metadata")
    @classmethod
    def _metadata_within_the_apis_limits(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        # OpenAI's: the response echoes it in three events of a stream, so 60 MiB of it came back as 180 MiB
        too_long = value is not None and any(len(k) > METADATA_KEY_CHARS or len(v) > METADATA_VALUE_CHARS
                                             for k, v in value.items())
        if value is not None and (len(value) > METADATA_PAIRS or too_long):
            limits = {"pairs": METADATA_PAIRS, "k": METADATA_KEY_CHARS, "v": METADATA_VALUE_CHARS, "param": "metadata"}
            raise PydanticCustomError("metadata_limits", "metadata holds at most {pairs} pairs, keys of at most {k} "
                                      "characters and values of at most {v}", limits)
        return value

    @field_validator("input", mode="before")
    @classmethod
    def _text_is_one_message(cls, value: Any) -> Any:
        return [{"type": "message", "role": "user", "content": value}] if isinstance(value, str) else value

    @field_validator("tools", mode="before")
    @classmethod
    def _function_tools_only(cls, value: Any) -> Any:
        for i, tool in enumerate(value if isinstance(value, list) else []):
            if isinstance(tool, dict) and tool.get("type") != "function":
                raise PydanticCustomError("unsupported_field", "tools[{i}] has type {kind}; only function tools are "
                                          "served here", {"i": i, "kind": repr(tool.get("type")), "param": "tools"})
        return value

    @model_validator(mode="after")
    def _refuse_what_is_not_served(self) -> ResponsesRequest:
        refusals = [
            ("previous_response_id", self.previous_response_id is not None, "responses are not stored, so send the "
             "conversation's earlier items (and the previous response's output) in input"),
            ("store", self.store is True, "responses are not stored"),
            ("include", bool(self.include), "no output has additional data to include"),
            ("background", self.background, "a response is computed while its request waits (or streams)"),
            ("truncation", self.truncation != "disabled", "a prompt over the context is refused, never cut"),
        ]
        for name, refused, why in refusals:
            if refused:
                raise PydanticCustomError("unsupported_field", "{name} is not supported here: {why}",
                                          {"name": name, "why": why, "param": name})
        if all(isinstance(item, ReasoningItem) for item in self.input) and self.instructions is None:
            raise PydanticCustomError("too_short", "input must hold at least one item besides reasoning (or the "
                                      "request instructions): the chat template needs a message", {"param": "input"})
        return self

    def chat_body(self) -> dict[str, Any]:
        """The chat completion request that computes this response (as JSON), the field names the chat route's
        errors use mapped back by CHAT_ALIASES."""
        body = {k: getattr(self, k) for k in _PASSED if getattr(self, k) is not None}
        body["messages"] = self._messages()
        if self.max_output_tokens is not None:
            body["max_completion_tokens"] = self.max_output_tokens
        if self.tools is not None:
            body["tools"] = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                             for t in self.tools]
        if self.tool_choice is not None:
            body["tool_choice"] = self.tool_choice if isinstance(self.tool_choice, str) else \
                {"type": "function", "function": {"name": self.tool_choice.name}}
        fmt = self.text.format if self.text is not None else None
        if fmt is not None and fmt.type == "json_object":
            body["response_format"] = {"type": "json_object"}
        elif fmt is not None and fmt.type == "json_schema":
            schema = {"name": fmt.name or "response", "schema": fmt.schema_, "description": fmt.description,
                      "strict": fmt.strict}
            body["response_format"] = {"type": "json_schema",
                                       "json_schema": {k: v for k, v in schema.items() if v is not None}}
        return body

    def _messages(self) -> list[dict[str, Any]]:
        """Chat messages: the instructions as the system message, then the items in order. A developer message is
        a system one (chat templates know no other); function calls join the assistant message before them, their
        outputs are tool messages; a reasoning item goes with the assistant message after it, as the template's
        reasoning_content."""
        messages: list[dict[str, Any]] = []
        if self.instructions is not None:
            messages.append({"role": "system", "content": self.instructions})
        reasoning: list[str] = []
        for item in self.input:
            if isinstance(item, ReasoningItem):
                reasoning += [p.text for p in item.content or item.summary]
                continue
            if isinstance(item, MessageItem):
                messages.append({"role": "system" if item.role == "developer" else item.role,
                                 "content": "".join(p.text for p in item.content)})
            elif isinstance(item, FunctionCallItem):
                call = {"id": item.call_id, "type": "function",
                        "function": {"name": item.name, "arguments": item.arguments}}
                last = messages[-1] if messages else {}
                if last.get("role") == "assistant" and not reasoning:
                    last.setdefault("tool_calls", []).append(call)
                    continue
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
            else:
                messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
            if reasoning and messages[-1]["role"] == "assistant":
                messages[-1]["reasoning_content"] = "\n".join(reasoning)
            reasoning = []
        return messages

    def echo(self) -> dict[str, Any]:
        """The request's fields a response repeats."""
        tool_choice = self.tool_choice if isinstance(self.tool_choice, str) or self.tool_choice is None else \
            self.tool_choice.model_dump()
        return {"instructions": self.instructions, "max_output_tokens": self.max_output_tokens,
                "metadata": self.metadata or {}, "parallel_tool_calls": self.parallel_tool_calls is not False,
                "temperature": self.temperature, "top_p": self.top_p,
                "tool_choice": tool_choice or ("auto" if self.tools else "none"),
                "tools": [t.model_dump(exclude_none=True) for t in self.tools or []],
                "text": (self.text or TextConfig()).model_dump(by_alias=True, exclude_none=True),
                "truncation": "disabled", "store": False, "previous_response_id": None, "user": self.user,
                "background": False}


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def response_usage(prompt_tokens: int, cached_tokens: int | None, completion_tokens: int,
                   prefix_caching: bool) -> dict[str, Any]:
    """A response's usage. The prompt's tokens not found cached are written to the prefix cache when it is on; no
    reasoning tokens are counted apart (a reasoning parser splits text, not tokens)."""
    cached = cached_tokens or 0
    return {"input_tokens": prompt_tokens,
            "input_tokens_details": {"cached_tokens": cached,
                                     "cache_write_tokens": prompt_tokens - cached if prefix_caching else 0},
            "output_tokens": completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt_tokens + completion_tokens}


class ResponseBuilder:
    """One response's output items, from the chat route's whole message or its stream deltas; `events` for each
    delta turns it into the stream's typed events (each item opened, added to, and closed in output order)."""

    def __init__(self, request: ResponsesRequest, model: str):
        self.request, self.model = request, model
        self.id, self.created_at = _item_id("resp"), int(time.time())
        self.output: list[dict[str, Any]] = []
        self.sequence = 0
        self.open: dict[str, Any] | None = None  # the item the stream adds to now
        self.calls: dict[int, dict[str, Any]] = {}  # a streamed call's item by the call's index

    # ------------------------------------------------------------------------------ whole

    def items(self, message: ChatMessageOut) -> None:
        """The output of the chat route's whole message: its reasoning, text and calls."""
        if message.reasoning_content:
            self.output.append(self._reasoning_item(message.reasoning_content, "completed"))
        if message.content or not (message.reasoning_content or message.tool_calls):
            self.output.append(self._message_item(message.content or "", "completed"))
        for call in message.tool_calls or []:
            self.output.append(self._call_item(call.id, call.function.name, call.function.arguments, "completed"))

    def response(self, status: str, finish_reason: str | None = None,
                 usage: dict[str, Any] | None = None) -> dict[str, Any]:
        """The response object; a response cut by max_output_tokens is incomplete, saying so."""
        incomplete = finish_reason == "length"
        if status == "completed" and incomplete:
            status = "incomplete"
        return {"id": self.id, "object": "response", "created_at": self.created_at, "model": self.model,
                "status": status, "error": None,
                "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
                "output": self.output, "usage": usage, **self.request.echo()}

    # ------------------------------------------------------------------------------ streamed

    def start(self) -> list[str]:
        return [self._event("response.created", response=self.response("in_progress")),
                self._event("response.in_progress", response=self.response("in_progress"))]

    def events(self, delta: DeltaMessage) -> list[str]:
        """The events of one delta of the chat route's stream."""
        out = []
        if delta.reasoning_content:
            out += self._text("reasoning", delta.reasoning_content)
        if delta.content:
            out += self._text("message", delta.content)
        for call in delta.tool_calls or []:
            if call.index not in self.calls:
                out += self._close()
                item = self._call_item(call.id or _item_id("call"), call.function.name or "", "", "in_progress")
                self.calls[call.index] = item
                out += self._open(item)
            item = self.calls[call.index]
            if call.function.arguments:
                item["arguments"] += call.function.arguments
                out.append(self._event("response.function_call_arguments.delta", item_id=item["id"],
                                       output_index=self.output.index(item), delta=call.function.arguments))
        return out

    def finish(self, finish_reason: str | None, usage: dict[str, Any]) -> list[str]:
        """The last events: the open item closed, then the response completed (or incomplete)."""
        out = self._close()
        response = self.response("completed", finish_reason, usage)
        return out + [self._event(f"response.{response['status']}", response=response)]

    def failed(self, message: str, kind: str) -> list[str]:
        """In-band, once the stream has begun: the error (of type `kind`: server_error, invalid_request_error), then
        the response failed."""
        response = {**self.response("failed"), "error": {"code": kind, "message": message}}
        return [self._event("error", code=kind, message=message, param=None),
                self._event("response.failed", response=response)]

    def _text(self, kind: str, text: str) -> list[str]:
        out = []
        if self.open is None or self.open["type"] != kind:
            out += self._close()
            item = self._reasoning_item("", "in_progress") if kind == "reasoning" else \
                self._message_item("", "in_progress")
            out += self._open(item)
        self.open["content"][0]["text"] += text
        return out + [self._text_event(self.open, "delta", delta=text)]

    def _text_event(self, item: dict[str, Any], stage: str, **fields: Any) -> str:
        """The delta or done event of a message's output_text or a reasoning item's reasoning_text."""
        name, extra = ("reasoning_text", {}) if item["type"] == "reasoning" else ("output_text", {"logprobs": []})
        return self._event(f"response.{name}.{stage}", item_id=item["id"], output_index=self.output.index(item),
                           content_index=0, **fields, **extra)

    def _open(self, item: dict[str, Any]) -> list[str]:
        """An item added; a message's or reasoning's first (empty) part with it."""
        parts = item.get("content")
        shown = {**item, "content": []} if parts is not None else dict(item)
        self.output.append(item)
        self.open = item
        out = [self._event("response.output_item.added", output_index=len(self.output) - 1, item=shown)]
        if item["type"] == "message":
            out.append(self._event("response.content_part.added", item_id=item["id"],
                                   output_index=len(self.output) - 1, content_index=0, part=dict(parts[0])))
        return out

    def _close(self) -> list[str]:
        """The open item's done events."""
        item, self.open = self.open, None
        if item is None:
            return []
        index, out = self.output.index(item), []
        item["status"] = "completed"
        if item["type"] == "function_call":
            out.append(self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                   name=item["name"], arguments=item["arguments"]))
        else:
            out.append(self._text_event(item, "done", text=item["content"][0]["text"]))
            if item["type"] == "message":
                out.append(self._event("response.content_part.done", item_id=item["id"], output_index=index,
                                       content_index=0, part=dict(item["content"][0])))
        return out + [self._event("response.output_item.done", output_index=index, item=copy.deepcopy(item))]

    def _event(self, kind: str, **fields: Any) -> str:
        """One server-sent event: its type as the event name and in the data, with the stream's sequence number."""
        data = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"

    @staticmethod
    def _message_item(text: str, status: str) -> dict[str, Any]:
        return {"id": _item_id("msg"), "type": "message", "role": "assistant", "status": status,
                "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}

    @staticmethod
    def _reasoning_item(text: str, status: str) -> dict[str, Any]:
        return {"id": _item_id("rs"), "type": "reasoning", "summary": [], "status": status,
                "content": [{"type": "reasoning_text", "text": text}]}

    @staticmethod
    def _call_item(call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
        return {"id": _item_id("fc"), "type": "function_call", "call_id": call_id, "name": name,
                "arguments": arguments, "status": status}
