"""specc's GGUF engine against llama.cpp on the same GGUF file and prompts, back to back (BENCHMARKS.md).

Plain greedy decoding of --max-new-tokens tokens (EOS ignored) on the first --limit prompts of each
set, chat template applied (the same text goes to both), 2 threads, --rounds times alternating which
runs first. Figure: decode tokens/s, prompt processing excluded on both sides (llama.cpp's "eval
time" line; specc's decode time, generate() minus prefill), median over prompts, then over rounds.

llama.cpp is built from source only when asked: --build DIR downloads the llama-cpp-python source
distribution from the package registry (it vendors llama.cpp's source), and builds llama.cpp's
`llama-completion` with cmake under DIR (several minutes on 2 cores); later runs pass
--llama-cpp DIR/llama.cpp/build. specc's engine (drafter none, --quant QUANT, inductor) is compiled
into --engines, or reused.

Usage: python examples/llama_cpp_compare.py (--build DIR | --llama-cpp BUILD_DIR) [--gguf FILE]
           [--quant gguf] [--limit 5] [--max-new-tokens 128] [--rounds 3] [--datasets humaneval,mt-bench]
           [--engines DIR] [--write BENCHMARKS.md] [--json]
"""
import argparse
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import specc
from specc import benchfile, harness
from specc.data import load_prompts
from specc.errors import SpeccError
from specc.models import default_gguf, quiet_libraries

EVAL = re.compile(r"\beval time =\s*([\d.]+) ms /\s*(\d+) runs")


def build_llama_cpp(root: Path) -> Path:
    """Download llama-cpp-python's sdist (pip, no dependencies) and build llama.cpp's llama-completion."""
    root.mkdir(parents=True, exist_ok=True)
    src = root / "llama.cpp"
    if not (src / "CMakeLists.txt").is_file():
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                        "llama-cpp-python", "-d", str(root)], check=True)
        sdist = sorted(root.glob("llama_cpp_python-*.tar.gz"))[-1]
        with tarfile.open(sdist) as tar:
            tar.extractall(root, filter="data")
        vendored = next(root.glob("llama_cpp_python-*/vendor/llama.cpp"))
        vendored.rename(src)
    build = src / "build"
    subprocess.run(["cmake", "-S", str(src), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF",
                    "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_SERVER=OFF", "-DBUILD_SHARED_LIBS=OFF"], check=True)
    subprocess.run(["cmake", "--build", str(build), "--target", "llama-completion", "-j", "2"], check=True)
    return build


def llama_decode(binary: Path, gguf: Path, text: str, n: int) -> float:
    """llama.cpp's decode tokens/s for one prompt (its own timing line)."""
    proc = subprocess.run([str(binary), "-m", str(gguf), "-p", text, "-n", str(n), "--temp", "0", "--ignore-eos",
                           "-t", "2", "-c", "2048", "--no-display-prompt", "-no-cnv"],
                          capture_output=True, text=True, timeout=600)
    found = EVAL.findall(proc.stderr + proc.stdout)
    if proc.returncode != 0 or not found:
        raise SpeccError(f"llama-completion failed (exit {proc.returncode}): {proc.stderr.strip()[-300:]}")
    ms, runs = found[-1]
    return int(runs) / (float(ms) / 1000)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    harness.bench_args(ap, limit=5, max_new_tokens=128, rounds=3)
    where = ap.add_mutually_exclusive_group(required=True)
    where.add_argument("--build", metavar="DIR", help="download and build llama.cpp under DIR first")
    where.add_argument("--llama-cpp", metavar="BUILD_DIR", help="an existing llama.cpp cmake build directory")
    ap.add_argument("--gguf", default=None, help="the GGUF file (default: the embedded SmolLM2 Q4_1)")
    ap.add_argument("--quant", default="gguf", help="specc's --quant for the same file (default gguf)")
    ap.add_argument("--datasets", default="humaneval,mt-bench")
    ap.add_argument("--engines", default="engines/llama-cpp-compare")
    args = ap.parse_args()
    build = build_llama_cpp(Path(args.build)) if args.build else Path(args.llama_cpp)
    binary = build / "bin" / "llama-completion"
    if not binary.is_file():
        raise SpeccError(f"{binary} does not exist; build llama.cpp with --build DIR first.")
    gguf = Path(args.gguf) if args.gguf else default_gguf()
    out = Path(args.engines) / f"{gguf.stem}-{args.quant}"
    if not (out / "specc.json").is_file():
        specc.compile(str(gguf) if args.gguf else None, drafter="none", backend="inductor", quant=args.quant,
                      modes="greedy", output_dir=out, progress=not args.json)
    engine = specc.load(out)
    figures, lines = [], []
    model = engine.manifest.target.name
    for dataset in args.datasets.split(","):
        texts = [engine.tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                                      add_generation_prompt=True)
                 for p in load_prompts(dataset, args.limit)]

        def specc_decode(text: str, n: int) -> float:  # decode tokens/s: one token a step, prefill excluded
            r = engine.generate(text, max_new_tokens=n, stop_at_eos=False)
            return r.stats.steps / (r.stats.wall_s - r.stats.prefill_s)

        arms = {"specc": lambda job: specc_decode(*job), "llama.cpp": lambda job: llama_decode(binary, gguf, *job)}
        res = harness.paired(arms, args.rounds, items=[(text, args.max_new_tokens) for text in texts],
                             warm=(texts[0], 8))  # warm-up, both sides
        med = {who: harness.median_of_rounds(res[who]) for who in arms}
        lines += [f"**{dataset}** ({len(texts)} prompts): specc {med['specc']:.1f} decode tokens/s, llama.cpp "
                  f"{med['llama.cpp']:.1f}: specc / llama.cpp = {med['specc'] / med['llama.cpp']:.2f}x.", ""]
        for who in med:
            cfg = (f"specc plain decoding, {gguf.name} (--quant {args.quant}, inductor), decode only" if who == "specc"
                   else f"llama.cpp plain decoding, {gguf.name}, decode only")
            figures.append(benchfile.figure(cfg, dataset, model=model, tokens_per_s=med[who],
                                            new_tokens=args.max_new_tokens, prompts=len(texts),
                                            note="decode tokens/s, prompt processing excluded"))
    setup = (f"Plain greedy decoding from {gguf.name}: specc's engine (--quant {args.quant}, inductor) and llama.cpp's "
             f"llama-completion (built from the source vendored in llama-cpp-python, 2 threads), back to back on the "
             f"first {args.limit} prompts of each set (chat template, the same text) x {args.max_new_tokens} new tokens "
             f"x {args.rounds} rounds, order alternated, EOS ignored; decode tokens/s excludes prompt processing.")
    return harness.record(args, "specc and llama.cpp on one GGUF", setup, "\n".join(lines), figures)


if __name__ == "__main__":
    quiet_libraries()
    try:
        sys.exit(main())
    except SpeccError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except subprocess.CalledProcessError as e:  # the download or the cmake build of llama.cpp
        print(f"error: {' '.join(map(str, e.cmd[:3]))} ... failed with exit code {e.returncode}.", file=sys.stderr)
        sys.exit(2)
