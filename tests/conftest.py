"""Shared fixtures: tiny model directories (with a tokenizer) and a runner for the `specc` command.

SPECC_CACHE is deliberately left alone: the converted SmolLM2 model and the AOTInductor cache in
~/.cache/specc are shared between test sessions (rebuilding them costs minutes).
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # tests/tiny.py

# Words of the tiny tokenizer. Ids: 0 <s>, 1 </s> (the tiny models' bos/eos), 2 <unk>, then these.
# Fewer than 64 entries in all, so every id fits the tiny models' vocabulary of 64.
WORDS = ("the a of and to in is it that was for on are with as i his they be at one have this from or "
         "had by word but what some we can out other were all there when up use your how said an each "
         "she which do their time if will way man water day").split()
TINY_VOCAB = 64


def tiny_tokenizer():
    """A word-level PreTrainedTokenizerFast built offline; unknown words become <unk>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["<s>", "</s>", "<unk>"] + list(dict.fromkeys(WORDS)))}
    assert len(vocab) <= TINY_VOCAB
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece()  # joins words with spaces
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def save_tiny_model(path: Path, vocab: int = TINY_VOCAB, layers: int = 2, seed: int = 0,
                    tokenizer: bool = True) -> Path:
    from tiny import tiny_model

    tiny_model("llama", vocab=vocab, layers=layers, seed=seed).save_pretrained(path)
    if tokenizer:
        tiny_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A tiny random llama (vocab 64, 2 layers) saved as a Hugging Face directory with a tokenizer."""
    return save_tiny_model(tmp_path_factory.mktemp("models") / "tiny-llama")


@pytest.fixture(scope="session")
def tiny_model_dir_vocab80(tmp_path_factory) -> Path:
    """A tiny llama whose vocabulary (80) differs from tiny_model_dir's; no tokenizer."""
    return save_tiny_model(tmp_path_factory.mktemp("models") / "tiny-llama-v80", vocab=80, layers=1, seed=1,
                           tokenizer=False)


def cli_env() -> dict:
    env = dict(os.environ, TRANSFORMERS_OFFLINE="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               PYTHONUNBUFFERED="1")
    env.setdefault("OMP_NUM_THREADS", "1")  # tiny models; the tests run several CLIs side by side
    env.pop("SPECC_DEBUG", None)  # errors must be one line, as users see them
    return env


def run_specc(*args, cwd=None, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run `python -m specc ARGS...` as a real subprocess and capture its output as text."""
    # -P: the working directory (often the repository root) is not put on sys.path, as for an installed command.
    return subprocess.run([sys.executable, "-P", "-m", "specc", *map(str, args)], cwd=cwd, env=cli_env(),
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="session")
def specc_cli():
    """`specc_cli(*args, cwd=None)` -> CompletedProcess of the `specc` command."""
    return run_specc


def pytest_collection_modifyitems(config, items):
    """The SmolLM2 tests (minutes each) first: with several workers (`make test` runs two), a long
    test started last would leave the other workers idle at the end."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)  # stable: file order otherwise


@pytest.fixture(autouse=True)
def _threads_per_test(request):
    """Tiny models run fastest on one thread (two threads spin on 2 cores); SmolLM2 tests take this
    worker's share of the cores."""
    import torch

    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    share = max(1, (os.cpu_count() or 1) // workers)
    n = torch.get_num_threads()
    torch.set_num_threads(min(n, share) if request.node.get_closest_marker("slow") else 1)
    yield
    torch.set_num_threads(n)
