"""cluster/ports.py: a free port for a server about to start beside a starting Ray, and who
holds a taken one."""

from __future__ import annotations

import os
import socket
from pathlib import Path

from cluster.ports import free_port, holder


def _ephemeral_range() -> tuple[int, int]:
    low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
    return int(low), int(high)


def test_a_free_port_lies_outside_the_ranges_starting_processes_take_ports_from():
    low, _ = _ephemeral_range()
    ports = {free_port() for _ in range(50)}
    assert all(20000 <= port < low for port in ports), sorted(ports)
    assert len(ports) > 1                      # not one fixed port every caller would race for
    for port in list(ports)[:5]:
        with socket.socket() as server:        # and each can be bound and listened on
            server.bind(("127.0.0.1", port))
            server.listen()


def test_the_holder_of_a_taken_port_is_this_process_and_a_free_one_has_none():
    with socket.socket() as held:
        held.bind(("127.0.0.1", free_port()))
        held.listen()
        port = held.getsockname()[1]
        assert holder(port) == f"{Path('/proc/self/comm').read_text().strip()} (pid {os.getpid()})"
    assert holder(free_port()) is None
