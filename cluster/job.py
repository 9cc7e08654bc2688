"""The `ray job submit` entrypoint: deploy specserve onto the running Ray cluster, or measure
it as a batch job.

    ray job submit --address http://HEAD:8265 --working-dir . -- \\
        python -m cluster.job --config cluster.yaml
    ray job submit --address http://HEAD:8265 --working-dir . -- \\
        python -m cluster.job --config cluster.yaml --bench --concurrency 1 8 --num-requests 16

Deploying: the application goes up (the same checks and waits as `specserve up`), the job
prints the endpoint and exits 0, and the application keeps serving: Serve's controller
outlives the job's driver. On failure (an invalid config, a pool no node can host, a
deployment that fails, no answer in time) it exits 1 with the reason. With --bench it
deploys (unless --url names a running endpoint), runs `specserve bench` against the
endpoint and prints the report's summary. A head started with `ray start --head` requires
token authentication by default: submit with RAY_AUTH_MODE=token in the environment (the
token is in ~/.ray), or start the head with RAY_AUTH_MODE=disabled.
"""

from __future__ import annotations

import argparse
import json
import sys

from cluster.config import DEFAULT_CONFIG_FILE


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cluster.job", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=DEFAULT_CONFIG_FILE, help="cluster config (default: %(default)s)")
    parser.add_argument("--bench", action="store_true", help="measure the endpoint with specserve bench")
    parser.add_argument("--url", help="with --bench: a running endpoint (default: deploy, then measure)")
    args, bench_args = parser.parse_known_args(argv)
    try:
        url = args.url or _deploy(args.config)
    except SystemExit as exc:
        print(f"specserve job failed: {exc.code}", file=sys.stderr, flush=True)
        return 1
    if not args.bench:
        print(f"specserve is serving at {url}/v1", flush=True)
        return 0
    return _bench(args.config, url, bench_args)


def _deploy(config_path: str) -> str:
    import ray

    from cluster.launch import deploy, load_or_report

    config = load_or_report(config_path)
    if config is None:
        raise SystemExit(f"{config_path} is not a valid cluster config")
    from cluster.app import ensure_gguf_files

    ensure_gguf_files(config)     # into the job's working folder: a one-node cluster's replicas read them there
    ray.init(logging_level="WARNING", log_to_driver=False)     # the job's cluster
    return deploy(config)


def _bench(config_path: str, url: str, bench_args: list[str]) -> int:
    import tempfile
    from pathlib import Path

    from cluster.cli import main as specserve

    out = Path(tempfile.mkdtemp()) / "bench.json"
    code = specserve(["bench", "--url", url, "--config", config_path, "--out", str(out), *bench_args])
    if code == 0:
        report = json.loads(out.read_text())
        print("BENCH SUMMARY " + json.dumps(report["summary"]), flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
