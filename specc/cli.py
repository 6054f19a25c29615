"""The `specc` command: compile, build, run, bench, inspect, train.

Every user-facing failure is one sentence on stderr and exit code 2; no tracebacks
(set SPECC_DEBUG=1 to see one for an internal error).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from .errors import SpeccError


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, not the whole usage block
        sys.stderr.write(f"specc: error: {message} (see `{self.prog} --help`).\n")
        sys.exit(2)


DEVICE_HELP = ("cpu | cuda[:N]: where the engine runs (default: the device it was compiled for; an inductor "
               "engine runs only there, an eager one anywhere)")
NO_CUDA_GRAPHS_HELP = ("on CUDA, launch each decode call's kernels one by one instead of replaying a captured CUDA "
                       "graph (for comparison); no effect on other devices")


def cmd_compile(a) -> int:
    import specc
    from specc.config import CompileConfig
    from specc.manifest import read

    config = CompileConfig(model=a.model, drafter=a.drafter, tree=a.tree, backend=a.backend, output_dir=a.output,
                           drafter_path=a.drafter_path, drafter_layers=a.drafter_layers, dtype=a.dtype,
                           block_size=a.block_size, device=a.device, children=a.children, max_len=a.max_len,
                           prefill_chunk=a.prefill_chunk, dump_ir=a.dump_ir, progress=not a.json,
                           adaptive=a.adaptive, ngram_branch=a.ngram_branch, ngram_corpus=a.ngram_corpus,
                           quant=a.quant, **({"modes": a.modes} if a.modes else {}))
    out = specc.compile(config=config)
    m = read(out)
    if a.json:
        d = m.to_json()
        print(json.dumps({"engine": str(out), "backend": a.backend, "drafter": m.drafter, "tree": m.tree["spec"],
                          "tree_report": {k: v for k, v in m.tree.items() if k not in ("parents", "depths")},
                          "graphs": d["graphs"], "adaptive": m.adaptive, "quant": d["quant"],
                          "compile_split": m.compile_split}))
    else:
        print(f"compiled {m.target.name} with drafter {a.drafter}, tree {m.tree['spec']} "
              f"({len(m.tree['paths'])} nodes), backend {a.backend} on {m.device} -> {out}")
        for line in tree_report_lines(m.tree):
            print("  " + line)
        for name, g in m.graphs.items():
            print(f"  graph {name:<14} {g.tokens:>4} tokens/call  passes: capture -> {' -> '.join(g.passes + g.lowering)}")
        if m.adaptive is not None:
            for line in adaptive_lines(m.adaptive):
                print("  " + line)
        if a.dump_ir:
            print(f"  graph after each pass written to {a.dump_ir}")
    return 0


def _read_prompt(a) -> str:
    if a.prompt_file:
        p = Path(a.prompt_file)
        if not p.is_file():
            raise SpeccError(f"prompt file {str(p)!r} does not exist.")
        return p.read_text()
    return a.prompt


def cmd_run(a) -> int:
    import specc
    from .runtime import Stats

    prompt = _read_prompt(a)  # a missing prompt file fails before the slow load
    engine = specc.load(a.engine, device=a.device, cuda_graphs=not a.no_cuda_graphs)
    kw = dict(max_new_tokens=a.max_new_tokens, temperature=a.temperature, top_p=a.top_p, seed=a.seed, chat=a.chat)
    if a.stream and not a.json:
        stats = Stats()
        for piece in engine.stream(prompt, stats=stats, **kw):
            sys.stdout.write(piece)
            sys.stdout.flush()
        sys.stdout.write("\n")
        _print_stats(stats)
        return 0
    res = engine.generate(prompt, **kw)
    if a.json:
        print(json.dumps({"text": res.text, "token_ids": res.token_ids, "stats": res.stats.as_dict()}))
    else:
        print(res.text)
        _print_stats(res.stats)
    return 0


def _print_stats(s) -> None:
    sys.stderr.write(f"[{s.new_tokens} tokens in {s.steps} steps: tau {s.tau:.2f}, {s.tokens_per_s:.1f} tokens/s, "
                     f"{s.wall_s:.2f} s]\n")


def cmd_bench(a) -> int:
    import shlex

    from .bench import run_bench

    # Writes only when asked (--write FILE.md): a measurement is not a reason to edit a file.
    report = run_bench(a.engine, dataset=a.dataset, limit=a.limit, max_new_tokens=a.max_new_tokens,
                       baseline=a.baseline, chat=not a.no_chat, plot=a.plot, device=a.device,
                       cuda_graphs=not a.no_cuda_graphs,
                       write=None if a.no_write else a.write,
                       progress=not a.json, command=shlex.join(["specc", *sys.argv[1:]]))
    if a.json:
        print(json.dumps(report))
    return 0


def tree_report_lines(tree: dict) -> list[str]:
    """What a measured tree (sequoia:BUDGET, auto) was built from, for people."""
    lines = []
    if "acceptance" in tree:
        c = tree["calibration"]
        lines.append(f"measured on {c['prompts']} calibration prompts x {c['new_tokens']} tokens ({c['steps']} steps, "
                     f"comb depth {c['comb_depth']}, {c['width']} ranks per depth)")
        for d, row in enumerate(tree["acceptance"], start=1):
            lines.append(f"  depth {d}: acceptance by rank " + " ".join(f"{p:.3f}" for p in row))
    if "expected_tokens" in tree:
        lines.append(f"expected tokens per step {tree['expected_tokens']:.3f}")
    for r in tree.get("candidates", []):
        mark = "*" if r["tree"] == tree.get("picked") else " "
        lines.append(f"{mark} {r['tree']:<12} {r['nodes']:>3} nodes  expected {r['expected_tokens']:.2f} tokens/step, "
                     f"{r['step_ms']:.1f} ms/step -> {r['expected_tokens_per_s']:.1f} tokens/s expected, "
                     f"{r['measured_tokens_per_s']:.1f} measured (tau {r['measured_tau']:.2f})")
    return lines


def adaptive_lines(entry: dict) -> list[str]:
    from .adaptive import report_lines

    return report_lines(entry) if "latency_ms" in entry else ["adaptive family not measured"]


def sm90_report(m, as_json: bool) -> int:
    """`specc inspect --sm90`: the engine's target shapes, dtype, decode-step sizes and modes -> the kernels'
    sm_90a build (kernels/hopper_build.py), as a table or JSON."""
    import torch

    from .kernels import hopper_build as hb
    from .quant import parse_quant

    why = hb.available()
    if why:
        raise SpeccError(f"cannot build the kernels for sm_90a here: {why}.")
    shape = hb.shape_of(m.target.config, m.cache_len, m.target.name)
    sizes = sorted({g.tokens for name, g in m.graphs.items() if name.startswith(("plain", "step", "fused"))}) or [1]
    modes = set(m.modes)
    quant = parse_quant(m.quant.target)
    gguf = quant.block_formats if quant is not None else ()  # the block products its graphs run
    parents, depths = m.tree["parents"], m.tree["depths"]

    def shape_at(T: int) -> tuple[int, int]:  # (depth, widest node) of the tree's first T nodes (a family member)
        kids = [sum(1 for p in parents[1:T] if p == i) for i in range(T)]
        return max(depths[:T]), max(1, max(kids))

    labelled = hb.shape_launches(shape, getattr(torch, m.dtype), tuple(sizes), gguf=gguf, greedy="greedy" in modes,
                                 sample=bool(modes - {"greedy"}), trees={T: [shape_at(T)] for T in sizes})
    rows = hb.build(labelled)
    bad = [b for b in rows if b.problems()]
    if as_json:
        print(json.dumps({"shape": shape.__dict__, "tree_sizes": sizes, "launches": len(labelled),
                          "rows": hb.as_dicts(rows)}))
    else:
        print(f"sm_90a build of {m.target.name}'s decode-step kernels ({m.dtype}, "
              f"{', '.join(map(str, sizes))} tokens a step; {len(labelled)} launches, {len(rows)} variants):\n")
        print(hb.table(rows))
    for b in bad:  # with --json too, on stderr: the reason is what a failing run must show first
        print(f"{b.kernel} [{b.config}]: {'; '.join(b.problems())}", file=sys.stderr if as_json else sys.stdout)
    return 1 if bad else 0


def cmd_inspect(a) -> int:
    from .manifest import read
    from .tree import draw_tree, tree_from_paths

    m = read(a.engine)
    if a.sm90:
        return sm90_report(m, a.json)
    tree = tree_from_paths(m.tree["paths"])
    if a.tree_png:
        draw_tree(tree, a.tree_png)
    lint = trt_lint_report(a.engine, m) if a.trt_lint else None
    if a.json:
        print(json.dumps({k: v for k, v in m.to_json().items() if k != "files"} | {"files": sorted(m.files)}
                         | ({"trt_lint": lint} if lint is not None else {})))
        return 1 if lint and lint["errors"] else 0
    print_engine(a.engine, m, tree)
    if a.passes:
        for name, g in m.graphs.items():
            print(f"graph {name} ({g.tokens} tokens/call):")
            for i, p in enumerate(["capture"] + g.passes):
                print(f"  {i}. {p}")
            for p in g.lowering:
                print(f"  +  {p} (before {m.backend} compiles it, for {m.device})")
    if a.tree_png:
        print(f"tree drawn to {a.tree_png}")
    if lint is not None:
        print(f"trt-lint    {lint['graphs']} ONNX graphs against TensorRT {lint['tensorrt']} ({lint['source']}): "
              f"{lint['errors']} error(s), {lint['notes']} note(s)")
        for f in lint["findings"]:
            print(f"  {f['severity']}: {f['graph']}: {f['op']} {f['node']}: {f['message']}")
        return 1 if lint["errors"] else 0
    return 0


def print_engine(engine: str, m, tree) -> None:
    """`specc inspect`'s summary of an engine (its Manifest)."""
    t = m.target
    print(f"engine      {engine}")
    print(f"target      {t.name} ({t.arch}, {t.num_layers} layers, vocab {t.vocab_size})")
    print(f"drafter     {json.dumps(m.drafter)}")
    print(f"tree        {m.tree['spec']}: {tree.size} nodes, depth {tree.max_depth}, max width {tree.max_width}")
    for line in tree_report_lines(m.tree):
        print("            " + line)
    branch = m.drafter.get("ngram_branch")
    if branch:
        print(f"            + prompt lookup's branch: {branch['depth']} nodes under the root at rank {branch['rank']}, "
              f"filled per step from matches of {branch['min_ngram']}-{branch['max_ngram']} tokens")
    corpus = m.drafter.get("corpus")
    if corpus:
        print(f"            + corpus table ({corpus['source']}): contexts of 1-3 tokens "
              f"{' / '.join(map(str, corpus['contexts']))}, drafting where lookup matches fewer than "
              f"{corpus['min_lookup']} tokens")
    chunks, timed = m.prefill_chunks, m.prefill_ms
    prefill = (f"prefill chunks {', '.join(map(str, chunks))}" if len(chunks) > 1 else f"prefill chunk {chunks[0]}") + (
        " (ms a call: " + ", ".join(f"{k} {'token' if k == '1' else 'tokens'} {v:.1f}" for k, v in timed.items()) + ")"
        if timed else "")
    print(f"backend     {m.backend} on {m.device}, dtype {m.dtype}, max_len {m.max_len}, {prefill}")
    if m.cpu_kernels:
        print("native      the few-row products call specc's C++ CPU products (kernels/*_cpu.cpp), built for "
              "the loading machine on first use")
    for setting, r in (m.products or {}).items():
        rows = "one row" if setting == "one_row" else "5+ rows" if "from_rows" not in r else ", ".join(
            f"{n}+ rows of {k} inputs" for k, n in r["from_rows"].items())  # engines before the widths: 5+
        print(f"products    float32 at {rows}: {r['product']}, timed at compile ({r['graph']} "
              + ", ".join(f"{k} {v:.1f} ms" for k, v in r["ms"].items())
              + ("; timed by an earlier compile on this machine" if r.get("timed_before") else "") + ")")
    print(f"modes       {', '.join(m.modes)} (one graph per mode for each graph that samples)")
    q, b = m.quant, m.quant.bytes_per_token
    if b:
        print(f"weights     target {q.target}: {b['target'] / 1e6:.1f} MB read per token; drafter {q.drafter}: "
              f"{b['drafter'] / 1e6:.1f} MB of its own per call")
    if m.adaptive is not None:
        print("adaptive    per step, the step graph with the most expected tokens per second:")
        for line in adaptive_lines(m.adaptive):
            print("            " + line)
    if m.compile_split:
        from .compiler import split_line

        print(f"compile     {split_line(m.compile_split)}")
    print(f"versions    specc {m.specc_version}, torch {m.torch_version}, transformers {m.transformers_version}")
    print(f"files       {len(m.files)} (sha256 recorded)")


