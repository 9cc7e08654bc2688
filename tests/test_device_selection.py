"""Device by reservation (replicas/engines/huggingface/loading.py, pick_device): a replica uses
a GPU only where Ray gave it one, whatever torch says of the machine; Ray 2.60 no longer hides
a node's GPUs from an actor that reserved none. The checks run in real Ray workers; only what
torch says of CUDA is told (this machine has none), through pick_device's own parameter."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from cluster.config import ModelSpec
from replicas.engines.huggingface.loading import load_causal_lm, pick_device

DRAFT = Path("models/draft")


def test_a_worker_without_a_reserved_gpu_runs_on_the_cpu_where_cuda_exists(ray_serve):
    import ray

    @ray.remote(num_cpus=0)
    def serve_one_step() -> tuple[list, str, int]:
        device = pick_device("auto", cuda_available=True)       # told the node has CUDA
        model = load_causal_lm(ModelSpec(path=DRAFT.resolve()), device=device)
        with torch.inference_mode():
            token = int(model(torch.tensor([[1, 2, 3]], device=device)).logits[0, -1].argmax())
        return ray.get_gpu_ids(), str(next(model.parameters()).device), token

    reserved, device, token = ray.get(serve_one_step.remote())
    assert reserved == [] and device == "cpu" and token >= 0


def test_a_reserved_gpu_is_used_and_one_torch_cannot_see_is_a_clear_error():
    assert pick_device("auto", reserved_gpus=[0], cuda_available=True).type == "cuda"
    with pytest.raises(RuntimeError, match="Ray gave this replica GPU"):
        pick_device("auto", reserved_gpus=[0], cuda_available=False)
    assert pick_device("cpu", reserved_gpus=[0], cuda_available=True).type == "cpu"   # asked for: kept
