"""The `specc` command, run as a real subprocess on tiny random models with the eager backend.

Each CLI call pays seconds of imports (torch, transformers; more to compile or load an engine),
and the tests mostly wait on subprocesses, so every test's CLI work is declared up front as a *job*
keyed by the test's name. A session fixture starts the jobs of the selected tests on a small thread pool at
once (the engines first, compiled once and shared); each test then checks its job's result.
Run one test alone (`-k`) and only its jobs, and the engines they need, run. Most refusals of bad
compile options run `main()` in the test's own process instead (the same code after the imports).
"""
from __future__ import annotations

import json
import os
import re
import shutil
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest

# One worker runs all of this module (make test runs two): the `jobs` fixture starts every test's job at once.
pytestmark = pytest.mark.xdist_group("cli")

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
# Greedy output of the tiny model from this prompt includes ids 60-63, which have no token in the
# tiny tokenizer (like the padded vocabularies of real models): they decode to nothing, so
# re-encoding the output text does not give the tokens back.
PROMPT = "the and the of"
BENCH_PROMPTS = ["the and the of the and the of the and", "it is the way of the water", "what is this"]


# -- helpers -----------------------------------------------------------------------------------

def leftovers(out: Path) -> list[str]:
    """Staging or trash directories that a compile into `out` may leave in its parent."""
    return sorted(p.name for p in out.parent.glob(f".{out.name}.*") if ".tmp-" in p.name or ".old-" in p.name)


def assert_user_error(proc, *needles: str, code: int = 2) -> str:
    """Exit code `code`, no traceback, nothing on stdout, one `specc: error:` sentence on stderr naming `needles`."""
    both = proc.stdout + proc.stderr
    assert "Traceback" not in both, both
    assert proc.returncode == code, f"exit {proc.returncode}\nstdout: {proc.stdout}\nstderr: {proc.stderr}"
    assert proc.stdout == "", proc.stdout
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, f"expected one line on stderr, got {len(lines)}:\n{proc.stderr}"
    line = lines[0]
    assert line.startswith("specc: error: "), line
    assert line.rstrip().endswith("."), f"not a sentence: {line}"
    for needle in needles:
        assert needle.lower() in line.lower(), f"{needle!r} not in: {line}"
    return line


def assert_ok(proc):
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stderr
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout: {proc.stdout}\nstderr: {proc.stderr}"


def manifest(engine: Path) -> dict:
    return json.loads((engine / "specc.json").read_text())


# -- jobs --------------------------------------------------------------------------------------

@dataclass
class Ctx:
    """What a job sees: the tiny model directories, its own scratch directory, and the engines."""
    model: Path  # tiny llama, vocab 64, with a tokenizer
    model80: Path  # tiny llama, vocab 80
    root: Path
    futures: dict
    cli: Callable  # conftest's specc_cli (a subprocess), or specc_main (this process)
    key: str = ""

    @property
    def tmp(self) -> Path:
        d = self.root / "jobs" / self.key.replace("[", "-").replace("]", "").replace("/", "_")
        d.mkdir(parents=True, exist_ok=True)
        return d

    def engine(self, name: str) -> Path:
        proc = self.futures[name].result()
        if proc.returncode != 0:
            raise RuntimeError(f"compiling engine {name} failed:\n{proc.stderr}")
        return engine_dir(self.root, name)

    def specc(self, *args):
        return self.cli(*args, cwd=self.tmp)


def engine_dir(root: Path, name: str) -> Path:
    return root / "engines" / name


JOBS: dict[str, tuple[Callable[[Ctx], object], tuple[str, ...], bool]] = {}


def job(key: str, *deps: str, slow: bool = False):
    """Register `fn(ctx)` as the CLI work of test `key` (a test's node name); deps are engine jobs.

    Engines start first (so a job waiting on one never waits for a queued one), then slow jobs
    (those that load an engine), then the rest, in registration order.
    """
    def register(fn):
        assert key not in JOBS, key
        JOBS[key] = (fn, deps, slow)
        return fn
    return register


@job("ngram")
def _(c: Ctx):
    return c.specc("compile", c.model, "--drafter", "ngram", "--tree", "chain:3", "--backend", "eager",
                   "--dump-ir", c.root / "ir", "-o", engine_dir(c.root, "ngram"))