def trt_lint_report(engine: str, m) -> dict:
    from .backends import get_backend
    from .trt_lint import engine_graph_files, findings_json, lint_engine
    from .trt_ops import SOURCE, TRT_VERSION

    if not get_backend(m.backend).onnx_files:
        raise SpeccError(f"--trt-lint reads an engine's ONNX graphs, and this is a {m.backend} engine; compile it "
                         f"with --backend onnx or tensorrt.")
    findings = lint_engine(Path(engine), m)
    return {"tensorrt": TRT_VERSION, "source": SOURCE, "graphs": len(engine_graph_files(m)),
            "errors": sum(f.severity == "error" for f in findings), "notes": sum(f.severity == "note" for f in findings),
            "findings": findings_json(findings)}


def cmd_build(a) -> int:
    from .compiler import build
    from .manifest import read

    out = build(a.engine, progress=not a.json)
    info = read(out).tensorrt
    if a.json:
        print(json.dumps({"engine": str(out), **info}))
    else:
        print(f"built {len(info['plans'])} TensorRT engines with TensorRT {info['tensorrt_version']} for {info['gpu']} "
              f"in {out}")
    return 0


def cmd_train(a) -> int:
    from .train import SMOKE, TrainConfig, train

    fields = {k: getattr(a, k) for k in TrainConfig.__dataclass_fields__ if getattr(a, k, None) is not None}
    cfg = TrainConfig(**{**(SMOKE if a.smoke else {}), **fields})  # explicit options win over --smoke's
    res = train(a.model, a.output, cfg, smoke=a.smoke, progress=not a.json,
                log=(lambda m: None) if a.json else print, command=" ".join(["specc", *sys.argv[1:]]),
                device=a.device)
    if a.json:
        print(json.dumps(res))
    else:
        ev = res["eval"] or {}
        print(f"trained {res['drafter']} drafter in {res['output']}: {res['steps']} steps on {res['sequences']} "
              f"sequences, held-out tau {ev.get('tau')} (greedy, full block, {ev.get('anchors')} anchors)"
              + (f"; stopped by --time-budget after {res['train_s']} s" if res.get("stopped_by_time") else ""))
        extra = [f"chain:{k} {v}" for k, v in ((k.removeprefix('tau_chain'), v) for k, v in ev.items()
                                               if k.startswith("tau_chain"))]
        if extra:
            print("  held-out tau by chain length: " + ", ".join(extra))
        print(f"  curve: {Path(res['output']) / 'train' / 'curve.png'}")
    return 0


