"""`specc bench`: tau, tokens/s and speedups on a prompt set, side by side in one run.

Measurement protocol (docs/development.md): same machine, same run, same prompts, batch 1, greedy, a fixed
number of new tokens (EOS does not stop any method), warm-up excluded, medians quoted. Baselines:
(a) plain autoregressive decoding through the same engine and backend, (b) Hugging Face
`generate()` of the same weights.
"""
from __future__ import annotations

import time
from pathlib import Path

import torch
from tqdm import tqdm

from . import benchfile, harness
from .data import load_prompts
from .errors import SpeccError


def hf_generate_timer(engine_dir: Path, dtype, device):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(Path(engine_dir) / "target", dtype=dtype).eval().to(device)
    eos = model.config.eos_token_id
    pad = (eos[0] if isinstance(eos, (list, tuple)) else eos) or 0

    def run(ids: list[int], n: int) -> tuple[list[int], float]:
        x = torch.tensor([ids], device=device)
        t0 = time.perf_counter()
        with torch.no_grad():
            out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, min_new_tokens=n,
                                 do_sample=False, pad_token_id=pad)
        return out[0, len(ids):].tolist(), time.perf_counter() - t0  # tolist() waits for the device first

    return run


def summarize(name: str, runs: list[dict]) -> dict:
    tps = [r["new_tokens"] / r["wall_s"] for r in runs]
    steps = sum(r.get("steps", 0) for r in runs)
    tau = sum(r["new_tokens"] - 1 for r in runs) / steps if steps else None
    out = {"method": name, "prompts": len(runs), "tokens_per_s": harness.median(tps),
           "tau": tau, "new_tokens": sum(r["new_tokens"] for r in runs), "steps": steps}
    if any(r.get("lookup_steps") for r in runs):  # a hybrid tree: how often prompt lookup's branch served
        out.update(lookup_steps=sum(r["lookup_steps"] for r in runs), lookup_accepted=sum(r["lookup_accepted"] for r in runs))
    return out


def run_bench(engine_dir, dataset: str = "mt-bench", limit: int | None = 10, max_new_tokens: int = 128,
              baseline: str = "both", chat: bool = True, plot=None, write=None, progress: bool = True,
              command: str = "", device: str | None = None, cuda_graphs: bool = True) -> dict:
    from . import load
    from .models import parse_dtype

    if limit is not None and limit < 1:
        raise SpeccError("--limit must be at least 1.")
    if max_new_tokens < 1:
        raise SpeccError("--max-new-tokens must be at least 1.")
    engine = load(engine_dir, device=device, cuda_graphs=cuda_graphs)
    prompts = load_prompts(dataset, limit)
    use_chat = chat and engine.tokenizer is not None and bool(getattr(engine.tokenizer, "chat_template", None))
    all_ids = [engine.encode(p, chat=use_chat) for p in prompts]
    fits = [ids for ids in all_ids if len(ids) + max_new_tokens <= engine.max_len]
    if not fits:
        raise SpeccError(f"no prompt of {dataset} fits --max-len {engine.max_len} with {max_new_tokens} new tokens.")
    speculative = engine.drafter is not None
    methods = (["speculative"] if speculative else []) + (["ar"] if baseline in ("ar", "both") or not speculative else [])
    hf = hf_generate_timer(engine_dir, parse_dtype(engine.manifest.dtype), engine.device) if baseline in ("hf", "both") else None

    # Warm-up, excluded from every figure.
    for m in methods:
        engine.generate(fits[0], max_new_tokens=8, speculate=(m == "speculative"), stop_at_eos=False)
    if hf:
        hf(fits[0], 8)

    runs: dict[str, list[dict]] = {m: [] for m in methods + (["hf"] if hf else [])}
    hist: list[int] = []
    identical = 0
    bar = tqdm(fits, desc=f"bench {dataset}", unit="prompt", disable=not progress)
    for ids in bar:
        outs = {}
        for m in methods:
            r = engine.generate(ids, max_new_tokens=max_new_tokens, speculate=(m == "speculative"), stop_at_eos=False)
            runs[m].append(r.stats.as_dict())
            outs[m] = r.token_ids
            if m == "speculative":
                for i, c in enumerate(r.stats.accepted_hist):
                    hist += [0] * (i + 1 - len(hist))
                    hist[i] += c
        if hf:
            toks, wall = hf(ids, max_new_tokens)
            runs["hf"].append({"new_tokens": len(toks), "wall_s": wall})
            outs["hf"] = toks
        if "speculative" in outs and "ar" in outs:
            identical += outs["speculative"] == outs["ar"]
    bar.close()

    rows = [summarize(m, rs) for m, rs in runs.items()]
    by = {r["method"]: r for r in rows}
    for r in rows:
        if "ar" in by:
            r["speedup_vs_ar"] = r["tokens_per_s"] / by["ar"]["tokens_per_s"]
        if "hf" in by:
            r["speedup_vs_hf"] = r["tokens_per_s"] / by["hf"]["tokens_per_s"]
    m = engine.manifest
    report = {
        "engine": str(engine_dir), "dataset": dataset, "prompts": len(fits), "skipped_too_long": len(all_ids) - len(fits),
        "max_new_tokens": max_new_tokens, "chat_template": use_chat, "backend": m.backend,
        "drafter": m.drafter, "tree": m.tree["spec"], "tree_nodes": len(m.tree["paths"]),
        "config": engine_label(m), "model": m.target.name, "device": str(engine.device),
        "cuda_graphs": engine.cuda_graphs,
        "date": benchfile.today(), "machine": benchfile.machine_text(benchfile.machine(str(engine.device))),
        "greedy_identical_to_ar": f"{identical}/{len(fits)}" if "ar" in runs and speculative else None,
        "accepted_hist": hist, "rows": rows, "command": command,
    }
    if progress:  # with --json the JSON object is the only thing on stdout
        print_report(report)
    if plot:
        plot_report(report, plot)
    if write:
        benchfile.write_run(write, report_run(report), report_setup(report), report_body(report))
    return report


