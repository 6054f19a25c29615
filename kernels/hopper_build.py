"""The sm_90a build check: every Triton kernel an engine launches, compiled for the H100/H200 by Triton's
own compiler with no GPU and no driver, and its resources read back from the cubin.

Which launches: the launchers themselves (tree_attention_triton, rows_linear_triton, accept_*_triton,
compact_kv_triton, gguf_linear_triton) are called on meta tensors of a model's shapes inside
triton_support.recording(), so the kernels, grids, arguments and options compiled here are the ones
the launch code makes; nothing is listed by hand that could drift from it. Which shapes: `Shape`
(SmolLM2-135M, Qwen3-8B, a Llama-3-70B-style GQA 8:1 with head_dim 128, or an engine's own target).

How: `triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=GPUTarget("cuda", 90, 32))`
runs TTIR -> TTGIR -> LLVM -> PTX -> the ptxas bundled with Triton, and needs the driver only to load
or launch the cubin, which this never does. The signature is specialised as Triton's launcher
specialises real arguments (specialise()): pointers 16-byte aligned as fresh allocations are, integers
equal to 1 become constants, integers divisible by 16 carry that divisibility. Registers, stack and
local memory come from the cubin (cuobjdump --dump-resource-usage, bundled with Triton), shared memory
from what Triton allocates per block, the MMA instructions from the PTX that ptxas assembled, spill
bytes from ptxas's own log.

What the check asserts (tests/test_hopper_build.py): every launch compiles; no spills and no local
memory; shared memory within the H100's 227 KB per block; bf16/fp16 attention on the tensor cores.
"""
from __future__ import annotations

import contextlib
import io
import math
import re
import subprocess
import tempfile
import time
import types
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from .triton_support import Launch, recording, triton

# The H100's (and H200's) per-SM limits (CUDA occupancy calculator, compute capability 9.0).
H100 = dict(regs_per_sm=65536, smem_per_block=232448, smem_per_sm=233472, smem_reserved=1024,
            threads_per_sm=2048, blocks_per_sm=32)


@dataclass(frozen=True)
class Shape:
    """What the launches depend on in a decoder: attention heads, head size, the product shapes of a
    layer and the LM head, the vocabulary, and the static cache length."""
    name: str
    heads: int
    kv_heads: int
    head_dim: int
    hidden: int
    intermediate: int
    vocab: int
    cache_len: int

    def products(self) -> dict[str, tuple[int, int]]:
        """[out, in] of every distinct decode-step product (q, k/v, o, gate/up, down, head)."""
        qd, kd = self.heads * self.head_dim, self.kv_heads * self.head_dim
        return {"q": (qd, self.hidden), "kv": (kd, self.hidden), "o": (self.hidden, qd),
                "gate_up": (self.intermediate, self.hidden), "down": (self.hidden, self.intermediate),
                "head": (self.vocab, self.hidden)}


SHAPES = {
    "smollm2": Shape("smollm2", 9, 3, 64, 576, 1536, 49152, 2048),
    "qwen3-8b": Shape("qwen3-8b", 32, 8, 128, 4096, 12288, 151936, 4096),
    "llama3-70b": Shape("llama3-70b", 64, 8, 128, 8192, 28672, 128256, 4096),
}
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def shape_of(config: dict, cache_len: int, name: str = "target") -> Shape:
    """The Shape of a Hugging Face decoder config (config.json's keys)."""
    heads = config["num_attention_heads"]
    return Shape(name, heads, config.get("num_key_value_heads") or heads,
                 config.get("head_dim") or config["hidden_size"] // heads, config["hidden_size"],
                 config["intermediate_size"], config["vocab_size"], cache_len)
TREE_SIZES = (1, 8, 16, 32, 64)
GGUF_FORMATS = ("Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K")


