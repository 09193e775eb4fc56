"""FastAPI app over one Engine: the OpenAI API (models, completions, chat completions, responses, streamed or
not), adapter loading and unloading at runtime, health and Prometheus metrics. The engine runs in
its own thread (EngineLoop); handlers only parse, queue and format.

Errors take OpenAI's shape {"error": {"message", "type", "param", "code"}} (server/errors.py):
unknown model 404, bad request 400 (validation errors too, naming the field), queue full 503.

`run_server` serves the app with uvicorn; SIGTERM or Ctrl-C ends the requests in flight (after a drain of
shutdown_timeout seconds), then the server, then the engine.
"""
from __future__ import annotations

import asyncio
import hmac
import logging
import math
import signal
import socket
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from types import FrameType
from typing import Any

import uvicorn
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.routing import APIRoute
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException
from uvicorn.config import STARTUP_FAILURE

from moelora.engine import (AdapterNameError, Engine, EngineDead, PromptError, StructuredOutput, TrialCancelled,
                            WorkerFailure)
from moelora.lora.errors import AdapterError
from moelora.server.body_limit import BodyLimit, BodyTooLarge
from moelora.server.engine_loop import (Delta, EngineError, EngineLoop, Overloaded, RequestInputError, Submission,
                                        merge_deltas)
from moelora.server.errors import APIError, bad_value, error_response, not_found, validation_error
from moelora.server.metrics import Metrics
from moelora.server.protocol import (ChatChoice, ChatChunkChoice, ChatCompletionChunk, ChatCompletionRequest,
                                     ChatCompletionResponse, ChoiceLogprobs, CompletionChoice,
                                     CompletionLogprobs, CompletionRequest, CompletionResponse, DeltaMessage,
                                     DetokenizeRequest, DetokenizeResponse, ErrorInfo, ErrorResponse, LoadLoRARequest,
                                     ModelCard, ModelList, PromptLogprob, PromptLogprobs, PromptTokensDetails,
                                     SamplingRequest, TokenizeRequest, TokenizeResponse, TokenLogprob, TopLogprob,
                                     UnloadLoRARequest, UsageInfo)
from moelora.server.reasoning import Reasoning, ReasoningParser
from moelora.server.responses import CHAT_ALIASES, ResponseBuilder, ResponsesRequest, response_usage
from moelora.server.tools import ChatTools, ChoiceOutput
from moelora.server.version import package_version

logger = logging.getLogger(__name__)
# at shutdown, after the drain: uvicorn's wait for the connections still open. The responses of requests that
# finished in the drain are still being written then (5 s cut some on a loaded 2-core CI machine)
CLOSE_SECONDS = 30.0
# FastAPI's 400 for a body its JSON parser raised on with other than a JSONDecodeError (the reason is not kept)
FASTAPI_PARSE_ERROR = "There was an error parsing the body"
# a request body's bytes past this are a 413 (BodyLimit): 100 MiB holds a batch of hundreds of long prompts
MAX_REQUEST_BYTES = 100 << 20


Entry = tuple[str, float | None, list[tuple[str, float]] | None]  # a token's text, log-probability, top ones (desc)


@dataclass
class _Choice:
    """One sequence's output so far; `text` starts with the prompt when it is echoed."""
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[Entry] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_tokens: int = 0
    cached_tokens: int | None = None  # of prompt_tokens, those found in the prefix cache (known with the first output)
    completion_tokens: int = 0
    cumulative_logprob: float = 0.0
    streamed: int = 0  # characters of text sent in stream chunks
    prompt_only: bool = False  # echo with max_tokens 0: the prompt is the whole output (_prompt_only)
    echo_logprobs: int | None = None  # echo with logprobs: the prompt's tokens lead the logprobs, with this many top
    prompt_top: int | None = None  # the request's prompt_logprobs
    prompt_logprobs: PromptLogprobs | None = None

    def add(self, d: Delta) -> list[Entry]:
        """Take a step's output; return its token log-probabilities (the prompt's first, when it has them)."""
        if self.prompt_only:
            d = _prompt_only(d)

        def entry(t: int, lp: dict[int, float]) -> Entry:
            return d.pieces[t], _json_logprob(lp[t]), sorted(((d.pieces[u], _json_logprob(v)) for u, v in lp.items()),
                                                              key=lambda x: -x[1])
        prompt = list(zip(d.out.prompt_token_ids or (), d.out.prompt_logprobs or (), d.out.prompt_logprob_ranks or ()))
        if prompt and self.prompt_top is not None:
            self.prompt_logprobs = [_prompt_entry(d, t, lp, rank, self.prompt_top) if lp is not None else None
                                    for t, lp, rank in prompt]
        new = [entry(t, _top(lp, t, self.echo_logprobs)) if lp is not None else (d.pieces[t], None, None)
               for t, lp, _ in prompt] if self.echo_logprobs is not None else []
        new += [entry(t, lp) for t, lp in zip(d.out.token_ids, d.out.logprobs)]
        self.text += d.out.text
        self.token_ids += d.out.token_ids
        self.logprobs += new
        self.finish_reason, self.stop_reason = d.out.finish_reason, d.out.stop_reason
        self.prompt_tokens, self.completion_tokens = d.out.prompt_tokens, d.out.completion_tokens
        self.cached_tokens = d.out.cached_tokens
        self.cumulative_logprob = d.out.cumulative_logprob
        return new

    def unsent(self) -> str:
        """The text not yet sent in a stream chunk, marked sent."""
        text, self.streamed = self.text[self.streamed:], len(self.text)
        return text


@dataclass
class _ChatRun:
    """A chat request's submitted sequences: their ids and Delta queue, each one's output so far, and how it is
    parsed (reasoning, tool calls); top_logprobs: the request's, 0 when not asked."""
    rids: list[str]
    queue: asyncio.Queue
    choices: list[_Choice]
    outputs: list[ChoiceOutput]
    top_logprobs: int