@job("test_compile_json")
def _(c: Ctx):
    return c.specc("compile", c.model, "--drafter", "ngram", "--tree", "chain:2", "--backend", "eager", "--max-len",
                   "32", "--prefill-chunk", "4", "--modes", "greedy", "--json", "-o", c.root / "compile-json")


def test_compile_json(result, jobs):
    """`specc compile --json`: one JSON line, with the compile's time split by phase and by graph."""
    assert_ok(result)
    lines = result.stdout.splitlines()
    assert len(lines) == 1, result.stdout
    out = json.loads(lines[0])
    split = out["compile_split"]
    assert set(split["graphs"]) == set(out["graphs"]) == {"prefill_greedy", "plain_greedy", "step_greedy"}
    assert {"load", "capture", "lower", "save"} <= set(split["phases"])
    assert all(g["capture"] > 0 for g in split["graphs"].values())
    assert 0 < sum(split["phases"].values()) <= split["total_s"] + 0.1
    assert split == json.loads((jobs.root / "compile-json" / "specc.json").read_text())["compile_split"]


@job("short")
def _(c: Ctx):
    return c.specc("compile", c.model, "--max-len", "16", "--prefill-chunk", "4", "--backend", "eager",
                   "-o", engine_dir(c.root, "short"))


# Session scope: started once per process whatever order a pytest-xdist worker receives this
# module's tests in (a module fixture can be torn down and set up again between them).
@pytest.fixture(scope="session")
def jobs(request, tiny_model_dir, tiny_model_dir_vocab80, tmp_path_factory, specc_cli):
    """Start the jobs of this module's selected tests (and the engines they need) on a thread pool."""
    wanted = {it.name for it in request.session.items if it.module.__name__ == __name__}
    needed = set()
    for key in wanted & set(JOBS):
        needed |= {key, *JOBS[key][1]}
    engines = {d for _, deps, _ in JOBS.values() for d in deps}
    order = sorted(JOBS, key=lambda k: (k not in engines, not JOBS[k][2]))  # stable: registration order within
    futures: dict = {}
    ctx = Ctx(tiny_model_dir, tiny_model_dir_vocab80, tmp_path_factory.mktemp("cli"), futures, specc_cli)
    pool = ThreadPoolExecutor(max_workers=max(2, min(4, os.cpu_count() or 2)))
    for key in order:
        if key in needed:
            futures[key] = pool.submit(JOBS[key][0], Ctx(ctx.model, ctx.model80, ctx.root, futures, specc_cli, key))
    yield ctx
    pool.shutdown(wait=True, cancel_futures=True)


@pytest.fixture
def result(request, jobs):
    """The result of this test's job (the job's exception, if it raised, is raised here)."""
    return jobs.futures[request.node.name].result()


# -- bad input: one line, exit 2, nothing half-written ------------------------------------------

def _json_tree_without_prefix(c: Ctx) -> str:
    f = c.tmp / "tree.json"
    f.write_text(json.dumps({"paths": [[0], [0, 0], [1, 0]]}))  # [1, 0] without [1]
    return str(f)


def _mtp_checkpoint(c: Ctx, modules: int = 1, hidden: int | None = None) -> str:
    """MTP heads (DeepSeek-V3 layout) for the tiny model, or for a tiny model of another hidden size."""
    from transformers import AutoModelForCausalLM

    from specc.drafters.mtp.model import build_heads, save_deepseek_v3
    from tiny import tiny_model

    tgt = tiny_model("llama", hidden=hidden) if hidden else AutoModelForCausalLM.from_pretrained(c.model)
    return str(save_deepseek_v3(build_heads(tgt, num_modules=modules), c.tmp / "mtp", tgt))


