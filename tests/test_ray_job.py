"""`ray job submit` and `serve deploy`, for real: a head started with `ray start --head` (token
authentication on, as by default), the job entrypoint deploying specserve and exiting while
it keeps serving, greedy output equal to the target alone (as `specserve up` gives), the
entrypoint's bench mode as a batch job, and the rendered Serve config deployed with
`serve deploy`, a cluster mixing engines (a llama.cpp draft pool on CPU nodes beside a
transformers target) submitted as a job; then the head is stopped."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

from cluster.render import render_serve_config
from tests.conftest import PROMPTS, free_port
from tests.http_client import complete, wait_for_the_draft_pool

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["RAY_AUTH_MODE"] = "token"          # `ray start --head` turns token authentication on
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"   # a job's `python` is this environment's
    return env


@pytest.fixture(scope="module")
def head(tmp_path_factory):
    """A Ray head of its own (its own ports, so that the tests' Ray is untouched)."""
    dashboard = free_port()
    args = [str(BIN / "ray"), "start", "--head", "--block", "--disable-usage-stats", "--num-cpus=2",
            f"--port={free_port()}", f"--dashboard-port={dashboard}", "--dashboard-host=127.0.0.1",
            f"--dashboard-agent-listen-port={free_port()}", f"--dashboard-agent-grpc-port={free_port()}",
            f"--metrics-export-port={free_port()}", f"--runtime-env-agent-port={free_port()}",
            f"--ray-client-server-port={free_port()}", '--resources={"cpu_node": 4}']
    log = open(tmp_path_factory.mktemp("head") / "ray-start.log", "w")
    process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=_env(), start_new_session=True)
    address = f"http://127.0.0.1:{dashboard}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"{address}/api/version", timeout=5).status_code in (200, 401, 403):  # up (tokens)
                    break
            except httpx.HTTPError:
                pass
            assert process.poll() is None and time.monotonic() < deadline, Path(log.name).read_text()
            time.sleep(1)
        yield address
    finally:
        process.send_signal(signal.SIGINT)           # `ray start --block` stops what it started
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            # With Serve's replicas running it takes a minute: the head's session is this Ray's alone
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=30)


@pytest.fixture(scope="module")
def job_config(zoo, tmp_path_factory) -> Path:
    port = free_port()
    data = {"models": {"target": {"path": str(zoo.target)}, "draft": {"path": str(zoo.drafts["perturbed"])}},
            "pools": {pool: {"resources": {"num_cpus": 0.1}} for pool in ("router", "draft", "target")},
            "server": {"host": "127.0.0.1", "port": port},
            "limits": {"max_tokens": 256, "default_max_tokens": 16, "context_length": 512}}
    path = tmp_path_factory.mktemp("job") / "cluster.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def submit(address: str, *entrypoint: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "ray"), "job", "submit", "--address", address, "--working-dir", str(REPO),
                           "--", "python", "-m", "cluster.job", *entrypoint],
                          capture_output=True, text=True, timeout=600, env=_env(), cwd=REPO)


def endpoint(config: Path) -> str:
    return f"http://127.0.0.1:{yaml.safe_load(config.read_text())['server']['port']}"


def test_a_submitted_job_deploys_specserve_and_leaves_it_serving(head, job_config, greedy_reference):
    result = submit(head, "--config", str(job_config))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    url = endpoint(job_config)
    assert f"specserve is serving at {url}/v1" in result.stdout, result.stdout[-3000:]
    out = complete(url, PROMPTS[0], max_tokens=24, speculation={"k": 4})     # after the job ended
    assert out["choices"][0]["token_ids"] == greedy_reference(PROMPTS[0], 24)


def test_a_bench_job_measures_the_endpoint_and_prints_its_result(head, job_config):
    result = submit(head, "--config", str(job_config), "--bench", "--url", endpoint(job_config),
                    "--concurrency", "1", "--num-requests", "2", "--requests-per-client", "2", "--max-tokens", "8",
                    "--prompt-tokens", "16",
                    "--hf-prompts", "0")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    [line] = [line for line in result.stdout.splitlines() if line.startswith("BENCH SUMMARY ")]
    summary = json.loads(line.removeprefix("BENCH SUMMARY "))
    assert summary["speedup_vs_target_only"]["1 greedy"] > 0


def test_a_job_with_a_llamacpp_draft_pool_on_cpu_nodes_serves_as_the_target_alone(head, job_config, zoo,
                                                                                   greedy_reference, tmp_path):
    """The mixed cluster of docs/ENGINES.md: the draft pool on llama.cpp, its GGUF file not
    there before the job (the job writes it from the tokenizer folder), its replicas on the
    nodes with the `cpu_node` resource; the target on transformers. Greedy output with the
    draft's proposals equals the target alone's generate."""
    mixed = yaml.safe_load(job_config.read_text())
    gguf = tmp_path / "draft-f32.gguf"
    mixed["models"]["draft"] = {"path": str(gguf), "tokenizer": str(zoo.drafts["perturbed"])}
    mixed["pools"]["draft"] = {"engine": "llamacpp", "resources": {"num_cpus": 0.1, "custom": {"cpu_node": 1}}}
    mixed["speculation"] = {"method": "draft_model"}
    path = tmp_path / "mixed.yaml"
    path.write_text(yaml.safe_dump(mixed))
    result = submit(head, "--config", str(path))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert gguf.is_file()
    url = endpoint(path)
    wait_for_the_draft_pool(url)
    for prompt in PROMPTS[:2]:
        out = complete(url, prompt, max_tokens=24, speculation={"k": 3})
        assert out["choices"][0]["token_ids"] == greedy_reference(prompt, 24)
        assert out["speculation"]["by_kind"]["draft_model"]["drafted_tokens"] > 0    # the pool's drafts


def test_a_job_that_cannot_deploy_exits_non_zero_with_the_reason(head, job_config, tmp_path):
    broken = yaml.safe_load(job_config.read_text())
    broken["pools"]["target"]["resources"] = {"num_cpus": 0.1, "custom": {"large_gpu": 1}}
    path = tmp_path / "broken.yaml"
    path.write_text(yaml.safe_dump(broken))
    result = submit(head, "--config", str(path))
    assert result.returncode != 0
    output = result.stdout + result.stderr
    assert "no node can host a target replica" in output and "large_gpu" in output, output[-3000:]


def test_the_rendered_serve_config_deploys_with_serve_deploy(head, job_config, greedy_reference, tmp_path):
    subprocess.run([str(BIN / "serve"), "shutdown", "-y", "--address", head], env=_env(), timeout=120,
                   capture_output=True)
    config_file = tmp_path / "serve.yaml"
    config_file.write_text(render_serve_config(job_config, models_dir=None, models_uri=None))
    deployed = subprocess.run([str(BIN / "serve"), "deploy", str(config_file), "--address", head],
                              capture_output=True, text=True, timeout=300, env=_env())
    assert deployed.returncode == 0, deployed.stdout + deployed.stderr
    url, deadline = endpoint(job_config), time.monotonic() + 240
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "the application deployed from the Serve config never answered"
        time.sleep(2)
    out = complete(url, PROMPTS[1], max_tokens=24, speculation={"k": 4})
    assert out["choices"][0]["token_ids"] == greedy_reference(PROMPTS[1], 24)
