"""The few-row products of one decode step alone: specc's C++ product against Inductor's reduction.

    python examples/bench_products.py [--weights float32,int8] [--rows 1,2,4,8] [--by-width]
        [--calls 10] [--rounds 5] [--json] [--write BENCHMARKS.md]

Every product weight of SmolLM2-135M-Instruct (random values of the real shapes: each layer's fused
q/k/v, output, gate/up and down projections, and the LM head) applied to R rows, in one graph that
the `matvec` pass rewrites and AOTInductor compiles, twice per weight format and row count: with
`specc::rows_linear`'s C++ product at every row count, and with the C++ product turned off (its
reference: the reduction Inductor compiles). The weights are graph inputs, so the packages share
one copy. Each round times every package in turn (the order rotated round by round); figures are
medians over all calls. The last column says which of the two the compiler picks at that row count
(kernels/rows_linear.py); that depends on the weight's input width too, so `--by-width` compiles
and times the weights of each input width (576: q/k/v, output, gate/up, LM head; 1536: down) as
packages of their own. Without it, a row count where specc picks differently per width times
neither of the two columns' forms: only `--by-width` times what specc runs there.
"""
import argparse
import sys
import tempfile
from pathlib import Path

import torch
from torch import nn
from transformers import AutoConfig

from specc import benchfile, harness
from specc.kernels import cpu_kernels
from specc.kernels import rows_linear as rl
from specc.models import resolve_model
from specc.passes.matvec import matvec
from specc.pipeline import capture