COMPILE_ERRORS = {  # id: (argv before -o, words the message must contain)
    "missing-model": (lambda c: ["/nonexistent/model"], ["/nonexistent/model", "does not exist"]),
    "tree-chain-x": (lambda c: [c.model, "--drafter", "ngram", "--tree", "chain:x"], ["chain:x", "malformed"]),
    "tree-topk-one-number": (lambda c: [c.model, "--drafter", "ngram", "--tree", "topk:2"], ["topk:2", "malformed"]),
    "tree-unknown-kind": (lambda c: [c.model, "--drafter", "ngram", "--tree", "foo:3"], ["foo:3", "malformed"]),
    "tree-json-missing-prefix": (lambda c: [c.model, "--drafter", "ngram", "--tree", _json_tree_without_prefix(c)],
                                 ["tree.json", "prefix"]),
    "unknown-backend": (lambda c: [c.model, "--backend", "cuda-magic"], ["--backend", "cuda-magic"]),
    "tensorrt-on-cpu": (lambda c: [c.model, "--backend", "tensorrt", "--device", "cpu"], ["TensorRT", "--device cuda"]),
    "onnx-bfloat16": (lambda c: [c.model, "--backend", "onnx", "--dtype", "bfloat16"], ["onnx", "float32"]),
    "dspark-without-path": (lambda c: [c.model, "--drafter", "dspark"], ["dspark", "--drafter-path"]),
    "mtp-without-path": (lambda c: [c.model, "--drafter", "mtp"], ["mtp", "--drafter-path"]),
    "draft-model-tree-not-chain": (lambda c: [c.model, "--drafter", "draft-model", "--drafter-layers", "1",
                                              "--tree", "topk:2,2"], ["draft-model", "chain:K"]),
    "sequoia-without-drafter": (lambda c: [c.model, "--tree", "sequoia:4"], ["sequoia:4", "--drafter ngram, mtp"]),
    "mtp-two-modules": (lambda c: [c.model, "--drafter", "mtp", "--drafter-path", _mtp_checkpoint(c, modules=2)],
                        ["one module", "2 modules"]),  # loads the target
    "mtp-hidden-mismatch": (lambda c: [c.model, "--drafter", "mtp", "--drafter-path", _mtp_checkpoint(c, hidden=48)],
                            ["hidden size 32", "another model"]),  # loads the target
    "dflash-without-path": (lambda c: [c.model, "--drafter", "dflash"], ["dflash", "--drafter-path"]),
    "dflash-path-not-dflash": (lambda c: [c.model, "--drafter", "dflash", "--drafter-path", c.model],
                               ["not a DFlash drafter"]),
    "tree-without-drafter": (lambda c: [c.model, "--drafter", "none", "--tree", "chain:3"], ["chain:3", "drafter"]),
    "device-cuda-here": (lambda c: [c.model, "--device", "cuda"], ["--device cuda", "no"]),  # a CPU-only machine
    "device-unknown": (lambda c: [c.model, "--device", "tpu"], ["--device", "tpu"]),
    "children-sampled-ngram": (lambda c: [c.model, "--drafter", "ngram", "--children", "sampled"],
                               ["--children sampled", "--drafter mtp or dflash"]),
    "children-unknown": (lambda c: [c.model, "--drafter", "ngram", "--children", "random"], ["--children", "random"]),
    "max-len-0": (lambda c: [c.model, "--max-len", "0"], ["--max-len"]),
    "max-len-not-int": (lambda c: [c.model, "--max-len", "many"], ["--max-len"]),
    "drafter-vocab-mismatch": (lambda c: [c.model, "--drafter", "draft-model", "--drafter-path", c.model80,
                                          "--tree", "chain:2"], ["vocabulary", "80", "64"]),  # loads both models
}


# As real subprocesses: a plain refusal, one from the argument parser, and two that load models first.
# The other cases go through the same `main()` in this process: each subprocess pays seconds of
# imports (torch, transformers), and what differs between the cases is only the check that refuses.
SUBPROCESS_CASES = ("missing-model", "max-len-not-int", "mtp-hidden-mismatch", "drafter-vocab-mismatch")


def _compile_error_job(argv):
    return lambda c: (c.tmp / "out", c.specc("compile", *argv(c), "-o", c.tmp / "out"))


for _id in SUBPROCESS_CASES:
    job(f"test_compile_bad_input[{_id}]", slow=_id != "missing-model")(_compile_error_job(COMPILE_ERRORS[_id][0]))


def check_compile_refusal(case: str, out: Path, proc) -> None:
    assert_user_error(proc, *COMPILE_ERRORS[case][1])
    assert not out.exists()
    assert leftovers(out) == []


