"""Tool calling in chat completions: `tools`, `tool_choice` and `parallel_tool_calls`, for chat
templates that write calls in the hermes format (Qwen2.5, Qwen3 and their MoE models):

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

The tools go to the chat template (transformers' `tools=`), which tells the model the format.
`tool_choice` "auto" (the default with tools) parses the output: each valid block becomes a tool
call, the text outside the blocks the content. "required" and a named function force the format
with a structural-tag grammar (xgrammar), one call or more, each call's arguments following its
tool's `parameters` schema, as vLLM forces them with guided decoding. "none" renders the tools
(vLLM's default) and parses nothing. A template that does not use `tools`, or writes calls in
another format, is a 400 naming `tools` unless tool_choice is "none".

Streamed, content goes out until a `<tool_call>` starts (a partial tag at the end of a chunk waits
for the next), then the call: its id, type and name once `{"name": ..., "arguments": ` has been
read, then its arguments as they come. A block whose JSON is not a call stays content, as vLLM
leaves it; streamed, that is known only when the name has not gone out yet: a block whose name was
sent and whose arguments then break stays a call, with the arguments as written.
"""
from __future__ import annotations

import functools
import json
import re
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import jinja2
import jinja2.meta

from moelora.engine import StructuredOutput
from moelora.server.errors import APIError
from moelora.server.protocol import (ChatCompletionRequest, ChatMessageOut, DeltaFunctionCall, DeltaMessage,
                                     DeltaToolCall, FunctionCallOut, ToolCallOut)
from moelora.server.reasoning import ReasoningParser, partial_tag

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