def shapes(config) -> list[tuple[int, int]]:
    """[out, in] of every product a decode step runs, in order."""
    h, kv = config.hidden_size, config.num_key_value_heads * (config.hidden_size // config.num_attention_heads)
    layer = [(h + 2 * kv, h), (h, h), (2 * config.intermediate_size, h), (h, config.intermediate_size)]
    return layer * config.num_hidden_layers + [(config.vocab_size, h)]


class Products(nn.Module):
    """Each product of x (or of its wider sibling for the down projections) with its weight, every
    output returned as it is (stored, as a decode step stores it: summing them instead would let
    Inductor fuse the sum into the reduction and skip the stores)."""

    def __init__(self, int8: bool):
        super().__init__()
        self.int8 = int8

    def forward(self, x, x_wide, *weights):
        outs = []
        for i in range(0, len(weights), 2 if self.int8 else 1):
            w = weights[i]
            inp = x if w.shape[1] == x.shape[-1] else x_wide
            y = nn.functional.linear(inp, w.to(inp.dtype)) * weights[i + 1] if self.int8 else nn.functional.linear(inp, w)
            outs.append(y)
        return tuple(outs)


def compile_products(int8: bool, rows: int, cpp: bool, args: tuple, out: Path):
    """An AOTInductor package of the products at `rows` rows, with the C++ product at every row count
    or turned off."""
    saved_state, saved_budget, saved_f32 = dict(cpu_kernels._state), rl.REDUCTION_ROWS_BYTES, rl.FLOAT32_KERNEL
    try:
        if cpp:
            rl.REDUCTION_ROWS_BYTES, rl.FLOAT32_KERNEL = 0, True  # every row count "many"
        else:
            cpu_kernels._state["loaded"] = False
        ep = matvec(capture(Products(int8), args))
        path = torch._inductor.aoti_compile_and_package(ep, package_path=str(out))
    finally:
        cpu_kernels._state.clear()
        cpu_kernels._state.update(saved_state)
        rl.REDUCTION_ROWS_BYTES, rl.FLOAT32_KERNEL = saved_budget, saved_f32
    return torch._inductor.aoti_load_package(path)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--weights", default="float32,int8")
    ap.add_argument("--rows", default="1,2,4,8")
    ap.add_argument("--by-width", action="store_true", help="one package per input width of the weights")
    harness.bench_args(ap, rounds=5, calls=10, calls_help="calls per package per round")
    a = ap.parse_args()
    formats, row_counts = a.weights.split(","), sorted({int(r) for r in a.rows.split(",")})
    if any(f not in ("float32", "int8") for f in formats) or row_counts[0] < 1 or row_counts[-1] > 16:
        print("error: --weights takes float32 and int8, --rows 1 to 16.", file=sys.stderr)
        return 2
    if not cpu_kernels.load_cpu_kernel():
        print(f"error: specc's C++ CPU products could not be built here ({cpu_kernels.load_error()}).",
              file=sys.stderr)
        return 2
    cmd = benchfile.command_line()
    config = AutoConfig.from_pretrained(resolve_model(None)[0])
    gen = torch.Generator().manual_seed(0)
    # groups of products timed together: all of them, or (--by-width) those of each input width
    widths = sorted({k for _, k in shapes(config)})
    groups = {w: [i for i, (_, k) in enumerate(shapes(config)) if k == w] for w in widths} if a.by_width \
        else {"all": list(range(len(shapes(config))))}
    weights, nbytes = {}, {}
    for f in formats:
        ws = []
        for n, k in shapes(config):
            if f == "int8":
                ws.append([torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8), torch.rand(n, generator=gen)])
            else:
                ws.append([torch.randn(n, k, generator=gen)])
        for g, members in groups.items():
            weights[(f, g)] = [t for i in members for t in ws[i]]
            nbytes[(f, g)] = sum(t.numel() * t.element_size() for t in weights[(f, g)] if t.dim() == 2)

    calls = {}  # (format, group, rows, cpp) -> (package, args)
    with tempfile.TemporaryDirectory() as tmp:
        for f in formats:
            for g in groups:
                for r in row_counts:
                    args = (torch.randn(1, r, config.hidden_size, generator=gen),
                            torch.randn(1, r, config.intermediate_size, generator=gen), *weights[(f, g)])
                    for cpp in (True, False):
                        if not a.json:
                            print(f"compiling {f} x {r} rows{'' if g == 'all' else f' of {g} inputs'}, "
                                  f"{'C++ product' if cpp else 'reduction'}", file=sys.stderr)
                        pkg = compile_products(f == "int8", r, cpp, args, Path(tmp) / f"{f}-{g}-{r}-{cpp}.pt2")
                        calls[(f, g, r, cpp)] = (pkg, args)
        # every package in turn each round (2 untimed calls first), the order rotated round by round
        arms = {key: (lambda pkg=pkg, args=args: harness.call_times(lambda: pkg(*args), a.calls, warmup=2))
                for key, (pkg, args) in calls.items()}
        res = harness.paired(arms, a.rounds, warmup=0)
    med = {key: 1000 * harness.median(t for times in harness.values(res[key]) for t in times) for key in calls}

    gb_s = benchfile.machine()["matvec_gb_s"]
    def uses(f: str, g, r: int) -> str:
        dtype = torch.int8 if f == "int8" else torch.float32
        by = {k: "C++" if rl.kernel_rows(r, k, dtype) else "reduction" for k in (widths if g == "all" else [g])}
        if f == "float32" and any(r == 1 or rl.many_rows(r, k) for k in by):  # settings compile times
            by = {k: v + " (rule; compile times it)" if r == 1 or rl.many_rows(r, k) else v for k, v in by.items()}
        return next(iter(by.values())) if len(set(by.values())) == 1 else ", ".join(f"{v} at {k}" for k, v in by.items())

    rows_out = [{"weights": f, "inputs": g, "rows": r, "cpp_ms": round(med[(f, g, r, True)], 3),
                 "reduction_ms": round(med[(f, g, r, False)], 3), "specc_uses": uses(f, g, r)}
                for f in formats for g in groups for r in row_counts]
    lines = ["| weights | inputs | MB | rows | C++ product ms | reduction ms | specc uses |", "|---|---|---|---|---|---|---|"]
    for row in rows_out:
        lines.append(f"| {row['weights']} | {row['inputs']} | {nbytes[(row['weights'], row['inputs'])] / 1e6:.0f} | "
                     f"{row['rows']} | {row['cpp_ms']:.2f} | {row['reduction_ms']:.2f} | {row['specc_uses']} |")
    setup = (f"SmolLM2-135M-Instruct's {len(shapes(config))} decode-step products (random weights of the real shapes) "
             f"through AOTInductor after the matvec pass, {a.calls} calls per package per round x {a.rounds} rounds, "
             f"medians. For scale: MKL's sgemv reads {gb_s} GB/s here (the machine line).")
    title = "Products by weight width" if a.by_width else "Decode-step products alone"
    return harness.record(a, title, setup, "\n".join(lines), command=cmd, products=rows_out)


if __name__ == "__main__":
    sys.exit(main())
