"""Graph plans: which graphs an engine holds, and the passes that make each one.

Every engine holds `prefill` (a static chunk of prompt tokens -> the next token; `prefill128` and the
like for larger chunks, --prefill-chunk 128,32) and `plain` (the
one-node tree: ordinary decoding, also the baseline); an engine whose tree has drafts holds
`step` (the tree verified in one call). A drafter kind adds its own graphs (specc/drafters/).
Graphs that sample exist once per sampling mode the engine carries (`plain_greedy`,
`step_top_p`, ...: specc.signature.MODES); the modes share one capture of the target.
"""
from __future__ import annotations

import shutil
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from torch import nn

from specc.passes.accept import accept
from specc.passes.compact_kv import compact_kv
from specc.passes.fuse_step import fuse_step
from specc.passes.last_row_head import last_row_head
from specc.passes.matvec import matvec
from specc.passes.sample_last import sample_last
from specc.passes.tree_attention import tree_attention
from specc.passes.tree_inputs import tree_inputs

from .adaptive import family_sizes, fused_name, prefix, step_name
from .backends import get_backend
from .pipeline import Pipeline, capture
from .prefill import prefill_name
from .signature import MODES, SampledChildren, graph_name, uniform_columns
from .tree import Tree, chain

MODULES = ("target", "draft", "fused")  # whose tensors a graph runs on: the fused step holds both


@dataclass
class GraphPlan:
    name: str  # the graph's key in the engine: graph_name(what it is, its mode)
    module: str  # one of MODULES
    T: int  # tokens (or drafter rows) per call
    pipeline: Pipeline
    fuse: tuple[str, str] | None = None  # (verify graph, drafter graph) that fuse_step joins
    mode: str | None = None  # the sampling mode it is built for; None: one graph serves every mode
    table: tuple[int, int] | None = None  # fused: the shape of the generation's uniforms table
    base: "GraphPlan | None" = None  # a first stage the modes share (captured once, never lowered)

    @property
    def passes(self) -> list[str]:
        fused = [f"fuse_step({', '.join(self.fuse)})"] if self.fuse else []
        return fused + (self.base.passes if self.base else []) + self.pipeline.names


def start(backend: str, verify: bool = True) -> Pipeline:
    """Inductor: few-row products become rows_linear or streaming reductions. Eager, in the target's
    decode graphs (`verify`): those over stored weights become rows_linear, whose eager body computes
    each row alike at any row count (a library GEMM does not: a verify row would differ from the plain
    step's); the written-out reductions would be materialised there, and prefill chunks (which plain
    and speculative decoding share) and drafter graphs (whose drafts are verified exactly whatever their
    bits) keep their GEMMs. onnx/tensorrt keep linear."""
    products = get_backend(backend).products
    if products == "all":
        return Pipeline().add("matvec", matvec)
    if products == "verify" and verify:
        return Pipeline().add("matvec", partial(matvec, stored_only=True))
    return Pipeline()


def prefill_plans(name: str, module: str, chunk: int, cache_len: int, backend: str, modes,
                  table: tuple[int, int] = (1, 2)) -> list[GraphPlan]:
    """A static chunk of prompt tokens -> the next token, one graph per mode over one shared capture."""
    base = GraphPlan(name, module, chunk, start(backend, verify=False).wrap("tree_inputs",
                                                               lambda p: tree_inputs(p, chain(chunk - 1), cache_len)))
    def last(m: str) -> Pipeline:
        p = Pipeline().wrap("sample_last", partial(sample_last, mode=m, table=table)).add("last_row_head", last_row_head)
        # the head is one row now (prefill only)
        return p.add("matvec", matvec) if get_backend(backend).products == "all" else p

    return [GraphPlan(graph_name(name, m), module, chunk, last(m), mode=m, base=base) for m in modes]


def decode_plans(name: str, module: str, tree: Tree, cache_len: int, backend: str, modes,
                 sampled: SampledChildren | None = None, table: tuple[int, int] = (1, 2)) -> list[GraphPlan]:
    """`tree` verified in one call, one graph per mode: the mode-free passes run once, then each
    mode's acceptance and KV compaction."""
    # tree_attention: the specc op runs SDPA itself on CPU and the Triton kernel on CUDA.
    base = GraphPlan(name, module, tree.size, start(backend).add("tree_attention", tree_attention)
                     .wrap("tree_inputs", lambda p: tree_inputs(p, tree, cache_len)))
    return [GraphPlan(graph_name(name, m), module, tree.size,
                      Pipeline().wrap("accept", partial(accept, tree=tree, sampled=sampled, mode=m, table=table))
                      .wrap("compact_kv", lambda p: compact_kv(p, tree)), mode=m, base=base) for m in modes]