def _trees(T: int) -> list[tuple[int, int]]:
    """(depth, width) of the trees of T nodes the acceptance walks see: a chain, and a tree whose root
    has two children (the widest rows of the project's default trees are a few nodes)."""
    if T == 1:
        return [(0, 1)]
    return sorted({(T - 1, 1), (max(1, (T - 1) // 2), 2)})


def shape_launches(shape: Shape, dtype: torch.dtype, tree_sizes=TREE_SIZES, gguf=GGUF_FORMATS,
                   kv_len: bool = True, greedy: bool = True, sample: bool = True, trees=None) -> list[tuple[str, Launch]]:
    """(label, launch) for every kernel launch of a decode step of `shape` in `dtype` at each tree size:
    attention over the cache, every product, greedy and sampling acceptance, KV compaction, and the
    GGUF products (float32 activations) for each block format in `gguf`. `trees`: the (depth, width)
    of the trees to accept at each size (default: a chain and a tree with two children per node)."""
    from . import compact_kv, gguf_linear, rows_linear, tree_accept, tree_attention

    meta = dict(device="meta")
    out: list[tuple[str, Launch]] = []
    KV, G, D, S, V = shape.kv_heads, shape.heads // shape.kv_heads, shape.head_dim, shape.cache_len, shape.vocab
    dt = str(dtype).removeprefix("torch.")
    for T in tree_sizes:
        def rec(label, fn, *args, **kw):
            with recording() as launches:
                fn(*args, **kw)
            out.extend((f"{shape.name} {dt} T={T} {label}", la) for la in launches)

        M = G * T
        cache = torch.empty(1, KV, S, D, dtype=dtype, **meta)
        rec("attention", tree_attention.tree_attention_triton, torch.empty(1, KV, M, D, dtype=dtype, **meta),
            cache, cache, torch.empty(1, 1, M, S, dtype=dtype, **meta), D ** -0.5,
            torch.empty((), dtype=torch.int64, **meta) if kv_len else None)
        for name, (N, K) in shape.products().items():
            rec(f"product {name} {N}x{K}", rows_linear.rows_linear_triton, torch.empty(1, T, K, dtype=dtype, **meta),
                torch.empty(N, K, dtype=dtype, **meta))
        for depth, width in (trees or {}).get(T) or _trees(T):
            tokens = torch.empty(T, dtype=torch.int64, **meta)
            children = torch.empty(T, width, dtype=torch.int64, **meta)
            if greedy:
                rec(f"accept greedy depth={depth} W={width}", tree_accept.accept_greedy_triton,
                    torch.empty(T, V, dtype=dtype, **meta), tokens, children, depth)
            if sample:
                rec(f"accept sample depth={depth} W={width}", tree_accept.accept_sample_triton,
                    torch.empty(T, V, dtype=torch.float32, **meta), tokens, children, depth,
                    torch.empty(T + 1, dtype=torch.float32, **meta))
            rec(f"compact_kv n={depth + 1}", compact_kv.compact_kv_triton, cache,
                torch.empty(depth + 1, dtype=torch.int64, **meta), torch.empty((), dtype=torch.int64, **meta))
        if T <= gguf_linear.MAX_ROWS:
            for fmt in gguf:
                for name, (N, K) in shape.products().items():
                    if fmt in gguf_linear.K_FORMATS:  # super-blocks of 256 (a file keeps narrower rows in others)
                        if K % gguf_linear.SUPER_BLOCK:
                            continue
                        qs = torch.empty(N, K // 256, gguf_linear.BLOCK_BYTES[fmt], dtype=torch.uint8, **meta)
                    else:
                        qs = torch.empty(N, K // 32, 32 if fmt == "Q8_0" else 16,
                                         dtype=torch.int8 if fmt == "Q8_0" else torch.uint8, **meta)
                    scales = torch.empty(N, K // 32, dtype=torch.float16, **meta)
                    rec(f"gguf {fmt} {name} {N}x{K}", gguf_linear.gguf_linear_triton,
                        torch.empty(1, T, K, dtype=torch.float32, **meta), qs, scales,
                        scales if fmt == "Q4_1" else torch.empty(0, dtype=torch.float16, **meta), fmt)
    return out


# ---------------------------------------------------------------------------------------------------
# specialisation, as Triton's launcher does it for real arguments

_TRITON_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.float64: "fp64",
                  torch.int64: "i64", torch.int32: "i32", torch.int16: "i16", torch.int8: "i8", torch.uint8: "u8",
                  torch.bool: "i1"}


def specialise(kernel, args: dict) -> tuple[dict, dict, dict]:
    """(signature, constexprs, attrs) for ASTSource, from arguments by name: what Triton's JIT launcher
    derives from real arguments (tensor data pointers taken as 16-byte aligned, as allocations are)."""
    from triton.backends.nvidia.compiler import CUDABackend

    signature, constexprs, attrs = {}, {}, {}
    for p in kernel.params:
        a = args[p.name]
        if p.is_constexpr:
            signature[p.name], constexprs[(p.num,)] = "constexpr", a
            continue
        if isinstance(a, torch.Tensor):
            ty, divisible = "*" + _TRITON_DTYPES[a.dtype], True
        elif isinstance(a, bool):
            ty, divisible = "u1", False
        elif isinstance(a, int):
            if a == 1 and not p.do_not_specialize:
                signature[p.name], constexprs[(p.num,)] = "constexpr", 1
                continue
            ty = "i32" if -2 ** 31 <= a < 2 ** 31 else ("u64" if a >= 2 ** 63 else "i64")
            divisible = a % 16 == 0 and not p.do_not_specialize
        elif isinstance(a, float):
            ty, divisible = "fp32", False
        else:
            raise TypeError(f"{p.name}: cannot specialise a {type(a).__name__}")
        signature[p.name] = ty
        if divisible:
            attrs[(p.num,)] = CUDABackend.parse_attr("D")
    return signature, constexprs, attrs


def jit_function(kernel):
    """The JITFunction of a kernel. Under TRITON_INTERPRET=1 the decorator made interpreter functions
    instead, which keep the Python functions they wrap; so did Triton's own `@jit` helpers (tl.max,
    tl.sum, tl.cdiv, ...), which the compiler would otherwise run in the interpreter. The kernel is
    made a JITFunction again over a copy of its module's globals in which every interpreter function,
    and every triton.language module that holds one, is replaced the same way (nothing is modified)."""
    from triton.runtime.jit import JITFunction

    if isinstance(kernel, JITFunction):
        return kernel
    return _compilable_globals(kernel.fn.__globals__)[kernel.fn.__name__]


_COMPILABLE: dict[int, dict] = {}  # id(a module's globals) -> their compilable copy


def _compilable_globals(module: dict) -> dict:
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    if id(module) in _COMPILABLE:
        return _COMPILABLE[id(module)]
    names = _COMPILABLE[id(module)] = dict(module)  # registered first: modules refer to each other
    for k, v in module.items():
        if isinstance(v, InterpretedFunction):
            if v.fn.__globals__ is not module:  # imported from another module: that module's copy
                names[k] = _compilable_globals(v.fn.__globals__)[v.fn.__name__]
                continue
            fn = types.FunctionType(v.fn.__code__, names, v.fn.__name__, v.fn.__defaults__, v.fn.__closure__)
            fn.__annotations__, fn.__doc__ = v.fn.__annotations__, v.fn.__doc__  # tl.constexpr marks
            fn.__module__, fn.__qualname__ = v.fn.__module__, v.fn.__qualname__
            names[k] = JITFunction(fn)
        elif isinstance(v, types.ModuleType) and v.__name__.startswith("triton.language"):
            names[k] = _compilable_module(v)
    return names


def _compilable_module(mod: types.ModuleType) -> types.ModuleType:
    """A stand-in for a triton.language module whose interpreter functions are JITFunctions again."""
    from triton.runtime.interpreter import InterpretedFunction

    if id(mod) in _STAND_INS:
        return _STAND_INS[id(mod)]
    if not any(isinstance(v, (InterpretedFunction, types.ModuleType)) for v in vars(mod).values()):
        return mod
    stand_in = _STAND_INS[id(mod)] = types.ModuleType(mod.__name__, mod.__doc__)
    vars(stand_in).update(_compilable_globals(vars(mod)))
    return stand_in


_STAND_INS: dict[int, types.ModuleType] = {}


# ---------------------------------------------------------------------------------------------------
# compile and read back

@dataclass
class Built:
    kernel: str
    config: str  # the labels of the launches that compile to this variant
    launches: int
    signature: str
    num_warps: int
    num_stages: int
    ok: bool
    models: str = ""  # the model shapes and dtypes of its launches ("smollm2/qwen3-8b", "bfloat16")
    dtypes: str = ""
    error: str = ""
    registers: int = 0
    spill_stores: int | None = None  # bytes, from ptxas's log (None: unknown)
    spill_loads: int | None = None
    local: int = 0  # bytes of local memory per thread
    stack: int = 0
    shared: int = 0  # bytes per block, Triton's static allocation
    local_ops: int = 0  # local-memory loads and stores the PTX asks for
    hgmma: int = 0  # wgmma (Hopper warpgroup MMA) instructions in the PTX
    hmma: int = 0  # mma.sync instructions in the PTX
    blocks_per_sm: int = 0
    seconds: float = 0.0

    @property
    def mma(self) -> str:
        return "wgmma" if self.hgmma else ("mma.sync" if self.hmma else "-")

    def problems(self) -> list[str]:
        """What breaks the check's rules (empty when none does)."""
        if not self.ok:
            return [f"does not compile: {self.error}"]
        p = []
        if self.spill_stores or self.spill_loads or self.spill_stores is None:
            p.append(f"spills ({self.spill_stores} B stored, {self.spill_loads} B loaded)")
        if self.local or self.stack or self.local_ops:
            p.append(f"local memory ({self.local} B local, {self.stack} B stack per thread, {self.local_ops} "
                     f"local loads/stores in the PTX)")
        if self.shared > H100["smem_per_block"]:
            p.append(f"{self.shared} B shared memory, over the {H100['smem_per_block']} B a block may take")
        return p


def _occupancy(regs: int, warps: int, shared: int) -> int:
    """Blocks resident per SM, the least of what registers (allocated per warp in units of 256),
    shared memory, threads and the block limit allow."""
    per_warp = math.ceil(max(regs, 1) * 32 / 256) * 256
    by_regs = H100["regs_per_sm"] // (per_warp * warps)
    by_smem = H100["smem_per_sm"] // (shared + H100["smem_reserved"]) if shared else H100["blocks_per_sm"]
    return min(by_regs, by_smem, H100["threads_per_sm"] // (32 * warps), H100["blocks_per_sm"])


def _tool(name: str) -> str:
    knob = getattr(getattr(triton, "knobs", None), "nvidia", None)
    path = getattr(getattr(knob, name, None), "path", None)
    return path or str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name)


def _read_cubin(b: Built, cubin: bytes, ptx: str, log: str) -> None:
    """Registers, stack and local memory from the cubin; the MMA instructions from the PTX ptxas
    assembled (mma.sync becomes HMMA, wgmma HGMMA); spill bytes from ptxas's log. A cubin from Triton's
    cache comes without a log: with no stack frame nothing can have spilled, with one the spills stay
    unknown (None) and `build` compiles it again."""
    with tempfile.TemporaryDirectory() as d:
        f = Path(d) / "k.cubin"
        f.write_bytes(cubin)
        res = subprocess.run([_tool("cuobjdump"), "--dump-resource-usage", str(f)], capture_output=True,
                             text=True, check=True).stdout
        fields = {k: int(v) for k, v in re.findall(r"\b(REG|STACK|LOCAL):(\d+)", res)}
        b.registers, b.stack, b.local = fields.get("REG", 0), fields.get("STACK", 0), fields.get("LOCAL", 0)
        b.hgmma = len(re.findall(r"^\s*wgmma\.mma_async", ptx, re.M))
        b.hmma = len(re.findall(r"^\s*mma\.sync", ptx, re.M))
        b.local_ops = len(re.findall(r"^\s*(?:ld|st)\.local", ptx, re.M))
    m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    b.spill_stores, b.spill_loads = (int(m.group(1)), int(m.group(2))) if m else (0, 0) if not b.stack else (None, None)


@contextlib.contextmanager
def _ptxas_log(fresh: bool):
    """Triton prints ptxas -v's log when it runs ptxas; `fresh` runs it even when the cache holds the
    cubin (ptxas again by hand would not be the same build: Triton passes its own options)."""
    knobs = getattr(triton, "knobs", None)
    if knobs is None:
        yield
        return
    with knobs.nvidia.scope(), knobs.compilation.scope():
        knobs.nvidia.dump_ptxas_log = True
        knobs.compilation.always_compile = fresh
        yield


def build(labelled: list[tuple[str, Launch]], arch: int = 90, progress=None) -> list[Built]:
    """Compile each distinct launch (kernel, specialised signature, options) for sm_{arch}a; `progress`
    is called with each result as it is read back."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    variants: dict[tuple, tuple[Launch, list[str]]] = {}
    for label, la in labelled:
        fn = jit_function(la.kernel)
        sig, cex, attrs = specialise(fn, la.args)
        key = (la.name, repr(sig), repr(sorted(cex.items())), repr(sorted(attrs)), la.num_warps, la.num_stages)
        variants.setdefault(key, (la, []))[1].append(label)
    target = GPUTarget("cuda", arch, 32)
    knobs = getattr(triton, "knobs", None)
    out = []
    for (name, sig_text, *_), (la, labels) in variants.items():
        fn = jit_function(la.kernel)
        sig, cex, attrs = specialise(fn, la.args)
        b = Built(name, "; ".join(labels[:3]) + (f"; +{len(labels) - 3}" if len(labels) > 3 else ""), len(labels),
                  " ".join(f"{k}={v}" for k, v in cex_names(fn, cex).items()), la.num_warps, la.num_stages, ok=False)
        b.models = "/".join(dict.fromkeys(label.split()[0] for label in labels))
        b.dtypes = "/".join(dict.fromkeys(label.split()[1] for label in labels))
        t0 = time.perf_counter()
        try:
            for fresh in (False, True):
                log = io.StringIO()
                with _ptxas_log(fresh), contextlib.redirect_stdout(log):
                    ck = triton.compile(ASTSource(fn, sig, cex, attrs), target=target,
                                        options={"num_warps": la.num_warps, "num_stages": la.num_stages})
                b.ok, b.shared = True, int(ck.metadata.shared)
                _read_cubin(b, ck.asm["cubin"], ck.asm["ptx"], log.getvalue())
                if b.spill_stores is not None or knobs is None:
                    break
            b.blocks_per_sm = _occupancy(b.registers, la.num_warps, b.shared)
        except Exception as e:  # noqa: BLE001 -- reported per variant, the check fails on it
            b.error = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300] if str(e).strip() else ''}"
        b.seconds = round(time.perf_counter() - t0, 2)
        out.append(b)
        if progress is not None:
            progress(b)
    return out


def cex_names(fn, cex: dict) -> dict:
    """Constexprs by parameter name, for the table."""
    names = {p.num: p.name for p in fn.params}
    return {names[k[0]]: v for k, v in sorted(cex.items())}


def available() -> str | None:
    """None when this Triton can build for NVIDIA GPUs here, else why not (one sentence)."""
    if triton is None:
        return "Triton is not installed"
    try:
        from triton.backends.compiler import GPUTarget  # noqa: F401
        from triton.backends.nvidia.compiler import CUDABackend  # noqa: F401
    except ImportError as e:
        return f"this Triton has no NVIDIA backend ({e})"
    for tool in ("ptxas", "cuobjdump"):
        if not Path(_tool(tool)).is_file():
            return f"Triton's bundled {tool} is missing ({_tool(tool)})"
    return None


def table(rows: list[Built]) -> str:
    """The build as a Markdown table."""
    head = ("| kernel | launches (first) | constexprs | warps | stages | regs | spills st/ld B | local B | "
            "shared KB | MMA | blocks/SM | s |\n|---|---|---|---|---|---|---|---|---|---|---|---|")
    lines = [head]
    for b in rows:
        if not b.ok:
            lines.append(f"| {b.kernel} | {b.config} | {b.signature} | {b.num_warps} | {b.num_stages} | "
                         f"FAILED: {b.error} | | | | | | {b.seconds} |")
            continue
        spills = "-" if b.spill_stores is None else f"{b.spill_stores}/{b.spill_loads}"
        lines.append(f"| {b.kernel} | {b.config} | {b.signature} | {b.num_warps} | {b.num_stages} | {b.registers} | "
                     f"{spills} | {b.local} | {b.shared / 1024:.1f} | {b.mma} | {b.blocks_per_sm} | {b.seconds} |")
    return "\n".join(lines)


def summary(rows: list[Built]) -> str:
    """The build by kernel and dtype as a Markdown table: variants, the register range, spill and local
    bytes, the most shared memory, the MMA instructions and the fewest blocks per SM."""
    groups: dict[tuple[str, str], list[Built]] = {}
    for b in rows:  # launches with inputs of one dtype whatever the model's (probabilities) group as one
        groups.setdefault((b.kernel, b.dtypes), []).append(b)
    lines = ["| kernel | model dtype | variants | regs | spills B | local B | shared KB (max) | MMA | blocks/SM (min) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for (kernel, dtype), bs in groups.items():
        ok = [b for b in bs if b.ok]
        if len(ok) < len(bs):
            lines.append(f"| {kernel} | {dtype} | {len(bs)} | {len(bs) - len(ok)} FAILED | | | | | |")
            continue
        regs = sorted(b.registers for b in ok)
        spills = sum((b.spill_stores or 0) + (b.spill_loads or 0) for b in ok)
        mma = "/".join(sorted({b.mma for b in ok}))
        lines.append(f"| {kernel} | {dtype} | {len(ok)} | {regs[0]}-{regs[-1]} | {spills} | "
                     f"{max(b.local + b.stack for b in ok)} | {max(b.shared for b in ok) / 1024:.1f} | {mma} | "
                     f"{min(b.blocks_per_sm for b in ok)} |")
    return "\n".join(lines)


def as_dicts(rows: list[Built]) -> list[dict]:
    return [asdict(b) | {"mma": b.mma, "problems": b.problems()} for b in rows]
