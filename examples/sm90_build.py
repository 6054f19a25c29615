"""Build every Triton kernel of specc for the H100/H200 (sm_90a) with Triton's own compiler, no GPU needed,
and print what the cubins say: registers, spills, local and shared memory, MMA instructions, blocks
per SM. The launches are recorded from the launchers at each model shape (kernels/hopper_build.py).

    python examples/sm90_build.py [--shapes smollm2,qwen3-8b,llama3-70b] [--dtypes bfloat16,float16,float32]
                                  [--tree-sizes 1,8,16,32,64] [--json out.json] [--summary]

Prints a Markdown table (one row per distinct compiled variant); exits 1 if any variant fails the
check's rules (does not compile, spills, uses local memory, or needs more shared memory than a block
may take on an H100).
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from specc.kernels import hopper_build as hb


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=",".join(hb.SHAPES), help=f"of {', '.join(hb.SHAPES)}")
    ap.add_argument("--dtypes", default="bfloat16,float16,float32")
    ap.add_argument("--tree-sizes", default=",".join(map(str, hb.TREE_SIZES)))
    ap.add_argument("--json", default=None, help="also write the rows to this file")
    ap.add_argument("--summary", action="store_true", help="one row per kernel and dtype instead of per variant")
    a = ap.parse_args()
    why = hb.available()
    if why:
        print(f"sm90_build: cannot build for sm_90a here: {why}.", file=sys.stderr)
        return 2
    try:
        shapes = [hb.SHAPES[s] for s in a.shapes.split(",")]
        dtypes = [getattr(torch, d) for d in a.dtypes.split(",")]
        sizes = tuple(int(t) for t in a.tree_sizes.split(","))
        assert all(isinstance(d, torch.dtype) and d in hb.DTYPES for d in dtypes) and all(t >= 1 for t in sizes)
    except (KeyError, AttributeError, ValueError, AssertionError):
        print(f"sm90_build: --shapes takes {', '.join(hb.SHAPES)}; --dtypes bfloat16, float16, float32; "
              f"--tree-sizes positive integers.", file=sys.stderr)
        return 2
    labelled = [la for s in shapes for d in dtypes for la in hb.shape_launches(s, d, sizes)]
    t0 = time.perf_counter()
    rows = hb.build(labelled, progress=lambda b: print(f"  {b.kernel:<26} {b.seconds:>5.2f} s  {b.signature}",
                                                      file=sys.stderr, flush=True))
    import triton

    print(f"triton {triton.__version__}, torch {torch.__version__}, target sm_90a; {len(labelled)} launches, "
          f"{len(rows)} compiled variants in {time.perf_counter() - t0:.1f} s\n")
    print(hb.summary(rows) if a.summary else hb.table(rows))
    bad = [b for b in rows if b.problems()]
    for b in bad:
        print(f"\n{b.kernel} [{b.config}]: {'; '.join(b.problems())}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"triton": triton.__version__, "torch": torch.__version__, "launches": len(labelled),
                       "rows": hb.as_dicts(rows)}, f, indent=1)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