LOGPROB_FLOOR = -9999.0  # vLLM's: JSON has no -inf (nor NaN), which logits of a broken model or adapter give


def _json_logprob(logprob: float) -> float:
    return logprob if math.isfinite(logprob) and logprob > LOGPROB_FLOOR else LOGPROB_FLOOR


def _top(lp: dict[int, float], token: int, k: int) -> dict[int, float]:
    """The token's and the k likeliest tokens' entries of a prompt token's (the engine's hold the most any field of
    the request asks for)."""
    return {token: lp[token], **dict(sorted(lp.items(), key=lambda x: -x[1])[:k])}


def _prompt_entry(d: Delta, token: int, lp: dict[int, float], rank: int, k: int) -> dict[str, PromptLogprob]:
    """vLLM's prompt_logprobs entry of a prompt token: the token's, then the k likeliest (ranks 1..k)."""
    entry = {str(token): PromptLogprob(logprob=_json_logprob(lp[token]), rank=rank, decoded_token=d.pieces[token])}
    for r, (u, v) in enumerate(sorted(lp.items(), key=lambda x: -x[1])[:k], 1):
        entry.setdefault(str(u), PromptLogprob(logprob=_json_logprob(v), rank=r, decoded_token=d.pieces[u]))
    return entry


def _prompt_only(d: Delta) -> Delta:
    """An echo with max_tokens 0 runs with max_tokens 1, as vLLM's: the engine runs a prompt (and gives its logprobs)
    only on the way to a token. Its output without that token, ended by length as max_tokens 0 asks, whatever the
    token was."""
    out = replace(d.out, token_ids=[], text="", logprobs=[], finish_reason="length" if d.out.finished else None,
                  stop_reason=None, completion_tokens=0, cumulative_logprob=0.0)
    return Delta(d.index, out, d.pieces)


def _usage_so_far(choice: _Choice) -> UsageInfo:
    """continuous_usage_stats: what a chunk of one sequence reports, as vLLM's: its prompt's tokens and its own
    completion's so far (not the other sequences' of the request)."""
    return UsageInfo(prompt_tokens=choice.prompt_tokens, completion_tokens=choice.completion_tokens,
                     total_tokens=choice.prompt_tokens + choice.completion_tokens,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=choice.cached_tokens)
                     if choice.cached_tokens is not None else None)


def _usage(choices: list[_Choice], n: int) -> UsageInfo:
    """Prompt tokens count once per prompt, not once per each of its n choices (those found cached: the first
    choice's, admitted first or with the others)."""
    prompt = sum(c.prompt_tokens for c in choices[::n])
    completion = sum(c.completion_tokens for c in choices)
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=sum(c.cached_tokens or 0
                                                                                 for c in choices[::n])))


def _completion_logprobs(entries: list[Entry], offset: int) -> CompletionLogprobs:
    """Legacy format: top_logprobs holds the chosen token and the top ones, as vLLM's (None for the
    prompt's first token, when echoed)."""
    out = CompletionLogprobs()
    for piece, lp, top in entries:
        out.tokens.append(piece)
        out.token_logprobs.append(lp)
        out.top_logprobs.append(dict(top) if top is not None else None)
        out.text_offset.append(offset)
        offset += len(piece)
    return out


def _chat_logprobs(entries: list[Entry], k: int) -> ChoiceLogprobs:
    def one(piece: str, lp: float) -> TopLogprob:
        return TopLogprob(token=piece, logprob=lp, bytes=list(piece.encode()))
    return ChoiceLogprobs(content=[TokenLogprob(**one(p, lp).model_dump(), top_logprobs=[one(*t) for t in top[:k]])
                                   for p, lp, top in entries])


def _sse(chunk: BaseModel) -> str:
    return f"data: {chunk.model_dump_json()}\n\n"


_DONE = "data: [DONE]\n\n"  # the end of a legacy route's stream


