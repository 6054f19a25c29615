"""Pass `functional_kv`: the caches become explicit inputs and outputs, for graphs that cannot mutate.

ONNX (and TensorRT, which builds from it) has no buffer mutation: torch.onnx keeps a program's user
outputs and silently drops its writes to buffers and inputs. This pass turns a finished specc
program into a pure function

    (past.<cache>..., *inputs) -> (*outputs, present.<cache>...)

where each `present` has its `past`'s shape and is `past` with the call's rows written, and puts
only standard operators between them:

* every cache write becomes one `specc::kv_write(cache, update, start, axis)`: a contiguous block of
  rows written at `start`. specc writes caches only at `start + arange(n)` (tree_inputs' slots,
  compact_kv's destination, DFlash's context rows); the pass checks that form and refuses any other
  write, because the ONNX op it becomes (TensorScatter-24, or ScatterND) writes one block.
* the specc ops become their torch references, which are standard operators: tree attention is
  masked attention over the whole static cache (ONNX Attention-23), acceptance is argmax / gather /
  cumulative products over the static tree, and compaction of the accepted path is a gather of its
  rows and a second contiguous block write at base_len.

The runner binds each `present` to its `past`'s memory, so a block write is made in place.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.utils import _pytree as pytree

import specc.kernels  # noqa: F401  (registers torch.ops.specc.*)
from specc.kernels.tree_accept import accept_greedy_reference, accept_sample_reference
from specc.kernels.tree_attention import tree_attention_reference
from specc.pipeline import canonical_name, example_inputs

@torch.library.custom_op("specc::kv_write", mutates_args=())
def kv_write(cache: Tensor, update: Tensor, start: Tensor, axis: int) -> Tensor:
    """`cache` with `update` written at rows start .. start + update.shape[axis] - 1 of `axis` (a copy)."""
    idx = torch.arange(update.shape[axis], device=cache.device) + start
    return cache.index_copy(axis, idx, update)


@kv_write.register_fake
def _(cache, update, start, axis):
    return torch.empty_like(cache)


def _compact_kv(cache: Tensor, src_slots: Tensor, dst_start: Tensor) -> None:
    """specc::compact_kv_ in standard ops: the rows gathered, then written as one block at dst_start."""
    dst = torch.arange(src_slots.shape[0], device=cache.device) + dst_start
    cache.index_copy_(2, dst, cache.index_select(2, src_slots))


def _tree_attention(q, k_cache, v_cache, mask, scale, kv_len=None):
    return tree_attention_reference(q, k_cache, v_cache, mask, scale)


REFERENCES = {
    torch.ops.specc.tree_attention.default: _tree_attention,
    torch.ops.specc.tree_accept_greedy.default: accept_greedy_reference,
    torch.ops.specc.tree_accept_sample.default: accept_sample_reference,
    torch.ops.specc.compact_kv_.default: _compact_kv,
}


class Functional(nn.Module):
    """The program's module with its caches swapped for explicit inputs, which it returns after writing."""

    def __init__(self, module: nn.Module, cache_fqns: list[str]):
        super().__init__()
        self.inner = module
        self.cache_fqns = cache_fqns

    def forward(self, *args):
        n = len(self.cache_fqns)
        caches, inputs = args[:n], args[n:]
        out = torch.func.functional_call(self.inner, dict(zip(self.cache_fqns, caches)), inputs, strict=False)
        return (*(out if isinstance(out, tuple) else (out,)), *caches)


def mutated_buffers(ep: torch.export.ExportedProgram) -> list[str]:
    """The buffers the program writes (its caches), in the order the program holds them: those its
    signature lists as mutated, and those an op writes in place in the graph (specc's finished
    programs keep index_copy_ / compact_kv_ on the buffer itself)."""
    buffers = {s.arg.name: s.target for s in ep.graph_signature.input_specs if s.kind.name == "BUFFER"}
    written = set(ep.graph_signature.buffers_to_mutate.values())
    alias = {name: name for name in buffers}  # node -> the buffer placeholder it is (an in-place op's result)
    for node in ep.graph.nodes:
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            continue
        for arg, value in zip(node.target._schema.arguments, node.args):
            info = arg.alias_info
            if info is not None and info.is_write and isinstance(value, torch.fx.Node) and value.name in alias:
                written.add(buffers[alias[value.name]])
                alias[node.name] = alias[value.name]
    return [s.target for s in ep.graph_signature.input_specs if s.kind.name == "BUFFER" and s.target in written]


def _block_start(idx: torch.fx.Node):
    """`start` when idx is `arange(n) + start` (or `start + arange(n)`), else None."""
    if idx.op != "call_function" or idx.target != torch.ops.aten.add.Tensor:
        return None
    a, b = idx.args

    def is_arange(n):
        return (isinstance(n, torch.fx.Node) and n.target in (torch.ops.aten.arange.default, torch.ops.aten.arange.start)
                and (n.target == torch.ops.aten.arange.default or n.args[0] == 0))

    if is_arange(a):
        return b
    if is_arange(b):
        return a
    return None


@dataclass
class FunctionalProgram:
    program: torch.export.ExportedProgram
    caches: list[str]  # canonical names, in input (and output) order
    n_outputs: int  # the original program's outputs
    compacted: list[str]  # caches whose accepted path is compacted by the separate compaction program


