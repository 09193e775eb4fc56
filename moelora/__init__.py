"""moelora: serving MoE language models with many LoRA adapters at once.

`moelora.Engine` and `moelora.SamplingParams` load on first use, so `import moelora` (and the
`moelora` command) stays light."""


def __getattr__(name: str):
    if name == "Engine":
        from moelora.engine.engine import Engine
        return Engine
    if name == "SamplingParams":
        from moelora.engine.sampling_params import SamplingParams
        return SamplingParams
    raise AttributeError(f"module 'moelora' has no attribute {name!r}")
