"""The engine alone, against the memory-bandwidth floor and a plain transformers forward: what
one forward pass of the serving engine (replicas/engines/huggingface/model_runner.py) costs on this machine.

    python -m cluster.bench.engine --random-llama 8b --device cuda --dtype bfloat16 \\
        --sequences 1 8 32 --positions 1 5 --context 512
    python -m cluster.bench.engine --model models/target --device cpu

For each batch of S sequences with `context` cached positions each, it times a forward of P
new positions per sequence two ways: a plain transformers forward over one batched cache
(the shapes alone), and the engine's `extend_batch` (its per-sequence caches, padding and
logits included). Decode (P = 1) at one sequence is compared with the floor: the model's
weight bytes over the device's copy bandwidth (a copy reads and writes each byte: bandwidth
= 2 x bytes / time). Random-weight Llama models of real sizes are built on the device in
seconds (no download): `1b`, `1.5b` (draft-sized), `8b`, `70b-layers=N` (70B's layer shape,
N layers). Imports neither Ray nor anything that needs it, so it runs on a bare GPU box.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

# name -> (hidden, layers, heads, kv_heads, intermediate, vocab): the shapes of public models.
SIZES = {
    "tiny": (64, 2, 4, 4, 128, 512),
    "1b": (2048, 16, 32, 8, 8192, 128256),         # Llama 3.2 1B
    "1.5b": (1536, 28, 12, 2, 8960, 151936),       # Qwen2 1.5B
    "8b": (4096, 32, 32, 8, 14336, 128256),        # Llama 3 8B
    "70b": (8192, 80, 64, 8, 28672, 128256),       # Llama 3 70B
}


def random_llama(name: str, device: torch.device, dtype: torch.dtype):
    """A Llama of the named size with random weights, built on `device` in `dtype`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    base, _, layers = name.partition("-layers=")
    hidden, depth, heads, kv_heads, intermediate, vocab = SIZES[base]
    config = LlamaConfig(hidden_size=hidden, num_hidden_layers=int(layers) if layers else depth,
                         num_attention_heads=heads, num_key_value_heads=kv_heads,
                         intermediate_size=intermediate, vocab_size=vocab, max_position_embeddings=8192,
                         tie_word_embeddings=False)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    return model.eval()