@pytest.mark.parametrize("case", SUBPROCESS_CASES)
def test_compile_bad_input(result, case):
    check_compile_refusal(case, *result)


@dataclass
class Finished:
    """What a CompletedProcess tells (exit code, stdout, stderr), from `main()` run in this process."""
    returncode: int
    stdout: str
    stderr: str


def specc_main(*args, cwd=None) -> Finished:
    """`specc ARGS` through `specc.cli.main` in this process, its output captured (the test's thread only).
    `cwd` is accepted for Ctx.specc's call and ignored: the jobs pass absolute paths."""
    import contextlib
    import io

    from specc.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main([str(a) for a in args])
        except SystemExit as e:  # argparse's own exits (--help)
            code = e.code
    return Finished(code, out.getvalue(), err.getvalue())


@pytest.mark.parametrize("case", [c for c in COMPILE_ERRORS if c not in SUBPROCESS_CASES])
def test_compile_bad_input_in_process(case, tiny_model_dir, tiny_model_dir_vocab80, tmp_path, monkeypatch):
    monkeypatch.delenv("SPECC_DEBUG", raising=False)  # errors as users see them
    c = Ctx(tiny_model_dir, tiny_model_dir_vocab80, tmp_path, {}, specc_main, case)
    check_compile_refusal(case, *_compile_error_job(COMPILE_ERRORS[case][0])(c))


def _refuse_overwrite_job(kind):
    def run(c: Ctx):
        out = c.tmp / "precious"
        if kind == "file":
            out.write_text("not an engine")
        else:
            out.mkdir()
            (out / "notes.txt").write_text("not an engine")
        return out, c.specc("compile", c.model, "--backend", "eager", "-o", out)
    return run


for _kind in ("file", "dir"):
    job(f"test_compile_refuses_to_overwrite_other_content[{_kind}]")(_refuse_overwrite_job(_kind))


@pytest.mark.parametrize("kind", ["file", "dir"])
def test_compile_refuses_to_overwrite_other_content(result, kind):
    out, proc = result
    assert_user_error(proc, str(out), "refusing")
    if kind == "file":
        assert out.read_text() == "not an engine"
    else:
        assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]
        assert (out / "notes.txt").read_text() == "not an engine"
    assert leftovers(out) == []


@job("test_train_refuses_a_bad_dspark_option")
def _(c: Ctx):
    return c.tmp / "x", c.specc("train", "--drafter", "dspark", "--markov-rank", "0", "-o", c.tmp / "x")


def test_train_refuses_a_bad_dspark_option(result):
    out, proc = result
    assert_user_error(proc, "--markov-rank", "at least 1")
    assert not out.exists()


@job("test_run_on_a_directory_that_is_not_an_engine")
def _(c: Ctx):
    return c.specc("run", c.model, "--prompt", "the")


def test_run_on_a_directory_that_is_not_an_engine(result):
    assert_user_error(result, "not a specc engine")


@job("test_run_on_a_device_this_machine_lacks", "short")
def _(c: Ctx):
    return c.specc("run", c.engine("short"), "--prompt", "the", "--device", "cuda:7")


def test_run_on_a_device_this_machine_lacks(result):
    import torch

    if torch.cuda.device_count() > 7:
        pytest.skip("this machine has a cuda:7")
    assert_user_error(result, "--device cuda:7")


@job("test_run_prompt_longer_than_max_len", "short", slow=True)
def _(c: Ctx):
    prompt = c.tmp / "long.txt"
    prompt.write_text(" ".join(["the water"] * 15))  # 30 known words: 30 tokens
    return c.specc("run", c.engine("short"), "--prompt-file", prompt, "--max-new-tokens", "4")


def test_run_prompt_longer_than_max_len(result):
    assert_user_error(result, "30 tokens", "--max-len 16")


MODIFIED_FILES = ["target/config.json", "target/model.safetensors"]


def _modified_engine_job(rel):
    def run(c: Ctx):
        engine = c.tmp / "engine"
        shutil.copytree(c.engine("short"), engine)
        assert rel in manifest(engine)["files"], f"{rel} has no recorded sha256"
        with open(engine / rel, "ab") as f:
            f.write(b" ")
        return c.specc("run", engine, "--prompt", "the", "--max-new-tokens", "2")
    return run


