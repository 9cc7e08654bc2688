"""TCP ports on this machine: whether one is free and which process holds it where it is not,
and a free one for a server about to start."""

from __future__ import annotations

import random
import socket
from pathlib import Path

_LISTEN = "0A"      # the state column of /proc/net/tcp for a listening socket
# Below the kernel's ephemeral range and above Ray's default worker ports (10002-19999): no
# starting process binds a port here unasked.
_UNCLAIMED_FROM = 20000


def free_port() -> int:
    """A port nothing listens on now, for a server about to start beside a starting Ray or
    vLLM. Not port 0's answer: the kernel hands that out of its ephemeral range, from which
    every new Ray worker, raylet and agent (and vLLM's engine) also take ports, so one of them
    could bind it first (a test's HAProxy failed so: 'Address already in use')."""
    candidates = list(range(_UNCLAIMED_FROM, max(_UNCLAIMED_FROM + 1000, _ephemeral_start())))
    random.shuffle(candidates)
    for port in candidates:
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port between {_UNCLAIMED_FROM} and {_ephemeral_start()}")


def _ephemeral_start() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def holder(port: int) -> str | None:
    """None if `port` can be bound here on every address; else what holds it: a process name
    and pid where Linux's /proc shows them, else 'another process'."""
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("0.0.0.0", port))
            return None
        except OSError:
            pass
    pid = _listening_pid(port)
    if pid is None:
        return "another process"
    try:
        return f"{Path(f'/proc/{pid}/comm').read_text().strip()} (pid {pid})"
    except OSError:
        return f"pid {pid}"


def _listening_pid(port: int) -> int | None:
    inodes = {_inode(line) for table in ("tcp", "tcp6") for line in _lines(Path("/proc/net") / table)
              if _listens_on(line, port)}
    if not inodes:
        return None
    for fd in Path("/proc").glob("[0-9]*/fd/*"):
        try:
            if fd.readlink().name.removeprefix("socket:[").removesuffix("]") in inodes:
                return int(fd.parts[2])
        except OSError:
            continue
    return None


def _lines(table: Path) -> list[list[str]]:
    try:
        return [line.split() for line in table.read_text().splitlines()[1:]]
    except OSError:
        return []


def _listens_on(fields: list[str], port: int) -> bool:
    return len(fields) > 9 and fields[3] == _LISTEN and int(fields[1].rsplit(":", 1)[1], 16) == port


def _inode(fields: list[str]) -> str:
    return fields[9]