def cmd_features(a) -> int:
    from .train import extract_features

    index = extract_features(a.model, a.output, a.tokens, a.taps, a.max_len, a.sources, progress=not a.json,
                             log=(lambda m: None) if a.json else print, device=a.device, batch_tokens=a.batch_tokens,
                             code_share=a.code_share, pretokenize=a.pretokenize)
    if a.pretokenize:
        if a.json:
            print(json.dumps({"output": a.output, **{k: index[k] for k in ("sequences", "tokens", "scored",
                                                                             "tokens_by_source", "complete")}}))
        else:
            print(f"pre-tokenized corpus in {a.output}: {index['tokens']} positions ({index['scored']} scored) in "
                  f"{index['sequences']} sequences" + ("" if not index["complete"] else " (the corpus is exhausted)"))
        return 0
    tokens = sum(s["tokens"] for s in index["shards"])
    scored = sum(s["scored"] for s in index["shards"])
    if a.json:
        print(json.dumps({"output": a.output, "tokens": tokens, "scored": scored, "shards": len(index["shards"]),
                          "complete": index["complete"]}))
    else:
        print(f"features in {a.output}: {tokens} positions ({scored} scored) in {len(index['shards'])} shards"
              + (" (the corpus is exhausted)" if index["complete"] else ""))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="specc", description="Compile a Hugging Face causal LM and a drafter into a lossless "
                                          "speculative-decoding engine, and run it.")
    sub = p.add_subparsers(dest="cmd", required=True, parser_class=_Parser)
    for add in (add_compile, add_build, add_run, add_bench, add_inspect, add_train, add_features):
        add(sub)
    return p


