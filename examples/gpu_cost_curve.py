"""The cost curve of a verify step on a GPU, and the memory floor it sits on.

    python examples/gpu_cost_curve.py [--json curve.json] [--shapes smollm2,qwen3-8b] [--Ts 1,2,4,8,16,32]
    python examples/gpu_cost_curve.py --device cpu --layers 2 --Ts 1,4 --context 128    # a dry run

For each model shape (random weights: no checkpoint reaches the GPU machine), specc's captured
target module (the one every engine graph is built from; GQA folded, fused projections, static
cache) runs T tokens at a context of --context tokens, for T in --Ts. On CUDA each call is captured
once in a CUDA graph and replayed, so host overhead does not count: what is timed is the kernels
(eager torch kernels, not Inductor's: a lower bound on what specc's compiled graphs can reach,
and a fair one for GEMM-bound steps). c(T) = t(T) / t(1): speculative decoding gains tau / c(T).

The floor: the bytes one step must read (every weight except the embedding table, which is only
indexed, plus the KV cache up to the context) over this GPU's device-to-device copy bandwidth,
measured here. Qwen3-8B runs --layers of its 36 layers (default 8); its per-layer time is reported
and the whole model's step estimated from it.
"""
from __future__ import annotations

import argparse
import json
import sys

import torch

from specc import harness

SHAPES = {  # the layer shapes of the real checkpoints (config.json)
    "smollm2": dict(arch="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, head_dim=64, tie_word_embeddings=True),
    "qwen3-8b": dict(arch="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                     num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                     tie_word_embeddings=False),
}


def build(shape: str, layers: int | None, cache_len: int, device: str, dtype: torch.dtype):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    from specc.target_module import TargetModule

    spec = dict(SHAPES[shape])
    arch, full_layers = spec.pop("arch"), spec["num_hidden_layers"]
    spec["num_hidden_layers"] = min(layers or full_layers, full_layers)
    config_cls, model_cls = (LlamaConfig, LlamaForCausalLM) if arch == "llama" else (Qwen3Config, Qwen3ForCausalLM)
    config = config_cls(**spec, max_position_embeddings=max(4096, cache_len), rms_norm_eps=1e-6)
    torch.manual_seed(0)
    with torch.device(device):  # initialised where it runs: an 8B-shaped layer stack is slow to fill on a CPU
        model = model_cls(config).to(dtype).eval()
    return TargetModule(model, cache_len).to(device), full_layers


def step_inputs(T: int, context: int, cache_len: int, device: str, dtype: torch.dtype) -> tuple:
    from specc.target_module import additive_mask

    pos = torch.arange(T, device=device) + context
    cols = torch.arange(cache_len, device=device)
    mask = additive_mask(cols.view(1, -1) <= pos.view(-1, 1), dtype).view(1, 1, T, cache_len)  # a chain of T
    return (torch.zeros(1, T, dtype=torch.int64, device=device), pos.view(1, T), pos, mask)


def time_call(fn, device: str, reps: int) -> float:
    """Median ms of fn(); on CUDA a replay of one captured CUDA graph."""
    if device.startswith("cuda"):
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up on a side stream, as capture requires
            harness.warm_up({"call": fn}, times=3)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        fn = graph.replay
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        times = []
        for _ in range(reps):
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        return harness.median(times)
    return 1000 * harness.median(harness.call_times(fn, reps, warmup=1))


def copy_bandwidth(device: str) -> float | None:
    """Bytes per second of a device-to-device copy, counting bytes read and written."""
    if not device.startswith("cuda"):
        return None
    x = torch.empty(2 << 30, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    ms = time_call(lambda: y.copy_(x), device, 10)
    return 2 * x.numel() / (ms / 1000)


def step_bytes(module, context: int) -> int:
    weights = sum(p.numel() * p.element_size() for n, p in module.named_parameters() if not n.startswith("embed"))
    if module.embed_tokens.weight is module.w_head:  # tied: the head reads the table in full
        weights += module.w_head.numel() * module.w_head.element_size()
    cache = sum(b[:, :, :context].numel() * b.element_size() for n, b in module.named_buffers() if n.endswith("_cache"))
    return weights + cache


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--shapes", default="smollm2,qwen3-8b")
    ap.add_argument("--layers", type=int, default=None, help="layers to build (default: all of SmolLM2, 8 of Qwen3-8B)")
    ap.add_argument("--Ts", default="1,2,4,8,16,32")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=50)
    args = ap.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("gpu_cost_curve needs a CUDA GPU; use --device cpu for a dry run.", file=sys.stderr)
        return 2
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    Ts = [int(t) for t in args.Ts.split(",")]
    bandwidth = copy_bandwidth(args.device)
    report = {"device": args.device, "dtype": str(dtype).replace("torch.", ""), "context": args.context,
              "copy_bandwidth_gb_s": bandwidth and round(bandwidth / 1e9, 1), "shapes": {}}
    for shape in args.shapes.split(","):
        layers = args.layers or (8 if shape == "qwen3-8b" else None)
        cache_len = args.context + max(Ts)
        module, full_layers = build(shape, layers, cache_len, args.device, dtype)
        built = len(module.blocks)
        ms = {}
        with torch.no_grad():
            for T in Ts:
                x = step_inputs(T, args.context, cache_len, args.device, dtype)
                ms[T] = time_call(lambda: module(*x), args.device, args.reps)
        floor_ms = bandwidth and 1000 * step_bytes(module, args.context) / bandwidth
        row = {"layers_built": built, "layers_full": full_layers, "ms": {T: round(v, 4) for T, v in ms.items()},
               "c": {T: round(ms[T] / ms[Ts[0]], 3) for T in Ts}, "floor_ms": floor_ms and round(floor_ms, 4),
               "plain_vs_floor": floor_ms and round(ms[Ts[0]] / floor_ms, 2)}
        if built < full_layers:  # per layer, from the step's total (head and embedding included: an upper bound)
            row["ms_per_layer_upper"] = {T: round(v / built, 4) for T, v in ms.items()}
        report["shapes"][shape] = row
        print(f"{shape} ({built}/{full_layers} layers, {report['dtype']}, {args.device}, context {args.context}):")
        for T in Ts:
            print(f"  T={T:<3} {ms[T]:9.3f} ms   c(T) = {row['c'][T]:.3f}")
        if floor_ms:
            print(f"  memory floor {floor_ms:.3f} ms at {bandwidth / 1e12:.2f} TB/s; plain is {row['plain_vs_floor']}x it")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
