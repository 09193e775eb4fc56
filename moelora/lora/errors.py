"""The one exception the adapter loader raises."""
from __future__ import annotations

from pathlib import Path

# an adapter's JSON files (adapter_config.json, added_tokens.json) are kilobytes; one larger is read no further than
# this: read whole, a file of gigabytes took the server's memory with it
MAX_JSON_BYTES = 16 << 20


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


def read_json_bytes(path: Path) -> bytes:
    """The bytes of one of an adapter's JSON files; AdapterError past MAX_JSON_BYTES (OSError as reading's)."""
    with path.open("rb") as f:
        data = f.read(MAX_JSON_BYTES + 1)
    if len(data) > MAX_JSON_BYTES:
        raise AdapterError(f"{path}: more than {MAX_JSON_BYTES >> 20} MiB, not an adapter's JSON file")
    return data
