"""What an operator sees: the Prometheus series of router/metrics.py and replicas/metrics.py
with plausible values after a few requests, a Grafana dashboard that uses only series that
exist, and `specserve status` naming every pool with its replica count."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import httpx
import pytest
import ray

from ray import serve

from tests.conftest import METRICS_PORT, PROMPTS, cluster_config, deploy
from tests.http_client import complete

DASHBOARD = Path(__file__).parent.parent / "k8s" / "grafana-dashboard.json"
SPECSERVE = Path(sys.executable).parent / "specserve"
EXPECTED = ("ray_specserve_cache_evictions_total", "ray_specserve_queue_depth", "ray_specserve_cached_tokens",
            "ray_specserve_router_requests", "ray_specserve_adaptive_k_share", "ray_specserve_batch_size_count")
_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")


def scrape() -> dict[str, list[tuple[str, float]]]:
    """Prometheus text from the node's metrics agent: series name -> [(labels, value)]."""
    series = defaultdict(list)
    text = httpx.get(f"http://127.0.0.1:{METRICS_PORT}/metrics", timeout=30).text
    for line in text.splitlines():
        match = _LINE.match(line)
        if match and not line.startswith("#"):
            series[match.group(1)].append((match.group(2) or "", float(match.group(3))))
    return series


def total(series, name: str, label: str = "") -> float:
    return sum(value for labels, value in series.get(name, []) if label in labels)


@pytest.fixture(scope="module")
def exported(apps, ray_serve, zoo):
    """The series once the traffic below has been exported (Ray exports every second here),
    with an app whose caches hold nothing (8 positions) so that evictions and rebuilds happen."""
    url = apps["perturbed"]
    for prompt in PROMPTS[:3]:
        complete(url, prompt, max_tokens=16, speculation={"k": 4})
    for prompt in PROMPTS:               # the router's own choice: windows of its measured table
        complete(url, prompt, max_tokens=32)
    assert httpx.post(f"{url}/v1/completions", json={"model": "nope", "prompt": "x"}, timeout=30).status_code == 404
    no_cache = {"kv_cache": {"max_tokens": 8}, "resources": {"num_cpus": 0.1},
                "batching": {"max_batch_size": 8, "wait_ms": 25.0}, "max_ongoing_requests": 8}
    forgetful = deploy(ray_serve, "forgetful", cluster_config(zoo.target, zoo.drafts["perturbed"],
                                                              pools={"draft": no_cache, "target": no_cache}))
    try:
        complete(forgetful, PROMPTS[0], max_tokens=16, speculation={"k": 2})
        deadline = time.monotonic() + 90
        while True:
            series = scrape()
            # the counters are the session's (earlier tests' traffic too): wait for this traffic's gauges
            if all(name in series for name in EXPECTED) and (
                    total(series, "ray_specserve_requests_total", 'status="404"') >= 1
                    and total(series, "ray_specserve_cache_rebuilds_total", 'pool="target"') >= 1
                    and total(series, "ray_specserve_cache_evictions_total", 'deployment="target"') >= 1
                    and total(series, "ray_specserve_generated_tokens_total") >= 64
                    and total(series, "ray_specserve_adaptive_goodput_tokens_per_s") > 0
                    and "ray_specserve_adaptive_round_ms" in series
            ) or time.monotonic() > deadline:
                return series
            time.sleep(1)
    finally:
        serve.delete("forgetful")


def test_the_named_series_are_served_with_plausible_values(exported):
    s = exported
    drafted, accepted = total(s, "ray_specserve_drafted_tokens_total"), total(s, "ray_specserve_accepted_tokens_total")
    assert 0 < accepted <= drafted
    generated = total(s, "ray_specserve_generated_tokens_total")
    assert generated >= 48
    rounds = total(s, "ray_specserve_tokens_per_round_count")
    assert 1 <= total(s, "ray_specserve_tokens_per_round_sum") / rounds <= 9     # k <= 8: 1..9 a round
    assert total(s, "ray_specserve_rounds_total", 'kind="speculative"') > 0
    assert total(s, "ray_specserve_k_count") == rounds
    assert total(s, "ray_specserve_verify_batch_size_count") == rounds
    assert total(s, "ray_specserve_ttft_seconds_count") >= 3
    assert total(s, "ray_specserve_inter_token_seconds_count") > 0
    assert total(s, "ray_specserve_requests_total", 'status="200"') >= 3
    assert total(s, "ray_specserve_errors_total", 'type="model_not_found"') >= 1
    for pool in ("draft", "target"):
        assert total(s, "ray_specserve_batch_size_count", f'deployment="{pool}"') > 0, pool
        assert any(f'deployment="{pool}"' in labels for labels, _ in s["ray_specserve_queue_depth"]), pool
        assert any(f'deployment="{pool}"' in labels for labels, _ in s["ray_specserve_cached_tokens"]), pool
    assert "ray_specserve_router_requests" in s
    # the goodput controller's view: k by method, its plan's goodput, round time predicted and measured
    assert any('method="draft_model"' in labels and 0 < value <= 1 for labels, value in s["ray_specserve_adaptive_k_share"])
    assert total(s, "ray_specserve_adaptive_goodput_tokens_per_s") > 0
    assert {kind for kind in ("predicted", "measured")
            if any(f'kind="{kind}"' in labels for labels, _ in s["ray_specserve_adaptive_round_ms"])} == {"predicted", "measured"}
    assert any('model="target_pass"' in labels for labels, _ in s["ray_specserve_adaptive_model_error"])
    assert total(s, "ray_specserve_cache_rebuilds_total", 'pool="target"') >= 1
    assert total(s, "ray_specserve_cache_evictions_total", 'deployment="target"') >= 1
    for labels, _ in s["ray_specserve_requests_total"]:
        assert "cmpl-" not in labels and "request_id" not in labels     # no request ids as labels


def test_the_dashboard_uses_only_series_that_exist(exported):
    dashboard = json.loads(DASHBOARD.read_text())
    expressions = [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]
    used = {name for expr in expressions for name in re.findall(r"ray_specserve_[a-z_]+", expr)}
    assert len(used) >= 15
    missing = sorted(name for name in used if name not in exported)
    assert not missing, f"the dashboard uses series that are not exported: {missing}"


def test_status_names_every_pool_with_its_replica_count(apps):
    env = {**os.environ, "RAY_ADDRESS": ray.get_runtime_context().gcs_address}
    result = subprocess.run([str(SPECSERVE), "status", "--app", "spec-perturbed"], capture_output=True,
                            text=True, timeout=120, env=env)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    logged = [line for line in (out + result.stderr).splitlines() if re.search(r"\b(INFO|WARNING)\b", line)]
    assert not logged, logged                     # the summary only, no Ray or Serve log lines
    assert "'spec-perturbed': RUNNING" in out, out
    for pool in ("router", "draft", "target"):
        [line] = [line for line in out.splitlines() if line.strip().startswith(pool)]
        assert "HEALTHY" in line and "replicas 1/1" in line, line
    assert "tokens/s" in out and "acceptance" in out, out
    assert "adaptive router 1:" in out and "in flight:" in out and "round ms predicted" in out, out   # the controller
    missing = subprocess.run([str(SPECSERVE), "status", "--app", "no-such-app"], capture_output=True,
                             text=True, timeout=120, env=env)
    assert missing.returncode == 1 and "no Serve application named 'no-such-app'" in missing.stdout