class OpenAIServing:
    def __init__(self, loop: EngineLoop, served_model_name: str, reasoning: Reasoning | None = None):
        self.loop, self.served_model_name, self.reasoning = loop, served_model_name, reasoning

    # ------------------------------------------------------------------------------- routes

    async def health(self) -> Response:
        return Response(status_code=200 if self.loop.healthy else 503)

    async def version(self) -> dict:
        """vLLM's /version: the server's."""
        return {"version": package_version()}

    async def metrics(self) -> Response:
        body, content_type = self.loop.metrics.render()
        return Response(body, media_type=content_type)

    async def models(self) -> ModelList:
        context = self.loop.engine.context_len
        base = ModelCard(id=self.served_model_name, root=self.loop.engine.config.model_path, max_model_len=context)
        return ModelList(data=[base, *(ModelCard(id=name, root=path, parent=base.id, max_model_len=context)
                                       for name, path in sorted(self.loop.adapters.items()))])

    async def model(self, model: str) -> ModelCard:
        """The base model's or an adapter's card (GET /v1/models/{model}: the openai client's models.retrieve)."""
        card = next((c for c in (await self.models()).data if c.id == model), None)
        if card is None:
            raise not_found(model)
        return card

    async def tokenize(self, body: TokenizeRequest) -> TokenizeResponse:
        """vLLM's /tokenize: the prompt's token ids (a chat's through its template, as chat completions make it), in
        the tokenize thread."""
        self._adapter(body.model)  # (an adapter tokenizes as its base model)
        engine = self.loop.engine
        self._need_tokenizer("tokenize")
        if body.messages is not None:
            tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
            prompt = await self._chat_prompt(body, self._template_messages(body), tools)
            field, special = "messages", False
        else:
            prompt, field, special = body.prompt, "prompt", True
        special = body.add_special_tokens if body.add_special_tokens is not None else special
        try:
            ids = await self.loop.run_tokenize(lambda: engine.tokenize(prompt, special))
        except PromptError as e:
            raise APIError(400, str(e), param=field) from e
        strs = await self.loop.run_tokenize(lambda: engine.tokenizer.convert_ids_to_tokens(ids)) \
            if body.return_token_strs else None
        return TokenizeResponse(count=len(ids), max_model_len=engine.context_len, tokens=ids, token_strs=strs)

    async def detokenize(self, body: DetokenizeRequest) -> DetokenizeResponse:
        """vLLM's /detokenize: the tokens' text, in the tokenize thread."""
        self._adapter(body.model)
        self._need_tokenizer("detokenize")
        return DetokenizeResponse(prompt=(await self._prompt_texts([body.tokens], field="tokens"))[0])

    def _need_tokenizer(self, route: str) -> None:
        if self.loop.engine.tokenizer is None:
            raise APIError(400, f"/{route} needs a tokenizer: {self.loop.engine.missing_tokenizer}")

    async def load_lora_adapter(self, body: LoadLoRARequest) -> dict:
        if body.lora_name == self.served_model_name:
            raise APIError(400, f"`{body.lora_name}` is the base model's name", param="lora_name")
        if body.lora_name in self.loop.adapters and not body.load_inplace:
            raise APIError(400, f"an adapter named `{body.lora_name}` is already loaded (from "
                                f"{self.loop.adapters[body.lora_name]}); unload it first, or load it with "
                                "load_inplace", param="lora_name")
        try:
            await self.loop.load_lora(body.lora_name, body.lora_path, body.load_inplace)
        except AdapterNameError as e:
            raise APIError(400, str(e), param="lora_name") from e
        except AdapterError as e:
            raise APIError(400, str(e), param="lora_path", problems=e.problems) from e
        except (EngineError, EngineDead, WorkerFailure) as e:  # a rank died: the engine's, not the request's
            raise APIError(503, str(e), type="server_error") from e
        return {"success": True, "message": f"Success: LoRA adapter '{body.lora_name}' added successfully."}

    async def unload_lora_adapter(self, body: UnloadLoRARequest) -> dict:
        try:
            await self.loop.unload_lora(body.lora_name)
        except AdapterError as e:
            raise APIError(404, str(e), param="lora_name", code="model_not_found") from e
        except (EngineError, EngineDead, WorkerFailure) as e:
            raise APIError(503, str(e), type="server_error") from e
        return {"success": True, "message": f"Success: LoRA adapter '{body.lora_name}' removed successfully."}

    async def start_profile(self, request: Request) -> dict:
        await _no_body(request)
        try:
            await self.loop.run(self.loop.engine.start_profile)
        except ValueError as e:
            raise APIError(400, str(e)) from e
        except (EngineError, EngineDead, WorkerFailure) as e:
            raise APIError(503, str(e), type="server_error") from e
        return {"success": True, "message": f"profiling into {self.loop.engine.config.profile_dir}"}

    async def stop_profile(self, request: Request) -> dict:
        await _no_body(request)
        try:
            traces = await self.loop.run(self.loop.engine.stop_profile)
        except ValueError as e:
            raise APIError(400, str(e)) from e
        except OSError as e:  # the profile directory went away, or filled up
            raise APIError(500, f"the profile could not be written: {e}", type="internal_server_error") from e
        except (EngineError, EngineDead, WorkerFailure) as e:
            raise APIError(503, str(e), type="server_error") from e
        return {"success": True, "message": f"profile written: {len(traces)} traces",
                "traces": [str(t) for t in traces]}

    async def completions(self, body: CompletionRequest, request: Request) -> Response:
        prompts = body.prompts
        if not prompts:
            raise APIError(400, "the prompt is empty", param="prompt")
        per_prompt = _sequences_per_prompt(body)
        if body.echo_only and body.min_tokens > 0:  # checked here: the engine is asked for the 1 token dropped
            raise APIError(400, f"min_tokens must be in [0, max_tokens=0], got {body.min_tokens}", param="min_tokens")
        max_tokens = 1 if body.echo_only else body.max_tokens  # (the one token is dropped: _prompt_only)
        echo_logprobs = body.logprobs if body.echo else None
        asked = [k for k in (echo_logprobs, body.prompt_logprobs) if k is not None]
        subs = self._submissions(body, prompts, max_tokens, body.logprobs, add_special_tokens=body.add_special_tokens,
                                 sequences=per_prompt, prompt_logprobs=max(asked) if asked else None)
        grammar = await self._compile_grammar(body, subs, request)
        echoes = await self._prompt_texts(prompts) if body.echo else [""] * len(prompts)
        rids, queue, prompt_tokens = await self._submit(body, subs)
        del grammar  # held until the engine started the requests' matchers from it (_compile_grammar)
        head = self._head("cmpl", body.model)
        choices = [_Choice(text=echoes[i // per_prompt], prompt_tokens=prompt_tokens[i], prompt_only=body.echo_only,
                           echo_logprobs=echo_logprobs, prompt_top=body.prompt_logprobs) for i in range(len(subs))]
        with_ids = self.loop.engine.tokenizer is None  # no text: the choices carry their token ids

        def chunk(d: Delta) -> CompletionResponse | None:
            choice = choices[d.index]
            offset = choice.streamed
            entries = choice.add(d)
            text = choice.unsent()
            if not (text or d.out.finished or entries or with_ids and d.out.token_ids):
                return None
            logprobs = _completion_logprobs(entries, offset) if body.logprobs is not None else None
            return CompletionResponse(**head, usage=_usage_so_far(choice) if body.continuous_usage else None, choices=[
                CompletionChoice(index=d.index, text=text, logprobs=logprobs, finish_reason=choice.finish_reason,
                                 stop_reason=choice.stop_reason, token_ids=d.out.token_ids if with_ids else None)])

        def usage_chunk() -> CompletionResponse:
            return CompletionResponse(**head, choices=[], usage=_usage(choices, per_prompt))

        if body.stream:
            return self._stream(rids, queue, chunk, [], usage_chunk if body.include_usage else None)
        await self._collect(request, rids, queue, choices, _grammar_field(body))
        # best_of: the n sequences of each prompt with the highest cumulative logprob; usage counts them all
        best = choices if per_prompt == body.n else [
            c for p in range(len(prompts))
            for c in sorted(choices[p * per_prompt:(p + 1) * per_prompt], key=lambda c: -c.cumulative_logprob)[:body.n]]
        return await self._json(lambda: CompletionResponse(**head, usage=_usage(choices, per_prompt), choices=[
            CompletionChoice(index=i, text=c.text, finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                             token_ids=c.token_ids if with_ids else None, prompt_logprobs=c.prompt_logprobs,
                             logprobs=_completion_logprobs(c.logprobs, 0) if body.logprobs is not None else None)
            for i, c in enumerate(best)]))

    async def chat_completions(self, body: ChatCompletionRequest, request: Request) -> Response:
        run = await self._start_chat(body, request)
        choices, outputs, k = run.choices, run.outputs, run.top_logprobs
        head = self._head("chatcmpl", body.model)

        def usage_so_far(i: int) -> UsageInfo | None:
            return _usage_so_far(choices[i]) if body.continuous_usage else None

        def chunk(d: Delta) -> ChatCompletionChunk | None:
            entries = choices[d.index].add(d)
            delta, reason = outputs[d.index].delta(d.out.text, d.out.finish_reason if d.out.finished else None)
            if not (delta.content or delta.reasoning_content or delta.tool_calls or d.out.finished or entries):
                return None
            return ChatCompletionChunk(**head, usage=usage_so_far(d.index), choices=[ChatChunkChoice(
                index=d.index, delta=delta, logprobs=_chat_logprobs(entries, k) if body.logprobs else None,
                finish_reason=reason, stop_reason=d.out.stop_reason)])

        def usage_chunk() -> ChatCompletionChunk:
            return ChatCompletionChunk(**head, choices=[], usage=_usage(choices, body.n))

        if body.stream:
            roles = [ChatCompletionChunk(**head, usage=usage_so_far(i), choices=[
                ChatChunkChoice(index=i, delta=DeltaMessage(role="assistant", content=""))])
                for i in range(len(choices))]
            return self._stream(run.rids, run.queue, chunk, roles, usage_chunk if body.include_usage else None)
        await self._collect(request, run.rids, run.queue, choices, _grammar_field(body))
        messages = [out.message(c.text, c.finish_reason) for out, c in zip(outputs, choices)]
        return await self._json(lambda: ChatCompletionResponse(**head, usage=_usage(choices, body.n),
                                                               prompt_logprobs=choices[0].prompt_logprobs, choices=[
            ChatChoice(index=i, message=message, finish_reason=reason, stop_reason=c.stop_reason,
                       logprobs=_chat_logprobs(c.logprobs, k) if body.logprobs else None)
            for i, (c, (message, reason)) in enumerate(zip(choices, messages))]))

    async def responses(self, body: ResponsesRequest, request: Request) -> Response:
        """OpenAI's Responses API through the chat route (server.responses)."""
        try:
            chat = ChatCompletionRequest.model_validate(body.chat_body())
            run = await self._start_chat(chat, request)
        except ValidationError as e:  # what the chat route's models check further (a call's arguments: JSON)
            first = e.errors()[0]
            param = str(first["loc"][0]) if first["loc"] else None
            param = CHAT_ALIASES.get(param, param)
            raise APIError(400, f"{param}: {first['msg']}" if param else first["msg"], param=param) from e
        except APIError as e:  # named as the Responses request names it
            e.info.param = CHAT_ALIASES.get(e.info.param, e.info.param)
            raise
        response = ResponseBuilder(body, body.model or self.served_model_name)
        choice, output = run.choices[0], run.outputs[0]

        def usage() -> dict:
            return response_usage(choice.prompt_tokens, choice.cached_tokens, choice.completion_tokens,
                                  self.loop.engine.config.enable_prefix_caching)

        if body.stream:
            def events(d: Delta) -> list[str]:
                choice.add(d)
                delta, _ = output.delta(d.out.text, d.out.finish_reason if d.out.finished else None)
                return response.events(delta)
            return self._event_stream(run.rids, run.queue, events, response.start(),
                                      lambda: response.finish(choice.finish_reason, usage()), response.failed)
        await self._collect(request, run.rids, run.queue, run.choices,
                            CHAT_ALIASES.get(field := _grammar_field(chat), field))
        message, _ = output.message(choice.text, choice.finish_reason)
        response.items(message)
        return JSONResponse(response.response("completed", choice.finish_reason, usage()))

    # ---------------------------------------------------------------------------- internals

    async def _start_chat(self, body: ChatCompletionRequest, request: Request) -> _ChatRun:
        """A chat request's sequences submitted: the messages through the chat template, its tools and reasoning
        parser set up for each choice's output."""
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        k = body.top_logprobs or 0
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        aliases = {"max_tokens": "max_completion_tokens"} if body.max_completion_tokens is not None else {}
        aliases |= {"logprobs": "top_logprobs", "prompt": "messages"}
        tools = ChatTools.of(body, self.loop.engine.tokenizer)
        messages = self._template_messages(body)
        prompt = await self._chat_prompt(body, messages, tools.specs)
        start = self.reasoning.output_start(prompt, messages[-1] if body.continue_final_message else None) \
            if self.reasoning else None
        subs = self._submissions(body, [prompt], max_tokens, k if body.logprobs else None,
                                 add_special_tokens=False, aliases=aliases, grammar=tools.grammar,
                                 prompt_logprobs=body.prompt_logprobs,
                                 grammar_gate=self.reasoning.grammar_gate(start) if self.reasoning else None)
        grammar = await self._compile_grammar(body, subs, request)
        rids, queue, prompt_tokens = await self._submit(body, subs, aliases)
        del grammar  # held until the engine started the request's matchers from it (_compile_grammar)
        separate = self.reasoning is not None and body.separate_reasoning
        return _ChatRun(rids, queue, [_Choice(prompt_tokens=p, prompt_top=body.prompt_logprobs) for p in prompt_tokens],
                        [tools.output(ReasoningParser(start) if separate else None, body.include_reasoning)
                         for _ in subs], k)

    def _head(self, prefix: str, model: str | None) -> dict:
        """The fields every response and stream chunk of one request carries: its id, its creation time (one for
        all the chunks of a stream, as OpenAI's) and the model it names."""
        return {"id": f"{prefix}-{uuid.uuid4().hex}", "created": int(time.time()),
                "model": model or self.served_model_name}

    def _adapter(self, model: str | None) -> str | None:
        """The adapter a request's model field names; None for the base model."""
        if model is None or model == self.served_model_name:
            return None
        if model not in self.loop.adapters:
            raise not_found(model)
        return model

    def _submissions(self, body: SamplingRequest, prompts: list, max_tokens: int | None, logprobs: int | None,
                     add_special_tokens: bool, aliases: dict[str, str] | None = None, sequences: int | None = None,
                     prompt_logprobs: int | None = None, grammar: StructuredOutput | None = None,
                     grammar_gate: dict[str, int | None] | None = None) -> list[Submission]:
        """`sequences` (default n) per prompt; with a seed, the k-th of them draws with seed + k (as
        Engine.generate). `aliases`: the request's names of SamplingParams fields, for the error's param.
        `grammar`: the structured output tool_choice asks for (no other field then does). `grammar_gate`: the
        StructuredOutput fields that hold a grammar back until a reasoning model's thinking ends."""
        lora = self._adapter(body.model)
        sequences = sequences or body.n
        limit, limit_name = self.loop.engine.config.max_running_requests, "max_running_requests"
        if self.loop.max_queued_requests is not None and self.loop.max_queued_requests < limit:
            limit, limit_name = self.loop.max_queued_requests, "max_queued_requests"  # more could never be admitted
        if not 1 <= sequences * len(prompts) <= limit:
            field = "prompt" if sequences == 1 else "n" if sequences == body.n else "best_of"
            raise APIError(400, f"n must be >= 1 and n * prompts <= {limit_name} ({limit}), got n={sequences} "
                           f"for {len(prompts)} prompts", param=field)
        policy = self.loop.engine.config.scheduling_policy
        if body.priority and policy != "priority":
            raise APIError(400, f"priority {body.priority} needs the server started with --scheduling-policy priority "
                           f"(this one schedules {policy!r}: every request's priority is 0)", param="priority")
        aliases = (aliases or {}) | {"structured_output": _grammar_field(body)}
        try:  # the model's generation config gives the sampling fields the request leaves unset
            params = body.sampling_params(max_tokens, logprobs, prompt_logprobs, self.loop.engine.sampling_defaults)
            if grammar is not None:
                params = replace(params, structured_output=grammar)
            if grammar_gate and params.structured_output is not None:
                params = replace(params, structured_output=replace(params.structured_output, **grammar_gate))
        except ValueError as e:
            raise bad_value(e, aliases) from e
        return [Submission(p, params.for_sequence(k), lora, add_special_tokens, body.priority)
                for p in prompts for k in range(sequences)]

    async def _compile_grammar(self, body: SamplingRequest, subs: list[Submission], request: Request) -> Any:
        """The request's compiled grammar (None without one), compiled in a worker thread (the compiler is
        thread-safe): while the caller holds it, the engine thread finds it ready (GrammarBackend.compile); a bad
        schema, regex or grammar, or one that takes too long to compile, is a 400 naming its field. A client that
        leaves meanwhile stops its grammar's trial compile (a 499)."""
        spec = subs[0].params.structured_output
        if spec is None:
            return None
        cancelled = threading.Event()
        compiled = asyncio.ensure_future(self.loop.compile_grammar(spec, cancelled))
        if not await _done_unless_gone(request, compiled):
            cancelled.set()
            compiled.add_done_callback(lambda f: f.cancelled() or f.exception())  # (its TrialCancelled: retrieved)
            raise APIError(499, "the client disconnected", code="client_disconnected")
        try:
            return compiled.result()
        except TrialCancelled as e:  # the server shuts down (EngineLoop.drain)
            raise APIError(503, "the server is shutting down", type="server_error") from e
        except Overloaded as e:
            raise _overloaded(e) from e
        except ValueError as e:
            field = _grammar_field(body)
            message = str(e) if field != "tools" else f"tools: the functions' parameters do not compile ({e})"
            raise APIError(400, message, param=field) from e

    async def _prompt_texts(self, prompts: list[str | list[int]], field: str = "prompt") -> list[str]:
        """The text of each prompt, as echo returns it (token ids decoded in the tokenize thread). `field`: the
        request's field of the prompts, which bad token ids' errors name."""
        if self.loop.engine.tokenizer is None:
            raise APIError(400, f"echo needs a tokenizer: {self.loop.engine.missing_tokenizer}", param="echo")
        ids = [p for p in prompts if not isinstance(p, str)]
        for p in ids:  # before the tokenizer sees them: ids outside its integers make it raise (OverflowError), and
            try:  # decoding millions of ids the engine then refuses would hold the tokenize thread for seconds
                self.loop.engine.check_token_ids(p)
                self.loop.engine.check_prompt_length(len(p))
            except PromptError as e:
                raise bad_value(e, {"prompt": field}) from e
        decoded = iter(await self.loop.run_tokenize(lambda: [self.loop.engine.tokenizer.decode(p) for p in ids]) if ids
                       else [])
        return [p if isinstance(p, str) else next(decoded) for p in prompts]

    @staticmethod
    def _template_messages(body: ChatCompletionRequest | TokenizeRequest) -> list[dict]:
        """The messages as the chat template gets them."""
        messages = []
        for i, m in enumerate(body.messages):
            msg = m.model_dump(exclude_none=True)
            if isinstance(m.content, list):
                if any(p.type != "text" or p.text is None for p in m.content):
                    raise APIError(400, f"messages[{i}]: only text content parts are supported", param="messages")
                msg["content"] = "\n".join(p.text for p in m.content)  # as vLLM gives a template the parts
            messages.append(msg)
        return messages

    async def _chat_prompt(self, body: ChatCompletionRequest | TokenizeRequest, messages: list[dict],
                           tools: list[dict] | None) -> str:
        """The messages (_template_messages) through the chat template, in the tokenize thread (not the event
        loop's)."""
        try:
            return await self.loop.run_tokenize(lambda: self.loop.engine.chat_prompt(
                messages, tools, body.add_generation_prompt, body.continue_final_message, body.chat_template_kwargs))
        except ValueError as e:
            field = next((f for f in ("chat_template_kwargs", "continue_final_message") if str(e).startswith(f)), None)
            if field is not None:
                raise APIError(400, str(e), param=field) from e
            raise APIError(400, f"{e}; use /v1/completions with a prompt", param="messages") from e

    async def _submit(self, body: SamplingRequest, subs: list[Submission], aliases: dict[str, str] | None = None
                      ) -> tuple[list[str], asyncio.Queue, list[int]]:
        """The sequences' request ids, the queue of their Deltas, and their prompts' token counts."""
        aliases = (aliases or {}) | {"structured_output": _grammar_field(body)}
        queue: asyncio.Queue = asyncio.Queue()
        try:
            rids, prompt_tokens = await self.loop.submit(subs, queue)
            return rids, queue, prompt_tokens
        except Overloaded as e:
            raise _overloaded(e) from e
        except AdapterError as e:  # unloaded since _adapter looked
            raise not_found(subs[0].lora or "") from e
        except ValueError as e:
            raise bad_value(e, aliases) from e
        except (EngineError, EngineDead) as e:
            raise APIError(503, str(e), type="server_error") from e

    @staticmethod
    async def _deltas(queue: asyncio.Queue, count: int) -> AsyncIterator[list[Delta]]:
        """Deltas of `count` sequences until every one has finished, as they come: those that queued up while the
        consumer was busy in one list, merged, one per sequence."""
        while count:
            items = [await queue.get()]
            while not queue.empty():
                items.append(queue.get_nowait())
            deltas = merge_deltas(items)
            error = deltas.pop() if deltas and isinstance(deltas[-1], Exception) else None
            count -= sum(d.out.finished for d in deltas)
            if deltas:
                yield deltas
            if error is not None:
                raise error

    async def _collect(self, request: Request, rids: list[str], queue: asyncio.Queue, choices: list[_Choice],
                       grammar_field: str) -> None:
        """Wait for every sequence, aborting them if the client leaves first or one of them fails (the
        response is then an error: the others' tokens would go nowhere). The choices take their outputs at the end,
        in a worker thread: the entries of a long prompt's prompt_logprobs (70 us a token) held the event loop."""
        received: list[Delta] = []

        async def consume() -> None:
            async for deltas in self._deltas(queue, len(rids)):
                received.extend(deltas)

        task = asyncio.ensure_future(consume())
        try:
            await _done_unless_gone(request, task)
        finally:
            if not task.done() or task.exception() is not None:  # the client left (or the server stops), or a failure
                task.cancel()
                self.loop.abort(rids)
        if not task.done():
            raise APIError(499, "the client disconnected", code="client_disconnected")
        try:
            task.result()
        except RequestInputError as e:  # (`grammar_field`: the request field its grammar came from)
            raise APIError(400, str(e), param=grammar_field) from e
        except EngineError as e:
            raise APIError(500, str(e), type="server_error") from e
        await asyncio.to_thread(lambda: [choices[d.index].add(d) for d in received])

    @staticmethod
    async def _json(build: Callable[[], BaseModel]) -> Response:
        """The body `build` makes, made and encoded in a worker thread: n sequences with their logprobs are megabytes,
        whose making held the event loop, and every other client's stream, for seconds."""
        return Response(await asyncio.to_thread(lambda: build().model_dump_json()), media_type="application/json")

    def _stream(self, rids: list[str], queue: asyncio.Queue, chunk: Callable[[Delta], BaseModel | None],
                first: list[BaseModel], usage: Callable[[], BaseModel] | None) -> StreamingResponse:
        """The legacy routes' SSE: the `first` chunks, one chunk per step output that has something to say, the
        usage chunk, then [DONE] (after an error too)."""
        def events(d: Delta) -> list[str]:
            return [_sse(c)] if (c := chunk(d)) is not None else []

        def failed(message: str, kind: str) -> list[str]:
            return [_sse(ErrorResponse(error=ErrorInfo(message=message, type=kind))), _DONE]
        return self._event_stream(rids, queue, events, [_sse(c) for c in first],
                                  lambda: ([_sse(usage())] if usage is not None else []) + [_DONE], failed)

    def _event_stream(self, rids: list[str], queue: asyncio.Queue, events: Callable[[Delta], list[str]],
                      first: list[str], last: Callable[[], list[str]], failed: Callable[[str, str], list[str]]
                      ) -> StreamingResponse:
        """SSE: the `first` events, a step output's `events`, the `last` ones; `failed` the events of an error (its
        message and type) once the stream has begun (it can only go in-band then). A client that leaves, or a failure,
        aborts the sequences."""
        async def body() -> AsyncIterator[str]:
            done = False
            try:
                # a write per batch of events: one that a reset connection refuses is the last one tried
                if first:
                    yield "".join(first)
                async for deltas in self._deltas(queue, len(rids)):
                    if text := "".join(e for d in deltas for e in events(d)):
                        yield text
                if end := "".join(last()):
                    yield end
                done = True
            except RequestInputError as e:
                for event in failed(str(e), "invalid_request_error"):
                    yield event
            except EngineError as e:
                for event in failed(str(e), "server_error"):
                    yield event
            except Exception as e:  # the response has started: the error can only go in-band
                logger.exception("streaming a response failed")
                for event in failed(f"internal error: {type(e).__name__}: {e}", "server_error"):
                    yield event
            finally:
                if not done:  # the client left, or the engine failed: free the cache now
                    self.loop.abort(rids)
        # Starlette starts the generator before it can notice a disconnect (the first suspension
        # point is in here), so the finally runs even for a client that left before its first chunk
        return StreamingResponse(body(), media_type="text/event-stream")


def _sequences_per_prompt(body: CompletionRequest) -> int:
    """best_of (n <= best_of; not streamed unless equal to n, as vLLM), else n."""
    if body.best_of is None or body.best_of == body.n:
        return body.n
    if body.best_of < body.n:
        raise APIError(400, f"best_of must be >= n, got best_of={body.best_of} and n={body.n}", param="best_of")
    if body.stream:
        raise APIError(400, "best_of > n cannot be streamed: the best sequences are known only at the end",
                       param="best_of")
    return body.best_of


def _overloaded(e: Overloaded) -> APIError:
    return APIError(503, f"the server is overloaded: {e}", type="server_error", code="overloaded")


def _grammar_field(body: SamplingRequest) -> str:
    """The request field a grammar comes from: the structured-output field, else tool_choice's
    forced calls, whose schemas are the tools'."""
    return (body.structured_output_fields or ["tools"])[0]


async def _done_unless_gone(request: Request, task: asyncio.Future) -> bool:
    """Wait until `task` is done or the client has closed the connection, whichever comes first; whether the task is
    done."""
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    return task.done()


async def _disconnected(request: Request) -> None:
    """Returns when the client closes the connection (the body has been read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


class _Route(APIRoute):
    """A route whose unexpected exceptions become a 500 in OpenAI's shape, logged with their traceback,
    as a normal response: Starlette's catch-all would send it and then re-raise, and uvicorn drops the
    kept-alive connection of an exception that reaches it."""

    def get_route_handler(self) -> Callable[[Request], Awaitable[Response]]:
        handler = super().get_route_handler()

        async def guarded(request: Request) -> Response:
            try:
                return await handler(request)
            except (APIError, HTTPException, RequestValidationError, BodyTooLarge):
                raise  # the app's exception handlers answer these (BodyLimit the last)
            except Exception as e:
                logger.exception("%s %s failed", request.method, request.url.path)
                return error_response(500, ErrorInfo(message=f"internal error: {type(e).__name__}: {e}",
                                                     type="server_error"))
        return guarded


def create_app(engine: Engine, served_model_name: str, max_queued_requests: int | None = None,
               api_key: str | None = None, stats_interval: float = 10.0,
               max_request_bytes: int = MAX_REQUEST_BYTES, watchdog_timeout: float = 300.0,
               reasoning_parser: str | None = None, grammar_compile_timeout: float = 10.0,
               runtime_lora_updating: bool = True) -> FastAPI:
    """The app; its engine thread starts and stops with the app's lifespan, which logs what it serves
    first and shuts the engine down (its other ranks, with tp_size > 1) last. With an api_key, every route but
    /health, /metrics and /version answers 401 unless the request carries 'Authorization: Bearer <key>' (and
    FastAPI's /docs, /redoc and /openapi.json are off). stats_interval:
    seconds between the stats log lines (0: none). A request body past max_request_bytes is a 413 (BodyLimit).
    watchdog_timeout: seconds one engine step may take before the server exits (EngineLoop; 0: never).
    reasoning_parser: "qwen3" or "deepseek_r1" sends a reasoning model's thinking apart (server.reasoning).
    grammar_compile_timeout: seconds a request's grammar may take to compile (EngineLoop; 0: no limit).
    runtime_lora_updating: False leaves out the adapter load and unload routes (404), so that no client can load a
    server path or unload the operator's adapters."""
    if served_model_name in engine.config.lora_paths:
        raise ValueError(f"the served model name {served_model_name!r} is also an adapter's name")
    reasoning = Reasoning.of(reasoning_parser, engine.tokenizer) if reasoning_parser is not None else None
    loop = EngineLoop(engine, Metrics(engine.lora_stats), max_queued_requests, stats_interval, watchdog_timeout,
                      grammar_compile_timeout)

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        logger.info("serving %s as %r%s%s%s", engine.config.model_path, served_model_name,
                    ", with an API key" if api_key else "",
                    f", its reasoning parsed ({reasoning.parser})" if reasoning else "",
                    "" if runtime_lora_updating else ", its adapters fixed (load and unload routes off)")
        for line in engine.summary():
            logger.info("%s", line)
        loop.start()
        yield
        loop.stop()
        # its other ranks end with the server, here: uvicorn ends a server stopped by SIGTERM by raising the signal
        # again once the app shut down, which kills the process before any code after uvicorn.run could stop them
        engine.shutdown()

    # with an API key, FastAPI's schema and docs pages are not served either (they would answer without it)
    docs = {"openapi_url": None, "docs_url": None, "redoc_url": None} if api_key else {}
    app = FastAPI(title="moelora", lifespan=lifespan, **docs)
    app.add_middleware(BodyLimit, max_bytes=max_request_bytes)
    app.router.route_class = _Route
    app.state.engine_loop = loop
    serving = OpenAIServing(loop, served_model_name, reasoning)
    app.api_route("/health", methods=["GET", "HEAD"])(serving.health)  # (probes that ask with HEAD got a 405)
    app.get("/metrics")(serving.metrics)
    app.get("/version")(serving.version)

    async def authorized(request: Request) -> None:
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
            raise APIError(401, "missing or incorrect API key (send 'Authorization: Bearer <key>')",
                           code="invalid_api_key")
    guarded = [Depends(authorized)] if api_key else []
    app.get("/v1/models", dependencies=guarded)(serving.models)
    app.get("/v1/models/{model:path}", dependencies=guarded)(serving.model)  # an adapter's name may hold a "/"
    app.post("/v1/completions", dependencies=guarded)(serving.completions)
    app.post("/v1/chat/completions", dependencies=guarded)(serving.chat_completions)
    app.post("/v1/responses", dependencies=guarded)(serving.responses)
    for prefix in ("/v1", ""):
        app.post(f"{prefix}/tokenize", dependencies=guarded)(serving.tokenize)
        app.post(f"{prefix}/detokenize", dependencies=guarded)(serving.detokenize)
        if runtime_lora_updating:
            app.post(f"{prefix}/load_lora_adapter", dependencies=guarded)(serving.load_lora_adapter)
            app.post(f"{prefix}/unload_lora_adapter", dependencies=guarded)(serving.unload_lora_adapter)
    if engine.config.profile_dir is not None:  # as vLLM's, only where the operator named the traces' directory
        app.post("/start_profile", dependencies=guarded)(serving.start_profile)
        app.post("/stop_profile", dependencies=guarded)(serving.stop_profile)

    @app.exception_handler(APIError)
    async def api_error(_: Request, e: APIError) -> JSONResponse:
        return error_response(e.status, e.info)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, e: RequestValidationError) -> JSONResponse:
        return validation_error(e, request.headers.get("content-type"))

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, e: HTTPException) -> JSONResponse:
        if e.status_code == 400 and e.detail == FASTAPI_PARSE_ERROR:  # FastAPI's, for what Python's parser raised on
            return error_response(400, ErrorInfo(
                message="the request body could not be parsed as JSON (an integer of more than 4300 digits, or lists "
                        "and objects nested thousands deep)", type="invalid_request_error", code="invalid_json"))
        return error_response(e.status_code, ErrorInfo(message=str(e.detail), type="invalid_request_error"))

    return app