def add_compile(sub) -> None:
    c = sub.add_parser("compile", help="compile a model and drafter into an engine directory")
    c.add_argument("model", nargs="?", default=None,
                   help="Hugging Face model directory or .gguf file (default: embedded SmolLM2-135M-Instruct)")
    c.add_argument("--drafter", default="none", help="none | ngram | draft-model | dflash | dspark | mtp")
    c.add_argument("--drafter-path", default=None,
                   help="draft model directory or .gguf (draft-model); DFlash / DSpark drafter directory (dflash, dspark); "
                        "MTP checkpoint, DeepSeek-V3 or Qwen3-Next layout (mtp). dflash and mtp on the embedded "
                        "SmolLM2 default to the drafters shipped with specc")
    c.add_argument("--block-size", type=int, default=None,
                   help="dflash, dspark: run on blocks of this size (at most the trained one; default: the shortest "
                        "length training used (4, 8, 16, ..., the trained size) that reaches the tree's depth)")
    c.add_argument("--drafter-layers", type=int, default=None,
                   help="draft-model: use the first N layers (of the target when no --drafter-path)")
    c.add_argument("--tree", default=None, help="chain:K | topk:DEPTH,WIDTH | sequoia:BUDGET | auto | FILE.json")
    c.add_argument("--backend", default="eager", help="eager | inductor | onnx | tensorrt")
    c.add_argument("--device", default=None,
                   help="cpu | cuda[:N]: where the engine runs (inductor compiles for it); default cpu, cuda for tensorrt")
    c.add_argument("--children", default="topk",
                   help="topk (each node's children are the drafter's top-k) | sampled (dflash, mtp: at temperature "
                        "> 0 children are i.i.d. draws from the drafter's distribution, verified with min(1, p/q))")
    c.add_argument("--modes", default=None,
                   help="the sampling modes the engine carries graphs for, comma-separated (default: all): greedy "
                        "(temperature 0), sample (temperature > 0), top_p (temperature > 0 with top-p < 1); each "
                        "mode adds its own graphs and compile time")
    c.add_argument("--dtype", default="float32")
    c.add_argument("--max-len", type=int, default=1024)
    c.add_argument("--prefill-chunk", default="128,32", metavar="N[,N...]",
                   help="prompt tokens per prefill call: one size or several, each a graph (default 128,32: a "
                        "prompt goes through the cheapest mix of calls, as timed at compile)")
    c.add_argument("--dump-ir", default=None, metavar="DIR", help="write the graph after every pass here")
    c.add_argument("--quant", default="none", metavar="KIND[:FIELD=VALUE]",
                   help="weight-only quantization of the target's linear layers and LM head: int8 (one scale per "
                        "output row), int8:group_size=32 (Q8_0 blocks), int4 (Q4_1 blocks), int4:symmetric=true "
                        "(Q4_0 blocks), gguf (a .gguf model's own blocks), or none. Lossless speculation is then "
                        "with respect to the quantized target")
    c.add_argument("--adaptive", action="store_true",
                   help="ngram: also compile a step graph for each prefix of the tree, time them here, and per step "
                        "verify the one with the most expected tokens per second (plain decoding when drafts look poor)")
    c.add_argument("--ngram-corpus", default=None, metavar="SOURCE",
                   help="ngram: also draft from a table of what followed each 1-3 token context in a corpus, where "
                        "prompt lookup finds no match of 2 tokens: sharegpt (ShareGPT's assistant turns, tokenized at "
                        "compile time), none, or a .jsonl file of {\"text\": ...} or {\"ids\": [...]} lines; default: "
                        "sharegpt for a chat model (its tokenizer has a chat template), else none")
    c.add_argument("--ngram-branch", type=int, default=0, metavar="K",
                   help="mtp, dflash, dspark: add a chain of K nodes under the root that the runtime fills with prompt "
                        "lookup's continuation of the text (a hybrid tree: lookup's long matches on code and "
                        "repetitive text, the model's drafts elsewhere); default 0")
    c.add_argument("--json", action="store_true")
    c.add_argument("-o", "--output", required=True, metavar="DIR")
    c.set_defaults(fn=cmd_compile)


