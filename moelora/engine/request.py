"""State of one request as the scheduler and model runner see it."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(eq=False)
class Req:
    rid: str
    prompt_ids: list[int]
    max_new_tokens: int
    lora: str | None = None                  # adapter name, None: the base model
    output_ids: list[int] = field(default_factory=list)
    row: int | None = None                   # row of kv.req_to_token while the request holds cache
    kv_slots: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))  # host, one per cached token
    finish_reason: str | None = None
    num_retractions: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def kv_len(self) -> int:
        """Tokens whose keys and values are (or, for the step being built, will be) in the cache."""
        return self.kv_slots.numel()

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def token_ids(self, start: int, end: int) -> list[int]:
        """Tokens start..end-1 of prompt + output."""
        prompt = len(self.prompt_ids)
        return self.prompt_ids[start:end] + self.output_ids[max(start - prompt, 0):max(end - prompt, 0)]