async def _no_body(request: Request) -> None:
    """The profile routes take no options (vLLM's take none): SGLang's (output_dir, num_steps, activities, ...) are a
    400, not silently ignored, since a client counting on num_steps would leave every rank recording."""
    body = (await request.body()).strip()
    if body not in (b"", b"{}", b"null"):
        raise APIError(400, f"{request.url.path} takes no body: the traces go to --profile-dir, POST /stop_profile "
                            f"ends them (got {body[:100]!r})")


class _Server(uvicorn.Server):
    """uvicorn's server, whose shutdown (SIGTERM, Ctrl-C) ends the requests in flight first (EngineLoop.drain):
    uvicorn alone waits for every response under way to end, a stream of thousands of tokens included, before the
    app, and the engine's other ranks with it, shut down."""

    def __init__(self, config: uvicorn.Config, loop: EngineLoop, shutdown_timeout: float):
        super().__init__(config)
        self.engine_loop, self.shutdown_timeout = loop, shutdown_timeout
        self.draining = False
        self.cut = False  # a second Ctrl-C came while the requests in flight drained

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # a second Ctrl-C during the drain ends the requests now, and the shutdown goes on, the app's and the ranks':
        # uvicorn's force_exit would skip them, leaving the engine thread stepping as the process ends
        if self.draining and sig == signal.SIGINT:
            self.cut = True
        else:
            super().handle_exit(sig, frame)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        for server in self.servers:  # uvicorn's first step, taken before the drain: no new connections meanwhile
            server.close()
        self.draining = True
        await self.engine_loop.drain(self.shutdown_timeout, lambda: self.cut)
        self.draining = False
        await super().shutdown(sockets)