START, END = "<tool_call>", "</tool_call>"
# a block's head is looked for while streaming in its first this many characters (each try reads the block from its
# start); a block whose head comes later is parsed whole when it closes, its call sent then
MAX_HEAD_CHARS = 4096
# A call's head: its name, then the arguments' opening brace. It matches a prefix of a block exactly
# when it matches the whole block, so streamed and whole outputs send the same name.
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*(?=\{)')
_NO_ARGUMENTS = {"type": "object", "properties": {}, "additionalProperties": False}


@functools.lru_cache(maxsize=16)
def template_tool_format(template: str) -> str | None:
    """"hermes" when the chat template reads `tools` and writes `<tool_call>` blocks, "other" when it
    reads `tools` and writes calls some other way, None when it does not read `tools`."""
    try:
        # loopcontrols: transformers renders templates with {% break %} and {% continue %}
        ast = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(template)
        reads_tools = "tools" in jinja2.meta.find_undeclared_variables(ast)
    except jinja2.TemplateSyntaxError:  # a tag of transformers' own ({% generation %}): read the text
        reads_tools = re.search(r"\{[{%][^}]*\btools\b", template) is not None
    if not reads_tools:
        return None
    return "hermes" if START in template else "other"


@dataclass
class ChatTools:
    """What a chat request's tools make of it: the tools the chat template gets, the grammar that
    forces calls (tool_choice required or named), and whether the output is parsed for calls."""
    specs: list[dict] | None = None
    grammar: StructuredOutput | None = None
    parse: bool = False
    max_calls: int | None = None  # parallel_tool_calls false: the first call only

    @classmethod
    def of(cls, body: ChatCompletionRequest, tokenizer: PreTrainedTokenizerBase | None) -> ChatTools:
        """APIError 400 naming the field for a tool_choice without tools or naming no tool, tools
        of the same name or whose parameters are no object schema, tools the chat template cannot
        take, or a forced call beside another structured-output field."""
        tools = body.tools or []
        choice = body.tool_choice or ("auto" if tools else "none")
        if not tools:
            if choice != "none":
                raise APIError(400, "tool_choice needs tools", param="tool_choice")
            return cls()
        names = [t.function.name for t in tools]
        if len(set(names)) < len(names):
            raise APIError(400, f"tools: two tools are named {next(n for n in names if names.count(n) > 1)!r}",
                           param="tools")
        for i, t in enumerate(tools):
            if t.function.parameters is not None and t.function.parameters.get("type", "object") != "object":
                raise APIError(400, f"tools[{i}].function.parameters: the arguments are a JSON object, so "
                               f"the schema's type must be object, got {t.function.parameters.get('type')!r}",
                               param="tools")
        named = choice.function.name if not isinstance(choice, str) else None
        if named is not None and named not in names:
            raise APIError(400, f"tool_choice names the function {named!r}, which is not among the tools "
                           f"({', '.join(names)})", param="tool_choice")
        specs = [t.model_dump(exclude_none=True) for t in tools]
        if choice == "none":
            return cls(specs)
        _check_template(tokenizer, specs)
        parallel = body.parallel_tool_calls is not False
        grammar = None
        if choice != "auto":
            if body.structured_output_fields:
                raise APIError(400, f"tool_choice {named or choice!r} constrains the output, and so does "
                               f"{body.structured_output_fields[0]}: give one", param="tool_choice")
            grammar = _call_grammar([t for t in tools if named in (None, t.function.name)],
                                    one=named is not None or not parallel)
        return cls(specs, grammar, parse=True, max_calls=None if parallel else 1)

    def output(self, reasoning: ReasoningParser | None = None, include_reasoning: bool = True) -> ChoiceOutput:
        """The output of one choice (sequence), its reasoning split off by `reasoning`."""
        return ChoiceOutput(ToolCallParser(self.max_calls) if self.parse else None, reasoning, include_reasoning)


def _check_template(tokenizer: PreTrainedTokenizerBase | None, specs: list[dict]) -> None:
    """400 naming tools when the chat template does not take them in the hermes format. Without a
    tokenizer or template nothing is said: rendering the chat refuses it with the reason."""
    try:
        template = tokenizer.get_chat_template(tools=specs) if tokenizer is not None else None
    except ValueError:  # no chat template
        return
    if template is None:
        return
    fmt = template_tool_format(template)
    if fmt is None:
        raise APIError(400, "the model's chat template has no tool format (it does not use `tools`): tools "
                       "can only be sent with tool_choice none", param="tools")
    if fmt != "hermes":
        raise APIError(400, f"the model's chat template writes tool calls in a format moelora does not parse "
                       f"(it parses hermes' {START} blocks): tools can only be sent with tool_choice none",
                       param="tools")


def _call_grammar(tools: list, one: bool) -> StructuredOutput:
    """Calls in the hermes format and nothing else: one (or one or more, a line apart) of `tools`,
    each call's arguments following its parameters schema. At most one whitespace character in a
    row inside the JSON (`", "`, `": "`), so a model cannot pad it with blanks until max_tokens."""
    tags = [{"type": "tag", "begin": f'{START}\n{{"name": {json.dumps(t.function.name)}, "arguments": ',
             "content": {"type": "json_schema", "json_schema": _arguments_schema(t.function.parameters),
                         "max_whitespace_cnt": 1},
             "end": f"}}\n{END}"} for t in tools]
    fmt = {"type": "tags_with_separator", "tags": tags, "separator": "\n", "at_least_one": True,
           "stop_after_first": one}
    return StructuredOutput("structural_tag", json.dumps({"type": "structural_tag", "format": fmt}))


def _arguments_schema(parameters: dict | None) -> dict:
    """The schema a call's arguments follow: its tool's parameters, an object's schema even without
    "type" (ChatTools.of refuses any other type), which xgrammar alone would read as any JSON value,
    and a call whose arguments are no object is no call."""
    return {"type": "object", **parameters} if parameters else _NO_ARGUMENTS


# ------------------------------------------------------------------------------------ parsing


@dataclass
class Parsed:
    """What some output text gave: content, and pieces of calls (a call's first piece has its id and
    name; the pieces of one call concatenate to its arguments)."""
    content: str = ""
    calls: list[DeltaToolCall] = field(default_factory=list)

    def start(self, index: int, name: str, arguments: str = "") -> None:
        """A call's first piece: a new id."""
        self.calls.append(DeltaToolCall(index=index, id=f"call_{uuid.uuid4().hex[:24]}", type="function",
                                        function=DeltaFunctionCall(name=name, arguments=arguments)))

    def add(self, index: int, arguments: str) -> None:
        """More of a call's arguments."""
        if not arguments:
            return
        if self.calls and self.calls[-1].index == index:
            self.calls[-1].function.arguments += arguments
        else:
            self.calls.append(DeltaToolCall(index=index, function=DeltaFunctionCall(arguments=arguments)))

    def __iadd__(self, other: Parsed) -> Parsed:
        self.content += other.content
        for c in other.calls:
            if c.id is None:
                self.add(c.index, c.function.arguments)
            else:
                self.calls.append(c)
        return self


@dataclass
class _Block:
    """A `<tool_call>` block being read; its text is the parser's buffer."""
    space_before: str  # the content's whitespace before it, content again if the block is no call
    dropped: bool      # a call past max_calls
    index: int = -1    # the call's, once its name went out
    head_tried: int = 0  # how much of the block's text the head was looked for in
    pos: int = 0       # how far the arguments have been read (and sent)
    depth: int = 0     # the arguments' JSON: open brackets, inside a string, after a backslash, complete
    in_string: bool = False
    escaped: bool = False
    complete: bool = False

    def arguments(self, text: str) -> str:
        """The arguments' text from `pos` to the end of `text` or of the arguments' JSON object,
        whichever comes first; brackets and strings are followed to know where the object ends.
        Control characters inside strings come out escaped: grammars let a model write them raw,
        which JSON does not allow, and the client parses the arguments."""
        out = []
        while self.pos < len(text) and not self.complete:
            c = text[self.pos]
            if self.escaped:
                self.escaped = False
            elif self.in_string:
                self.escaped, self.in_string = c == "\\", c != '"'
                if c < " ":
                    c = f"\\u{ord(c):04x}"
            elif c == '"':
                self.in_string = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]":
                self.depth -= 1
                self.complete = self.depth == 0
            out.append(c)
            self.pos += 1
        return "".join(out)


