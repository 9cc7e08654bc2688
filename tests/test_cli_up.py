"""`specserve up` end to end, as a real subprocess: it builds the placeholder models that the
config asks for, starts its own local Ray, deploys, answers HTTP, and shuts down on SIGTERM."""

from __future__ import annotations

import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
import yaml

from cluster.ports import free_port

SPECSERVE = Path(sys.executable).parent / "specserve"
HAPROXY_PORT_VARIABLES = ("RAY_SERVE_HAPROXY_STATS_PORT", "RAY_SERVE_HAPROXY_METRICS_PORT")
STARTUP_TIMEOUT_S = 180
SHUTDOWN_TIMEOUT_S = 60
MAX_TOKENS = 8
# What Serve's proxy and its HAProxy say when the port was taken before they bound it.
PORT_TAKEN = ("Failed to bind to address", "Address already in use")


@dataclass
class Server:
    process: subprocess.Popen
    url: str
    config_dir: Path
    lines: list[str] = field(default_factory=list)
    _queue: queue.Queue = field(default_factory=queue.Queue)

    def start_reader(self) -> None:
        def pump() -> None:
            for line in self.process.stdout:
                self._queue.put(line.rstrip("\n"))
            self._queue.put(None)  # end of output

        threading.Thread(target=pump, daemon=True).start()

    def read_until(self, marker: str, timeout_s: float) -> str | None:
        """Collect output lines until one contains `marker`; None on timeout or end of output."""
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            try:
                line = self._queue.get(timeout=min(left, 1.0))
            except queue.Empty:
                continue
            if line is None:
                return None
            self.lines.append(line)
            if marker in line:
                return line
        return None

    def drain(self, timeout_s: float = 5.0) -> None:
        """Collect what is left of the output after the process ended."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                line = self._queue.get(timeout=0.2)
            except queue.Empty:
                if self.process.poll() is not None:
                    return
                continue
            if line is None:
                return
            self.lines.append(line)

    def output(self) -> str:
        return "\n".join(self.lines)


@dataclass
class Stopped:
    returncode: int | None
    seconds: float
    output: str


def write_config(folder: Path, port: int, draft_resources: dict | None = None) -> Path:
    small = {"resources": {"num_cpus": 0.1}}
    data = {
        "models": {"target": {"path": "m/target", "placeholder": "target"},
                   "draft": {"path": "m/draft", "placeholder": "draft"}},
        "pools": {"router": small, "draft": {"resources": draft_resources or small["resources"]}, "target": small},
        "speculation": {"k": 3, "max_k": 8},
        # The port in the file is overridden by --port on the command line.
        "server": {"host": "127.0.0.1", "port": 1, "model_name": "specserve-up-test"},
        "limits": {"max_tokens": 64, "default_max_tokens": 16, "context_length": 512},
    }
    path = folder / "cluster.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def terminate(process: subprocess.Popen) -> None:
    """Make sure the process and whatever it started in its session are gone."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=SHUTDOWN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(process.pid, signal.SIGKILL)  # its own session: started with start_new_session
    except (ProcessLookupError, PermissionError):
        pass
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass


def start_up(tmp_path_factory, **config_fields) -> Server:
    """`specserve up` on a fresh config, as a subprocess in a session of its own. A free port
    can still be taken before Serve's proxy or HAProxy binds it: then again, with another
    port."""
    for attempt in range(3):
        srv = _start_once(tmp_path_factory, **config_fields)
        if srv.read_until("specserve is up", STARTUP_TIMEOUT_S) is not None:
            return srv
        terminate(srv.process)
        srv.drain()
        if not any(refusal in srv.output() for refusal in PORT_TAKEN):
            break
    pytest.fail(f"`specserve up` was not up within {STARTUP_TIMEOUT_S} s "
                f"(exit code {srv.process.poll()}); its output so far:\n{srv.output()}")