def bind_socket(host: str, port: int) -> socket.socket:
    """The server's address, bound before the model loads (as vLLM does): a --host that resolves to nothing here or
    a port another process holds is an error at once, naming them, not after the load."""
    sock = None
    try:
        addresses = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        # IPv4 first where the name has both (localhost), as uvicorn binds it
        family, kind, proto, _, address = next((a for a in addresses if a[0] == socket.AF_INET), addresses[0])
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError as e:
        if sock is not None:
            sock.close()
        raise OSError(f"cannot listen on {host}:{port} (--host, --port): {e.strerror or e}") from None
    return sock


def run_server(app: FastAPI, sock: socket.socket, host: str, port: int, log_level: str = "info",
               shutdown_timeout: float = 0.0) -> None:
    """Serve create_app's app with uvicorn on `sock` (bind_socket's for host:port) until SIGTERM or Ctrl-C, as
    uvicorn.run does (its exit status 3 when the server could not start), but on the signal the requests in flight
    get shutdown_timeout seconds to finish before they are ended (vLLM's --shutdown-timeout; 0: ended at once), so
    that the server stops within that time."""
    # once the requests in flight ended (the drain), a client that reads nothing more holds uvicorn's wait for its
    # connection no longer than this
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=CLOSE_SECONDS)
    server = _Server(config, app.state.engine_loop, shutdown_timeout)
    bound_host, bound_port = sock.getsockname()[:2]  # uvicorn given a socket logs no address: said here
    logger.info("listening on http://%s:%d", f"[{bound_host}]" if ":" in bound_host else bound_host, bound_port)
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:  # uvicorn raises Ctrl-C's SIGINT again once it shut down
        pass
    if not server.started:
        sys.exit(STARTUP_FAILURE)
