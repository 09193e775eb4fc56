"""moelora: serving MoE language models with many LoRA adapters at once.

`moelora.Engine` and `moelora.SamplingParams` load on first use, so `import moelora` (and the
`moelora` command) stays light."""


def __getattr__(name: str):
    if name in ("Engine", "SamplingParams"):
        import moelora.engine
        return getattr(moelora.engine, name)
    raise AttributeError(f"module 'moelora' has no attribute {name!r}")
