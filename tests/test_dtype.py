"""bf16 engines: every attention's mask is in its query's dtype (CUDA's memory-efficient SDPA refuses a
float32 mask beside bf16 queries), and speculative greedy output equals the same engine's plain
decoding, for each drafter that has graphs of its own."""
from __future__ import annotations

import pytest
import torch
from torch.fx import GraphModule

import specc
from test_engine import PROMPT, mtp_checkpoint, random_dflash
from tiny import tiny_model

SDPA = torch.ops.aten.scaled_dot_product_attention.default


def attention_dtypes(module: torch.nn.Module) -> list[tuple[torch.dtype, torch.dtype]]:
    """(query dtype, mask dtype) of every attention node in a graph module and any subgraph it holds."""
    out = []
    for sub in module.modules():
        if not isinstance(sub, GraphModule):
            continue
        for node in sub.graph.nodes:
            if node.op != "call_function":
                continue
            if node.target is SDPA:
                q, mask = node.args[0], node.kwargs.get("attn_mask", node.args[3] if len(node.args) > 3 else None)
            elif node.target is torch.ops.specc.tree_attention.default:
                q, mask = node.args[0], node.args[3]
            else:
                continue
            out.append((q.meta["val"].dtype, mask.meta["val"].dtype))
    return out


def drafter_args(kind: str, model, tmp_path) -> dict:
    if kind == "dflash":
        return dict(drafter_path=random_dflash(model, tmp_path / "d", block=4)[0], tree="topk:2,2")
    if kind == "dspark":
        from test_dspark import random_dspark

        return dict(drafter_path=random_dspark(model, tmp_path / "ds", block=4)[0], tree="topk:2,2")
    if kind == "mtp":
        return dict(drafter_path=mtp_checkpoint(model, tmp_path / "mtp", "copy")[0], tree="chain:2")
    if kind == "draft-model":
        return dict(drafter_layers=1, tree="chain:3")
    return dict(tree="chain:3")


# torch < 2.13's C++ code generator ignores emulate_precision_casts (its Triton one, the GPU's, does
# not), so a CPU inductor bf16 engine's graphs round differently there.
OLD_CPU_INDUCTOR = tuple(int(x) for x in torch.__version__.split(".")[:2]) < (2, 13)


OLD_TORCH = pytest.mark.xfail(OLD_CPU_INDUCTOR, strict=True, reason=(
    "torch < 2.13 on CPU: Inductor's C++ code ignores emulate_precision_casts"))


# Inductor: the mtp engine alone (its step graph verifies as an ngram engine's does, and it adds the
# drafter's and the fused graphs); an ngram inductor engine cost 80 s more of the suite for no other graph.
@pytest.mark.parametrize("kind,backend", [
    ("ngram", "eager"), ("mtp", "eager"), ("dflash", "eager"), ("dspark", "eager"), ("draft-model", "eager"),
    pytest.param("mtp", "inductor", marks=OLD_TORCH)])
def test_bf16_engine(tmp_path, kind, backend):
    """bf16 engines of every drafter kind: greedy speculative output is plain decoding's, token for token,
    on prompts long enough to meet the near ties a tiny random model is full of (the mtp inductor
    engine's fused graph is the one that left plain decoding before row-invariant numerics)."""
    model = tiny_model("llama", vocab=64, layers=1 if kind == "mtp" else 2, seed=3)  # MTP "copy" heads imitate one layer
    model.save_pretrained(tmp_path / "m")
    modes = "greedy" if backend == "inductor" else "greedy,top_p"  # inductor: compile time
    path = specc.compile(tmp_path / "m", drafter=kind, dtype="bfloat16", backend=backend,
                         output_dir=tmp_path / "e", max_len=96, prefill_chunk=8, progress=False,
                         modes=modes, **drafter_args(kind, model, tmp_path))
    engine = specc.load(path)
    if backend == "eager":
        for name, graph in engine.graphs.items():
            pairs = attention_dtypes(graph.inner.module)
            assert pairs, f"graph {name} has no attention"
            assert all(q == mask == torch.bfloat16 for q, mask in pairs), (name, pairs)
    steps = []
    g = torch.Generator().manual_seed(5)
    prompts = [PROMPT, PROMPT * 3] + [torch.randint(2, 64, (n,), generator=g).tolist() for n in (7, 19, 33)]
    for prompt in prompts:
        spec = engine.generate(prompt, max_new_tokens=40, stop_at_eos=False)
        plain = engine.generate(prompt, max_new_tokens=40, stop_at_eos=False, speculate=False)
        assert spec.token_ids == plain.token_ids, prompt
        steps.append(spec.stats.steps)
    assert sum(steps) < len(prompts) * 39  # drafts were accepted
    if "top_p" in modes:
        sampled = engine.generate(PROMPT, max_new_tokens=24, stop_at_eos=False, temperature=0.8, top_p=0.9, seed=1)
        assert len(sampled.token_ids) == 24
