"""Weight-only quantization of the target's linear layers: `quantize_(target, config)`.

Decoding one token reads every weight once, so on both this CPU and a GPU its time is the weight
bytes. A config is a frozen dataclass (`--quant` parses to one once: `parse_quant`), and a handler
registered for its type (`@handler`) quantizes each product weight, as torchao's `quantize_` does:

* `Int8WeightOnly()` (--quant int8): each [out, in] product weight as int8 with one float scale per
  output row (symmetric, round to nearest: w ~= q * scale[out]), a quarter of float32's bytes. The
  product keeps the scale outside the reduction, `F.linear(x, q.to(x.dtype)) * scale`, so the
  `matvec` pass hands a few-row product the int8 weight itself (`specc::rows_linear`: on CPU a C++
  product that widens it in registers, elsewhere a reduction Inductor fuses the cast into); larger
  products (prefill chunks) cast and call the GEMM.
  `Int8WeightOnly(group_size=32)` (--quant int8:group_size=32): llama.cpp's Q8_0 blocks instead.
* `Int4WeightOnly()` (--quant int4): blocks of 32 weights along the input, each with a float16
  scale and minimum, 4-bit codes (0.625 bytes per weight): GGUF's Q4_1 layout.
  `Int4WeightOnly(symmetric=True)` (--quant int4:symmetric=true): llama.cpp's Q4_0 blocks.
  The block formats run on the GGUF product (specc::gguf_linear, kernels/gguf_linear.py).
* `GGUFFile()` (--quant gguf): the blocks a GGUF file stores (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, and the K-quants
  Q4_K, Q5_K, Q6_K of Q4_K_M / Q5_K_M / Q6_K files), read into `GGUFBlocks` and kept as they are.
  They decode bit for bit to the float weights transformers loads from the file (checked when an
  engine is built), so such an engine computes the very model a float load of the file gives, from
  0.56-1.1 bytes per weight. A fused product whose tensors differ in format (a Q4_K_M file keeps
  attn_v, and some layers' ffn_down, in Q6_K beside Q4_K) is one block group per run of parts in one
  format, its outputs concatenated (GGUFParts). The engine keeps the blocks
  (target/gguf_blocks.safetensors).

Quantizing is a pure function of the float weights for every kind but gguf, so an engine stores its
target's float weights and `specc.load` quantizes them again to the very same tensors; the manifest
keeps the config as --quant spells it (`quant_spec`). Each config says what its products compute
with (`weights`: int8 rows or blocks), which the backends declare they lower (Backend.weights).

The same formula runs on every backend, so a quantized engine's plain decoding, its speculative
decoding and its eager reference all compute the one quantized model: speculation stays lossless
with respect to it (for int8, not to the float model it came from). Drafters keep their own
(float) weights; a drafter that shares the target's LM head keeps the float head it was given.
torchao's Int8WeightOnlyConfig computes the same kind of int8 weights, but as a tensor subclass:
what the pipeline needs is plain buffers that torch.export, the matvec pass and the backends see as
ordinary tensors and ops, and one formula that every backend runs alike, so specc keeps these few
lines instead of a dependency (torchao 0.18 is on the registry).
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from .errors import SpeccError

GGUF_FILE = "gguf_blocks.safetensors"  # an engine's copy of its target's GGUF blocks (in target/)
GGUF_FORMATS = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")  # kernels/gguf_linear.py
# What a quantized product computes with, which a backend must lower (Backend.weights): float
# weights, int8 rows with a scale each (Int8Weight), or GGUF blocks (GGUFWeight, GGUFParts).
WEIGHT_FORMATS = ("float", "int8", "blocks")


# ---------------------------------------------------------------------------------------------------
# configs: one frozen dataclass per kind, parsed once from the CLI's string (parse_quant)

@dataclass(frozen=True)
class Int8WeightOnly:
    """int8 codes, symmetric, round to nearest. group_size None: one float scale per output row
    (q in [-127, 127]), a product the matvec pass hands the int8 weight itself; 32: blocks of 32
    along the input with a float16 scale each, as llama.cpp's Q8_0 quantizes them, run on the
    GGUF product."""
    group_size: int | None = None
    NAME: ClassVar[str] = "int8"

    def __post_init__(self):
        if self.group_size not in (None, 32):
            raise SpeccError(f"--quant int8:group_size={self.group_size} is not built; use none (one scale per "
                             f"output row) or 32 (Q8_0 blocks).")

    @property
    def weights(self) -> str:
        return "int8" if self.group_size is None else "blocks"

    @property
    def block_formats(self) -> tuple[str, ...]:
        return () if self.group_size is None else ("Q8_0",)


@dataclass(frozen=True)
class Int4WeightOnly:
    """4-bit codes in blocks of 32 along the input. Asymmetric (the default): a float16 scale and
    minimum per block, both rounded to float16 before the codes are chosen against them (w ~= d * q
    + m, q in 0..15): GGUF's Q4_1 layout. symmetric: one float16 scale per block (w ~= d * (q - 8)),
    as llama.cpp's Q4_0 quantizes them. Both run on the GGUF product."""
    symmetric: bool = False
    NAME: ClassVar[str] = "int4"
    weights: ClassVar[str] = "blocks"

    @property
    def block_formats(self) -> tuple[str, ...]:
        return ("Q4_0",) if self.symmetric else ("Q4_1",)


