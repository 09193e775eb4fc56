"""The one exception the adapter loader raises."""
from __future__ import annotations

from pathlib import Path


class AdapterError(ValueError):
    """An adapter that cannot be served as it is. The message names the adapter, the offending
    tensor or config field, and what was expected; `problems` lists each problem on its own."""

    def __init__(self, message: str, problems: list[str] | None = None):
        super().__init__(message)
        self.problems = problems if problems is not None else [message]


def missing_file(directory: Path, name: str, what: str) -> AdapterError:
    """The error of `directory` (which should be `what`) without its file `name`: a path that does not exist, or is
    a file, says so, rather than that it lacks the file."""
    if not directory.exists():
        return AdapterError(f"{directory}: does not exist ({what} expected)")
    if not directory.is_dir():
        return AdapterError(f"{directory}: is a file, not {what}")
    return AdapterError(f"{directory}: no {name}")