def add_run(sub) -> None:
    r = sub.add_parser("run", help="generate text with an engine")
    r.add_argument("engine", metavar="DIR")
    g = r.add_mutually_exclusive_group(required=True)
    g.add_argument("--prompt")
    g.add_argument("--prompt-file")
    r.add_argument("--chat", action="store_true", help="apply the model's chat template")
    r.add_argument("--max-new-tokens", type=int, default=256)
    r.add_argument("--temperature", type=float, default=0.0)
    r.add_argument("--top-p", type=float, default=1.0)
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--device", default=None, help=DEVICE_HELP)
    r.add_argument("--no-cuda-graphs", action="store_true", help=NO_CUDA_GRAPHS_HELP)
    r.add_argument("--stream", action="store_true")
    r.add_argument("--json", action="store_true")
    r.set_defaults(fn=cmd_run)


def add_bench(sub) -> None:
    b = sub.add_parser("bench", help="measure tau, tokens/s and speedups on a prompt set")
    b.add_argument("engine", metavar="DIR")
    b.add_argument("--dataset", default="mt-bench", help="mt-bench | humaneval | FILE.jsonl")
    b.add_argument("--limit", type=int, default=10)
    b.add_argument("--max-new-tokens", type=int, default=128)
    b.add_argument("--baseline", default="both", choices=["hf", "ar", "both"])
    b.add_argument("--no-chat", action="store_true", help="do not apply the chat template to prompts")
    b.add_argument("--device", default=None, help=DEVICE_HELP + "; the HF baseline runs there too")
    b.add_argument("--no-cuda-graphs", action="store_true", help=NO_CUDA_GRAPHS_HELP)
    b.add_argument("--plot", default=None, metavar="FILE.png", help="acceptance histogram and tokens/s")
    b.add_argument("--write", default=None, metavar="FILE.md",
                   help="insert this run, dated, under '## History' in FILE.md (e.g. BENCHMARKS.md) and regenerate "
                        "its Current figures table (default: write nothing)")
    b.add_argument("--no-write", action="store_true", help="write nothing (the default; kept for older scripts)")
    b.add_argument("--json", action="store_true")
    b.set_defaults(fn=cmd_bench)