@dataclass(frozen=True)
class GGUFFile:
    """Keep the blocks of the target's own GGUF file (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K) as they are:
    the compiler reads them (read_gguf_blocks) into GGUFBlocks, which quantize_ takes."""
    NAME: ClassVar[str] = "gguf"
    weights: ClassVar[str] = "blocks"
    block_formats: ClassVar[tuple] = GGUF_FORMATS

    def check(self, cfg) -> None:
        if cfg.model is not None and Path(cfg.model).suffix != ".gguf":
            raise SpeccError("--quant gguf keeps a GGUF file's own blocks; give a .gguf model (or none, for the "
                             "embedded SmolLM2 GGUF), or use --quant int8.")
        if cfg.torch_dtype != torch.float32:
            raise SpeccError("--quant gguf computes in float32 (the activations of its products); use --dtype float32.")


@dataclass(frozen=True)
class GGUFBlocks:
    """The weights as a GGUF file stores them (read_gguf_blocks): {product name: (format, qs, d, m)},
    or for a fused product whose parts differ in format a list of those, stacked by rows in order."""
    blocks: dict = field(compare=False, repr=False)
    NAME: ClassVar[str] = "gguf"
    weights: ClassVar[str] = "blocks"
    block_formats: ClassVar[tuple] = GGUF_FORMATS


CONFIGS = {c.NAME: c for c in (Int8WeightOnly, Int4WeightOnly, GGUFFile)}  # what --quant names
NONE = "none"  # no quantization: the weights as loaded


def parse_quant(spec) -> object | None:
    """--quant's value -> a config (None for no quantization): NAME or NAME:FIELD=VALUE[,FIELD=VALUE],
    e.g. int8, int8:group_size=32, int4:symmetric=true, gguf. A config object passes through."""
    if spec is None or spec == NONE:
        return None
    if not isinstance(spec, str):
        if not any(isinstance(spec, c) for c in (*CONFIGS.values(), GGUFBlocks)):
            raise SpeccError(f"unsupported quantization config {spec!r}; use one of "
                             f"{', '.join(c.__name__ for c in CONFIGS.values())}.")
        return spec
    name, _, options = spec.partition(":")
    if name not in CONFIGS:
        raise SpeccError(f"unknown --quant {spec!r}; use one of {NONE}, {', '.join(CONFIGS)}.")
    kind, values = CONFIGS[name], {}
    fields = {f.name: f for f in dataclasses.fields(kind)}
    for item in filter(None, options.split(",")):
        key, _, value = item.partition("=")
        if key not in fields:
            raise SpeccError(f"--quant {name} takes {', '.join(fields) or 'no options'}; {key!r} is not one of them.")
        values[key] = _option_value(name, key, value)
    return kind(**values)


