"""The direct channel between routers and model replicas: calls go and answers come back on
a real TCP connection, many at once; a frame not signed with the app's key is refused before
anything in it runs; a broken channel is reported as such. Through HTTP, once a lane's route
is known every round's calls go direct, and killing the target replica mid-stream still
completes every stream token for token (tests/test_concurrency.py covers failover by handle)."""

from __future__ import annotations

import asyncio
import itertools
import os
import signal
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
from ray import serve

from replicas.direct_channel import ChannelBroken, ChannelClient, ChannelServer, _frame
from tests.conftest import PROMPTS, cluster_config, deploy
from tests.http_client import complete, reassemble, stream_chunks

KEY = b"k" * 32


def run(coro):
    return asyncio.run(coro)


class Recorder:
    def __init__(self):
        self.calls = []

    async def double(self, payload):
        self.calls.append(payload)
        await asyncio.sleep(0.01 * (3 - payload))      # later calls answer first
        return payload * 2

    async def fail(self, payload):
        raise ValueError(f"bad payload {payload}")


def test_concurrent_calls_get_their_own_answers_and_errors_come_back():
    async def scenario():
        recorder = Recorder()
        server = ChannelServer(KEY, {"double": recorder.double, "fail": recorder.fail})
        address = await server.start("127.0.0.1")
        client = ChannelClient(KEY, address)
        answers = await asyncio.gather(*(client.call("double", n) for n in range(3)))
        with pytest.raises(ValueError, match="bad payload 7"):
            await client.call("fail", 7)
        client.close()
        server.close()
        return answers, sorted(recorder.calls)
    assert run(scenario()) == ([0, 2, 4], [0, 1, 2])


def test_a_frame_signed_with_another_key_is_refused_unread():
    async def scenario():
        recorder = Recorder()
        server = ChannelServer(KEY, {"double": recorder.double})
        address = await server.start("127.0.0.1")
        reader, writer = await asyncio.open_connection(*address)
        writer.write(_frame(b"x" * 32, (0, "double", 1)))
        await writer.drain()
        closed = await asyncio.wait_for(reader.read(), 5)      # b"": the server hung up
        stranger = ChannelClient(b"y" * 32, address)
        with pytest.raises(ChannelBroken):
            await asyncio.wait_for(stranger.call("double", 2), 5)
        server.close()
        return closed, recorder.calls, server.refused_frames
    assert run(scenario()) == (b"", [], 2)


def test_a_channel_to_nowhere_is_broken():
    async def scenario():
        server = ChannelServer(KEY, {})
        host, port = await server.start("127.0.0.1")
        server.close()
        await asyncio.sleep(0.05)
        client = ChannelClient(KEY, (host, port))
        with pytest.raises(ChannelBroken):
            await client.call("double", 1)
        return client.broken
    assert run(scenario()) is True


def call_paths(app: str) -> dict:
    return serve.get_deployment_handle("router", app_name=app).describe.remote().result()["call_paths"]


def test_rounds_go_direct_once_the_route_is_known(apps, greedy_reference):
    url = apps["perturbed"]
    complete(url, PROMPTS[0], max_tokens=8)            # the lane's routes are asked for
    before = call_paths("spec-perturbed")
    out = complete(url, PROMPTS[1], max_tokens=32, speculation={"k": 3})
    after = call_paths("spec-perturbed")
    rounds = out["speculation"]["rounds"]
    assert out["choices"][0]["token_ids"] == greedy_reference(PROMPTS[1], 32)
    assert after.get("handle", 0) == before.get("handle", 0)
    assert after["direct"] - before.get("direct", 0) >= rounds + 1     # every verify and the drafts


@pytest.fixture(scope="module")
def killable(ray_serve, zoo):
    # A draft the target seldom agrees with: about one token a round, so streams are still
    # running when the replica is killed, however fast the engine.
    url = deploy(ray_serve, "direct-kill", cluster_config(zoo.target, zoo.drafts["unrelated"]))
    yield url
    serve.delete("direct-kill")


def test_killing_the_target_replica_mid_stream_completes_every_stream_exactly(killable, greedy_reference):
    prompts, max_tokens = PROMPTS[:4], 240
    complete(killable, prompts[0], max_tokens=4)        # routes known before the streams start
    target = serve.get_deployment_handle("target", app_name="direct-kill")
    router = serve.get_deployment_handle("router", app_name="direct-kill")
    pid = target.describe.remote().result()["pid"]
    paths = router.describe.remote().result()["call_paths"]
    streaming = threading.Semaphore(0)

    def stream(prompt):
        # Reads on after its first chunk: a client that stopped reading would hold the
        # router's stream back, and no call would be in flight when the replica dies.
        chunks = stream_chunks(killable, prompt, max_tokens=max_tokens, speculation={"k": 2})
        first = next(chunks)
        streaming.release()
        return reassemble(itertools.chain([first], chunks))

    with ThreadPoolExecutor(len(prompts)) as pool:
        futures = [pool.submit(stream, prompt) for prompt in prompts]
        for _ in prompts:
            assert streaming.acquire(timeout=60)
        os.kill(pid, signal.SIGKILL)
        results = [future.result(timeout=180) for future in futures]
    for prompt, out in zip(prompts, results):
        assert out["choices"][0]["token_ids"] == greedy_reference(prompt, max_tokens), prompt
    assert target.describe.remote().result()["pid"] != pid
    # The broken channel's calls went by handle: those in flight as retries, the next ones
    # because the channel was down (whether a retry is counted depends on the moment).
    assert router.describe.remote().result()["call_paths"].get("handle", 0) > paths.get("handle", 0)