def add_inspect(sub) -> None:
    i = sub.add_parser("inspect", help="describe an engine")
    i.add_argument("engine", metavar="DIR")
    i.add_argument("--passes", action="store_true", help="list the passes that made each graph")
    i.add_argument("--tree-png", default=None, metavar="FILE")
    i.add_argument("--trt-lint", action="store_true",
                   help="check every ONNX graph against TensorRT's operator table and restrictions (exit 1 on errors)")
    i.add_argument("--sm90", action="store_true",
                   help="build the Triton kernels this engine's decode steps launch on a GPU for the H100/H200 "
                        "(sm_90a, no GPU needed) and print registers, spills, shared memory and MMA (exit 1 on a "
                        "spill, local memory or a failed build)")
    i.add_argument("--json", action="store_true")
    i.set_defaults(fn=cmd_inspect)


def add_build(sub) -> None:
    b = sub.add_parser("build", help="build a tensorrt engine directory's TensorRT engines (on the GPU machine)")
    b.add_argument("engine", metavar="DIR")
    b.add_argument("--json", action="store_true")
    b.set_defaults(fn=cmd_build)


class TrainedKinds:
    """`specc train --drafter`'s choices: the kinds with a trainer (specc.train.DRAFTERS, from the kinds'
    registry). Read only when argparse checks or lists them: the registry imports torch, which every other
    command's parser would pay for."""

    def __iter__(self):
        from .train import DRAFTERS

        return iter(DRAFTERS)

    def __contains__(self, name) -> bool:
        return name in tuple(self)