class ToolCallParser:
    """Hermes tool calls out of output text fed in pieces: feed() each piece, finish() at the end.
    The pieces' results concatenate to the same content and calls however the text is split (but for
    a block whose arguments break after its name went out: see the module's docstring).

    The whitespace between the content and a block, and between blocks, belongs to neither."""

    def __init__(self, max_calls: int | None = None):
        self.max_calls = max_calls
        self.calls = 0
        self._buf = ""          # text not decided yet: a partial START, or the open block's text
        self._no_end = 0        # how much of the open block's text holds no END
        self._space = ""        # the content's trailing whitespace: dropped if a block follows
        self._after_block = False
        self._block: _Block | None = None

    def feed(self, text: str) -> Parsed:
        out = Parsed()
        self._buf += text
        while True:
            if self._block is None:
                i = self._buf.find(START)
                if i < 0:
                    keep = partial_tag(self._buf, START)
                    self._content(self._buf[:len(self._buf) - keep], out)
                    self._buf = self._buf[len(self._buf) - keep:]
                    return out
                self._content(self._buf[:i], out)
                self._block = _Block(self._space, dropped=self.max_calls is not None and self.calls >= self.max_calls)
                self._space, self._buf, self._no_end = "", self._buf[i + len(START):], 0
            else:
                j = self._buf.find(END, self._no_end)
                if j < 0:
                    self._no_end = max(0, len(self._buf) - len(END) + 1)
                    self._read_block(self._buf, out)
                    return out
                body, self._buf = self._buf[:j], self._buf[j + len(END):]
                self._close_block(body, END, out)

    def finish(self) -> Parsed:
        """The rest: a partial START is content; a block never closed is closed here."""
        out = Parsed()
        if self._block is not None:
            self._close_block(self._buf, "", out)
        else:
            self._content(self._buf, out)
        out.content += self._space
        self._buf = self._space = ""
        return out

    def _content(self, text: str, out: Parsed) -> None:
        if self._after_block:
            text = text.lstrip()
            self._after_block = not text
        body = text.rstrip()
        if body:
            out.content += self._space + body
            self._space = ""
        self._space += text[len(body):]

    def _read_block(self, text: str, out: Parsed) -> None:
        """Send the call's name once its head is complete, then its arguments as far as they go."""
        b = self._block
        if b.dropped:
            return
        text = text[:len(text) - partial_tag(text, END)]  # a partial END is not arguments
        if b.index < 0:
            # a head that the text before did not complete ends at a "{" of the new text (_HEAD's lookahead)
            tried, b.head_tried = b.head_tried, len(text)
            if "{" not in text[tried:] or len(text) > MAX_HEAD_CHARS:
                return
            head = _head(text)
            if head is None:
                return
            name, b.pos = head
            b.index, self.calls = self.calls, self.calls + 1
            out.start(b.index, name)
        out.add(b.index, b.arguments(text))

    def _close_block(self, body: str, end: str, out: Parsed) -> None:
        """The block ends (`end`: its END, or "" at the end of the output): a call, or content."""
        b, self._block = self._block, None
        if b.dropped:
            self._after_block = True
        elif b.index >= 0:  # the name went out: the call stands
            out.add(b.index, b.arguments(body))
            self._after_block = True
        elif (call := _whole_call(body)) is not None:
            out.start(self.calls, *call)
            self.calls += 1
            self._after_block = True
        else:  # not a call: the block is content, as written
            self._space = b.space_before
            self._content(START + body + end, out)


