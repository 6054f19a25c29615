"""Where a tree's verify and the plain step part ways, row by row and op by op.

    python examples/row_divergence.py [MODEL] [--dtypes float32,bfloat16,float16] [--backend inductor]
        [--tree chain:4] [--prompt TEXT] [--chat] [--context N] [--seed S] [--json]

Speculative greedy output equals plain decoding only if each row of a T-node verify gets the very bits
the 1-row plain step gets for the same token at the same position. For each dtype this builds the
engine's two verify programs for MODEL (default: the embedded SmolLM2) with the backend's passes,
writes the same text into their cache (the prompt, or --context random tokens), and reports

* rows: each tree node's logits against the plain program's along the node's path, bit for bit, as the
  backend runs them (inductor: both compiled with AOTInductor, as an engine's are);
* first op: the first node, in graph order, whose output for the root row differs, with both programs
  run eagerly node by node (where the graphs' own math makes rows differ).

Exit status 1 when any row differs. The drafts are random tokens: the check is about numerics, and a
wrong draft is verified by the same arithmetic as a right one.
"""
import argparse
import json
import sys

from specc.errors import SpeccError
from specc.models import load_model, parse_dtype
from specc.row_check import compare_rows, first_divergence, random_text
from specc.target_module import TargetModule
from specc.tree import parse_tree


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model", nargs="?", default=None)
    ap.add_argument("--dtypes", default="float32,bfloat16,float16")
    ap.add_argument("--backend", default="inductor", choices=("eager", "inductor"))
    ap.add_argument("--tree", default="chain:4")
    ap.add_argument("--prompt", default="Write a limerick about a compiler.")
    ap.add_argument("--chat", action="store_true")
    ap.add_argument("--context", type=int, default=0, help="random context tokens instead of the prompt")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    tree = parse_tree(args.tree)
    out, bad = [], False
    for name in args.dtypes.split(","):
        dtype = parse_dtype(name)
        loaded = load_model(args.model, dtype)
        vocab = loaded.model.config.vocab_size
        if args.context or loaded.tokenizer is None:
            context = random_text(vocab, args.context or 64, args.seed)
        elif args.chat:
            context = loaded.tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}],
                                                           add_generation_prompt=True, tokenize=True)
            context = list(context["input_ids"] if isinstance(context, dict) else context)
        else:
            context = loaded.tokenizer(args.prompt)["input_ids"]
        drafts = random_text(vocab, tree.size, args.seed + 1)
        target = TargetModule(loaded.model, len(context) + tree.size + 64)
        node = first_divergence(target, tree, context, drafts, args.backend)
        rows = compare_rows(target, tree, context, drafts, args.backend)
        bad |= not rows.identical
        out.append({"dtype": name, "backend": args.backend, "tree": args.tree, "context": len(context),
                    "rows": rows.as_dict(), "first_op": node.as_dict() if node else None})
        if not args.json:
            verdict = "every row identical" if rows.identical else (
                f"rows {rows.differing_rows} differ (max |diff| {rows.max_abs:.3g}, argmax flips at "
                f"{rows.argmax_flips or 'none'})")
            where = "none" if node is None else (f"{node.node} ({node.op}, call {node.occurrence}), "
                                                 f"{node.differing} values, max |diff| {node.max_abs:.3g}")
            print(f"{name:>9} {args.backend}: {verdict}; first op whose root row differs (eager): {where}",
                  flush=True)
    if args.json:
        print(json.dumps(out, indent=2))
    return 1 if bad else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except SpeccError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