def _option_value(name: str, key: str, value: str):
    low = value.strip().lower()
    if low in (NONE, ""):  # a field set back to its unset value
        return None
    if low in ("true", "false"):
        return low == "true"
    if low.isdigit():
        return int(low)
    raise SpeccError(f"--quant {name}:{key}={value!r} is not a number, true, false or none.")


def quant_spec(config) -> str:
    """The config as --quant spells it (what the manifest keeps and parse_quant reads back)."""
    if config is None:
        return NONE
    changed = [f"{f.name}={str(getattr(config, f.name)).lower()}" for f in dataclasses.fields(config)
               if f.init and f.name != "blocks" and getattr(config, f.name) != f.default]
    return config.NAME + (":" + ",".join(changed) if changed else "")


class Int8Weight(nn.Module):
    """A product weight [out, in] as int8 `q` and float `scale` [out]; call it like F.linear's weight."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        q, scale = quantize_int8(weight)
        self.register_buffer("q", q)
        self.register_buffer("scale", scale)

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.q.to(x.dtype)) * self.scale.to(x.dtype)

    def dequantized(self) -> torch.Tensor:
        return self.q.to(self.scale.dtype) * self.scale[:, None]


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-row int8: scale = max |w| / 127 over the row (1 for an all-zero row)."""
    w = weight.detach().float()
    amax = w.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q.contiguous(), scale.to(weight.dtype)


class GGUFWeight(nn.Module):
    """A product weight kept in GGUF blocks (Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K), dequantised inside
    the product (specc::gguf_linear, kernels/gguf_linear.py)."""

    def __init__(self, fmt: str, qs: torch.Tensor, d: torch.Tensor, m: torch.Tensor):
        import specc.kernels  # noqa: F401  (registers torch.ops.specc.gguf_linear)

        super().__init__()
        self.fmt = fmt
        self.register_buffer("qs", qs)
        self.register_buffer("d", d)
        self.register_buffer("m", m)

    @property
    def shape(self) -> torch.Size:
        from specc.kernels.gguf_linear import weight_shape

        return torch.Size(weight_shape(self.qs, self.fmt))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.specc.gguf_linear(x.to(torch.float32), self.qs, self.d, self.m, self.fmt).to(x.dtype)

    def dequantized(self) -> torch.Tensor:
        from specc.kernels.gguf_linear import dequantize

        return dequantize(self.qs, self.d, self.m, self.fmt)


class GGUFParts(nn.Module):
    """A fused product weight (q/k/v, gate/up) whose GGUF tensors are in different block formats: one
    GGUFWeight per group of rows (`groups`: (format, qs, d, m) each, in row order), the outputs
    concatenated. Exported, it is one specc::gguf_linear per group and a cat."""

    def __init__(self, groups: list):
        super().__init__()
        self.parts = nn.ModuleList(GGUFWeight(*group) for group in groups)

    @property
    def shape(self) -> torch.Size:
        return torch.Size([sum(p.shape[0] for p in self.parts), self.parts[0].shape[1]])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([p(x) for p in self.parts], dim=-1)

    def dequantized(self) -> torch.Tensor:
        return torch.cat([p.dequantized() for p in self.parts])