for _rel in MODIFIED_FILES:
    job(f"test_run_refuses_a_modified_engine[{_rel}]", "short")(_modified_engine_job(_rel))


@pytest.mark.parametrize("rel", MODIFIED_FILES)
def test_run_refuses_a_modified_engine(result, rel):
    assert_user_error(result, rel, "sha256")


# -- happy paths -------------------------------------------------------------------------------

@job("test_compile_output_and_manifest", "ngram")
def _(c: Ctx):
    return c.futures["ngram"].result()


def test_compile_output_and_manifest(result, jobs):
    assert_ok(result)
    engine = engine_dir(jobs.root, "ngram")
    assert f"-> {engine}" in result.stdout
    m = manifest(engine)
    assert m["backend"] == "eager"
    assert m["drafter"]["kind"] == "ngram"
    assert m["tree"]["spec"] == "chain:3"
    assert m["modes"] == ["greedy", "sample", "top_p"]  # the default: every mode
    # the default prefill chunks, 128 and 32: a chunk graph each, timed at compile with the one-token graph
    assert set(m["graphs"]) == {f"{g}_{mode}" for g in ("prefill128", "prefill", "plain", "step") for mode in m["modes"]}
    assert (m["prefill_chunk"], m["prefill_chunks"], sorted(m["prefill_ms"])) == (32, [128, 32], ["1", "128", "32"])
    assert all(m["graphs"][f"step_{mode}"]["tokens"] == 4 for mode in m["modes"])
    on_disk = {str(p.relative_to(engine)) for p in engine.rglob("*") if p.is_file()}
    assert on_disk == set(m["files"]) | {"specc.json"}
    assert not any(f.endswith((".bin", ".pt", ".pkl", ".pickle")) for f in on_disk)
    assert leftovers(engine) == []


@job("test_dump_ir_writes_one_file_per_pass_per_graph", "ngram")
def _(c: Ctx):
    return c.engine("ngram")


def test_dump_ir_writes_one_file_per_pass_per_graph(result, jobs):
    m = manifest(result)
    expected = {f"{name}.{i:02d}-{p}.txt" for name, g in m["graphs"].items()
                for i, p in enumerate(["capture"] + g["passes"])}
    written = {p.name for p in (jobs.root / "ir").iterdir()}
    assert written == expected
    for name in expected:
        assert (jobs.root / "ir" / name).stat().st_size > 0


@job("test_run_json", "ngram", slow=True)
def _(c: Ctx):
    return c.specc("run", c.engine("ngram"), "--prompt", PROMPT, "--max-new-tokens", "20", "--json", "--device", "cpu")


def test_run_json(result):
    assert_ok(result)
    lines = result.stdout.splitlines()
    assert len(lines) == 1, result.stdout
    res = json.loads(lines[0])
    assert {"text", "token_ids", "stats"} <= set(res)
    stats = res["stats"]
    assert {"new_tokens", "steps", "tau", "tokens_per_s", "wall_s"} <= set(stats)
    ids = res["token_ids"]
    assert isinstance(res["text"], str)
    assert ids and all(isinstance(t, int) and 0 <= t < 64 for t in ids)
    assert stats["new_tokens"] == len(ids) and 1 <= len(ids) <= 20
    assert stats["steps"] >= 1 and stats["wall_s"] > 0 and stats["tokens_per_s"] > 0
    assert stats["tau"] == pytest.approx((len(ids) - 1) / stats["steps"], abs=1e-3)
    assert stats["tau"] >= 1.0  # every verify pass commits at least one token


@job("test_inspect_passes_and_tree_png", "ngram")
def _(c: Ctx):
    png = c.tmp / "tree.png"
    return png, c.specc("inspect", c.engine("ngram"), "--passes", "--tree-png", png)


def test_inspect_passes_and_tree_png(result):
    png, proc = result
    assert_ok(proc)
    for word in ("chain:3", "prefill", "plain", "step", "capture", "tree_inputs", "accept", "compact_kv",
                 "sample_last"):
        assert word in proc.stdout, word
    assert re.search(r"^compile +compiled in \d+ s: .*capture \d+ s", proc.stdout, re.M), proc.stdout
    assert png.read_bytes()[:8] == PNG_MAGIC