def _start_once(tmp_path_factory, **config_fields) -> Server:
    folder = tmp_path_factory.mktemp("specserve-up")
    port = free_port()
    config = write_config(folder, port, **config_fields)
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    # HAProxy's stats and metrics ports of its own: the session's test cluster (conftest.py)
    # holds the ones this process's environment names.
    env.update({variable: str(free_port()) for variable in HAPROXY_PORT_VARIABLES})
    env.setdefault("HF_HUB_OFFLINE", "1")
    process = subprocess.Popen(
        [str(SPECSERVE), "up", "--config", str(config), "--port", str(port)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
        cwd=tmp_path_factory.mktemp("elsewhere"),  # model paths must resolve against the config
        start_new_session=True,
    )
    srv = Server(process=process, url=f"http://127.0.0.1:{port}", config_dir=folder)
    srv.start_reader()
    return srv


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = start_up(tmp_path_factory)
    try:
        yield srv
    finally:
        terminate(srv.process)


@pytest.fixture(scope="module")
def stopped(server) -> Stopped:
    """SIGTERM the running server and wait for it to exit."""
    start = time.monotonic()
    server.process.send_signal(signal.SIGTERM)
    try:
        returncode = server.process.wait(timeout=SHUTDOWN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        returncode = None
    seconds = time.monotonic() - start
    server.drain()
    return Stopped(returncode, seconds, server.output())


def test_startup_output(server):
    out = server.output()
    up_line = server.lines[-1]
    assert f"{server.url}/v1" in up_line and "specserve-up-test" in up_line, up_line
    for role in ("target", "draft"):
        folder = (server.config_dir / "m" / role).resolve()
        assert f"building an UNTRAINED placeholder {role} model (random weights) at {folder}" in out, out
        assert (folder / "config.json").is_file()
    assert "starting Ray locally" in out, out
    progress = [line for line in server.lines if "loading models ..." in line]
    assert progress, out
    for deployment in ("router", "draft", "target"):
        if not any(f"{deployment}: " in line for line in progress):
            pytest.fail(f"no progress line names the {deployment} deployment:\n{out}")
    assert "Traceback" not in out, out


def test_health(server):
    response = httpx.get(f"{server.url}/health", timeout=30)
    assert response.status_code == 200
    assert response.json() == {"status": "ok"}


def test_models_lists_the_configured_name(server):
    response = httpx.get(f"{server.url}/v1/models", timeout=30)
    assert response.status_code == 200
    assert [m["id"] for m in response.json()["data"]] == ["specserve-up-test"]


def test_completion(server):
    body = {"model": "specserve-up-test", "prompt": "def main():\n    ", "temperature": 0,
            "max_tokens": MAX_TOKENS}
    response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    data = response.json()
    assert data["usage"]["completion_tokens"] == MAX_TOKENS, data
    assert data["choices"][0]["finish_reason"] == "length", data
    assert isinstance(data["choices"][0]["text"], str)


def test_sigterm_shuts_down(stopped):
    assert stopped.returncode is not None, (
        f"still running {SHUTDOWN_TIMEOUT_S} s after SIGTERM; output:\n{stopped.output}")
    assert "shutting down" in stopped.output, stopped.output
    print(f"`specserve up` exited with code {stopped.returncode} {stopped.seconds:.1f} s after SIGTERM")


def test_sigterm_exit_code_is_zero(stopped):
    assert stopped.returncode == 0, f"exit code {stopped.returncode}; output:\n{stopped.output}"


def test_up_serves_the_target_alone_when_no_node_can_host_the_drafts(server, stopped, tmp_path_factory):
    # after the module's server stopped: one local Ray at a time
    srv = start_up(tmp_path_factory, draft_resources={"num_cpus": 0.1, "custom": {"no_such_node_kind": 1}})
    try:
        assert "the draft pool is not running yet" in srv.output(), srv.output()
        body = {"model": "specserve-up-test", "prompt": "def main():\n    ", "temperature": 0,
                "max_tokens": MAX_TOKENS}
        response = httpx.post(f"{srv.url}/v1/completions", json=body, timeout=120)
        assert response.status_code == 200, response.text
        spec = response.json()["speculation"]
        assert spec["by_kind"]["draft_model"]["drafted_tokens"] == 0, spec
        assert spec["rounds"] - 1 <= spec["fallback_rounds"] <= spec["rounds"] and spec["fallback_rounds"] > 0
    finally:
        terminate(srv.process)


def test_up_on_a_taken_port_says_which_and_who_holds_it_before_starting_ray(tmp_path):
    """A HAProxy left behind by a killed cluster keeps the ports: `specserve up` must say so
    at once, not after Ray started and Serve failed deep inside."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        config = write_config(tmp_path, port)
        env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
        started = time.monotonic()
        done = subprocess.run([str(SPECSERVE), "up", "--config", str(config), "--port", str(port)],
                              capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 1, done.stdout + done.stderr
    assert f"port {port}: " in done.stderr and f"(pid {os.getpid()})" in done.stderr, done.stderr
    assert "starting Ray" not in done.stdout and time.monotonic() - started < 60
