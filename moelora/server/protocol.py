"""Request and response bodies of the OpenAI API (completions, chat completions, models), the
adapter-management routes, and OpenAI's error shape. Pydantic checks types; SamplingParams checks
ranges, so the rules live in one place. Every string of a request body, unknown fields included,
must be valid Unicode (JSON can carry lone surrogates, which no tokenizer or response can)."""
from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

from moelora.engine.sampling_params import SamplingParams


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None
    problems: list[str] | None = None  # an adapter's validation problems, one each


class ErrorResponse(BaseModel):
    error: ErrorInfo


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class StreamOptions(BaseModel):
    include_usage: bool = False


# ----------------------------------------------------------------------------------- requests


class RequestBody(BaseModel):
    """A request body: every string in it, at any depth, must encode as UTF-8."""

    @model_validator(mode="before")
    @classmethod
    def _unicode(cls, data: Any) -> Any:
        if isinstance(data, dict):
            path = _first_bad_string(data)
            if path is not None:
                where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path).lstrip(".")
                raise PydanticCustomError("invalid_unicode", "{where} is not valid Unicode (a lone surrogate)",
                                          {"where": where, "param": str(path[0])})
        return data


def _first_bad_string(value: Any, path: tuple = ()) -> tuple | None:
    """Where the first string (or key) that cannot be encoded as UTF-8 is, None if there is none."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path
        return None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        bad = _first_bad_string(key, path + ("<key>",)) or _first_bad_string(item, path + (key,))
        if bad is not None:
            return bad
    return None


class SamplingRequest(RequestBody):
    """Fields both generation routes share. None means the default, as a null in JSON does."""
    model: str | None = None  # the served model name or an adapter's; None: the base model
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # vLLM/SGLang extensions
    top_k: int | None = None
    min_p: float | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    user: str | None = None  # OpenAI's end-user id: checked, not used

    def sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        """ValueError names the bad field (SamplingParams.<field>); max_tokens None: up to the context."""
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise ValueError(f"SamplingParams.{name} is not supported (must be 0)")
        given = {k: getattr(self, k) for k in ("temperature", "top_p", "top_k", "min_p") if getattr(self, k) is not None}
        return SamplingParams(max_tokens=max_tokens, seed=self.seed, stop=self.stop, stop_token_ids=self.stop_token_ids,
                              ignore_eos=self.ignore_eos, logprobs=logprobs, skip_special_tokens=self.skip_special_tokens,
                              **given)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None  # top log-probabilities per token (legacy completions)

    @property
    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        return [p] if isinstance(p, str) or (p and isinstance(p[0], int)) else list(p)


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, tool_calls, ...: handed to the chat template as they are
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None  # None: up to the context length
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None


class LoadLoRARequest(RequestBody):
    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)


class UnloadLoRARequest(RequestBody):
    lora_name: str = Field(min_length=1)


# ---------------------------------------------------------------------------------- responses


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "moelora"
    root: str | None = None    # where it was loaded from
    parent: str | None = None  # adapters: the base model's id


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float] = Field(default_factory=list)
    top_logprobs: list[dict[str, float]] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = None  # a model served without a tokenizer: its output, which has no text


class _Response(BaseModel):
    """What every OpenAI response and stream chunk carries."""
    id: str
    created: int = Field(default_factory=lambda: int(time.time()))
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


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(_Response):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    usage: UsageInfo


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(_Response):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None
