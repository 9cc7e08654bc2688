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
                  "graphed": gpu_check.greedy_matches(cpu, compiled=False, graphs=True),
                  "tensor_parallel": gpu_check.tensor_parallel(cpu),
                  "sampled": gpu_check.sampled_fits(cpu),
                  "devices": gpu_check.device_selection(),
                  "bfloat16": gpu_check.bfloat16_exactness(cpu, max_tokens=24),
                  "loaded": sorted(set({SERVING_PACKAGES!r}) & {{m.split(".")[0] for m in sys.modules if sys.modules[m]}})}}))
"""


def test_gpu_check_runs_with_torch_and_transformers_alone():
    done = subprocess.run([sys.executable, "-c", RUN_WITHOUT_THEM], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["greedy"]["ok"] and report["sampled"]["ok"], report
    # on a CPU the graphed passes rerun in their buckets (no CUDA); replays must have run
    assert report["graphed"]["ok"] and report["graphed"]["cuda_graphs"]["replayed"] > 0, report["graphed"]
    assert report["tensor_parallel"]["ok"] and report["tensor_parallel"]["backend"] == "gloo", report
    assert report["tensor_parallel"]["tokens_compared"] == 72
    assert report["devices"] == {"ok": True, "auto_outside_ray": "cpu", "auto_without_a_reserved_gpu": "cpu"}
    bfloat16 = report["bfloat16"]
    runs = ("row_blocks", "row_blocks_graphed", "plain")
    assert [bfloat16[each]["row_block"] for each in runs] == [128, 128, None]
    assert all(bfloat16[each]["tokens_compared"] > 0 for each in runs)
    assert bfloat16["ok"] is all(bfloat16[each]["batch_invariant"] and bfloat16[each]["tokens_after_a_difference"] == 0
                                 for each in runs[:2])
    assert report["loaded"] == []


def test_a_part_running_at_the_deadline_is_stopped_and_the_rest_skipped(tmp_path):
    """The lent machine's minutes are counted: --deadline-s stops the checklist hard, and
    what was done is in the report."""
    out = tmp_path / "report.json"
    done = subprocess.run([sys.executable, "-m", "cluster.bench.gpu_check", "--device", "cpu", "--sizes", "tiny",
                           "--deadline-s", "4", "--out", str(out)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    outcomes = list(json.loads(out.read_text())["parts"].values())
    stopped = outcomes.index({"ok": False, "error": "stopped at the 4 s deadline"})   # whichever ran then
    assert all("part_s" in outcome for outcome in outcomes[:stopped])
    assert outcomes[stopped + 1:] == [{"skipped": "after the 4 s deadline"}] * (len(outcomes) - stopped - 1)
    assert len(outcomes) == 9 and stopped < 8
