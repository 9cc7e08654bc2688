"""Other projects' servers run beside the cluster by `specserve bench` (vLLM's, llama.cpp's):
each started in a session of its own with its output in a log, ready when its OpenAI
`/v1/models` answers, and stopped, its whole process group, when the bench ends."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Callable, Iterator

import httpx

from cluster.ports import free_port

READY_TIMEOUT_S = 600
STOP_TIMEOUT_S = 30


@contextlib.contextmanager
def running_servers(commands: dict[str, Callable[[int], list[str]]], label: str, log_folder: Path,
                    env: dict | None = None) -> Iterator[dict[str, str]]:
    """Start each mode's command (given its port) one after the other, since two starting at
    once would share the CPUs; yields {mode: base URL}; each server's output in log_folder."""
    log_folder.mkdir(parents=True, exist_ok=True)
    processes: list[subprocess.Popen] = []
    urls: dict[str, str] = {}
    try:
        for mode, command in commands.items():
            port = free_port()
            log = log_folder / f"{mode}.log"
            process = subprocess.Popen(command(port), stdout=log.open("w"), stderr=subprocess.STDOUT, env=env,
                                       start_new_session=True)
            processes.append(process)
            urls[mode] = f"http://127.0.0.1:{port}"
            print(f"bench: starting {label} ({mode}) on port {port}, log {log}", flush=True)
            wait_ready(urls[mode], process, log)
        yield urls
    finally:
        for process in processes:
            stop(process)


def wait_ready(url: str, process: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
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
    raise RuntimeError(f"the server did not answer within {READY_TIMEOUT_S} s (log: {log})")


def stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=10)