def _head(text: str) -> tuple[str, int] | None:
    """The name and where the arguments start, once the block's text has them."""
    m = _HEAD.match(text)
    if m is None:
        return None
    try:
        name = json.loads(m.group(1))
    except json.JSONDecodeError:  # an escape JSON does not have
        return None
    # an escaped lone surrogate ("\ud800") decodes to no text a response can carry: not a call's name
    return (name, m.end()) if _is_text(name) else None


def _is_text(text: str) -> bool:
    """Whether the string is valid Unicode (no lone surrogates): what a JSON response can carry."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _whole_call(body: str) -> tuple[str, str] | None:
    """(name, arguments as written) of a block whose JSON is a call, None otherwise. The arguments
    are the model's text when the block starts with the name (as streamed), else re-serialised."""
    try:
        obj = json.loads(body, strict=False)  # raw control characters in strings: see _Block.arguments
    except json.JSONDecodeError:
        return None
    if not (isinstance(obj, dict) and isinstance(obj.get("name"), str) and isinstance(obj.get("arguments"), dict)):
        return None
    if not _is_text(obj["name"]):
        return None
    head = _head(body)
    if head is None:  # re-serialised: escapes of lone surrogates stay escapes
        arguments = json.dumps(obj["arguments"], ensure_ascii=False)
        return obj["name"], arguments if _is_text(arguments) else json.dumps(obj["arguments"])
    block = _Block("", dropped=False, pos=head[1])
    return head[0], block.arguments(body)


class ChoiceOutput:
    """One choice's output as a message or stream deltas: as the model wrote it, or parsed for its
    reasoning (server.reasoning), then for calls. A choice that made calls and stopped finishes with
    reason tool_calls."""

    def __init__(self, parser: ToolCallParser | None, reasoning: ReasoningParser | None = None,
                 include_reasoning: bool = True):
        self.parser, self.reasoning, self.include_reasoning = parser, reasoning, include_reasoning

    def delta(self, text: str, finish_reason: str | None) -> tuple[DeltaMessage, str | None]:
        """A stream chunk's delta of the next piece of text (finish_reason set: the last piece)."""
        reasoning, text = self._split(text, finish_reason is not None)
        if self.parser is None:
            return DeltaMessage(reasoning_content=reasoning, content=text), finish_reason
        parsed = self.parser.feed(text or "")
        if finish_reason is not None:
            parsed += self.parser.finish()
        return (DeltaMessage(reasoning_content=reasoning, content=parsed.content or None,
                             tool_calls=parsed.calls or None), self._reason(finish_reason))

    def message(self, text: str, finish_reason: str | None) -> tuple[ChatMessageOut, str | None]:
        reasoning, text = self._split(text, True)
        if self.parser is None:
            return ChatMessageOut(reasoning_content=reasoning, content=text), finish_reason
        parsed = self.parser.feed(text or "")
        parsed += self.parser.finish()
        calls = [ToolCallOut(id=c.id, function=FunctionCallOut(name=c.function.name, arguments=c.function.arguments))
                 for c in parsed.calls]
        return (ChatMessageOut(reasoning_content=reasoning, content=parsed.content or None, tool_calls=calls or None),
                self._reason(finish_reason))

    def _split(self, text: str, last: bool) -> tuple[str | None, str | None]:
        """(reasoning, content) of the next piece of text, each None when empty (but for content
        without a reasoning parser: the text as it is)."""
        if self.reasoning is None:
            return None, text
        reasoning, content = self.reasoning.feed(text)
        if last:
            more = self.reasoning.finish()
            reasoning, content = reasoning + more[0], content + more[1]
        return (reasoning or None) if self.include_reasoning else None, content or None

    def _reason(self, finish_reason: str | None) -> str | None:
        return "tool_calls" if finish_reason == "stop" and self.parser.calls else finish_reason
