"""The GPU checklist (cluster/bench/gpu_check.py) must run on a lent GPU machine that has torch,
transformers and safetensors and nothing of the serving stack: here its CPU-capable parts run
in a fresh interpreter where importing pydantic, Ray, FastAPI or the other serving packages
fails."""

from __future__ import annotations

import json
import subprocess
import sys

SERVING_PACKAGES = ["pydantic", "ray", "fastapi", "starlette", "uvicorn", "prometheus_client", "llguidance",
                    "openai", "httpx_sse"]

RUN_WITHOUT_THEM = f"""
import json, sys
for name in {SERVING_PACKAGES!r}:
    sys.modules[name] = None           # `import name` now raises ImportError
import torch
from cluster.bench import gpu_check
cpu = torch.device("cpu")
print(json.dumps({{"greedy": gpu_check.greedy_matches(cpu, compiled=False),
                  "sampled": gpu_check.sampled_fits(cpu),
                  "loaded": sorted(set({SERVING_PACKAGES!r}) & {{m.split(".")[0] for m in sys.modules if sys.modules[m]}})}}))
"""


def test_gpu_check_runs_with_torch_and_transformers_alone():
    done = subprocess.run([sys.executable, "-c", RUN_WITHOUT_THEM], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["greedy"]["ok"] and report["sampled"]["ok"], report
    assert report["loaded"] == []
