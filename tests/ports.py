"""Free ports for the clusters the tests start, taken where no starting Ray process takes its
own: a port the kernel hands out (bind to port 0) lies in the ephemeral range, from which every
new Ray worker, raylet and agent also takes ports, so one of them could bind it first (a
fresh-clone run failed so: HAProxy 'cannot bind socket (Address already in use)' for the
port the test had just found free). Between Ray's worker ports (10002-19999 by default) and
the ephemeral range (32768 up on Linux) nothing binds unasked."""

from __future__ import annotations

import random
import socket

FIRST_PORT = 20000


def _ephemeral_start() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A port that nothing listens on now, outside the ranges new processes take ports from."""
    candidates = list(range(FIRST_PORT, max(FIRST_PORT + 1000, _ephemeral_start())))
    random.shuffle(candidates)
    for port in candidates:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port between {FIRST_PORT} and {_ephemeral_start()}")
