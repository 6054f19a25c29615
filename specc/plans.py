"""Graph plans: which graphs an engine holds, and the passes that make each one.

Every engine holds `prefill` (a static chunk of prompt tokens -> the next token) and `plain` (the
one-node tree: ordinary decoding, also the baseline); an engine whose tree has drafts holds
`step` (the tree verified in one call). A drafter kind adds its own graphs (specc/drafters/).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from torch import nn

from specc.passes.accept import accept
from specc.passes.compact_kv import compact_kv
from specc.passes.fuse_step import fuse_step
from specc.passes.matvec import matvec
from specc.passes.sample_last import sample_last
from specc.passes.tree_attention import tree_attention
from specc.passes.tree_inputs import tree_inputs

from .pipeline import Pipeline, capture
from .signature import SampledChildren
from .tree import Tree, chain

MODULES = ("target", "draft", "fused")  # whose tensors a graph runs on: the fused step holds both


@dataclass
class GraphPlan:
    name: str
    module: str  # one of MODULES
    T: int  # tokens (or drafter rows) per call
    pipeline: Pipeline
    fuse: tuple[str, str] | None = None  # (verify graph, drafter graph) that fuse_step joins


def start(backend: str) -> Pipeline:
    # Inductor only: it turns few-row products into streaming reductions; eager would materialise them.
    return Pipeline().add("matvec", matvec) if backend == "inductor" else Pipeline()


def prefill_pipeline(chunk: int, cache_len: int, backend: str) -> Pipeline:
    return (start(backend).add("tree_inputs", lambda ep: tree_inputs(ep, chain(chunk - 1), cache_len))
            .add("sample_last", sample_last))


def decode_pipeline(tree: Tree, cache_len: int, backend: str, sampled: SampledChildren | None = None) -> Pipeline:
    # tree_attention: the specc op runs SDPA itself on CPU and the Triton kernel on CUDA.
    return (start(backend).add("tree_attention", tree_attention)
            .add("tree_inputs", lambda ep: tree_inputs(ep, tree, cache_len))
            .add("accept", lambda ep: accept(ep, tree, sampled)).add("compact_kv", lambda ep: compact_kv(ep, tree)))


def graph_plans(kind, tree: Tree, chunk: int, cache_len: int, backend: str = "eager",
                sampled: SampledChildren | None = None) -> list[GraphPlan]:
    """The engine's graphs for drafter `kind` (a module of specc.drafters) and `tree`."""
    plans = [GraphPlan("prefill", "target", chunk, prefill_pipeline(chunk, cache_len, backend)),
             GraphPlan("plain", "target", 1, decode_pipeline(chain(0), cache_len, backend))]
    if tree.size > 1:
        plans.append(GraphPlan("step", "target", tree.size, decode_pipeline(tree, cache_len, backend, sampled)))
    return plans + kind.plans(tree, chunk, cache_len, backend, sampled)


def build_program(plan: GraphPlan, modules: dict[str, nn.Module], built: dict, tree: Tree,
                  dump_dir: Path | None = None):
    """Capture the plan's module (`modules[plan.module]`, which knows its own example inputs) and run
    the plan's passes; a fused plan instead joins two programs already `built`."""
    if plan.fuse is not None:
        verify_name, draft_name = plan.fuse
        ep = fuse_step(built[verify_name], built[draft_name], tree, modules["draft"].signature)
    else:
        module = modules[plan.module]
        ep = capture(module, module.example_inputs(plan.T))
    return plan.pipeline.run(ep, dump_dir=dump_dir, label=plan.name)