def copy_bandwidth(device: torch.device, megabytes: int = 1024, repeats: int = 5) -> float:
    """Bytes per second a device-to-device copy moves (each byte read once, written once)."""
    source = torch.empty(megabytes * 2 ** 20, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    times = [_timed(lambda: target.copy_(source), device) for _ in range(repeats + 1)][1:]
    return 2 * source.numel() / min(times)


def _timed(step, device: torch.device) -> float:
    _sync(device)
    started = time.perf_counter()
    step()
    _sync(device)
    return time.perf_counter() - started


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def plain_forward_ms(model, sequences: int, positions: int, context: int, repeats: int, device) -> float:
    """One transformers forward of `positions` new tokens per sequence over a batched cache of
    `context` positions (cropped back after each run, so every run has the same shape)."""
    from transformers import DynamicCache

    vocab = model.config.vocab_size
    cache = DynamicCache(config=model.config)
    prompt = torch.randint(1, vocab, (sequences, context), device=device)
    model(input_ids=prompt, cache=cache, use_cache=True)
    new = torch.randint(1, vocab, (sequences, positions), device=device)
    where = torch.arange(context, context + positions, device=device).expand(sequences, -1)

    def step():
        model(input_ids=new, position_ids=where, cache=cache, use_cache=True)
        cache.crop(-positions)      # transformers 5.24: a negative count removes that many
    return _median_ms(step, repeats, device)


@torch.inference_mode()
def engine_ms(model, sequences: int, positions: int, context: int, repeats: int, device,
              compiled: bool = False, fused: bool = False, graphs: bool = False) -> float:
    """The engine's extend_batch of the same shapes: `positions` recomputed per sequence over
    its cached context (the call keeps the cache, so every run has the same shape); compiled:
    with the compiled layers (compiled once per process, so only the first call pays); fused:
    the fused CPU forward (models.*.compile: auto on a CPU); graphs: replayed from CUDA graphs
    (models.*.compile: auto on a GPU; on a CPU rerun in their buckets, to run the path)."""
    from replicas.engines.huggingface.model_runner import ExtendCall, ModelRunner

    length = context + positions
    runner = ModelRunner(model, max_cached_tokens=sequences * length, max_seq_len=length, compiled=compiled,
                         fused_cpu=fused)
    if fused and not runner.fused:
        raise SystemExit("the fused CPU forward does not apply to this model or device (float32 Llama on a CPU)")
    if graphs:
        from replicas.engines.huggingface.cuda_graphs import capture_for

        runner.replay_graphs(capture_for(device))
    vocab = model.config.vocab_size
    calls = [ExtendCall(f"s{b}", torch.randint(1, vocab, (context + positions,)).tolist(), positions)
             for b in range(sequences)]
    runner.extend_batch(calls)
    return _median_ms(lambda: runner.extend_batch(calls), repeats, device)


def _median_ms(step, repeats: int, device) -> float:
    step()   # warm-up
    return round(statistics.median(_timed(step, device) for _ in range(repeats)) * 1000, 3)


def weight_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def measure(model, device: torch.device, sequences: list[int], positions: list[int], context: int,
            repeats: int, compiled: bool = False, fused: bool = False, graphs: bool = False) -> dict:
    bandwidth = copy_bandwidth(device)
    floor_ms = weight_bytes(model) / bandwidth * 1000
    rows = []
    for count in sequences:
        for new in positions:
            plain = plain_forward_ms(model, count, new, context, repeats, device)
            engine = engine_ms(model, count, new, context, repeats, device)
            row = {"sequences": count, "positions": new, "plain_ms": plain, "engine_ms": engine,
                   "engine_over_plain": round(engine / plain, 3), "plain_over_floor": round(plain / floor_ms, 3)}
            if compiled:
                row["compiled_ms"] = engine_ms(model, count, new, context, repeats, device, compiled=True)
                row["eager_over_compiled"] = round(engine / row["compiled_ms"], 3)
            if graphs:
                row["graphed_ms"] = engine_ms(model, count, new, context, repeats, device, graphs=True)
                row["eager_over_graphed"] = round(engine / row["graphed_ms"], 3)
            if fused:
                row["fused_ms"] = engine_ms(model, count, new, context, repeats, device, fused=True)
                row["eager_over_fused"] = round(engine / row["fused_ms"], 3)
            rows.append(row)
    return {"device": str(device), "dtype": str(next(model.parameters()).dtype),
            "weight_bytes": weight_bytes(model), "copy_bandwidth_bytes_s": round(bandwidth),
            "weight_gb": round(weight_bytes(model) / 1e9, 3), "copy_bandwidth_gb_s": round(bandwidth / 1e9, 1),
            "decode_floor_ms": round(floor_ms, 6), "context": context, "rows": rows}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--random-llama", help="tiny, 1b, 1.5b, 8b or 70b-layers=N")
    source.add_argument("--model", type=Path, help="a local Hugging Face model folder")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--sequences", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--positions", type=int, nargs="+", default=[1, 5])
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--compile", action="store_true",
                        help="also time the engine with its layers compiled (models.*.compile: on)")
    parser.add_argument("--fused", action="store_true",
                        help="also time the fused CPU forward (models.*.compile: auto; float32 on a CPU)")
    parser.add_argument("--graphs", action="store_true",
                        help="also time the forward replayed from CUDA graphs (models.*.compile: auto on a GPU)")
    args = parser.parse_args(argv)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    if args.random_llama:
        model = random_llama(args.random_llama, device, dtype)
    else:
        from cluster.config import ModelSpec
        from replicas.engines.huggingface.loading import load_causal_lm

        model = load_causal_lm(ModelSpec(path=args.model.resolve(), dtype=args.dtype), device=device)
    report = measure(model, device, args.sequences, args.positions, args.context, args.repeats, args.compile,
                     args.fused, args.graphs)
    report["model"] = args.random_llama or str(args.model)
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