def functional_kv(ep: torch.export.ExportedProgram) -> FunctionalProgram:
    """Invariant: the program mutates nothing; its user inputs are the caches (`caches` order) then the
    original inputs; its user outputs are the original outputs, then -- if the program compacted
    the accepted path (specc::compact_kv_) -- that compaction's source slots and destination start,
    then each cache after the call. Every cache write is one `specc::kv_write` block; no other specc
    op remains. The compaction itself is left to `compaction_program`: in the same graph its write
    would read the first write's result, an intermediate every runtime copies whole."""
    module = ep.module()
    n_outputs = len(ep.graph_signature.user_outputs)
    compacted = _split_compaction(module)
    for node in module.graph.nodes:
        if node.op == "call_function" and node.target in REFERENCES:
            node.target = REFERENCES[node.target]
    module.recompile()
    fqns = mutated_buffers(ep)
    caches = [module.get_buffer(f).clone() for f in fqns]
    with torch.no_grad():
        fep = torch.export.export(Functional(module, fqns), (*caches, *example_inputs(ep)), strict=False)
    fep = fep.run_decompositions({})
    _blocks(fep, set(fep.graph_signature.user_inputs[:len(fqns)]))
    return FunctionalProgram(fep, [canonical_name(f) for f in fqns], n_outputs, [canonical_name(f) for f in compacted])


def _split_compaction(module: torch.fx.GraphModule) -> list[str]:
    """Remove the compact_kv_ calls (all with one source and destination, the compact_kv pass's form)
    and return those two as extra outputs; returns the compacted caches' names."""
    g = module.graph
    calls = [n for n in g.nodes if n.op == "call_function" and n.target == torch.ops.specc.compact_kv_.default]
    if not calls:
        return []
    src, dst = calls[0].args[1:3]
    names = []
    for n in calls:
        cache = n.args[0]
        while cache.op == "call_function" and cache.target._schema.name.endswith("_"):  # an in-place write returns its input
            cache = cache.args[0]
        if n.args[1:3] != (src, dst) or cache.op != "get_attr":
            raise ValueError(f"{n.name}: the caches of one graph are compacted along one path from a cache buffer.")
        names.append(cache.target)
        g.erase_node(n)
    out = g.output_node()
    outs = out.args[0]
    outs = (*outs, src, dst) if isinstance(outs, (tuple, list)) else (outs, src, dst)
    out.args = (outs,)
    codegen = g._codegen  # the unlifted module unflattens its outputs by this spec: two more leaves now
    codegen.pytree_info = codegen.pytree_info._replace(out_spec=pytree.tree_structure(tuple(range(len(outs)))))
    g.eliminate_dead_code()
    module.recompile()
    return names


class Compaction(nn.Module):
    """The accepted path's rows (src) of each cache written as one block at dst."""

    def __init__(self, n: int):
        super().__init__()
        self.n = n

    def forward(self, *args):
        caches, (src, dst) = args[:self.n], args[self.n:]
        return tuple(torch.ops.specc.kv_write(c, c.index_select(2, src), dst, -2) for c in caches)


def compaction_program(ep: torch.export.ExportedProgram, compacted: list[str]) -> torch.export.ExportedProgram:
    """(past caches..., src [D+1], dst []) -> the caches with rows src moved to dst.. (functional_kv's split)."""
    module = ep.module()
    by_canon = {canonical_name(n): b for n, b in module.named_buffers()}
    caches = [by_canon[c].clone() for c in compacted]
    src = torch.zeros(_compact_rows(module), dtype=torch.int64)
    with torch.no_grad():
        return torch.export.export(Compaction(len(caches)), (*caches, src, torch.tensor(0)), strict=False)


def _compact_rows(module: torch.fx.GraphModule) -> int:
    n = next(n for n in module.graph.nodes if n.op == "call_function" and n.target == torch.ops.specc.compact_kv_.default)
    return n.args[1].meta["val"].shape[0]


def _blocks(ep: torch.export.ExportedProgram, cache_inputs: set[str]) -> None:
    """Every index_copy into a cache (the only way specc writes one) becomes a kv_write block, in place."""
    g = ep.graph
    written = {n for n in g.nodes if n.op == "placeholder" and n.name in cache_inputs}
    for node in list(g.nodes):
        if node.op != "call_function" or node.target not in (torch.ops.aten.index_copy.default,
                                                             torch.ops.specc.kv_write.default):
            continue
        if node.args[0] not in written:  # an index_copy into something else stays one
            continue
        written.add(node)
        if node.target == torch.ops.specc.kv_write.default:
            continue
        cache, axis, idx, update = node.args
        rank = cache.meta["val"].dim()
        if rank != 4 or axis % rank != 2:
            raise ValueError(f"{node.name} writes a {rank}-D cache along axis {axis}; specc's caches are "
                             f"[batch, kv_heads, slots, head_dim], written along the slots (axis -2).")
        axis = -2  # TensorScatter's (and TensorRT's) form
        start = idx if tuple(idx.meta["val"].shape) == (1,) else _block_start(idx)
        if start is None:
            raise ValueError(f"{node.name} writes a cache at slots that are not one contiguous block "
                             f"({idx.format_node()}); the functional (ONNX) graphs write one block per cache.")
        with g.inserting_before(node):
            new = g.call_function(torch.ops.specc.kv_write.default, (cache, update, start, axis))
        new.meta = dict(node.meta)
        written.add(new)
        node.replace_all_uses_with(new)
        g.erase_node(node)
    g.eliminate_dead_code()
    ep.graph_module.recompile()
