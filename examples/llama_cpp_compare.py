"""specc's GGUF engine against llama.cpp on the same GGUF file and prompts, back to back (BENCHMARKS.md).

Plain greedy decoding of --max-new-tokens tokens (EOS ignored) on the first --limit prompts of each
set, chat template applied (the same text goes to both), 2 threads, --rounds times alternating which
runs first. Figure: decode tokens/s, prompt processing excluded on both sides (llama.cpp's "eval
time" line; specc's decode time, generate() minus prefill), median over prompts, then over rounds.

Best against best: --speculative DIR adds a specc engine of the same file with a drafter (compiled
beforehand with `specc compile FILE --quant gguf --drafter ...`), and --lookup N adds llama.cpp's own
speculative decoding, `llama-lookup` (prompt lookup, N drafts a step; its "decoded ... tokens in ...
seconds" line). Each dataset's line then gives specc's best over llama.cpp's best, and the run checks
that the speculative engine's greedy tokens are the plain engine's on every prompt (it fails if not).

llama.cpp is built from source only when asked: --build DIR downloads the llama-cpp-python source
distribution from the package registry (it vendors llama.cpp's source), and builds llama.cpp's
`llama-completion` and `llama-lookup` with cmake under DIR (several minutes on 2 cores); later runs pass
--llama-cpp DIR/llama.cpp/build. specc's engine (drafter none, --quant QUANT, inductor) is compiled
into --engines, or reused.

Usage: python examples/llama_cpp_compare.py (--build DIR | --llama-cpp BUILD_DIR) [--gguf FILE]
           [--quant gguf] [--limit 5] [--max-new-tokens 128] [--rounds 3] [--datasets humaneval,mt-bench]
           [--engines DIR] [--speculative ENGINE_DIR] [--lookup 8] [--model NAME] [--write BENCHMARKS.md] [--json]
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
DECODED = re.compile(r"\bdecoded\s+(\d+) tokens in\s+([\d.]+) seconds")  # llama-lookup's line


def build_llama_cpp(root: Path) -> Path:
    """Download llama-cpp-python's sdist (pip, no dependencies) and build llama.cpp's llama-completion and
    llama-lookup."""
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
    subprocess.run(["cmake", "--build", str(build), "--target", "llama-completion", "llama-lookup", "-j", "2"], check=True)
    return build


def llama_decode(binary: Path, gguf: Path, text: str, n: int, drafts: int = 0) -> float:
    """llama.cpp's decode tokens/s for one prompt (its own timing line): llama-completion, or with `drafts`
    llama-lookup drafting that many tokens a step."""
    common = ["-m", str(gguf), "-p", text, "-n", str(n), "--temp", "0", "--ignore-eos", "-t", "2", "-c", "2048"]
    extra = ["--spec-draft-n-max", str(drafts)] if drafts else ["--no-display-prompt", "-no-cnv"]
    proc = subprocess.run([str(binary), *common, *extra], capture_output=True, text=True, timeout=600)
    found = (DECODED if drafts else EVAL).findall(proc.stderr + proc.stdout)
    if proc.returncode != 0 or not found:
        raise SpeccError(f"{binary.name} failed (exit {proc.returncode}): {proc.stderr.strip()[-300:]}")
    if drafts:
        tokens, seconds = found[-1]
        return int(tokens) / float(seconds)
    ms, runs = found[-1]
    return int(runs) / (float(ms) / 1000)


def drafter_label(engine) -> str:
    """How a speculative engine drafts, for its figure: drafter, tree, adaptive."""
    m = engine.manifest
    return f"{m.drafter['kind']} {m.tree['spec']}{' adaptive' if m.adaptive else ''}"


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
    ap.add_argument("--speculative", metavar="ENGINE_DIR", default=None,
                    help="also time this specc engine of the same file, compiled with a drafter")
    ap.add_argument("--lookup", metavar="N", type=int, default=0,
                    help="also time llama.cpp's llama-lookup with N drafts a step (0: not)")
    ap.add_argument("--model", default=None,
                    help="the model's name in the figures (default: the engine's target name, the file's stem)")
    args = ap.parse_args()
    if args.lookup < 0:
        raise SpeccError(f"--lookup takes a number of drafts a step, 0 or more (got {args.lookup}).")
    build = build_llama_cpp(Path(args.build)) if args.build else Path(args.llama_cpp)
    binary, lookup = build / "bin" / "llama-completion", build / "bin" / "llama-lookup"
    for exe in [binary] + ([lookup] if args.lookup else []):
        if not exe.is_file():
            raise SpeccError(f"{exe} does not exist; build llama.cpp with --build DIR first.")
    gguf = Path(args.gguf) if args.gguf else default_gguf()
    out = Path(args.engines) / f"{gguf.stem}-{args.quant}"
    if not (out / "specc.json").is_file():
        specc.compile(str(gguf) if args.gguf else None, drafter="none", backend="inductor", quant=args.quant,
                      modes="greedy", output_dir=out, progress=not args.json)
    engine = specc.load(out)
    spec = specc.load(args.speculative) if args.speculative else None
    if spec is not None and (spec.manifest.drafter["kind"] == "none" or spec.manifest.quant != engine.manifest.quant
                             or spec.manifest.target != engine.manifest.target):
        raise SpeccError(f"{args.speculative} is not a speculative engine of {gguf.name} with --quant {args.quant}; "
                         f"compile one with `specc compile {gguf} --quant {args.quant} --drafter ngram`.")
    figures, lines = [], []
    model = args.model or engine.manifest.target.name
    for dataset in args.datasets.split(","):
        texts = [engine.tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                                      add_generation_prompt=True)
                 for p in load_prompts(dataset, args.limit)]

        taus = []
        if spec is not None:  # lossless: the speculative engine's greedy tokens are the plain engine's
            for text in texts:
                if (spec.generate(text, max_new_tokens=args.max_new_tokens, stop_at_eos=False).token_ids
                        != engine.generate(text, max_new_tokens=args.max_new_tokens, stop_at_eos=False).token_ids):
                    raise SpeccError(f"{args.speculative}'s greedy tokens differ from plain decoding's on a {dataset} "
                                     f"prompt: a lossless speculative engine must give the same.")

        def specc_decode(eng, text: str, n: int) -> float:
            """Decode tokens/s: the tokens after the prefill's first one over the time after prefill."""
            r = eng.generate(text, max_new_tokens=n, stop_at_eos=False)
            if eng is spec:
                taus.append(r.stats.tau)
            return (r.stats.new_tokens - 1) / (r.stats.wall_s - r.stats.prefill_s)

        arms = {"specc": lambda job: specc_decode(engine, *job),
                "llama.cpp": lambda job: llama_decode(binary, gguf, *job)}
        if spec is not None:
            arms["specc speculative"] = lambda job: specc_decode(spec, *job)
        if args.lookup:
            arms["llama.cpp lookup"] = lambda job: llama_decode(lookup, gguf, *job, drafts=args.lookup)
        res = harness.paired(arms, args.rounds, items=[(text, args.max_new_tokens) for text in texts],
                             warm=(texts[0], 8))  # warm-up, every side
        med = {who: harness.median_of_rounds(res[who]) for who in arms}
        line = (f"**{dataset}** ({len(texts)} prompts): specc {med['specc']:.1f} decode tokens/s, llama.cpp "
                f"{med['llama.cpp']:.1f}: specc / llama.cpp = {med['specc'] / med['llama.cpp']:.2f}x.")
        if len(arms) > 2:
            best_s = max((w for w in med if w.startswith("specc")), key=med.get)
            best_l = max((w for w in med if w.startswith("llama.cpp")), key=med.get)
            if spec is not None:
                line += f" specc speculative {med['specc speculative']:.1f} (tau {sum(taus) / len(taus):.2f})."
            if args.lookup:
                line += f" llama.cpp lookup {med['llama.cpp lookup']:.1f}."
            plain = {"specc": "specc plain", "llama.cpp": "llama.cpp plain"}
            line += (f" Best against best: {plain.get(best_s, best_s)} / {plain.get(best_l, best_l)} = "
                     f"{med[best_s] / med[best_l]:.2f}x"
                     f"{'; the speculative tokens were the plain ones on every prompt' if spec else ''}.")
        lines += [line, ""]
        for who in med:
            cfg = {"specc": f"specc plain decoding, {gguf.name} (--quant {args.quant}, inductor), decode only",
                   "llama.cpp": f"llama.cpp plain decoding, {gguf.name}, decode only",
                   "specc speculative": f"specc {drafter_label(spec) if spec else ''}, {gguf.name} "
                                        f"(--quant {args.quant}, {spec.manifest.backend if spec else ''}), decode only",
                   "llama.cpp lookup": f"llama.cpp lookup ({args.lookup} drafts), {gguf.name}, decode only"}[who]
            tau = sum(taus) / len(taus) if who == "specc speculative" and taus else None
            figures.append(benchfile.figure(cfg, dataset, model=model, tokens_per_s=med[who], tau=tau,
                                            new_tokens=args.max_new_tokens, prompts=len(texts),
                                            note="decode tokens/s, prompt processing excluded"))
    also = ((f"; specc's {drafter_label(spec)} engine of the same file" if spec else "")
            + (f"; llama.cpp's llama-lookup, {args.lookup} drafts a step" if args.lookup else ""))
    setup = (f"Greedy decoding from {gguf.name}: specc's plain engine (--quant {args.quant}, inductor) and llama.cpp's "
             f"llama-completion (built from the source vendored in llama-cpp-python, 2 threads){also}, back to back on the "
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
