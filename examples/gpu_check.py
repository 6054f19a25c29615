"""Check and time specc's Triton kernels on a CUDA machine (H100/H200), then time the fused decode step.

    python examples/gpu_check.py [--json results.json] [--trials 20] [--layers 30] [--skip-kernels | --skip-engine]
    python examples/gpu_check.py --env-only --json env.json                # the environment report alone
    python examples/gpu_check.py --device cpu --layers 2 --skip-kernels    # a dry run of the engine part
    python examples/gpu_check.py --rows --json rows.json                   # row invariance of the verify

examples/gpu_check.sh runs it section by section (setup, environment, kernels, engine).

Shapes are SmolLM2-135M's: 9 query heads over 3 kv heads, head size 64, a static cache of 2048
slots, trees of T = 1, 4, 8, 16, 32 nodes, a vocabulary of 49152. For each kernel it reports the
largest error against the reference (attention: also both against a float64 computation) or the
number of mismatching results (acceptance, compaction: these must be exact), and the median time of
the op as the compiled graphs call it (torch.ops.specc.*, dispatching to Triton on CUDA) next to
its torch reference, measured with triton.testing.do_bench. Prints a markdown table; exits 1 if a
check fails. Runs in about a minute (most of it Triton compiling the kernels).

Then the engine: a target with SmolLM2-135M's shapes and random weights (no checkpoint can be
carried to the GPU machine), a random one-layer DFlash drafter, `--tree chain:3`, compiled with
the inductor backend for the GPU in bf16: only the graphs the timed runs call (greedy, one prefill
size that takes a whole prompt in one call), each graph's compile seconds printed as it finishes
and kept in the JSON (`compile_s_per_graph`), so a slow compile shows as a figure, not a timeout. Random drafts are almost never accepted, so every step
commits about one token; what is measured is the decode time per step of plain decoding (the
one-token graph), of the unfused speculative step (target step graph, then the drafter's graph)
and of the fused step (one graph), side by side per prompt (specc.harness: the order rotated each
round), medians over prompts and rounds; once with the decode calls replayed from captured CUDA
graphs and once launched kernel by kernel
(`specc.load(..., cuda_graphs=False)`), with the profiler's count of kernel launches, graph
launches and synchronising calls per step.
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time

import torch

MAX_SECONDS = 8 * 60
PROMPT_TOKENS = 64  # the engine section's prompts, and its one prefill chunk


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="also write the rows and the environment to this file")
    ap.add_argument("--trials", type=int, default=20, help="random trees per acceptance/compaction check")
    ap.add_argument("--device", default="cuda", help="where the engine part runs (cpu: a dry run, no kernels)")
    ap.add_argument("--shape", default="smollm2", choices=("smollm2", "qwen3-8b"),
                    help="the engine's target: SmolLM2-135M's or Qwen3-8B's layer shapes, random weights")
    ap.add_argument("--layers", type=int, default=None,
                    help="target layers (default: all 30 of SmolLM2-135M; 4 of Qwen3-8B's 36)")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--backend", default="inductor", help="the engine's backend (eager: a quick dry run)")
    ap.add_argument("--skip-kernels", action="store_true")
    ap.add_argument("--skip-engine", action="store_true")
    ap.add_argument("--env-only", action="store_true", help="report the environment (as JSON with --json) and stop")
    ap.add_argument("--rows", action="store_true",
                    help="check row invariance (each row of a verify = the plain step, bit for bit) and stop")
    ap.add_argument("--row-backends", default="eager,inductor", help="with --rows: the backends to check")
    args = ap.parse_args()
    if args.rows:
        start = time.time()
        report = check_rows(args)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"rows": report}, f, indent=1)
        print(f"whole check {time.time() - start:.0f} s.")
        return 0 if all(r["identical"] for r in report if r["claimed"]) else 1
    if args.env_only:
        env = environment()
        print(json.dumps(env, indent=1))
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"environment": env}, f, indent=1)
        return 0 if env["cuda_available"] and env["specc_ops"] else 1
    if args.device == "cpu":
        start = time.time()
        engine = time_engine(args)
        print_engine(engine, time.time() - start)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"engine": engine}, f, indent=1)
        return 0
    if not torch.cuda.is_available():
        print("gpu_check needs a CUDA GPU and this machine has none; the CPU tests (tests/test_kernels.py) "
              "check the kernels under TRITON_INTERPRET=1 instead.", file=sys.stderr)
        return 2
    try:
        import triton
        from triton.testing import do_bench
    except ImportError:
        print("gpu_check needs triton (pip install triton).", file=sys.stderr)
        return 2

    import specc.kernels as K
    from specc.target_module import additive_mask
    from specc.acceptance import accept_greedy, sampling_probs, tree_depth

    dev = torch.device("cuda")
    ops = torch.ops.specc
    KV, G, D, S, V = 3, 3, 64, 2048, 49152
    Ts = () if args.skip_kernels else (1, 4, 8, 16, 32)  # every kernel check loops over these
    rows, failed = [], []
    start = time.time()

    def bench(fn) -> float:
        return do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3  # microseconds

    def row(kernel, shape, dtype, check, ok, fn_triton, fn_torch, extra=None):
        t_tri, t_ref = bench(fn_triton), bench(fn_torch)
        r = {"kernel": kernel, "shape": shape, "dtype": str(dtype).replace("torch.", ""), "check": check,
             "ok": bool(ok), "triton_us": round(t_tri, 2), "torch_us": round(t_ref, 2),
             "speedup": round(t_ref / t_tri, 2)}
        r.update(extra or {})
        rows.append(r)
        if not ok:
            failed.append(f"{kernel} {shape} {r['dtype']}: {check}")
        print(f"  {kernel:<20} {shape:<34} {r['dtype']:<8} {check:<44} {t_tri:9.1f} us {t_ref:9.1f} us",
              flush=True)

    def random_tree(T, g):
        parents = [-1] + [int(torch.randint(0, i, (), generator=g)) for i in range(1, T)]
        kids = [[c for c in range(T) if parents[c] == i] for i in range(T)]
        table = torch.full((T, max(1, max(len(k) for k in kids))), -1, dtype=torch.int64)
        for i, k in enumerate(kids):
            table[i, :len(k)] = torch.tensor(k, dtype=torch.int64)
        return tuple(parents), table

    def tree_mask(T, base, parents, dtype):
        allowed = torch.zeros(T, S, dtype=torch.bool)
        allowed[:, :base] = True
        for i in range(T):
            j = i
            while j >= 0:
                allowed[i, base + j] = True
                j = parents[j]
        return additive_mask(allowed, dtype).view(1, 1, T, S)  # in the query's dtype, as engines pass it

    print(f"# specc kernels on {torch.cuda.get_device_name()} (torch {torch.__version__}, triton {triton.__version__})")
    g = torch.Generator().manual_seed(0)

    # ---- tree_attention: the decode step's attention over the whole static cache
    for dtype in (torch.bfloat16, torch.float32):
        tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
        for T in Ts:
            M = G * T
            parents, _ = random_tree(T, g)
            base = S - T - 137  # a part of the cache is still empty, as in a real step
            mask = tree_mask(T, base, parents, dtype).repeat(1, 1, G, 1).to(dev)
            q = torch.randn(1, KV, M, D, generator=g).to(dev, dtype)
            k = torch.randn(1, KV, S, D, generator=g).to(dev, dtype)
            v = torch.randn(1, KV, S, D, generator=g).to(dev, dtype)
            scale = D ** -0.5
            kv_len = torch.tensor(base + T, device=dev)  # what the engines pass: keys past it are not read
            got = ops.tree_attention(q, k, v, mask, scale, kv_len)
            ref = K.tree_attention_reference(q, k, v, mask, scale)
            exact = torch.softmax(q.double() @ k.double().transpose(-1, -2) * scale + mask.double(), -1) @ v.double()
            err = (got.double() - ref.double()).abs().max().item()
            err_t = (got.double() - exact).abs().max().item()
            err_r = (ref.double() - exact).abs().max().item()
            ok = err <= tol and err_t <= max(tol, 2 * err_r)
            row("tree_attention", f"q[1,{KV},{M},{D}] S={S}", dtype,
                f"max|tri-ref| {err:.1e} (vs fp64: {err_t:.1e} / {err_r:.1e})", ok,
                lambda: ops.tree_attention(q, k, v, mask, scale, kv_len),
                lambda: K.tree_attention_reference(q, k, v, mask, scale),
                {"err_vs_ref": err, "err_triton_vs_fp64": err_t, "err_ref_vs_fp64": err_r})

    # ---- acceptance: random trees, drafts that often follow the target's top token
    def drafts(table, scores):
        T = scores.shape[0]
        tokens = torch.randint(0, V, (T,), generator=g)
        best = scores.argmax(-1).cpu()
        for i in range(T):
            kids = [c for c in table[i].tolist() if c >= 0]
            if kids and float(torch.rand((), generator=g)) < 0.8:
                tokens[kids[int(torch.randint(0, len(kids), (), generator=g))]] = best[i]
        return tokens.to(dev)

    for T in Ts:
        bad = bad_s = 0
        accepted = []
        for trial in range(args.trials):
            if trial % 2:
                parents, table = random_tree(T, g)
            else:  # a chain
                parents = tuple(range(-1, T - 1))
                table = torch.full((T, 1), -1, dtype=torch.int64)
                table[:-1, 0] = torch.arange(1, T)
            depth = tree_depth(parents)
            table_d = table.to(dev)
            logits = (3 * torch.randn(T, V, generator=g)).to(dev)
            tokens = drafts(table, logits)
            got = [t.tolist() for t in ops.tree_accept_greedy(logits, tokens, table_d, depth)]
            ref = [t.tolist() for t in K.accept_greedy_reference(logits, tokens, table_d, depth)]
            bad += got != ref
            accepted.append(ref[0])
            probs = sampling_probs(logits, torch.tensor(0.8, device=dev), torch.tensor(0.95, device=dev))
            u = torch.rand(T + 1, generator=g).to(dev)
            got = [t.tolist() for t in ops.tree_accept_sample(probs, tokens, table_d, depth, u)]
            ref = [t.tolist() for t in K.accept_sample_reference(probs, tokens, table_d, depth, u)]
            bad_s += got != ref
        extra = {"trials": args.trials, "mean_accepted": sum(accepted) / len(accepted)}
        row("tree_accept_greedy", f"logits[{T},{V}] random trees", torch.float32,
            f"mismatches {bad}/{args.trials}", bad == 0,
            lambda: ops.tree_accept_greedy(logits, tokens, table_d, depth),
            lambda: accept_greedy(logits, tokens, parents, table_d), extra)  # the vectorised torch version
        row("tree_accept_sample", f"probs[{T},{V}] random trees", torch.float32,
            f"mismatches {bad_s}/{args.trials}", bad_s == 0,
            lambda: ops.tree_accept_sample(probs, tokens, table_d, depth, u),
            lambda: K.accept_sample_reference(probs, tokens, table_d, depth, u), extra)

    # ---- compact_kv_: one layer's cache, the accepted path of a random tree
    for T in Ts:
        bad = 0
        cache = torch.randn(1, KV, S, D, generator=g).to(dev, torch.bfloat16)
        for trial in range(args.trials):
            parents, _ = random_tree(T, g)
            node = int(torch.randint(0, T, (), generator=g))
            path = []
            while node >= 0:
                path.append(node)
                node = parents[node]
            path = path[::-1]
            path += [path[-1]] * (tree_depth(parents) + 1 - len(path))
            base = int(torch.randint(0, S - T, (), generator=g))
            src = (base + torch.tensor(path)).to(dev)
            dst = torch.tensor(base, device=dev)
            a, b = cache.clone(), cache.clone()
            ops.compact_kv_(a, src, dst)
            K.compact_kv_reference(b, src, dst)
            bad += not torch.equal(a, b)
        row("compact_kv_", f"cache[1,{KV},{S},{D}] n={len(path)}", torch.bfloat16, f"mismatches {bad}/{args.trials}",
            bad == 0, lambda: ops.compact_kv_(a, src, dst), lambda: K.compact_kv_reference(b, src, dst))

    # ---- rows_linear: a decode step's products on the tensor cores with one tile shape at every row count,
    # against cuBLAS (F.linear), whose kernel changes with the row count: the timing that decides whether
    # specc keeps its own product on CUDA; each row's bits must equal the one-row call's
    for dtype in (torch.bfloat16,):
        for N, K_ in ((1536, 576), (12288, 4096)) if Ts else ():
            w = (torch.randn(N, K_, generator=g) * K_ ** -0.5).to(dev, dtype)
            for T in Ts:
                x = torch.randn(1, T, K_, generator=g).to(dev, dtype)
                got = ops.rows_linear(x, w)
                ref = x.float() @ w.float().T
                err = ((got.float() - ref).abs().max() / ref.abs().max()).item()
                same = all(torch.equal(ops.rows_linear(x[:, i:i + 1].contiguous(), w)[0, 0], got[0, i])
                           for i in range(T))
                row("rows_linear", f"x[{T},{K_}] w[{N},{K_}]", dtype, f"rel err {err:.1e}, rows alike {same}",
                    err < 2e-2 and same, lambda: ops.rows_linear(x, w), lambda: torch.nn.functional.linear(x, w))

    engine = None
    try:
        engine = None if args.skip_engine else time_engine(args)
    except Exception as e:  # the kernel table above still counts; say what broke
        failed.append(f"engine: {type(e).__name__}: {e}")
    wall = time.time() - start
    print()
    print("| kernel | shape | dtype | check | ok | Triton (us) | torch (us) | speedup |")
    print("|---|---|---|---|---|---:|---:|---:|")
    for r in rows:
        print(f"| {r['kernel']} | {r['shape']} | {r['dtype']} | {r['check']} | {'yes' if r['ok'] else 'NO'} | "
              f"{r['triton_us']} | {r['torch_us']} | {r['speedup']} |")
    print(f"\n{len(rows) - len(failed)}/{len(rows)} checks passed in {wall:.0f} s. Torch columns: SDPA with the float "
          f"mask; specc.acceptance.accept_greedy (vectorised); the Python reference walks for sampling; "
          f"index_select + index_copy_ for compaction; cuBLAS (F.linear) for rows_linear.")
    if engine is not None:
        print_engine(engine, wall)
    if args.json:
        env = {**environment(), "wall_s": round(wall, 1)}
        with open(args.json, "w") as f:
            json.dump({"environment": env, "rows": rows, "engine": engine, "failed": failed}, f, indent=1)
    if wall > MAX_SECONDS:
        print(f"warning: took {wall:.0f} s, over the {MAX_SECONDS} s budget", file=sys.stderr)
    for f in failed:
        print(f"FAILED: {f}", file=sys.stderr)
    return 1 if failed else 0


def environment() -> dict:
    """What the machine has: GPU, memory, versions, and whether specc imports and registers its ops."""
    import os

    env = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
           "cuda_available": torch.cuda.is_available(),
           # what examples/gpu_setup.py exported for AOTInductor's CUDA build
           "cuda_home": os.environ.get("CUDA_HOME"), "library_path": os.environ.get("LIBRARY_PATH")}
    try:
        import triton
        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    if env["cuda_available"]:
        props = torch.cuda.get_device_properties(0)
        env.update(gpu=props.name, capability=f"{props.major}.{props.minor}", sms=props.multi_processor_count,
                   memory_gib=round(props.total_memory / 2**30, 1), devices=torch.cuda.device_count())
    try:
        import specc
        import specc.compiler  # noqa: F401  (the whole pipeline imports)
        import specc.kernels  # noqa: F401  (registers the ops)
        env["specc"] = specc.__version__
        env["specc_ops"] = all(hasattr(torch.ops.specc, op) for op in
                               ("tree_attention", "tree_accept_greedy", "tree_accept_sample", "compact_kv_"))
    except Exception as e:  # reported, not raised: the rest of the report still counts
        env["specc"], env["specc_ops"] = f"import failed: {type(e).__name__}: {e}", False
    return env


def check_rows(args) -> dict:
    """Row invariance on args.device: a random target of args.shape's layer shapes (2 layers), bf16 and
    float32 eager, bf16 inductor (of args.row_backends): every node of a chain of 5 and of a 2x2 tree verified in
    one call against the plain program along its path, bit for bit (specc.row_check). Chains are what
    the CUDA kernels are built to keep identical ("claimed"); branching trees are reported, not claimed."""
    from pathlib import Path

    from specc.row_check import compare_rows, random_text
    from specc.tree import parse_tree

    sys.path.insert(0, str(Path(__file__).resolve().parent))  # also when run with python -P
    from gpu_cost_curve import build

    out = []
    print(f"\n| rows ({args.shape}, {args.layers or 2} layers, {args.device}) | backend | dtype | tree | rows differing | argmax flips |"
          f"\n|---|---|---|---|---|---|", flush=True)
    for dtype in (torch.bfloat16, torch.float32):
        target, _ = build(args.shape, args.layers or 2, 160, "cpu", dtype)  # captured on the CPU, run on the device
        vocab = target.vocab_size
        for backend in args.row_backends.split(","):
            if backend == "inductor" and dtype != torch.bfloat16:
                continue  # compile time: the section has two minutes; bf16 is what GPU users run
            for spec in ("chain:4", "topk:2,2"):
                tree = parse_tree(spec)
                t0 = time.time()
                r = compare_rows(target, tree, random_text(vocab, 70, 1), random_text(vocab, tree.size, 2), backend,
                                 args.device)
                row = {"backend": backend, "dtype": str(dtype)[6:], "tree": spec, "claimed": spec.startswith("chain"),
                       "seconds": round(time.time() - t0, 1), **r.as_dict()}
                out.append(row)
                print(f"| | {backend} | {row['dtype']} | {spec} | {r.differing_rows or 'none'} "
                      f"(max {r.max_abs:.3g}) | {r.argmax_flips or 'none'} |", flush=True)
    return out


def time_engine(args) -> dict:
    """Compile a random engine of args.shape for args.device and time plain, unfused and fused steps."""
    import tempfile
    from pathlib import Path

    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    import specc
    from specc import harness
    from specc.drafters.dflash.model import DFlashDrafter, dflash_config_for, save_dflash

    sys.path.insert(0, str(Path(__file__).resolve().parent))  # also when run with python -P
    from gpu_cost_curve import SHAPES

    tmp = Path(tempfile.mkdtemp(prefix="specc-gpu-check-"))
    spec = dict(SHAPES[args.shape])
    arch, full_layers = spec.pop("arch"), spec["num_hidden_layers"]
    layers = min(args.layers or (full_layers if args.shape == "smollm2" else 4), full_layers)
    config_cls, model_cls = (LlamaConfig, LlamaForCausalLM) if arch == "llama" else (Qwen3Config, Qwen3ForCausalLM)
    cfg = config_cls(**{**spec, "num_hidden_layers": layers}, max_position_embeddings=8192, rope_theta=100000.0,
                     rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2)
    dtype = "bfloat16" if args.device.startswith("cuda") else "float32"
    torch.manual_seed(0)
    model_cls(cfg).to(getattr(torch, dtype)).save_pretrained(tmp / "target")  # bf16 on disk: 8B-wide tables are big
    save_dflash(DFlashDrafter(dflash_config_for(cfg, num_layers=1, block_size=4, num_taps=2, mask_token_id=0)),
                tmp / "dflash")
    print(f"\n# engine: random {args.shape}-shaped target ({layers} of {full_layers} layers), DFlash chain:3, "
          f"{args.backend}, {dtype}, {args.device}", flush=True)
    t0 = time.time()
    per_graph = {}

    def compiled(name: str, seconds: float) -> None:  # a line per graph as it is done
        per_graph[name] = seconds
        print(f"  compiled {name} in {seconds:.1f} s ({time.time() - t0:.0f} s so far)", flush=True)

    # Only what the timed runs call: greedy graphs (no sampling modes), one prefill size that takes a
    # whole prompt in one call (no second chunk graph, no prefill timing), no adaptive family.
    path = specc.compile(tmp / "target", drafter="dflash", drafter_path=tmp / "dflash", tree="chain:3",
                         backend=args.backend, device=args.device, dtype=dtype, max_len=1024,
                         prefill_chunk=PROMPT_TOKENS, output_dir=tmp / "engine", progress=False, modes="greedy",
                         on_graph=compiled)
    compile_s = time.time() - t0
    print(f"  compiled {len(per_graph)} graphs in {compile_s:.0f} s", flush=True)
    cuda = args.device.startswith("cuda")
    # Two loads of one engine: decode calls replayed from captured CUDA graphs, and launched kernel by
    # kernel (--no-cuda-graphs); on a CPU dry run only the second exists.
    engines = {"launch": specc.load(path, cuda_graphs=False)}
    if cuda:
        engines["cuda_graphs"] = specc.load(path, cuda_graphs=True)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, cfg.vocab_size, (PROMPT_TOKENS,), generator=g).tolist() for _ in range(args.prompts)]
    paths = ("plain", "unfused", "fused")

    def run(engine, ids, path, n):
        engine.use_fused = path == "fused"
        return engine.generate(ids, max_new_tokens=n, speculate=path != "plain", stop_at_eos=False)

    out = {"device": args.device, "shape": args.shape, "layers": layers, "layers_full": full_layers, "dtype": dtype,
           "compile_s": round(compile_s, 1), "compile_s_per_graph": per_graph, "new_tokens": args.new_tokens}
    for label, engine in engines.items():
        # the warm-up (and, with CUDA graphs, the captures), then the paths side by side, order rotated each round
        arms = {p: (lambda job, e=engine, p=p: run(e, job[0], p, job[1])) for p in paths}
        res = harness.paired(arms, args.rounds, items=[(ids, args.new_tokens) for ids in prompts],
                             warm=(prompts[0], 8))
        ms = harness.medians(res, key=lambda r: harness.decode_ms_per_step(r.stats))
        runs = zip(*(harness.values(res[p]) for p in paths))  # each prompt run: the three paths' outputs
        same = sum(len({tuple(r.token_ids) for r in outs}) == 1 for outs in runs)
        out[label] = {"runs_per_path": len(harness.values(res["fused"])),
                      "ms_per_step": {m: round(v, 3) for m, v in ms.items()},
                      "tau": round(harness.median(harness.values(res["fused"], key=lambda r: r.stats.tau)), 3),
                      "identical_runs": f"{same}/{len(prompts) * args.rounds}",
                      "per_step": launches_per_step(engine, prompts[0], run) if cuda else None}
    return out


def launches_per_step(engine, ids, run) -> dict:
    """Kernel launches, graph launches and synchronising calls per decode step, from the profiler's
    CUDA runtime events over one generation of each path (prefill excluded by subtracting a run of
    one new token)."""
    from torch.profiler import ProfilerActivity, profile

    kinds = {"kernel_launches": ("LaunchKernel", "cuLaunch"), "graph_launches": ("GraphLaunch",),
             "syncs": ("Synchronize",), "memcpys": ("Memcpy",)}

    def count(path, n):
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            r = run(engine, ids, path, n)
        names = [e.name for e in prof.events()]
        return r.stats.steps, {k: sum(any(w in name for w in words) for name in names) for k, words in kinds.items()}

    out = {}
    for path in ("plain", "fused"):
        steps_long, long = count(path, 33)
        steps_short, short = count(path, 1)
        steps = max(1, steps_long - steps_short)
        out[path] = {k: round((long[k] - short[k]) / steps, 2) for k in kinds}
    return out


def print_engine(e: dict, wall: float) -> None:
    labels = (("plain", "plain decoding (one-token graph)"), ("unfused", "unfused: step graph + drafter graph"),
              ("fused", "fused: one graph"))
    runs = [k for k in ("cuda_graphs", "launch") if k in e]
    print(f"\n| decode step ({e['shape']}, {e['device']}, {e['dtype']}, {e['layers']} of {e['layers_full']} layers) | "
          + " | ".join(f"ms/step {k} | vs plain" for k in runs) + " |")
    print("|---|" + "---:|---:|" * len(runs))
    for path, label in labels:
        cells = [f"{e[k]['ms_per_step'][path]:.3f} | {e[k]['ms_per_step'][path] / e[k]['ms_per_step']['plain']:.2f}x"
                 for k in runs]
        print(f"| {label} | " + " | ".join(cells) + " |")
    for k in runs:
        ms = e[k]["ms_per_step"]
        print(f"\n{k}: fused vs unfused {ms['unfused'] / ms['fused']:.3f}x per step; tau {e[k]['tau']} (random "
              f"drafts); identical tokens in {e[k]['identical_runs']} prompt runs (plain, unfused and fused agree "
              f"token for token where every verify row computes the plain step's bits: rows.json tells); per step "
              f"from the profiler: {e[k]['per_step']}")
    if "cuda_graphs" in e:
        print(f"CUDA graphs vs launches, fused step: "
              f"{e['launch']['ms_per_step']['fused'] / e['cuda_graphs']['ms_per_step']['fused']:.2f}x")
    for k in runs:  # the step's cost per layer, an upper bound (the head and the drafter are in it too)
        per_layer = {m: round(v / e["layers"], 4) for m, v in e[k]["ms_per_step"].items()}
        print(f"{k}: ms per layer (upper bound) {per_layer}; all {e['layers_full']} layers: about "
              f"{per_layer['plain'] * e['layers_full']:.2f} ms per plain step")
    graphs = ", ".join(f"{k} {v:.1f}" for k, v in e.get("compile_s_per_graph", {}).items())
    print(f"compile {e['compile_s']} s (per graph, s: {graphs}); whole script {wall:.0f} s.")


if __name__ == "__main__":
    sys.exit(main())