def _fmt(x, spec=".2f", suffix=""):
    return "-" if x is None else format(x, spec) + suffix


def drafter_label(report: dict) -> str:
    """e.g. "dflash B=4 chain:3", "mtp sequoia:4 (4 nodes)": the drafter and the tree."""
    d = report["drafter"]
    block = f" B={d['block_size']}" if "block_size" in d else ""
    branch = f" + ngram branch {d['ngram_branch']['depth']}" if d.get("ngram_branch") else ""
    corpus = (d.get("corpus") or {}).get("source")
    table = "" if corpus is None else " + ShareGPT table" if corpus == "sharegpt" else f" + table of {Path(corpus).name}"
    nodes = report.get("tree_nodes")
    measured = "" if nodes is None or (report["tree"].startswith("chain:") and not branch) else f" ({nodes} nodes)"
    tree = Path(report["tree"]).name if report["tree"].endswith(".json") else report["tree"]  # a tree file: its name
    return f"{d['kind']}{block} {tree}{branch}{measured}{table}"


# the backend BENCHMARKS.md's labels leave unsaid (most runs use it)
QUIET_BACKEND = "inductor"


def engine_label(manifest) -> str:
    """The configuration an engine runs (its Manifest), as BENCHMARKS.md keys it: drafter and tree, then
    the backend, device and children when they are not the defaults (inductor, cpu, topk)."""
    label = drafter_label({"drafter": manifest.drafter, "tree": manifest.tree["spec"],
                           "tree_nodes": len(manifest.tree["paths"])})
    extra = [manifest.backend if manifest.backend != QUIET_BACKEND else None,
             manifest.device if manifest.device != "cpu" else None,
             "sampled children" if manifest.drafter.get("children") == "sampled" else None]
    return ", ".join([label] + [e for e in extra if e])


def plain_label(report: dict) -> str:
    extra = [report["backend"] if report["backend"] != QUIET_BACKEND else None,
             report["device"] if report.get("device", "cpu") != "cpu" else None]
    return ", ".join([benchfile.PLAIN] + [e for e in extra if e])


def dataset_name(report: dict) -> str:
    """mt-bench, humaneval, or a prompt file's name (not its whole path)."""
    ds = str(report["dataset"])
    return Path(ds).name if ds.endswith(".jsonl") else ds


def report_figures(report: dict) -> list[dict]:
    """The rows of a report as BENCHMARKS.md figures: the speculative engine, plain decoding, HF generate()."""
    names = {"speculative": report["config"], "ar": plain_label(report), "hf": benchfile.HF}
    return [benchfile.figure(names[r["method"]], dataset_name(report), model=report["model"], tau=r["tau"],
                             tokens_per_s=r["tokens_per_s"], vs_plain=r.get("speedup_vs_ar"),
                             vs_hf=r.get("speedup_vs_hf"), new_tokens=report["max_new_tokens"],
                             prompts=r["prompts"]) for r in report["rows"]]


