"""Separate hosts on this machine for tests: Linux network namespaces, each with its own
address on a private bridge, and a Ray node in each. Used by tests/test_network_faults.py.

The hosts talk to each other and to their own loopback only: the bridge has no address in
the machine's own namespace and no route out, so nothing the tests send leaves the hosts they
made. Everything made here is removed on exit, the processes in the namespaces first, even
when a test fails; leftovers of an earlier run that was killed are removed before a start.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

BRIDGE = "ssfault-br"
SUBNET = "10.213.77"
RAY_PORT = 6390
TEMP_DIR = Path("/tmp/ssfault")
RAY = Path(sys.executable).parent / "ray"


@dataclass(frozen=True)
class Host:
    name: str                    # the namespace
    address: str
    resources: dict = field(default_factory=dict)

    @property
    def link(self) -> str:
        """The host's end of its link (inside its namespace); the bridge's end is link + 'b'."""
        return f"{self.name[-8:]}-l"

    @property
    def bridge_end(self) -> str:
        return f"{self.name[-8:]}-b"


# The hosts' Ray takes no tokens: they are private to the test, and a worker started with
# `ray start --address` does not find the token a head made (Ray 2.60).
ENV = {**os.environ, "RAY_AUTH_MODE": "disabled"}


def run(*command: str, check: bool = True, timeout: float = 60, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(command, capture_output=True, text=True, check=check, timeout=timeout,
                          env={**ENV, **(env or {})})


def in_host(host: Host, *command: str, **options) -> subprocess.CompletedProcess:
    return run("ip", "netns", "exec", host.name, *command, **options)


def can_make_namespaces() -> str | None:
    """None when this process may make namespaces, links and bridges; else why not."""
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "the ip and tc commands (iproute2) are not installed"
    probe = "ssfault-probe"
    made = run("ip", "netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"cannot make a network namespace: {made.stderr.strip()}"
    run("ip", "netns", "del", probe, check=False)
    return None


class Hosts:
    """The bridge and one namespace per host, each with a veth link to the bridge."""

    def __init__(self, hosts: list[Host]):
        self.hosts = hosts

    def __enter__(self) -> "Hosts":
        self.remove()
        try:
            run("ip", "link", "add", BRIDGE, "type", "bridge")
            run("ip", "link", "set", BRIDGE, "up")
            for host in self.hosts:
                self._make(host)
        except BaseException:
            self.remove()
            raise
        return self

    def _make(self, host: Host) -> None:
        run("ip", "netns", "add", host.name)
        run("ip", "link", "add", host.bridge_end, "type", "veth", "peer", "name", host.link)
        run("ip", "link", "set", host.link, "netns", host.name)
        run("ip", "link", "set", host.bridge_end, "master", BRIDGE)
        run("ip", "link", "set", host.bridge_end, "up")
        in_host(host, "ip", "addr", "add", f"{host.address}/24", "dev", host.link)
        in_host(host, "ip", "link", "set", host.link, "up")
        in_host(host, "ip", "link", "set", "lo", "up")

    def __exit__(self, *exc) -> None:
        self.remove()

    def remove(self) -> None:
        for host in self.hosts:
            kill_processes(host)
            run("ip", "netns", "del", host.name, check=False)
            run("ip", "link", "del", host.bridge_end, check=False)
        run("ip", "link", "del", BRIDGE, check=False)
        shutil.rmtree(TEMP_DIR, ignore_errors=True)


def kill_processes(host: Host) -> None:
    """Every process in the host's namespace, as when its machine goes away (`ray stop` would
    find Ray's processes in every namespace of this machine, not only this host's)."""
    pids = run("ip", "netns", "pids", host.name, check=False).stdout.split()
    for pid in pids:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except ProcessLookupError:
            pass
    if pids:
        time.sleep(0.5)


_COMMON = ["--num-cpus", "1", "--disable-usage-stats", "--include-log-monitor=false"]


def start_ray(head: Host, workers: list[Host], head_env: dict | None = None) -> None:
    """A Ray head in the first host, a worker in each other, each declaring its node kind;
    head_env: settings of the head's GCS (RAY_health_check_* say when a node is dead)."""
    in_host(head, str(RAY), "start", "--head", "--node-ip-address", head.address, "--port", str(RAY_PORT),
            "--include-dashboard=false", "--temp-dir", str(TEMP_DIR), "--resources", json.dumps(head.resources),
            *_COMMON, timeout=180, env=head_env)
    for worker in workers:
        start_worker(head, worker)


def start_worker(head: Host, worker: Host) -> None:
    in_host(worker, str(RAY), "start", "--address", f"{head.address}:{RAY_PORT}",
            "--node-ip-address", worker.address, "--resources", json.dumps(worker.resources),
            *_COMMON, timeout=180)


def slow_link(host: Host, rate: str) -> None:
    """Token-bucket rate limits on both ends of the host's link (this kernel has no netem)."""
    in_host(host, "tc", "qdisc", "add", "dev", host.link, "root", "tbf", "rate", rate, "burst", "1600",
            "latency", "30s")
    run("tc", "qdisc", "add", "dev", host.bridge_end, "root", "tbf", "rate", rate, "burst", "1600",
        "latency", "30s")


def normal_link(host: Host) -> None:
    in_host(host, "tc", "qdisc", "del", "dev", host.link, "root", check=False)
    run("tc", "qdisc", "del", "dev", host.bridge_end, "root", check=False)


def cut_link(host: Host) -> None:
    in_host(host, "ip", "link", "set", host.link, "down")


def heal_link(host: Host) -> None:
    in_host(host, "ip", "link", "set", host.link, "up")
