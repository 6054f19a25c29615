"""The decode graphs' attention on CPU, alone: specc's slot-order kernel against ATen's SDPA.

    python examples/bench_attention.py [--dtypes float32,bfloat16] [--contexts 256,1024] [--Ts 1,4,8,16]
        [--calls 200] [--rounds 3] [--json] [--write BENCHMARKS.md]

One layer's attention of SmolLM2-135M (3 kv heads, 3 query heads each, head size 64) over a cache of
--contexts filled keys (a 2048-slot cache), for T tree nodes (M = 3T query rows per kv head), as the
decode graphs call it:

* rows_attention: specc_cpu::rows_attention (kernels/attention_cpu.cpp), each row summed over the keys in
  slot order (row-invariant: the CPU body of specc::tree_attention where the C++ kernels build);
* sdpa-blocks: ATen's SDPA over the keys read in whole blocks of 64 (attend_prefix without the C++ kernels);
* sdpa-exact: ATen's SDPA over exactly kv_len keys (attend_prefix before row invariance).

Interleaved rounds (the order rotated each round, specc.harness), medians of microseconds per call; the step
graph calls it once per layer (30).
"""
import argparse
import sys

import torch
import torch.nn.functional as F

from specc import benchfile, harness
from specc.errors import SpeccError
from specc.kernels import cpu_kernels
from specc.models import parse_dtype
from specc.passes.attend_prefix import keys_read


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--contexts", default="256,1024")
    ap.add_argument("--Ts", default="1,4,8,16")
    harness.bench_args(ap, rounds=3, calls=200, calls_help="calls of each op per round, timed as one block")
    a = ap.parse_args()
    try:
        dtypes = [parse_dtype(name) for name in a.dtypes.split(",")]
        contexts, Ts = [int(c) for c in a.contexts.split(",")], [int(t) for t in a.Ts.split(",")]
    except (SpeccError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if min(contexts) < 1 or min(Ts) < 1 or max(contexts) + max(Ts) > 2048:
        print("error: --contexts and --Ts must be positive with context + T <= 2048.", file=sys.stderr)
        return 2
    if not cpu_kernels.load_cpu_kernel():
        print(f"error: specc's C++ CPU kernels could not be built here ({cpu_kernels.load_error()}).", file=sys.stderr)
        return 2
    cmd = benchfile.command_line()
    KV, G, D, S = 3, 3, 64, 2048
    g = torch.Generator().manual_seed(0)
    op = torch.ops.specc_cpu.rows_attention
    calls = {}
    for dtype in dtypes:
        name = str(dtype).removeprefix("torch.")
        k = torch.randn(1, KV, S, D, generator=g).to(dtype)
        v = torch.randn(1, KV, S, D, generator=g).to(dtype)
        for context in contexts:
            for T in Ts:
                n = context + T  # kv_len: the tree's own slots are the last ones written
                q = torch.randn(1, KV, G * T, D, generator=g).to(dtype)
                rows = torch.arange(T).view(T, 1) + context
                mask = torch.zeros(T, S).masked_fill(torch.arange(S).view(1, S) > rows, -1e9)
                mask = mask.repeat(G, 1).view(1, 1, G * T, S).to(dtype)
                kv_len, blocks = torch.tensor(n), keys_read(n, S)
                calls[(name, context, T, "rows_attention")] = lambda q=q, k=k, v=v, m=mask, n=kv_len: op(q, k, v, m, 0.125, n)
                for label, keys in (("sdpa-blocks", blocks), ("sdpa-exact", n)):
                    calls[(name, context, T, label)] = lambda q=q, k=k, v=v, m=mask, j=keys: F.scaled_dot_product_attention(
                        q, k[:, :, :j], v[:, :, :j], attn_mask=m[..., :j], scale=0.125)
    arms = {key: (lambda fn=fn: 1e6 * harness.mean_time(fn, a.calls, warmup=5)) for key, fn in calls.items()}
    med = harness.medians(harness.paired(arms, a.rounds))  # microseconds per call; a warm-up round first
    rows_out, lines = [], ["| dtype | context | T (rows) | rows_attention us | sdpa-blocks us | sdpa-exact us | "
                           "rows / sdpa-exact |", "|---|---|---|---|---|---|---|"]
    for (name, context, T, label) in calls:
        if label != "rows_attention":
            continue
        r, b, e = (med[(name, context, T, x)] for x in ("rows_attention", "sdpa-blocks", "sdpa-exact"))
        rows_out.append({"dtype": name, "context": context, "T": T, "rows_us": round(r, 1), "sdpa_blocks_us": round(b, 1),
                         "sdpa_exact_us": round(e, 1)})
        lines.append(f"| {name} | {context} | {T} ({G * T}) | {r:.1f} | {b:.1f} | {e:.1f} | {r / e:.2f} |")
    setup = (f"One layer of SmolLM2-135M's attention (3 kv heads x {G} query rows per node, head size {D}, a {S}-slot "
             f"cache), torch threads {torch.get_num_threads()}, {a.calls} calls x {a.rounds} interleaved rounds after a "
             f"warm-up round, medians.")
    return harness.record(a, "Decode attention alone", setup, "\n".join(lines), command=cmd, attention=rows_out)


if __name__ == "__main__":
    sys.exit(main())