def add_train(sub) -> None:
    t = sub.add_parser("train", help="train a DFlash, DSpark or MTP drafter by self-distillation on ShareGPT prompts")
    t.add_argument("model", nargs="?", default=None, help="target (default: embedded SmolLM2-135M-Instruct)")
    t.add_argument("--drafter", required=True, choices=TrainedKinds(), metavar="KIND",
                   help="the drafter kind to train: %(choices)s")
    t.add_argument("-o", "--output", required=True, help="run directory; the same command resumes a stopped run")
    t.add_argument("--layers", type=int, help="DFlash / DSpark layers, MTP modules (default 1)")
    t.add_argument("--block-size", type=int, dest="block_size",
                   help="DFlash block size (B-1 drafts), DSpark block size (B drafts), MTP depth + 1 (default 16 "
                        "for dflash, 7 for dspark, 5 for mtp)")
    t.add_argument("--taps", type=int, help="DFlash / DSpark: target layers to condition on (default 3)")
    t.add_argument("--labels", choices=["regenerate", "data"], help="sequences: the target's own responses "
                   "(default) or the dataset's")
    t.add_argument("--prompts", type=int, help="training sequences (default 1000)")
    t.add_argument("--eval-prompts", type=int, dest="eval_prompts", help="held-out sequences (default 24)")
    t.add_argument("--response-len", type=int, dest="response_len", help="new tokens per response (default 192)")
    t.add_argument("--steps", type=int, help="optimizer steps, one sequence each (default 2000)")
    t.add_argument("--anchors", type=int, help="DFlash / DSpark blocks per sequence (default 64)")
    t.add_argument("--markov-rank", type=int, dest="markov_rank", help="DSpark: rank of the Markov head (default 256)")
    t.add_argument("--rows", type=int, help="MTP: rows scored per depth per step, a random sample (default 0: all)")
    t.add_argument("--lr", type=float, help="peak learning rate (default 6e-4)")
    t.add_argument("--seed", type=int)
    t.add_argument("--eval-every", type=int, dest="eval_every")
    t.add_argument("--checkpoint-every", type=int, dest="checkpoint_every")
    t.add_argument("--soft", type=float, help="weight of the loss toward the target's top-k distribution, 0-1 "
                   "(features only; default 0: its argmax alone)")
    t.add_argument("--regress", type=float, help="weight of an EAGLE-style regression of the drafter's LM-head "
                   "input onto the target's (default 0)")
    t.add_argument("--init", choices=["random", "target"], help="drafter layers: random (default) or copies of the "
                   "target's last layers")
    t.add_argument("--features", help="teacher-forced target features: a folder shared between runs (extracted "
                   "there when --feature-tokens asks for more than it holds)")
    t.add_argument("--feature-tokens", type=int, dest="feature_tokens",
                   help="extract features until the folder holds this many positions (resumable)")
    t.add_argument("--feature-sources", dest="feature_sources",
                   help="corpora for the features: sharegpt,code (default both; code = the Python standard library)")
    t.add_argument("--feature-max-len", type=int, dest="feature_max_len", help="tokens per feature sequence "
                   "(default 1024)")
    t.add_argument("--feature-stream", dest="feature_stream", metavar="DIR",
                   help="a pre-tokenized corpus (`specc features --pretokenize`) whose features the target computes "
                        "while training reads them, a window at a time (nothing on disk): for a GPU")
    t.add_argument("--pack-tokens", type=int, dest="pack_tokens",
                   help="--feature-stream, dflash / dspark: pack sequences back to back into records of up to this "
                        "many positions, one record per step (default 0: one sequence)")
    t.add_argument("--feature-precision", dest="feature_precision", choices=["float32", "tf32", "bfloat16"],
                   help="--feature-stream: the target forward's precision (default float32; tf32: float32 with "
                        "TensorFloat-32 products on CUDA; the held-out set is always float32)")
    t.add_argument("--feature-batch-tokens", type=int, dest="feature_batch_tokens",
                   help="--feature-stream: padded positions per target forward (default 32768)")
    t.add_argument("--feature-window-tokens", type=int, dest="feature_window_tokens",
                   help="--feature-stream: positions whose features are computed at once and held (default 524288)")
    t.add_argument("--time-budget", type=float, dest="time_budget", metavar="SECONDS",
                   help="end the steps after this many seconds (evaluated and saved there), the learning rate "
                        "annealing by elapsed time as well as by step (default 0: no limit)")
    t.add_argument("--device", default="cpu", help="cpu | cuda[:N]: where the target and the drafter run (default cpu)")
    t.add_argument("--smoke", action="store_true", help="a tiny random target and a few steps (for CI)")
    t.add_argument("--json", action="store_true")
    t.set_defaults(fn=cmd_train)


