"""State of one request as the scheduler, model runner and engine see it."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from moelora.engine.detokenizer import IncrementalDetokenizer
from moelora.engine.sampler import LogitBias
from moelora.engine.sampling_params import SamplingParams


@dataclass(eq=False)
class Req:
    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    lora: str | None = None                  # adapter name, None: the base model
    seed: int = 0                            # the sampler's: params.seed, else one the engine drew
    detokenizer: IncrementalDetokenizer | None = None  # text, and the stop and length finishes
    return_prompt_logprobs: bool = False     # keep log-probabilities of every prompt position
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] = field(default_factory=list)  # per output token, if params.logprobs is set
    prompt_logprobs: list[torch.Tensor] = field(default_factory=list)  # [tokens, vocab] per prefill chunk
    row: int | None = None                   # row of kv.req_to_token while the request holds cache
    kv_slots: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))  # host, one per cached token
    finish_reason: str | None = None         # "stop", "length", "abort" or "error"
    error: str | None = None                 # why it failed (finish_reason "error")
    error_is_input: bool = False             # that failure is its own input's: constraints no token can meet
    num_retractions: int = 0
    overtaken: int = 0                       # requests admitted before it while it waited for an adapter slot
    num_pending: int = 0                     # sampled by a step whose results are not read yet (overlap scheduling)
    cumulative_logprob: float = 0.0          # of the output tokens, under the raw logits
    grammar: Any = None                      # xgrammar GrammarMatcher while a structured output runs
    allowed_tokens: torch.Tensor | None = None  # [ceil(vocab / 32)] int32 host bitmask of allowed_token_ids
    logit_bias: LogitBias | None = None      # params.logit_bias as host tensors (sampler.logit_bias_tensors)
    # prompt_logprob_entries[k]: prompt token k + 1's log-probability and the top ones (params.prompt_logprobs)
    prompt_logprob_entries: list[dict[int, float]] = field(default_factory=list)
    prompt_logprob_ranks: list[int] = field(default_factory=list)  # prompt token k + 1's rank (1: the likeliest)
    arrival: float = 0.0                     # time.perf_counter() at arrival: its wait for admission counts from here
    priority: int = 0                        # scheduling_policy "priority": lower values are admitted first
    arrival_order: int = 0                   # requests the scheduler took before it (priority's ties: earlier first)
    holds_adapter: bool = False              # took a reference to its adapter (LoRAManager.acquire), not released yet
    prompt_index: int = 0                    # its prompt's place in the generate / prompt_logprobs call that made it
    # prefix caching: kv_slots[:cached_len] are the prefix cache's (prefix_node's path, held while the request
    # holds cache); prefix_key: the tree its tokens go to when it finishes (its adapter's, as loaded when admitted)
    cached_len: int = 0
    prefix_node: Any = None
    prefix_key: Any = None
    cached_prompt_tokens: int = 0            # of its prompt, the tokens found cached when it was first admitted

    @property
    def masked(self) -> bool:
        """Samples from some tokens only (a grammar, allowed_token_ids)."""
        return self.grammar is not None or self.allowed_tokens is not None

    @property
    def num_tokens(self) -> int:
        """Prompt and generated tokens, the pending one included."""
        return len(self.prompt_ids) + self.num_generated

    @property
    def num_generated(self) -> int:
        return len(self.output_ids) + self.num_pending

    @property
    def kv_len(self) -> int:
        """Tokens whose keys and values are (or, for the step being built, will be) in the cache."""
        return self.kv_slots.numel()

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def token_ids(self, start: int, end: int) -> list[int]:
        """Tokens start..end-1 of prompt + output (a pending token is not known here)."""
        prompt = len(self.prompt_ids)
        return self.prompt_ids[start:end] + self.output_ids[max(start - prompt, 0):max(end - prompt, 0)]
