"""Request and response bodies of the OpenAI API (completions, chat completions, models), the
adapter-management routes, and OpenAI's error shape. Pydantic checks types; SamplingParams checks
ranges, so the rules live in one place. Every string of a request body, unknown fields included,
must be valid Unicode (JSON can carry lone surrogates, which no tokenizer or response can), and every number
finite (JSON has no NaN or Infinity, which Python's parser reads: echoed back, they made the answer invalid JSON)."""
from __future__ import annotations

import json
import math
import time
from typing import Any, ClassVar, Literal, get_args

from pydantic import (BaseModel, ConfigDict, Field, SerializerFunctionWrapHandler, StrictInt, field_validator,
                      model_serializer, model_validator)
from pydantic_core import PydanticCustomError

from moelora.engine import MAX_LOGPROBS, SamplingParams, StructuredOutput


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None
    problems: list[str] | None = None  # an adapter's validation problems, one each


class ErrorResponse(BaseModel):
    error: ErrorInfo


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # found in the prefix cache, not computed


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None  # (None: not known yet, in a stream's first chunks)


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None  # the output always follows the schema


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs` (the successor of its guided_* fields)."""
    model_config = ConfigDict(extra="forbid")
    json_: str | dict[str, Any] | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


# ----------------------------------------------------------------------------------- requests


class RequestBody(BaseModel):
    """A request body: every string in it, at any depth, must encode as UTF-8 and every number be finite; a null
    stands for the field's default."""

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        """OpenAI's API takes null for its optional fields ("n": null is n=1), as vLLM does; a field that cannot hold
        None takes its default then (a field that can keeps the None, which means something: max_tokens null is up
        to the context)."""
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        return {k: v for k, v in data.items() if not (v is None and k in fields and not fields[k].is_required()
                                                      and type(None) not in get_args(fields[k].annotation))}

    @model_validator(mode="before")
    @classmethod
    def _no_booleans_for_numbers(cls, data: Any) -> Any:
        """A number field given true or false is refused (pydantic's lax mode reads true as 1: "n": true was n=1)."""
        if isinstance(data, dict):
            fields = cls.model_fields
            for key, value in data.items():
                if type(value) is bool and key in fields:
                    types = set(get_args(fields[key].annotation)) or {fields[key].annotation}
                    if bool not in types and types & {int, float}:
                        raise PydanticCustomError("bool_not_number", "{field} must be a number, not {value}",
                                                  {"field": key, "value": json.dumps(value), "param": key})
        return data

    @model_validator(mode="before")
    @classmethod
    def _unicode(cls, data: Any) -> Any:
        if isinstance(data, dict):
            try:
                bad = _first_bad_value(data)
            except (NestingError, TooManyValues) as e:
                raise PydanticCustomError(e.kind, "{message}", {"message": str(e), "param": str(e.path[0])}) from None
            if bad is not None:
                path, value = bad
                if isinstance(value, str):
                    raise PydanticCustomError("invalid_unicode", "{where} is not valid Unicode (a lone surrogate)",
                                              {"where": _where(path), "param": str(path[0])})
                raise PydanticCustomError("not_finite", "{where} is {value}: JSON has no NaN or Infinity",
                                          {"where": _where(path), "value": json.dumps(value), "param": str(path[0])})
        return data


class StreamOptions(RequestBody):  # its nulls too stand for the defaults, as vLLM's
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False  # a last chunk with the usage of the whole request
    continuous_usage_stats: bool = False  # vLLM's: with include_usage, every chunk has its sequence's usage so far


MAX_NESTING = 128  # lists and objects in a request, one inside another: deeper is refused (no schema needs it)
# lists and objects in a request: walking and validating each costs microseconds on the event loop (a chat message of
# 3.4M empty content parts, 97 MiB, held it 25 s); a conversation of thousands of messages holds a few tens of thousands
MAX_CONTAINERS = 65536
# strings and keys in a request, which the validators, serialisers and chat templates after the walk take one by one
# (2M empty stop strings, 5.7 MiB, held the event loop 2.2 s): a logit_bias of a 256k vocabulary fits twice
MAX_STRINGS = 1 << 19


class NestingError(ValueError):
    def __init__(self, path: tuple):
        super().__init__(f"{_where(path)} is nested deeper than {MAX_NESTING} lists and objects")
        self.path, self.kind = path, "too_deep"


class TooManyValues(ValueError):
    def __init__(self, path: tuple, what: str, limit: int):
        super().__init__(f"the body holds more than {limit} {what} (at {_where(path)})")
        self.path, self.kind = path, "too_many_values"


def _where(path: tuple) -> str:
    return "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path).lstrip(".")


_SCALARS = frozenset((int, float, bool, type(None)))  # what JSON gives besides strings, lists and objects


def _first_bad_value(value: Any) -> tuple[tuple, Any] | None:
    """Where the first string (or key) that cannot be encoded as UTF-8, or number that is not finite, is, and it;
    None if there is none, in document order. Iterative: nesting deeper than MAX_NESTING is a NestingError, before
    the validators and serialisers after this one recurse into it (a RecursionError: a 500), more than
    MAX_CONTAINERS lists and objects or MAX_STRINGS strings and keys a TooManyValues. It runs on the event loop, so a
    list of scalars (a prompt of millions of token ids) or of strings is passed over at C speed, its items looked at
    one by one only where a float is among them or a string does not encode, and a path is made only for strings,
    lists and objects."""
    stack, containers, strings = [((), value)], 0, 0
    while stack:
        path, value = stack.pop()
        if isinstance(value, str):
            strings += 1
            if strings > MAX_STRINGS:
                raise TooManyValues(path, "strings and keys", MAX_STRINGS)
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                return path, value
            continue
        if type(value) is float and not math.isfinite(value):
            return path, value
        if not isinstance(value, (dict, list)) or not value:
            continue
        if len(path) >= MAX_NESTING:
            raise NestingError(path)
        containers += 1
        if containers > MAX_CONTAINERS:
            raise TooManyValues(path, "lists and objects", MAX_CONTAINERS)
        if isinstance(value, dict):
            strings += len(value)
            if strings > MAX_STRINGS:
                raise TooManyValues(path, "strings and keys", MAX_STRINGS)
            if _plain_scalars(value.values()) and _all_encode(value):  # (a logit_bias of the vocabulary)
                continue
            stack += reversed([c for key, item in value.items() for c in ((path + ("<key>",), key), (path + (key,), item))])
        else:
            if _plain_scalars(value):
                continue
            if set(map(type, value)) == {str}:  # (prompts, stop strings)
                if strings + len(value) > MAX_STRINGS:
                    raise TooManyValues(path, "strings and keys", MAX_STRINGS)
                if _all_encode(value):
                    strings += len(value)
                    continue
            stack += reversed([(path + (i,), item) for i, item in enumerate(value)
                               if type(item) not in _SCALARS or type(item) is float])
    return None


def _plain_scalars(values: Any) -> bool:
    """Whether the values are all numbers, booleans and nulls, every float finite: at C speed, and a float's
    finiteness looked at only where there is a float."""
    types = set(map(type, values))
    if not _SCALARS.issuperset(types):
        return False
    if float not in types:
        return True
    try:
        return all(map(math.isfinite, values))
    except (OverflowError, TypeError):  # an int past a float's range, a null: one by one
        return all(type(v) is not float or math.isfinite(v) for v in values)


def _all_encode(strings: Any) -> bool:
    """Whether every one of the strings encodes as UTF-8, at C speed (a surrogate stays one beside any other)."""
    try:
        "".join(strings).encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


# vLLM/OpenAI fields moelora does not serve: name -> (the values that change nothing, why it is refused)
_UNSUPPORTED = {
    "use_beam_search": ((False,), "beam search is not supported"),
    "length_penalty": ((1.0,), "it scores beam search, which is not supported"),
    "bad_words": ((None, []), "bad_words is not supported (use logit_bias)"),
    "spaces_between_special_tokens": ((True,), "special tokens are decoded as the tokenizer joins them"),
    "truncate_prompt_tokens": ((None,), "prompts are never truncated"),
    "logits_processors": ((None, []), "custom logits processors are not supported"),
    "return_tokens_as_token_ids": ((False,), "return_tokens_as_token_ids is not supported"),
    "guided_decoding_backend": ((None, "xgrammar"), "the only structured-output backend is xgrammar"),
    "guided_whitespace_pattern": ((None,), "JSON grammars allow no free whitespace; a pattern is not supported"),
    "structural_tag": ((None,), "structural tags are not supported"),
}
_UNSUPPORTED_CHAT = {
    "echo": ((False,), "echo is served on /v1/completions only"),
    "add_special_tokens": ((False,), "the chat template writes the special tokens"),
    "modalities": ((None, ["text"]), "the only output modality is text"),
    "audio": ((None,), "audio output is not supported"),
    "prediction": ((None,), "predicted outputs are not supported"),
    "reasoning_effort": ((None,), "the model has no reasoning-effort setting"),
    "verbosity": ((None,), "the model has no verbosity setting"),
    "web_search_options": ((None,), "web search is not supported"),
    "store": ((None, False), "stored completions are not supported"),
    "service_tier": ((None, "auto", "default"), "only the default service tier is served"),
    "functions": ((None,), "the legacy functions field is not supported: use tools"),
    "function_call": ((None,), "the legacy function_call field is not supported: use tool_choice"),
}
# the request fields that ask for structured output, and the StructuredOutput kind each gives
_GUIDED = {"guided_json": "json_schema", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


class SamplingRequest(RequestBody):
    """Fields both generation routes share. None means the default, as a null in JSON does. An unknown
    field is a 400 naming it; a known one moelora does not serve is a 400 saying why, unless its value
    changes nothing."""
    model_config = ConfigDict(extra="forbid")
    unsupported: ClassVar[dict[str, tuple[tuple, str]]] = _UNSUPPORTED

    model: str | None = None  # the served model name or an adapter's; None: the base model
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None  # token id (a string in JSON) -> bias
    response_format: ResponseFormat | None = None
    user: str | None = None  # OpenAI's end-user id: checked, not used (it changes no output)
    # vLLM/SGLang extensions
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    allowed_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None  # xgrammar's EBNF (GBNF)
    structured_outputs: StructuredOutputs | None = None
    prompt_logprobs: int | None = None  # every prompt token's log-probability, rank and the top ones (vLLM's)
    priority: int = 0  # the queue's order under --scheduling-policy priority, lower first (vLLM's)

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        for name, (harmless, why) in cls.unsupported.items():
            if name in data and not any(data[name] == v and isinstance(data[name], bool) == isinstance(v, bool)
                                        for v in harmless):
                raise PydanticCustomError("unsupported_field", "{name} is not supported here: {why}",
                                          {"name": name, "why": why, "param": name})
        return {k: v for k, v in data.items() if k not in cls.unsupported}

    @model_validator(mode="after")
    def _stream_options_with_stream(self) -> SamplingRequest:
        if self.stream_options is not None and not self.stream:  # as vLLM: nothing would read them
            raise PydanticCustomError("stream_options_without_stream", "stream_options is only allowed with stream: "
                                      "true", {"param": "stream_options"})
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
            raise PydanticCustomError("prompt_logprobs_range", "prompt_logprobs must be in [0, {most}], got {value}",
                                      {"param": "prompt_logprobs", "most": MAX_LOGPROBS, "value": self.prompt_logprobs})
        if self.prompt_logprobs is not None and self.stream:  # as vLLM
            raise PydanticCustomError("prompt_logprobs_with_stream", "prompt_logprobs is not available with stream: "
                                      "true", {"param": "prompt_logprobs"})
        return self

    def sampling_params(self, max_tokens: int | None, logprobs: int | None, prompt_logprobs: int | None = None,
                        defaults: dict[str, float | int] | None = None) -> SamplingParams:
        """ValueError names the bad field (SamplingParams.<field>); max_tokens None: up to the context. `defaults`:
        SamplingParams fields for those the request leaves unset (the model's generation config)."""
        given = {k: getattr(self, k) for k in ("temperature", "top_p", "top_k", "min_p", "presence_penalty",
                                               "frequency_penalty", "repetition_penalty") if getattr(self, k) is not None}
        given = (defaults or {}) | given
        return SamplingParams(max_tokens=max_tokens, seed=self.seed, stop=self.stop, stop_token_ids=self.stop_token_ids,
                              ignore_eos=self.ignore_eos, logprobs=logprobs, skip_special_tokens=self.skip_special_tokens,
                              include_stop_str_in_output=self.include_stop_str_in_output,
                              logit_bias=self._logit_bias(), min_tokens=self.min_tokens,
                              allowed_token_ids=self.allowed_token_ids, prompt_logprobs=prompt_logprobs,
                              structured_output=self.structured_output(), **given)

    @property
    def structured_output_fields(self) -> list[str]:
        """The request fields that ask for structured output (at most one may)."""
        return [f for f in ("response_format", *_GUIDED, "structured_outputs") if getattr(self, f) is not None
                and not (f == "response_format" and self.response_format.type == "text")]

    def structured_output(self) -> StructuredOutput | None:
        fields = self.structured_output_fields
        if len(fields) > 1:
            raise ValueError(f"SamplingParams.structured_output: {' and '.join(fields)} both ask for structured "
                             "output; give one")
        if not fields:
            return None
        field = fields[0]
        if field == "response_format":
            if self.response_format.type == "json_object":
                return StructuredOutput("json_object")
            if self.response_format.json_schema is None:
                raise ValueError("SamplingParams.structured_output: type json_schema needs the json_schema field")
            return StructuredOutput("json_schema", json.dumps(self.response_format.json_schema.json_schema))
        if field == "structured_outputs":
            so = self.structured_outputs
            given = [k for k in ("json_", "regex", "choice", "grammar") if getattr(so, k) is not None] + \
                (["json_object"] if so.json_object else [])
            if len(given) != 1:
                raise ValueError("SamplingParams.structured_output: structured_outputs must give exactly one of json, "
                                 f"regex, choice, grammar, json_object; got {len(given)}")
            kind = {"json_": "json_schema", "json_object": "json_object"}.get(given[0], given[0])
            value = getattr(so, given[0])
        else:
            kind, value = _GUIDED[field], getattr(self, field)
        if kind == "json_object":
            return StructuredOutput("json_object")
        if kind == "choice":
            return StructuredOutput("choice", choices=tuple(value))
        return StructuredOutput(kind, value if isinstance(value, str) else json.dumps(value))

    def _logit_bias(self) -> dict[int, float]:
        bias = {}
        for key, value in (self.logit_bias or {}).items():
            try:
                token = int(key)
            except ValueError:
                raise ValueError(f"SamplingParams.logit_bias must be keyed by token ids, got {key!r}") from None
            bias[token] = value
        return bias

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        """Usage in every chunk: as vLLM, continuous_usage_stats counts only with include_usage."""
        return self.include_usage and self.stream_options.continuous_usage_stats


class CompletionRequest(SamplingRequest):
    unsupported: ClassVar[dict[str, tuple[tuple, str]]] = {
        **_UNSUPPORTED, "suffix": ((None, ""), "fill-in-the-middle (suffix) is not supported")}
    prompt: str | list[str] | list[StrictInt] | list[list[StrictInt]]  # (strict: true and false are not token ids)
    max_tokens: int | None = 16
    logprobs: int | None = None  # top log-probabilities per token (legacy completions)
    echo: bool = False  # the prompt before the completion (with logprobs: the prompt's first)
    best_of: int | None = None  # sequences generated per prompt; the n of highest cumulative logprob return
    add_special_tokens: bool = True

    @property
    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        return [p] if isinstance(p, str) or (p and isinstance(p[0], int)) else list(p)

    @property
    def echo_only(self) -> bool:
        """echo with max_tokens 0: the prompt (and its logprobs) alone, no completion, as vLLM's."""
        return self.echo and self.max_tokens == 0


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class FunctionCall(BaseModel):
    """A call an assistant message made. Chat templates expect the arguments as a mapping (Qwen's
    write them with tojson), so the JSON text OpenAI sends is parsed here, as vLLM does."""
    model_config = ConfigDict(extra="allow")
    name: str
    arguments: dict[str, Any]

    @field_validator("arguments", mode="before")
    @classmethod
    def _parse(cls, value: Any) -> Any:
        if not isinstance(value, str):
            return value
        try:
            arguments = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"the arguments are not valid JSON: {e}") from None
        except RecursionError:
            raise ValueError(f"the arguments are nested deeper than {MAX_NESTING} lists and objects") from None
        try:  # the JSON's escapes can spell lone surrogates the text itself had not, and Python's parser reads NaN
            bad = _first_bad_value(arguments)
        except NestingError:
            raise ValueError(f"the arguments are nested deeper than {MAX_NESTING} lists and objects") from None
        except TooManyValues:
            raise ValueError(f"the arguments hold more than {MAX_CONTAINERS} lists and objects") from None
        if bad is not None:
            raise ValueError("the arguments are not valid Unicode (an escaped lone surrogate)"
                             if isinstance(bad[1], str) else
                             f"the arguments hold {json.dumps(bad[1])}: JSON has no NaN or Infinity")
        return arguments


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="allow")
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # other fields are handed to the chat template as they are
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's calls
    tool_call_id: str | None = None  # a tool message: the call it answers


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments; None: no arguments
    strict: bool | None = None  # tool_choice required or named always follows the schema; auto does not


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(SamplingRequest):
    unsupported: ClassVar[dict[str, tuple[tuple, str]]] = {**_UNSUPPORTED, **_UNSUPPORTED_CHAT}
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None  # None: up to the context length
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None  # None: auto with tools
    parallel_tool_calls: bool | None = None  # None: True
    # vLLM's: the prompt ends where the assistant's turn begins, or with the messages, or inside the last one (an
    # assistant's, for the model to go on with); and more variables for the chat template (Qwen3's enable_thinking)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    # with a reasoning parser (server.reasoning): the thinking sent (vLLM's), the thinking split from the answer
    # (SGLang's; false: the text as the model wrote it)
    include_reasoning: bool = True
    separate_reasoning: bool = True

    @model_validator(mode="after")
    def _one_end_of_the_prompt(self) -> ChatCompletionRequest:
        _check_prompt_end(self)
        return self


def _check_prompt_end(body: ChatCompletionRequest | TokenizeRequest) -> None:
    if body.add_generation_prompt and body.continue_final_message:  # as vLLM
        raise PydanticCustomError("conflicting_fields", "continue_final_message and add_generation_prompt cannot "
                                  "both be true", {"param": "continue_final_message"})


class TokenizeRequest(RequestBody):
    """vLLM's /tokenize: a text prompt, or chat messages through the chat template (the fields of a chat request that
    make its prompt). add_special_tokens None: true for a prompt, false for messages (the template writes them)."""
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    tools: list[Tool] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    add_special_tokens: bool | None = None
    return_token_strs: bool = False  # each token's string (the tokenizer's, as vLLM's token_strs)

    @model_validator(mode="after")
    def _one_prompt(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise PydanticCustomError("prompt_or_messages", "give a prompt or messages (one of them)",
                                      {"param": "prompt"})
        _check_prompt_end(self)
        return self


class DetokenizeRequest(RequestBody):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    tokens: list[StrictInt]


class LoadLoRARequest(RequestBody):
    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)
    load_inplace: bool = False  # vLLM's: replace a loaded adapter of that name


class UnloadLoRARequest(RequestBody):
    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = None  # vLLM's: adapters are named, not numbered; accepted, unread


# ---------------------------------------------------------------------------------- responses


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "moelora"
    root: str | None = None    # where it was loaded from
    parent: str | None = None  # adapters: the base model's id
    max_model_len: int | None = None  # tokens one request may hold, prompt and output (vLLM's field)


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(BaseModel):
    prompt: str


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)  # None: the prompt's first token (echo)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    logprob: float
    rank: int  # among the vocabulary: 1 the likeliest
    decoded_token: str


# vLLM's prompt_logprobs: per prompt token (None for the first, which nothing predicts), token id -> its entry: the
# prompt's token and the top prompt_logprobs tokens
PromptLogprobs = list[dict[str, PromptLogprob] | None]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # vLLM's: the stop string or stop_token_ids token that ended it (None: EOS)
    token_ids: list[int] | None = None  # a model served without a tokenizer: its output, which has no text
    prompt_logprobs: PromptLogprobs | None = None  # with the request's prompt_logprobs


class _Response(BaseModel):
    """What every OpenAI response and stream chunk carries."""
    id: str
    created: int  # Unix seconds, when the request came: the same in every chunk of a stream
    model: str


class CompletionResponse(_Response):
    """A whole completion, or one chunk of a streamed one (same shape, as OpenAI's)."""
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprob]


class FunctionCallOut(BaseModel):
    name: str
    arguments: str  # JSON text, as the model wrote it


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    reasoning_content: str | None = None  # a reasoning model's thinking (server.reasoning)
    content: str | None
    tool_calls: list[ToolCallOut] | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # as CompletionChoice's


class ChatCompletionResponse(_Response):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    usage: UsageInfo
    prompt_logprobs: PromptLogprobs | None = None  # (vLLM's place for them: the response's, one prompt)


class _Delta(BaseModel):
    """A stream delta carries only what it adds, as OpenAI's and vLLM's: its None fields are left out.
    Clients merge deltas key by key (the openai package's stream helper does), so a later tool-call
    delta's "type": null would overwrite its call's type."""

    @model_serializer(mode="wrap")
    def _without_none(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class DeltaFunctionCall(_Delta):
    name: str | None = None  # in the call's first delta
    arguments: str = ""      # the next piece of the arguments' JSON text


class DeltaToolCall(_Delta):
    index: int  # the call's position among the choice's calls
    id: str | None = None  # in the call's first delta, with type and name
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class DeltaMessage(_Delta):
    role: Literal["assistant"] | None = None
    reasoning_content: str | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # as CompletionChoice's, in the chunk with the finish_reason


class ChatCompletionChunk(_Response):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None
