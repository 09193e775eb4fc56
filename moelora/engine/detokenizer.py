"""Incremental detokenization of one request for streaming, with stop tokens and stop strings."""
from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Literal

from moelora.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# Prompt tokens decoded along with the output, as in vLLM/SGLang: tokenizers whose decode depends
# on context (SentencePiece drops the leading space of the first token) then give the output the
# text it has after the prompt.
PROMPT_CONTEXT_TOKENS = 5
# A character split over tokens waits for its last bytes, the tokens since the last complete one decoded again
# with each new token; past this many tokens the text is final, U+FFFD included, but for the last few tokens where
# they may be a character's first bytes (TAIL_TOKENS). Well-formed UTF-8 completes a character within a few tokens;
# output that never does (bytes a client forces with logit_bias or allowed_token_ids) would otherwise cost the
# streaming thread the square of its length.
MAX_PENDING_TOKENS = 16
TAIL_TOKENS = 3  # the most tokens an incomplete UTF-8 character (4 bytes at most) spans, a byte or more a token


class IncrementalDetokenizer:
    """Turns a request's generated tokens into text as they come.

    add(token) returns the text that can be released now: bytes of a character split over several
    tokens wait until it is complete (no U+FFFD while incomplete), and text that may be the start
    of a stop string waits until that is decided. Stop tokens are not part of the text, nor are stop
    strings unless include_stop_str_in_output; stop strings count only in the text of the tokens after
    the first min_tokens. Once finished, the text released is decode(generated tokens,
    skip_special_tokens) cut where the stop string that completed first begins (or ends) (exactly so
    for byte-level BPE tokenizers, unless past MAX_PENDING_TOKENS tokens ending inside characters a character's
    bytes span more than TAIL_TOKENS tokens, which needs tokens that add no bytes, such as skipped special tokens,
    inside it), and `stop_reason` says which stop ended it, as vLLM's does.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase | None, prompt_ids: Sequence[int], params: SamplingParams,
                 eos_token_ids: Iterable[int] | None = None) -> None:
        """eos_token_ids: default the tokenizer's EOS; pass the model's (generation_config) if it has more.
        Without a tokenizer there is no text: only stop tokens, EOS and max_tokens end the request. With
        params.max_tokens None, no length finish either: the caller's `finish` ends it."""
        self.params = params
        self._tokenizer = tokenizer
        if eos_token_ids is None:
            eos_token_ids = [] if tokenizer is None or tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
        self._eos_ids = frozenset() if params.ignore_eos else frozenset(eos_token_ids)
        self._stop_ids = set(params.stop_token_ids) | self._eos_ids
        self._ids = list(prompt_ids[-PROMPT_CONTEXT_TOKENS:])
        # _ids[_prefix:_read] was decoded already; decoding from _prefix gives the context it needs
        self._prefix, self._read = 0, len(self._ids)
        self._partial = 0  # chars of the text past _read handed to _append while a character is incomplete
        self._text = ""  # decoded output, cut at the stop string once one is found
        self._stop_ends = [StopStringEnd(stop) for stop in params.stop] if tokenizer is not None else []  # (no text)
        self._released = 0  # chars of _text handed out
        self.num_tokens = 0
        self.finish_reason: Literal["stop", "length"] | None = None
        # vLLM's stop_reason: the stop string that matched, or the token of stop_token_ids that came; None when
        # EOS (the model's own end) ended the output, or its length, or a finish decided elsewhere
        self.stop_reason: str | int | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def stop_token_ids(self) -> frozenset[int]:
        """The tokens that end the output: stop_token_ids, and EOS unless ignore_eos."""
        return frozenset(self._stop_ids)

    @property
    def text(self) -> str:
        """The text released so far."""
        return self._text[:self._released]

    def add(self, token_id: int) -> str:
        """Take one generated token; return the new text that can be released."""
        if self.finished:
            raise RuntimeError(f"request already finished ({self.finish_reason}); got token {token_id}")
        self.num_tokens += 1
        if token_id in self._stop_ids:
            if token_id not in self._eos_ids:  # as vLLM: a stop token that is also EOS ends it as EOS
                self.stop_reason = token_id
            self._finish("stop")  # (the text it flushes may still hold a stop string, which then is the reason)
        else:
            self._ids.append(token_id)
            self._append(self._decode_new(flush=False))
            if not self.finished and self.params.max_tokens is not None and self.num_tokens >= self.params.max_tokens:
                self._finish("length")
        return self._release()

    def finish(self, reason: Literal["stop", "length"]) -> str:
        """Finish now, for a reason decided elsewhere (the output's grammar is complete, or the engine's
        max_tokens ended it); the text left to release."""
        self._finish(reason)
        return self._release()

    def _decode_new(self, flush: bool) -> str:
        """Text of the tokens past _read that is final: a character still missing bytes (a U+FFFD at
        the end) waits for them, unless flushing or past MAX_PENDING_TOKENS (_final_before_tail); the text before
        it is released already."""
        prefix_text = self._decode(self._ids[self._prefix:self._read])
        new_text = self._decode(self._ids[self._prefix:])[len(prefix_text):]
        # read: where the final text ends, on a character boundary; handed: chars of the text after it handed out
        final, read, handed = new_text, len(self._ids), 0
        if not flush and new_text.endswith("\ufffd"):
            if len(self._ids) - self._read > MAX_PENDING_TOKENS:
                final, read, handed = self._final_before_tail(prefix_text, new_text)
            else:
                final, read = new_text.rstrip("\ufffd"), None
        piece = final[self._partial:]
        if read is not None:  # later tokens decode after it
            self._prefix, self._read, self._partial = self._read, read, handed
        else:
            self._partial = len(final)
        return piece

    def _final_before_tail(self, prefix_text: str, new_text: str) -> tuple[str, int, int]:
        """Past MAX_PENDING_TOKENS: the text that is final, the tokens it ends at, and the chars of the text after them
        handed out already. The last TAIL_TOKENS tokens (or fewer) stay pending where the text splits cleanly before
        them (no character spans the split): they hold the first bytes of the character still to complete (after
        text of their own, as a token of a character and the next one's first byte may). The rest is final, the bytes
        that never completed a character included."""
        for kept in range(TAIL_TOKENS, 0, -1):
            cut = len(self._ids) - kept
            head = self._decode(self._ids[self._prefix:cut])[len(prefix_text):]
            if head + self._decode(self._ids[cut:]) == new_text:
                return head, cut, max(0, self._partial - len(head))
        return new_text, len(self._ids), 0

    def _decode(self, ids: list[int]) -> str:
        if self._tokenizer is None:
            return ""
        return self._tokenizer.decode(ids, skip_special_tokens=self.params.skip_special_tokens)

    def _append(self, piece: str) -> None:
        """Add decoded text; finish at the stop string that completes first in the text (of two completing together,
        the one that begins first), which only the new text can complete: where the tokens' boundaries fall does
        not change which one ends the output. As in vLLM, none can before the output has more than min_tokens tokens
        (one that begins in their text still can after)."""
        start = len(self._text)
        self._text += piece
        for end in self._stop_ends:
            end.feed(piece)
        if self.num_tokens <= self.params.min_tokens:
            return
        hits = [(i + len(s), i, s) for s in self.params.stop
                if (i := self._text.find(s, max(0, start - len(s) + 1))) >= 0]
        if hits:
            end, i, self.stop_reason = min(hits)
            self._text = self._text[:end if self.params.include_stop_str_in_output else i]
            self.finish_reason = "stop"

    def _finish(self, reason: Literal["stop", "length"]) -> None:
        self.finish_reason = reason
        # the output ends here: bytes of an incomplete character decode as U+FFFD, as one-shot decode
        # does; that text can still hold a stop string
        self._append(self._decode_new(flush=True))

    def _release(self) -> str:
        end = len(self._text) if self.finished else len(self._text) - self._stop_prefix_len()
        piece, self._released = self._text[self._released:end], end
        return piece

    def _stop_prefix_len(self) -> int:
        """Length of the longest end of the text that is the start of a stop string."""
        return max((end.matched for end in self._stop_ends), default=0)


class StopStringEnd:
    """How much of a stop string a growing text ends with: the longest proper prefix of the stop string that is
    an end of the text, kept up to date as text is appended (Knuth-Morris-Pratt), so each character costs O(1)
    amortized, whatever the lengths of the text and of the stop string."""

    def __init__(self, stop: str) -> None:
        self.stop = stop
        self.matched = 0
        self._border = _borders(stop)

    def feed(self, text: str) -> None:
        """Append text."""
        stop, k = self.stop, self.matched
        for ch in text:
            while k and stop[k] != ch:
                k = self._border[k - 1]
            if stop[k] == ch:
                k += 1
            if k == len(stop):  # the whole stop string (the caller finds those): keep the longest proper end
                k = self._border[k - 1]
        self.matched = k


@functools.lru_cache(maxsize=64)  # the n sequences of a request, and its detokenizers on two threads, share one
def _borders(stop: str) -> tuple[int, ...]:
    """border[i]: the length of the longest proper prefix of stop[:i + 1] that is also its end."""
    border = [0] * len(stop)
    k = 0
    for i in range(1, len(stop)):
        while k and stop[i] != stop[k]:
            k = border[k - 1]
        if stop[i] == stop[k]:
            k += 1
        border[i] = k
    return tuple(border)
