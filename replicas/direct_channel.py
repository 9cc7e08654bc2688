"""A direct channel from a router to a model replica: one TCP connection per router and
replica, many calls in flight on it, for the two calls of every round.

Why: a Serve handle call costs 4.3-4.8 ms here, a round makes two, and at one client they
were 88 % of a round's coordination (docs/BENCHMARKS.md). The channel carries the same
calls (`propose`, `verify`: lists of requests, lists of results) without Serve's routing,
queue-length probing and object plumbing in the way. Serve still decides which replica
serves a lane (the router asks, through a handle with the lane as session id, for that
replica's channel address), still starts, replaces and scales the replicas, and still
carries any call the channel cannot: a router that finds a channel broken goes back to the
handle path, which retries on another replica.

Frames: 4-byte big-endian body length, 32-byte HMAC-SHA256 of the body under the app's
channel key, then the body (a pickle). A frame whose MAC does not match closes the
connection before anything in it is unpickled: only processes given the key (the app's
router and model replicas) can make a replica run anything. Request body: (call id, method,
payload); answer body: (call id, ok, result or exception).
"""

from __future__ import annotations

import asyncio
import contextvars
import hashlib
import hmac
import itertools
import logging
import pickle
import struct
from typing import Any, Awaitable, Callable

logger = logging.getLogger("ray.serve")
_HEADER = struct.Struct(">I")
_MAC_BYTES = 32
_MAX_FRAME_BYTES = 1 << 30


class ChannelBroken(ConnectionError):
    """The connection to the replica is gone (or never came up): use the handle path."""


def _frame(key: bytes, obj: Any) -> bytes:
    body = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    return _HEADER.pack(len(body)) + hmac.new(key, body, hashlib.sha256).digest() + body


async def _read_frame(reader: asyncio.StreamReader, key: bytes) -> Any:
    (size,) = _HEADER.unpack(await reader.readexactly(_HEADER.size))
    if size > _MAX_FRAME_BYTES:
        raise ConnectionError(f"a frame of {size} bytes")
    mac = await reader.readexactly(_MAC_BYTES)
    body = await reader.readexactly(size)
    if not hmac.compare_digest(mac, hmac.new(key, body, hashlib.sha256).digest()):
        raise PermissionError("a frame that was not signed with the channel key")
    return pickle.loads(body)


class ChannelServer:
    """Serves `methods` (name -> async callable of one payload) on host:port (0: any free)."""

    def __init__(self, key: bytes, methods: dict[str, Callable[[Any], Awaitable[Any]]]):
        self.key, self.methods = key, methods
        self.refused_frames = 0
        self._server: asyncio.AbstractServer | None = None

    async def start(self, host: str, port: int = 0) -> tuple[str, int]:
        self._server = await asyncio.start_server(self._serve, host, port)
        return host, self._server.sockets[0].getsockname()[1]

    def close(self) -> None:
        if self._server is not None:
            self._server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        calls: set[asyncio.Task] = set()
        try:
            while True:
                call_id, method, payload = await _read_frame(reader, self.key)
                task = asyncio.create_task(self._answer(writer, call_id, method, payload))
                calls.add(task)
                task.add_done_callback(calls.discard)
        except PermissionError:
            self.refused_frames += 1
            logger.warning("closed a direct channel connection that sent an unsigned frame")
        except (asyncio.IncompleteReadError, ConnectionError):
            pass   # the router went away
        finally:
            writer.close()

    async def _answer(self, writer: asyncio.StreamWriter, call_id: int, method: str, payload) -> None:
        try:
            result, ok = await self.methods[method](payload), True
        except Exception as exc:  # noqa: BLE001 - the caller gets it, as from a handle call
            result, ok = exc, False
        try:
            writer.write(_frame(self.key, (call_id, ok, result)))
            await writer.drain()
        except ConnectionError:
            pass   # the router went away; it retries elsewhere


class ChannelClient:
    """A router's connection to one replica's ChannelServer."""

    def __init__(self, key: bytes, address: tuple[str, int]):
        self.key, self.address = key, address
        self._ids = itertools.count()
        self._pending: dict[int, asyncio.Future] = {}
        self._writer: asyncio.StreamWriter | None = None
        self._connecting: asyncio.Lock | None = None
        self._reader_task: asyncio.Task | None = None
        self.broken = False

    async def call(self, method: str, payload) -> Any:
        """The method's result; its exception re-raised; ChannelBroken when the connection is
        or goes down before the answer came."""
        writer = await self._connection()
        call_id = next(self._ids)
        future = asyncio.get_running_loop().create_future()
        self._pending[call_id] = future
        try:
            writer.write(_frame(self.key, (call_id, method, payload)))
            await writer.drain()
            ok, result = await future
        except (ConnectionError, OSError) as exc:
            self._break()
            raise ChannelBroken(str(exc)) from None
        finally:
            self._pending.pop(call_id, None)
        if not ok:
            raise result
        return result

    def close(self) -> None:
        self._break()

    async def _connection(self) -> asyncio.StreamWriter:
        if self.broken:
            raise ChannelBroken(f"the channel to {self.address} is down")
        if self._writer is not None:
            return self._writer
        self._connecting = self._connecting or asyncio.Lock()
        async with self._connecting:
            if self._writer is None:
                try:
                    reader, self._writer = await asyncio.open_connection(*self.address)
                except OSError as exc:
                    self._break()
                    raise ChannelBroken(str(exc)) from None
                # A fresh context: the reader serves every later call, not the one that connected.
                self._reader_task = asyncio.get_running_loop().create_task(self._read(reader),
                                                                           context=contextvars.Context())
        return self._writer

    async def _read(self, reader: asyncio.StreamReader) -> None:
        try:
            while True:
                call_id, ok, result = await _read_frame(reader, self.key)
                future = self._pending.get(call_id)
                if future is not None and not future.done():
                    future.set_result((ok, result))
        except (asyncio.IncompleteReadError, ConnectionError, PermissionError, OSError):
            self._break()

    def _break(self) -> None:
        self.broken = True
        for future in self._pending.values():
            if not future.done():
                future.set_exception(ConnectionResetError(f"the channel to {self.address} closed"))
        if self._writer is not None:
            self._writer.close()