@job("test_inspect_sm90", "ngram")
def _(c: Ctx):
    return c.specc("inspect", c.engine("ngram"), "--sm90", "--json")


def test_inspect_sm90(result):
    """The engine's decode-step kernels built for the H100 (sm_90a) without a GPU, or one sentence why not."""
    from specc.kernels.hopper_build import available

    if available() is not None:
        assert_user_error(result, "sm_90a")
        return
    assert_ok(result)
    report = json.loads(result.stdout)
    assert report["tree_sizes"] == [1, 4] and report["shape"]["vocab"] == 64
    kernels = {r["kernel"] for r in report["rows"]}
    assert {"_tree_attention_kernel", "_rows_linear_kernel", "_greedy_walk_kernel", "_compact_kv_kernel"} <= kernels
    assert all(r["ok"] and not r["problems"] for r in report["rows"])


@job("test_recompile_replaces_the_engine", "short", slow=True)
def _(c: Ctx):
    # Compile into an existing engine directory: a copy of "short" plus a stray file.
    target = c.tmp / "engine"
    shutil.copytree(c.engine("short"), target)
    (target / "stray.txt").write_text("left over from an earlier engine")
    return target, c.specc("compile", c.model, "--max-len", "12", "--prefill-chunk", "4", "--backend", "eager",
                           "-o", target)


def test_recompile_replaces_the_engine(result):
    engine, proc = result
    assert_ok(proc)
    m = manifest(engine)
    assert m["max_len"] == 12  # the old engine had 16
    assert not (engine / "stray.txt").exists()
    assert sorted(p.name for p in engine.parent.iterdir()) == ["engine"]  # no staging or trash left


@job("test_run_stream", "ngram", slow=True)
def _(c: Ctx):
    return c.specc("run", c.engine("ngram"), "--prompt", PROMPT, "--max-new-tokens", "20", "--stream")


def test_run_stream(result, jobs):
    assert_ok(result)
    assert result.stdout.endswith("\n")
    summary = result.stderr.splitlines()[-1] if result.stderr else ""  # e.g. "[19 steps, tau 1.00, 0.07 s]"
    found = re.search(r"(\d+) steps", summary), re.search(r"tau ([0-9.]+)", summary)
    assert all(found), f"no steps and tau in the summary on stderr: {result.stderr!r}"
    steps, tau = int(found[0][1]), float(found[1][1])
    assert tau >= 1.0, f"every verify pass commits at least one token, yet --stream reports tau {tau}"
    if "test_run_json" in jobs.futures:
        # Greedy and the same prompt: the same text (then a newline), steps and tau as --json.
        res = json.loads(jobs.futures["test_run_json"].result().stdout)
        assert result.stdout == res["text"] + "\n"
        assert steps == res["stats"]["steps"]
        assert tau == pytest.approx(res["stats"]["tau"], abs=0.006)


@job("test_bench", "ngram", slow=True)
def _(c: Ctx):
    data = c.tmp / "prompts.jsonl"
    data.write_text("\n".join(json.dumps({"prompt": p}) for p in BENCH_PROMPTS) + "\n")
    plot, md = c.tmp / "bench.png", c.tmp / "B.md"
    return plot, md, c.specc("bench", c.engine("ngram"), "--dataset", data, "--limit", "2", "--max-new-tokens", "8",
                             "--baseline", "both", "--json", "--plot", plot, "--write", md, "--device", "cpu")


def test_bench(result):
    plot, md, proc = result
    assert_ok(proc)
    assert plot.read_bytes()[:8] == PNG_MAGIC
    table = md.read_text()
    assert "| method |" in table and "HF generate()" in table
    try:
        report = json.loads(proc.stdout)
    except ValueError:
        pytest.fail(f"`specc bench --json` stdout is not one JSON object:\n{proc.stdout}")
    assert report["prompts"] == 2 and report["max_new_tokens"] == 8 and report["device"] == "cpu"
    rows = {r["method"]: r for r in report["rows"]}
    assert set(rows) == {"speculative", "ar", "hf"}
    for r in rows.values():
        assert r["prompts"] == 2 and r["new_tokens"] == 16 and r["tokens_per_s"] > 0
    assert report["greedy_identical_to_ar"] == "2/2"