def quantize_int4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[N, K] (K a multiple of 32) -> Q4_1 blocks (qs [N, K/32, 16] uint8, d and m [N, K/32] float16):
    per block m = min, d = (max - min) / 15, both rounded to float16 first and the codes chosen
    against the rounded values, so each weight is within d/2 of its code's value."""
    N, K = weight.shape
    if K % 32:
        raise SpeccError(f"--quant int4 needs input sizes that are multiples of 32; a product has {K}.")
    w = weight.detach().float().reshape(N, K // 32, 32)
    lo, hi = w.amin(-1), w.amax(-1)
    m = lo.to(torch.float16)
    d = ((hi - m.float()) / 15).to(torch.float16)
    d32 = d.float()[..., None]
    q = torch.where(d32 > 0, torch.round((w - m.float()[..., None]) / torch.where(d32 > 0, d32, 1)), 0).clamp(0, 15)
    q = q.to(torch.uint8)
    qs = q[..., :16] | (q[..., 16:] << 4)  # values 0..15 in the low nibbles, 16..31 in the high ones
    return qs.contiguous(), d.contiguous(), m.contiguous()


def _blocks_of_32(weight: torch.Tensor, fmt: str) -> torch.Tensor:
    N, K = weight.shape
    if K % 32:
        raise SpeccError(f"{fmt} blocks need input sizes that are multiples of 32; a product has {K}.")
    return weight.detach().float().reshape(N, K // 32, 32)


def quantize_q8_0(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[N, K] -> Q8_0 blocks (qs [N, K/32, 32] int8, d [N, K/32] float16, m empty) as llama.cpp's
    reference quantizer makes them: d = max |w| / 127, codes w / d rounded half away from zero
    against the float32 d (gguf-py's bit-exact port is the test's reference)."""
    w = _blocks_of_32(weight, "Q8_0")
    d = w.abs().amax(-1, keepdim=True) / 127
    x = w * torch.where(d == 0, 0, 1 / d).to(torch.float32)
    a = x.abs()
    whole = a.floor()
    q = torch.sign(x) * (whole + torch.floor(2 * (a - whole)))  # round half away from zero, as roundf
    return q.to(torch.int8).contiguous(), d.squeeze(-1).to(torch.float16).contiguous(), torch.empty(0, dtype=torch.float16)


def quantize_q4_0(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[N, K] -> Q4_0 blocks (qs [N, K/32, 16] uint8, d [N, K/32] float16, m empty) as llama.cpp's
    reference quantizer makes them: d = (the block's value of largest magnitude) / -8, codes
    trunc(w / d + 8.5) clamped to 0..15 against the float32 d."""
    w = _blocks_of_32(weight, "Q4_0")
    big = w.gather(-1, w.abs().argmax(-1, keepdim=True))
    d = big / -8
    q = torch.trunc(w * torch.where(d == 0, 0, 1 / d).to(torch.float32) + 8.5).clamp(0, 15).to(torch.uint8)
    qs = q[..., :16] | (q[..., 16:] << 4)
    return qs.contiguous(), d.squeeze(-1).to(torch.float16).contiguous(), torch.empty(0, dtype=torch.float16)


def linear(x: torch.Tensor, weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear for a float weight or a quantized one (a module that computes the product)."""
    if isinstance(weight, torch.Tensor):
        return F.linear(x, weight, bias)
    y = weight(x)
    return y if bias is None else y + bias


PRODUCTS = ("wqkv", "wo", "w_gate_up", "w_down")
# config type -> handler(name, float weight, config) -> the quantized weight module, or None to keep it float
HANDLERS: dict[type, Callable] = {}


def handler(config_type: type):
    """Register how a config quantizes one product weight (torchao's pattern: a handler per config type)."""
    def register(fn):
        HANDLERS[config_type] = fn
        return fn
    return register


@handler(Int8WeightOnly)
def _int8(name: str, w: torch.Tensor, config: Int8WeightOnly):
    return Int8Weight(w) if config.group_size is None else GGUFWeight("Q8_0", *quantize_q8_0(w))


@handler(Int4WeightOnly)
def _int4(name: str, w: torch.Tensor, config: Int4WeightOnly):
    return GGUFWeight("Q4_0", *quantize_q4_0(w)) if config.symmetric else GGUFWeight("Q4_1", *quantize_int4(w))


@handler(GGUFBlocks)
def _gguf(name: str, w: torch.Tensor, config: GGUFBlocks):
    if name not in config.blocks:  # stored as float in the file: stays float
        return None
    spec = config.blocks[name]
    new = GGUFParts(spec) if isinstance(spec, list) else GGUFWeight(*spec)
    check_blocks(name, new, w)
    return new


@handler(GGUFFile)
def _gguf_file(name: str, w: torch.Tensor, config: GGUFFile):
    raise SpeccError("--quant gguf takes the file's blocks: read them first (read_gguf_blocks).")


def quantize_(target: nn.Module, config) -> nn.Module:
    """Replace the target's product weights (each block's fused q/k/v, output, fused gate/up and
    down projections, and the LM head) by quantized ones, in place; returns the target. The
    embedding table stays float: a token reads one row of it. `config`: a config object
    (Int8WeightOnly(), Int4WeightOnly(symmetric=True), GGUFBlocks(...)), its --quant string, or None."""
    config = parse_quant(config)
    if config is None:
        return target
    quantize = HANDLERS[type(config)]
    owners = [(f"blocks.{i}.{name}", block, name) for i, block in enumerate(target.blocks) for name in PRODUCTS]
    for full, owner, name in owners + [("w_head", target, "w_head")]:
        w = getattr(owner, name)
        if not isinstance(w, torch.Tensor):
            continue
        new = quantize(full, w, config)
        if new is not None:
            delattr(owner, name)
            setattr(owner, name, new)
    return target


def check_blocks(name: str, q: GGUFWeight | GGUFParts, w: torch.Tensor) -> None:
    """The blocks must decode to exactly the float weight the model was loaded with."""
    if tuple(q.shape) != tuple(w.shape) or not torch.equal(q.dequantized(), w.detach().float()):
        raise SpeccError(f"the GGUF blocks of {name} do not decode to the weights transformers loaded from the file; "
                         f"this GGUF cannot be kept in its own quantization (use --quant none or int8).")


# A target product -> the GGUF tensors it is made of (rows stacked in this order), for llama-architecture files.
GGUF_PARTS = {"wqkv": ("attn_q", "attn_k", "attn_v"), "wo": ("attn_output",), "w_gate_up": ("ffn_gate", "ffn_up"),
              "w_down": ("ffn_down",)}


def read_gguf_blocks(path, config) -> GGUFBlocks:
    """The product weights of a llama-architecture GGUF file as blocks, in the target's layout: q/k/v
    and gate/up stacked by rows, q and k rows un-permuted as transformers un-permutes them (llama.cpp
    interleaves the rotary halves), the LM head from `output.weight` or, tied, `token_embd.weight`.
    A product whose tensors are float in the file is left out (it stays float); one whose tensors
    differ in block format (Q4_K_M's Q4_K q/k beside a Q6_K v) becomes a list of block groups, one
    per run of parts in one format."""
    import gguf
    import numpy as np

    from specc.kernels.gguf_linear import BLOCK_BYTES, block_size, split_blocks

    try:
        reader = gguf.GGUFReader(str(path))
    except ValueError as e:  # gguf-py's checks, among them K-quant rows that are not whole super-blocks
        raise SpeccError(f"{path} is not a GGUF file that --quant gguf can read: {str(e).rstrip('.')}.") from None
    arch = reader.fields.get("general.architecture")
    arch = bytes(arch.parts[arch.data[0]]).decode() if arch is not None else "?"
    if arch != "llama":
        raise SpeccError(f"--quant gguf reads llama-architecture GGUF files; {path} is {arch!r}.")
    tensors = {t.name: t for t in reader.tensors}

    def rows(name: str, heads: int | None):
        t = tensors.get(name)
        if t is None:
            raise SpeccError(f"{path} has no tensor {name}, which --quant gguf reads for a llama model.")
        kind = t.tensor_type.name
        if kind in ("F32", "F16", "BF16"):
            return None
        if kind not in GGUF_FORMATS:
            raise SpeccError(f"--quant gguf keeps {', '.join(GGUF_FORMATS)} blocks; {name} in {path} is {kind} "
                             f"(use --quant none or int8).")
        K, size = int(t.shape[0]), block_size(kind)  # GGUF lists the input dimension first
        raw = torch.from_numpy(np.array(t.data))
        if K % size or raw.shape[-1] != K // size * BLOCK_BYTES[kind]:
            raise SpeccError(f"{name} in {path} is {kind} with rows of {K} values, not a whole number of {kind}'s "
                             f"{size}-value blocks; the file is damaged.")
        if heads is not None:  # transformers' reverse permutation of q/k rows, as a row index
            n = raw.shape[0]
            raw = raw[torch.arange(n).reshape(heads, n // heads // 2, 2).transpose(1, 2).reshape(-1)]
        return kind, raw

    heads = {"attn_q": config.num_attention_heads,
             "attn_k": getattr(config, "num_key_value_heads", None) or config.num_attention_heads}
    out = {}
    products = [(f"blocks.{i}.{p}", [f"blk.{i}.{g}.weight" for g in parts])
                for i in range(config.num_hidden_layers) for p, parts in GGUF_PARTS.items()]
    products.append(("w_head", ["output.weight" if "output.weight" in tensors else "token_embd.weight"]))
    for product, names in products:
        parts = [rows(n, heads.get(n.split(".")[-2])) for n in names]
        if any(p is None for p in parts):
            if not all(p is None for p in parts):
                raise SpeccError(f"--quant gguf needs {' / '.join(names)} all quantized or all float; {path} mixes "
                                 f"float and quantized tensors there.")
            continue
        groups: list[tuple[str, list]] = []  # runs of consecutive parts in one format, stacked by rows
        for kind, raw in parts:
            if groups and groups[-1][0] == kind:
                groups[-1][1].append(raw)
            else:
                groups.append((kind, [raw]))
        blocks = [(fmt, *split_blocks(torch.cat(raws), fmt)) for fmt, raws in groups]
        out[product] = blocks[0] if len(blocks) == 1 else blocks
    return GGUFBlocks(out)


def save_blocks(config: GGUFBlocks, path) -> None:
    """One safetensors file; its metadata names each product's format, or its groups' formats in
    order (their tensors under NAME.I.qs and so on)."""
    from safetensors.torch import save_file

    tensors, formats = {}, {}
    for name, spec in config.blocks.items():
        groups = list(enumerate(spec)) if isinstance(spec, list) else [(None, spec)]
        for i, (fmt, qs, d, m) in groups:
            prefix = name if i is None else f"{name}.{i}"
            tensors.update({f"{prefix}.qs": qs, f"{prefix}.d": d, f"{prefix}.m": m})
        formats[name] = [fmt for fmt, *_ in spec] if isinstance(spec, list) else spec[0]
    save_file(tensors, str(path), metadata={"formats": json.dumps(formats)})


def load_blocks(path) -> GGUFBlocks:
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        def group(prefix: str, fmt: str):
            return fmt, f.get_tensor(f"{prefix}.qs"), f.get_tensor(f"{prefix}.d"), f.get_tensor(f"{prefix}.m")

        formats = json.loads(f.metadata()["formats"])
        return GGUFBlocks({name: [group(f"{name}.{i}", x) for i, x in enumerate(fmt)] if isinstance(fmt, list)
                           else group(name, fmt) for name, fmt in formats.items()})


def for_target(config, gguf_file, hf_config):
    """The config quantize_ takes for a compile: GGUFFile becomes the file's blocks."""
    return read_gguf_blocks(gguf_file(), hf_config) if isinstance(config, GGUFFile) else config


def save_quant(config, folder) -> None:
    """What an engine must keep besides its float weights: a GGUF file's blocks (the other kinds are
    a pure function of the float weights and are quantized again at load)."""
    if isinstance(config, GGUFBlocks):
        save_blocks(config, folder / GGUF_FILE)


def load_quant(spec: str, folder):
    """The manifest's --quant spec -> the config quantize_ takes for a stored engine (folder: ENGINE/target)."""
    config = parse_quant(spec)
    return load_blocks(folder / GGUF_FILE) if isinstance(config, GGUFFile) else config


def weight_bytes(module: nn.Module | None, shared: nn.Module | None = None) -> int:
    """Bytes of the weights one call of `module` reads for one token: every parameter and buffer
    except the KV caches, the embedding table as one row, and none of the tensors it shares with
    `shared` (a drafter's view of the target's embedding, say)."""
    if module is None:
        return 0
    skip = {id(t) for t in [*shared.parameters(), *shared.buffers()]} if shared is not None else set()
    total = 0
    for name, t in {id(t): (n, t) for n, t in [*module.named_parameters(), *module.named_buffers()]}.values():
        if id(t) in skip or name.rsplit(".", 1)[-1] in ("k_cache", "v_cache"):
            continue
        if name.endswith("embed_tokens.weight"):
            total += t.shape[1] * t.element_size()
        else:
            total += t.numel() * t.element_size()
    return total
