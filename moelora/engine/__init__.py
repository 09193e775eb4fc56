"""The engine's public interface: what the server, the CLI and the demo use (design: the server talks to it only).

The names load on first use (PEP 562), so importing one engine module does not import all of them."""
from __future__ import annotations

import importlib

_MODULES = {
    "Engine": "engine", "EngineDead": "engine", "PromptError": "engine", "RequestFailed": "engine",
    "StepOutput": "stepper", "EngineConfig": "config", "MAX_LORA_RANK": "config",
    "SamplingParams": "sampling_params", "StructuredOutput": "sampling_params", "MAX_LOGPROBS": "sampling_params",
    "AdapterNameError": "lora_manager", "LoRAStats": "lora_manager", "RankShare": "lora_slots",
    "IncrementalDetokenizer": "detokenizer", "GrammarTrials": "grammar_trials", "TrialCancelled": "grammar_trials",
    "WorkerFailure": "workers", "node_ranks": "workers", "serves_engine": "workers",
}
__all__ = sorted(_MODULES)


def __getattr__(name: str) -> object:
    if name not in _MODULES:
        raise AttributeError(f"module 'moelora.engine' has no attribute {name!r}")
    return getattr(importlib.import_module(f"moelora.engine.{_MODULES[name]}"), name)


def __dir__() -> list[str]:
    return __all__
