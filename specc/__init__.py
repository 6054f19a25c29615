"""specc: a compiler for lossless speculative decoding of Hugging Face causal LMs.

    path = specc.compile(model, drafter="ngram", tree="chain:4", backend="inductor", output_dir=...)
    path = specc.compile(model, specc.CompileConfig(drafter="ngram", output_dir=...))  # the same
    engine = specc.load(path)
    res = engine.generate("prompt", max_new_tokens=256)
"""
__version__ = "0.1.0"

from .errors import SpeccError  # noqa: E402

QUANT_CONFIGS = ("Int8WeightOnly", "Int4WeightOnly", "GGUFFile")
__all__ = ["compile", "build", "load", "CompileConfig", "Engine", "Result", "Stats", "SpeccError", *QUANT_CONFIGS,
           "__version__"]


def __getattr__(name):
    # Lazy: `specc --help` and argument errors should not pay for importing torch and transformers.
    if name in ("compile", "build", "load"):
        from . import compiler
        return getattr(compiler, name)
    if name == "CompileConfig":
        from .config import CompileConfig
        return CompileConfig
    if name in QUANT_CONFIGS:  # specc.compile(model, quant=specc.Int8WeightOnly(group_size=32))
        from . import quant
        return getattr(quant, name)
    if name in ("Engine", "Result", "Stats"):
        from . import runtime
        return getattr(runtime, name)
    raise AttributeError(f"module 'specc' has no attribute {name!r}")
