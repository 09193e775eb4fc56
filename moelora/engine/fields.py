"""`option`: a dataclass field that carries its own description, so the `moelora` command's flags,
built from EngineConfig's and SamplingParams' fields, document themselves; `keyword_aliases`: the flags' other
spellings as constructor keywords too."""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import MISSING, field
from typing import Any


def option(default: Any = MISSING, help: str = "", aliases: tuple[str, ...] = (), factory: Any = MISSING) -> Any:
    """A field with its one-line description (--help) and other spellings of its flag (vLLM's names
    where they differ from SGLang's)."""
    return field(default=default, default_factory=factory, metadata={"help": help, "aliases": aliases})


def keyword_aliases(cls: type) -> type:
    """A dataclass of `option` fields whose constructor takes every alias of a field's flag as a keyword too
    (--tensor-parallel-size: tensor_parallel_size), so code written for vLLM's keyword names runs as command lines
    written for its flags do. A field given under two spellings with different values is a ValueError: neither
    can be assumed to be the one meant."""
    spellings = {alias.lstrip("-").replace("-", "_"): f.name
                 for f in dataclasses.fields(cls) for alias in f.metadata["aliases"]}
    init = cls.__init__

    @functools.wraps(init)
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        spelt = {name: name for name in kwargs}
        for key in [k for k in kwargs if k in spellings]:
            name, value = spellings[key], kwargs.pop(key)
            if name in kwargs and kwargs[name] != value:
                raise ValueError(f"{cls.__name__}.{name} is given twice, as {spelt[name]}={kwargs[name]!r} and as "
                                 f"{key}={value!r}: give one")
            kwargs[name], spelt[name] = value, key
        init(self, *args, **kwargs)

    cls.__init__ = __init__
    return cls
