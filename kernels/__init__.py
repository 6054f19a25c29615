"""specc.kernels: the custom ops the compiled graphs call, each a torch reference plus a Triton kernel.

This folder is the top-level kernels/ of the repository, installed as the package specc.kernels
(pyproject.toml's package-dir): import it as `specc.kernels`, never as `kernels`.

Importing this package registers the ops under the `specc` namespace:

* ``torch.ops.specc.tree_attention(q, k_cache, v_cache, mask, scale)`` -- attention of the folded
  GQA query rows over the static cache with an additive tree mask (tree_attention.py);
* ``torch.ops.specc.tree_accept_greedy`` / ``tree_accept_sample`` -- acceptance of a draft tree
  (tree_accept.py);
* ``torch.ops.specc.compact_kv_`` -- the accepted path's K/V moved in place to consecutive slots
  (compact_kv.py);
* ``torch.ops.specc.gguf_linear(x, qs, d, m, fmt)`` -- a product with a weight kept in a GGUF
  file's Q8_0 / Q4_0 / Q4_1 / Q5_0 / Q5_1 blocks or Q4_K / Q5_K / Q6_K super-blocks, dequantised in the kernel
  (gguf_linear.py). Its CPU body calls ``torch.ops.specc_cpu.gguf_matvec`` (gguf_cpu.cpp) or, for
  the K-quants, ``torch.ops.specc_cpu.gguf_kquant_matvec`` (gguf_kquants_cpu.cpp) for a few rows,
  C++ products built for the machine on first use (cpu_kernels.py), where a compiler is found; else
  the reference;
* ``torch.ops.specc.rows_linear(x, w)`` -- x @ w.T for the few rows of a decode step, w float or
  int8 (the `matvec` pass puts it in; rows_linear.py): on CPU the C++ product
  ``torch.ops.specc_cpu.dense_matvec`` (dense_cpu.cpp) where it builds and was measured faster,
  else a streaming reduction Inductor fuses; on CUDA a tensor-core Triton product with one tile shape
  at every row count (not yet run on a GPU).

Every Triton launch goes through triton_support.launch, so hopper_build.py can record the launches an
engine of any shape makes and compile each for the H100 (sm_90a) without a GPU (tests/test_hopper_build.py).

On CPU tensors each op runs its torch reference; on CUDA tensors it runs the Triton kernel. Triton
stays optional at run time: without it this package still imports, and CUDA calls fall back to the
reference (correct, only slower).

Each op is a `torch.library.triton_op`: torch.export keeps it as one node (what the passes put in
and the tests look for), while Inductor and AOTInductor trace into its body. A compiled CUDA graph
therefore embeds the Triton kernels, and a compiled CPU graph runs the reference as native code,
with no call back into Python per layer and step (a plain custom op would go through AOTI's proxy
executor). The acceptance ops' CPU bodies are the vectorised references in tree_accept.py (the
rules themselves, and a plain-Python oracle, are in specc.acceptance). Triton has no CPU code
generator, so the kernels are tested on CPU under ``TRITON_INTERPRET=1`` against the references
(tests/test_kernels.py).

The folder is top-level (kernels/, beside passes/) and installed as specc.kernels. Run from the
repository root, Python also finds it first as a top-level ``kernels``, the name of a Hugging Face
package that transformers (>= 5.25) depends on and imports: imported under that name this file
loads that package in its own place when it is installed, and otherwise defines nothing (below).
The tests run without the root on sys.path; tests/test_layout.py checks both ways.
"""
from __future__ import annotations

if __name__ != "specc.kernels":  # found as a top-level `kernels` from the repository root
    import importlib.machinery
    import importlib.util
    import os
    import sys

    _root = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
    _elsewhere = [p for p in sys.path if os.path.realpath(p or os.getcwd()) != _root]
    _spec = importlib.machinery.PathFinder.find_spec(__name__, _elsewhere)
    if _spec is not None and _spec.loader is not None:  # Hugging Face's package: become it
        _module = importlib.util.module_from_spec(_spec)
        sys.modules[__name__] = _module  # the import statement returns what sys.modules holds
        _spec.loader.exec_module(_module)
    __all__: list[str] = []
else:
    from .compact_kv import compact_kv_reference, compact_kv_triton
    from .gguf_linear import dequantize as gguf_dequantize
    from .gguf_linear import gguf_linear_reference, gguf_linear_triton
    from .rows_linear import rows_linear_reference
    from .tree_accept import (accept_greedy_reference, accept_greedy_triton, accept_sample_reference,
                              accept_sample_triton, accept_sampled_reference)
    from .tree_attention import tree_attention_reference, tree_attention_triton
    from .triton_support import HAS_TRITON

    __all__ = [
        "HAS_TRITON",
        "tree_attention_reference", "tree_attention_triton",
        "accept_greedy_reference", "accept_greedy_triton", "accept_sample_reference", "accept_sample_triton",
        "accept_sampled_reference",
        "compact_kv_reference", "compact_kv_triton",
        "gguf_dequantize", "gguf_linear_reference", "gguf_linear_triton",
        "rows_linear_reference",
    ]
