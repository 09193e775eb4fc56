"""Reasoning models in chat completions (`moelora serve --reasoning-parser qwen3`, `deepseek_r1` or
`deepseek_v3`, vLLM's and SGLang's flag): the thinking a model writes between `<think>` and `</think>` goes out
as the message's `reasoning_content` (DeepSeek's and vLLM's field), the rest as its content, and a
structured output (response_format, guided_*, a forced tool call) applies to the answer after the
thinking, not to the thinking (engine.structured_output.AfterReasoning).

Whether the output starts inside the thinking is read off the prompt the chat template wrote. A
prompt that ends with `<think>` (Qwen3-Thinking's and DeepSeek-R1's templates open it) starts it;
one that ends with `</think>` (Qwen3's enable_thinking false writes an empty one) has closed it,
and the output is all answer. Continuing the final message (continue_final_message), that
message's last tag decides, and a message with a `reasoning_content` has closed it. Otherwise the
parsers differ: deepseek_r1 takes the output to start thinking (DeepSeek-R1 writes no `<think>`
first), qwen3 only if the output's first token is `<think>` (Qwen3's hybrid models think by default
and open it themselves; its instruct models never do), deepseek_v3 takes it for the answer
(DeepSeek-V3.1's template opens the thinking in the prompt when `chat_template_kwargs` ask for it).

The whitespace about the tags belongs to neither the reasoning nor the answer, as SGLang strips it;
an output that goes on with the final message's text keeps its first whitespace.
`include_reasoning: false` (vLLM's) leaves the reasoning out; `separate_reasoning: false` (SGLang's)
sends the text as the model wrote it, tags and all.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

START, END = "<think>", "</think>"
# each parser's start of an output whose prompt neither opens nor closes the thinking (OutputStart.thinking)
PARSERS = {"deepseek_r1": True, "deepseek_v3": False, "qwen3": None}


@dataclass(frozen=True)
class Reasoning:
    """A server's reasoning parser: its name, and the token ids of `<think>` and `</think>`."""
    parser: str
    start_id: int
    end_id: int

    @classmethod
    def of(cls, parser: str, tokenizer: PreTrainedTokenizerBase | None) -> Reasoning:
        """ValueError naming --reasoning-parser for a parser moelora does not have, a model without a
        tokenizer, or a tokenizer without `<think>` and `</think>` as tokens of their own."""
        if parser not in PARSERS:
            raise ValueError(f"--reasoning-parser must be one of {', '.join(PARSERS)}, got {parser!r}")
        if tokenizer is None:
            raise ValueError("--reasoning-parser needs the model's tokenizer, and the model has none")
        vocab = tokenizer.get_vocab()
        missing = [tag for tag in (START, END) if tag not in vocab]
        if missing:
            raise ValueError(f"--reasoning-parser {parser}: the tokenizer has no token {' or '.join(missing)}, which "
                             "the model's thinking starts and ends with: is this a reasoning model?")
        return cls(parser, vocab[START], vocab[END])

    def output_start(self, prompt: str, continued: dict | None = None) -> OutputStart:
        """Where the output starts. `continued`: the final message (an assistant's, as the chat template
        gets it) that the output goes on with (continue_final_message); its tags decide then, and not
        the rest of the prompt's (a question may quote a tag)."""
        default = PARSERS[self.parser]
        if continued is None:
            tail = prompt.rstrip()
            return OutputStart(True if tail.endswith(START) else False if tail.endswith(END) else default)
        text = continued.get("content") if isinstance(continued.get("content"), str) else ""
        start, end = text.rfind(START), text.rfind(END)
        if start > end:
            return OutputStart(True, goes_on=bool(text[start + len(START):].strip()))
        if end >= 0 or isinstance(continued.get("reasoning_content"), str):  # (templates close a message's reasoning)
            return OutputStart(False, goes_on=True)
        return OutputStart(default, goes_on=bool(text.strip()))

    def grammar_gate(self, start: OutputStart) -> dict[str, int | None]:
        """The StructuredOutput fields that hold a grammar back until the thinking ends."""
        if start.thinking is False:
            return {}
        return {"reasoning_end": self.end_id, "reasoning_start": None if start.thinking else self.start_id}


@dataclass(frozen=True)
class OutputStart:
    """Where an output starts: inside the thinking (True), in the answer (False), or either as its first
    token is `<think>` or not (None). `goes_on`: it continues text of the prompt's final message, so its
    first whitespace is the model's, not the newlines about a tag."""
    thinking: bool | None
    goes_on: bool = False


class ReasoningParser:
    """One choice's output text, fed in pieces, split into reasoning and content: feed() each piece,
    finish() at the end. However the text is split, the pieces concatenate to the same two texts."""

    def __init__(self, start: OutputStart):
        self.thinking = start.thinking is True
        # a <think> first opens the thinking, or is dropped from it (unless the output goes on with a thought)
        self._at_start = start.thinking is None or self.thinking and not start.goes_on
        self._buf = ""            # text not decided yet: a partial tag, or whitespace
        self._space = ""          # the reasoning's trailing whitespace: dropped if it is the last
        self._reasoned = start.goes_on  # some reasoning went out: its leading whitespace is behind
        self._strip = False       # the answer after </think>: its leading whitespace is dropped

    def feed(self, text: str) -> tuple[str, str]:
        """(reasoning, content) of the next piece."""
        self._buf += text
        reasoning, content = [], []
        while self._buf:
            if self._at_start:  # (a <think> first inside the thinking: DeepSeek-R1-0528 writes one)
                head = self._buf.lstrip()
                if head.startswith(START):
                    self._buf, self.thinking = head[len(START):], True
                elif not head or START.startswith(head):
                    break  # whitespace, or the start of a <think>: wait for more
                self._at_start = False  # else the answer as written (or the thinking, if it had started)
                continue
            if self.thinking:
                i = self._buf.find(END)
                if i < 0:
                    keep = partial_tag(self._buf, END)
                    reasoning.append(self._reasoning(self._buf[:len(self._buf) - keep]))
                    self._buf = self._buf[len(self._buf) - keep:]
                    break
                reasoning.append(self._reasoning(self._buf[:i]))
                self._buf, self.thinking, self._strip = self._buf[i + len(END):], False, True
                self._space = ""
                continue
            if self._strip:
                self._buf = self._buf.lstrip()
                self._strip = not self._buf
            content.append(self._buf)
            self._buf = ""
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        """The rest: a partial tag is text as written, the thinking's trailing whitespace goes."""
        rest, self._buf = self._buf, ""
        if self.thinking:
            return self._reasoning(rest.rstrip()), ""
        return "", rest if not self._strip else rest.lstrip()

    def _reasoning(self, text: str) -> str:
        if not self._reasoned:
            text = text.lstrip()
        body = text.rstrip()
        out = ""
        if body:
            out, self._space, self._reasoned = self._space + body, "", True
        self._space += text[len(body):]
        return out


def partial_tag(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag` (and is not all of it)."""
    return next((k for k in range(min(len(tag) - 1, len(text)), 0, -1) if tag.startswith(text[-k:])), 0)
