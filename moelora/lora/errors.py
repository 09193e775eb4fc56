"""The one exception the adapter loader raises."""
from __future__ import annotations


class AdapterError(ValueError):
    """An adapter that cannot be served as it is. The message names the adapter, the offending
    tensor or config field, and what was expected; `problems` lists each problem on its own."""

    def __init__(self, message: str, problems: list[str] | None = None):
        super().__init__(message)
        self.problems = problems if problems is not None else [message]