def graph_plans(kind, tree: Tree, chunk: int, cache_len: int, backend: str = "eager",
                sampled: SampledChildren | None = None, modes=MODES, adaptive: bool = False,
                larger_chunks=()) -> list[GraphPlan]:
    """The engine's graphs for drafter `kind` (a module of specc.drafters), `tree` and sampling `modes`;
    `adaptive` adds a step graph for each of the tree's node-count prefixes (specc/adaptive.py), and
    where the kind fuses its step, a fused step for each (it drafts the whole next tree).
    `larger_chunks`: prefill chunk sizes beyond `chunk`, each a chunk graph of its own (the drafters'
    graphs keep `chunk`)."""
    table = uniform_table(cache_len, tree, sampled)  # every graph of a generation reads the one table
    plans = [p for c in sorted(larger_chunks, reverse=True)
             for p in prefill_plans(prefill_name(c, chunk), "target", c, cache_len, backend, modes, table)]
    plans += (prefill_plans("prefill", "target", chunk, cache_len, backend, modes, table)
             + decode_plans("plain", "target", chain(0), cache_len, backend, modes, table=table))
    if adaptive:
        for k in family_sizes(tree)[1:-1]:
            plans += decode_plans(step_name(k, tree.size), "target", prefix(tree, k), cache_len, backend, modes,
                                  sampled, table)
    if tree.size > 1:
        plans += decode_plans("step", "target", tree, cache_len, backend, modes, sampled, table)
    own = kind.plans(tree, chunk, cache_len, backend, sampled, modes)
    if adaptive:
        own += [GraphPlan(graph_name(fused_name(k, tree.size), p.mode), "fused", k, Pipeline(),
                          fuse=(graph_name(step_name(k, tree.size), p.mode), p.fuse[1]), mode=p.mode, table=p.table)
                for p in own if p.fuse is not None for k in family_sizes(tree)[:-1]]
    return plans + own


def uniform_table(cache_len: int, tree: Tree, sampled: SampledChildren | None) -> tuple[int, int]:
    """The shape of an engine's uniforms table: a row per cache position (signature.uniform_columns)."""
    return cache_len, uniform_columns(tree.size, sampled)


def build_program(plan: GraphPlan, modules: dict[str, nn.Module], built: dict, tree: Tree,
                  dump_dir: Path | None = None, keep_uncaptured: bool = False):
    """Capture the plan's module (`modules[plan.module]`, which knows its own example inputs) and run
    the plan's passes; a plan with a base starts from the base's program (built once, kept in
    `built` under ("base", name)); a fused plan instead joins two programs already `built`."""
    if plan.fuse is not None:
        verify_name, draft_name = plan.fuse
        ep = fuse_step(built[verify_name], built[draft_name], tree, modules["draft"].signature(plan.mode or "greedy"),
                       plan.table, plan.T)
    elif plan.base is not None:
        key, base_dump = ("base", plan.base.name), Path(dump_dir) / ".base" if dump_dir else None
        if key not in built:  # left uncaptured when it ends in wrapping passes: each mode captures once
            built[key] = build_program(plan.base, modules, built, tree, base_dump, keep_uncaptured=True)
        if dump_dir is not None:  # each graph's dump holds every pass that made it, the shared ones too
            for f in sorted(base_dump.glob(f"{plan.base.name}.*.txt")):
                shutil.copyfile(f, Path(dump_dir) / f"{plan.name}{f.name[len(plan.base.name):]}")
        return plan.pipeline.run(built[key], dump_dir=dump_dir, label=plan.name, first=len(plan.base.passes) + 1)
    else:
        module = modules[plan.module]
        ep = capture(module, module.example_inputs(plan.T) if plan.mode is None else
                     module.example_inputs(plan.T, plan.mode))
    return plan.pipeline.run(ep, dump_dir=dump_dir, label=plan.name, keep_uncaptured=keep_uncaptured)
