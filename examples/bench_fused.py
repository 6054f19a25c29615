"""The fused decode step against the unfused one, side by side in one run (BENCHMARKS.md).

Fused: one graph call per step (verify, accept, KV compaction, drafter update, next drafts).
Unfused: the same engine's separate target step graph and drafter step graph, with the host
gathering the accepted rows in between. Both run on the same prompts, alternating per prompt,
with plain decoding through the same engine beside them; the tokens must be identical.

Usage: python examples/bench_fused.py [--configs dflash=chain:3,mtp=chain:1] [--limit 3]
           [--max-new-tokens 256] [--dataset mt-bench] [--out BENCHMARKS.md]
"""
import argparse
import datetime
import os
import platform
import statistics
import sys

import torch

import specc
from specc.data import load_prompts


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", default="dflash=chain:3,mtp=chain:1")
    ap.add_argument("--limit", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--dataset", default="mt-bench")
    ap.add_argument("--engines", default="engines/bench-fused")
    ap.add_argument("--out", default="BENCHMARKS.md")
    a = ap.parse_args()
    cmd = "python examples/bench_fused.py " + " ".join(sys.argv[1:])
    lines = [f"\n## Fused decode step vs unfused, {datetime.date.today().isoformat()}\n",
             f"Machine: {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__} (CPU), "
             f"{torch.get_num_threads()} threads. SmolLM2-135M-Instruct with the shipped drafters, fp32, inductor, "
             f"greedy, {a.max_new_tokens} new tokens, first {a.limit} {a.dataset} prompts (chat template), EOS ignored; "
             f"warm-up excluded; the three methods alternate per prompt; medians over prompts.\n",
             f"```\n{cmd}\n```\n",
             "| drafter | tree | fused tokens/s | unfused tokens/s | fused vs unfused | plain tokens/s | fused vs plain "
             "| ms/step fused | ms/step unfused | tau | identical tokens |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    prompts = load_prompts(a.dataset, a.limit)
    for item in a.configs.split(","):
        kind, _, tree = item.partition("=")
        path = specc.compile(None, drafter=kind, tree=tree, backend="inductor",
                             output_dir=f"{a.engines}/{kind}-{tree.replace(':', '')}", max_len=1024)
        engine = specc.load(path)
        ids = [engine.encode(p, chat=True) for p in prompts]

        def run(x, mode, n):
            engine.use_fused = mode == "fused"
            return engine.generate(x, max_new_tokens=n, speculate=mode != "plain", stop_at_eos=False)

        for mode in ("fused", "unfused", "plain"):  # warm-up
            run(ids[0], mode, 8)
        tps = {m: [] for m in ("fused", "unfused", "plain")}
        step_ms = {m: [] for m in ("fused", "unfused")}
        same, tau = 0, []
        for x in ids:
            outs = {}
            for mode in tps:
                r = run(x, mode, a.max_new_tokens)
                tps[mode].append(r.stats.tokens_per_s)
                outs[mode] = r.token_ids
                if mode in step_ms:
                    step_ms[mode].append(1000 * (r.stats.wall_s - r.stats.prefill_s) / r.stats.steps)
                if mode == "fused":
                    tau.append(r.stats.tau)
            same += outs["fused"] == outs["unfused"] == outs["plain"]
        med = {m: statistics.median(v) for m, v in tps.items()}
        lines.append(f"| {kind} | {tree} | {med['fused']:.2f} | {med['unfused']:.2f} | {med['fused'] / med['unfused']:.3f}x "
                     f"| {med['plain']:.2f} | {med['fused'] / med['plain']:.2f}x | "
                     f"{statistics.median(step_ms['fused']):.1f} | {statistics.median(step_ms['unfused']):.1f} | "
                     f"{statistics.median(tau):.2f} | {same}/{len(ids)} |")
        print(lines[-1], flush=True)
    with open(a.out, "a") as f:
        f.write("\n".join(lines) + "\n\n")
    print(f"appended to {a.out}")
    return 0


if __name__ == "__main__":
    from specc.cli import _quiet_libraries

    _quiet_libraries()
    sys.exit(main())
