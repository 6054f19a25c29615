"""specc: a compiler for lossless speculative decoding of Hugging Face causal LMs."""
__version__ = "0.1.0"

from .errors import SpeccError  # noqa: E402
from .compiler import compile, load  # noqa: E402,F401
from .runtime import Engine, Result, Stats  # noqa: E402,F401

__all__ = ["compile", "load", "Engine", "Result", "Stats", "SpeccError", "__version__"]