def report_setup(report: dict) -> str:
    return (f"{report['model']}, {report['backend']} backend, greedy, {report['max_new_tokens']} new tokens per "
            f"prompt, first {report['prompts']} prompts of {dataset_name(report)}, chat template "
            f"{'on' if report['chat_template'] else 'off'}, EOS ignored; warm-up excluded; medians over prompts.")


def report_body(report: dict) -> str:
    text = markdown_table(report)
    if report["greedy_identical_to_ar"]:
        text += f"\n\nGreedy output identical to plain decoding on {report['greedy_identical_to_ar']} prompts."
    if report["accepted_hist"]:
        text += f"\nAccepted drafts per step (0, 1, 2, ...): {report['accepted_hist']}."
    return text


def report_run(report: dict) -> dict:
    """The report as a BENCHMARKS.md run (see specc.benchfile)."""
    return benchfile.new_run(f"specc bench: {report['config']} on {dataset_name(report)}", report_figures(report),
                             command=report["command"] or benchfile.command_line(), device=report["device"])


def markdown_table(report: dict) -> str:
    lines = ["| method | tau | tokens/s (median) | vs plain (same backend) | vs HF generate() |",
             "|---|---|---|---|---|"]
    names = {"speculative": drafter_label(report), "ar": "plain decoding",
             "hf": "HF generate()"}
    for r in report["rows"]:
        lines.append(f"| {names[r['method']]} | {_fmt(r['tau'])} | {_fmt(r['tokens_per_s'])} | "
                     f"{_fmt(r.get('speedup_vs_ar'), suffix='x')} | {_fmt(r.get('speedup_vs_hf'), suffix='x')} |")
    return "\n".join(lines)


def print_report(report: dict) -> None:
    print(f"{report['model']} | {report['backend']} | drafter {report['drafter']['kind']} | tree {report['tree']} | "
          f"{report['dataset']}: {report['prompts']} prompts x {report['max_new_tokens']} new tokens")
    print(markdown_table(report))
    if report["greedy_identical_to_ar"]:
        print(f"greedy output identical to plain decoding: {report['greedy_identical_to_ar']}")


def plot_report(report: dict, path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 4))
    FigureCanvasAgg(fig)
    ax1, ax2 = fig.subplots(1, 2)
    hist = report["accepted_hist"]
    if hist:
        total = sum(hist)
        ax1.bar(range(len(hist)), [h / total for h in hist], color="#4477aa")
        ax1.set_xlabel("draft tokens accepted per step")
        ax1.set_ylabel("fraction of steps")
        ax1.set_title(f"acceptance ({report['drafter']['kind']} {report['tree']})")
    else:
        ax1.text(0.5, 0.5, "no drafter", ha="center")
    names = [r["method"] for r in report["rows"]]
    ax2.bar(names, [r["tokens_per_s"] for r in report["rows"]], color=["#228833", "#bbbbbb", "#ee6677"][: len(names)])
    ax2.set_ylabel("tokens/s (median)")
    ax2.set_title(f"{report['dataset']}, {report['backend']}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def matvec_floor(model, reps: int = 20) -> dict:
    """The time of the model's matrix-vector products alone for one token (every Linear once,
    batch 1, the LM head included): the part of a decode step no scheduling can remove. Measured
    two ways: torch.nn.functional.linear on the [out, in] weights (the sgemv HF runs), and a plain
    sum over the same weights (reading every byte once: the memory floor, which specc's `matvec`
    pass approaches)."""
    import torch.nn.functional as F

    weights = [m.weight.detach() for m in model.modules() if isinstance(m, torch.nn.Linear)]
    xs = [torch.randn(1, w.shape[1], dtype=w.dtype) for w in weights]

    def median_ms(fn) -> float:
        def one_token():
            for w, x in zip(weights, xs):
                fn(x, w)
        with torch.no_grad():  # the first passes warm the allocator
            return harness.median(harness.call_times(one_token, reps, warmup=2)) * 1e3

    linear_ms = median_ms(F.linear)
    stream_ms = median_ms(lambda x, w: w.sum())
    nbytes = sum(w.numel() * w.element_size() for w in weights)
    return {"matvecs": len(weights), "weight_bytes": nbytes, "ms_per_token": linear_ms,
            "gb_per_s": nbytes / linear_ms / 1e6, "stream_ms_per_token": stream_ms,
            "stream_gb_per_s": nbytes / stream_ms / 1e6}
