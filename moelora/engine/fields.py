"""`option`: a dataclass field that carries its own description, so the `moelora` command's flags,
built from EngineConfig's and SamplingParams' fields, document themselves."""
from __future__ import annotations

from dataclasses import MISSING, field
from typing import Any


def option(default: Any = MISSING, help: str = "", aliases: tuple[str, ...] = (), factory: Any = MISSING) -> Any:
    """A field with its one-line description (--help) and other spellings of its flag (vLLM's names
    where they differ from SGLang's)."""
    return field(default=default, default_factory=factory, metadata={"help": help, "aliases": aliases})