def add_features(sub) -> None:
    f = sub.add_parser("features", help="extract teacher-forced target features for `specc train --features`")
    f.add_argument("model", nargs="?", default=None, help="target (default: embedded SmolLM2-135M-Instruct)")
    f.add_argument("-o", "--output", required=True, help="features folder; the same command resumes or extends it")
    f.add_argument("--tokens", type=int, required=True, help="extract until the folder holds this many positions")
    f.add_argument("--taps", type=int, default=3, help="DFlash target layers to keep (default 3, as train)")
    f.add_argument("--max-len", type=int, default=1024, dest="max_len", help="tokens per sequence (default 1024)")
    f.add_argument("--sources", default="sharegpt,code", help="sharegpt,code (default both)")
    f.add_argument("--code-share", type=float, default=0.25, dest="code_share",
                   help="share of the positions from the code source when both are used (default 0.25; the corpus "
                        "ends when either source runs out)")
    f.add_argument("--device", default="cpu", help="cpu | cuda[:N]: where the target runs (default cpu)")
    f.add_argument("--batch-tokens", type=int, default=0, dest="batch_tokens",
                   help="padded positions per target forward, several sequences at a time (default 0: one "
                        "sequence per forward; a GPU wants about 32768)")
    f.add_argument("--pretokenize", action="store_true",
                   help="write the corpus' token ids and loss masks alone (no target forward), for "
                        "`specc train --feature-stream DIR` on another machine")
    f.add_argument("--json", action="store_true")
    f.set_defaults(fn=cmd_features)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        from .models import quiet_libraries

        quiet_libraries()
        return args.fn(args)
    except SpeccError as e:
        sys.stderr.write(f"specc: error: {e}\n")
        return 2
    except BrokenPipeError:  # `specc ... | head`
        return 0
    except KeyboardInterrupt:
        sys.stderr.write("specc: interrupted\n")
        return 130
    except Exception as e:  # an internal bug: still one line unless asked for more
        if os.environ.get("SPECC_DEBUG"):
            raise
        sys.stderr.write(f"specc: internal error: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''} "
                         f"(set SPECC_DEBUG=1 for a traceback).\n")
        return 1


if __name__ == "__main__":
    sys.exit(main())
