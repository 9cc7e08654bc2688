"""Row blocks (llama_forward.RowBlockLinear): a target in bfloat16 stays exact on matrix
kernels that, like a GPU's library, sum a row's products in an order chosen by the matrix's
shape. This CPU's oneDNN kernels do not (its bfloat16 forward passes the invariance probe
without blocks: tests/test_reduced_precision.py), so these tests give the forward such a
kernel: split-K, more splits for fewer rows, each partial rounded to bfloat16, as a GPU's
split-K writes its partials in the output's type."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from cluster.config import ModelSpec
from replicas.engines import huggingface
from replicas.engines.huggingface import DraftEngine, TargetEngine, llama_forward
from replicas.engines.huggingface.invariance import batch_invariant
from replicas.engines.huggingface.llama_forward import RowBlockLinear
from replicas.engines.huggingface.loading import load_causal_lm
from replicas.engines.huggingface.model_runner import ModelRunner
from replicas.tokenizer import load_tokenizer
from tests.test_reduced_precision import MODELS, speculated, target_alone
from training.corpus import held_out_prompts

BLOCK = 16


def split_k_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x W^T + b summed over the input features in 4 partial sums under 16 rows, 2 under 64,
    else 1 (a library fills a GPU with split-K where there are few rows), added in x's dtype."""
    rows = x.numel() // x.shape[-1]
    splits = 4 if rows < 16 else 2 if rows < 64 else 1
    parts = [F.linear(xs, ws) for xs, ws in zip(x.chunk(splits, -1), weight.chunk(splits, -1))]
    out = parts[0]
    for part in parts[1:]:
        out = out + part
    return out if bias is None else out + bias


@pytest.fixture
def split_k_kernels(monkeypatch):
    """The eager forward's plain linears on split_k_gemm (not oneDNN's prepacked weights)."""
    monkeypatch.setattr(llama_forward, "_onednn_bfloat16", lambda: False)
    monkeypatch.setattr(llama_forward, "_gemm", split_k_gemm)


@pytest.fixture(scope="module")
def bf16_pair():
    return (load_causal_lm(ModelSpec(path="models/target", dtype="bfloat16")),
            load_causal_lm(ModelSpec(path="models/draft", dtype="bfloat16")))


def test_a_row_depends_on_its_neighbours_on_the_split_k_kernel_and_not_in_row_blocks():
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(96, 256, generator=generator).bfloat16()
    row = torch.randn(1, 256, generator=generator).bfloat16()
    others = torch.randn(40, 256, generator=generator).bfloat16()
    alone, among = split_k_gemm(row, weight), split_k_gemm(torch.cat([row, others]), weight)[:1]
    assert not torch.equal(alone, among)          # the kernel's habit, seen on one row
    blocked = RowBlockLinear(lambda x: split_k_gemm(x, weight), BLOCK)
    assert torch.equal(blocked(row), blocked(torch.cat([row, others]))[:1])
    assert torch.equal(blocked(torch.cat([others, row]))[-1:], blocked(row))


def test_row_blocks_keep_shapes_and_drop_their_padding():
    x = torch.randn(3, 7, 32)
    weight, bias = torch.randn(24, 32), torch.randn(24)
    blocked = RowBlockLinear(lambda part: F.linear(part, weight, bias), 4)(x)     # 21 rows: 6 blocks, 3 padded
    assert blocked.shape == (3, 7, 24)
    torch.testing.assert_close(blocked, F.linear(x, weight, bias))


def test_the_split_k_kernel_fails_the_invariance_probe_and_row_blocks_pass_it(bf16_pair, split_k_kernels):
    target, _ = bf16_pair
    assert not batch_invariant(ModelRunner(target, 8192))
    assert batch_invariant(ModelRunner(target, 8192, row_block=BLOCK))


def test_bf16_greedy_speculation_on_the_split_k_kernel_equals_the_target_alone_in_row_blocks(
        bf16_pair, split_k_kernels):
    """Batches of 8 sequences verifying 3 drafts beside each other, against each sequence's
    own single steps (tests/test_reduced_precision.py's helpers): the same tokens, all 128.
    Without row blocks some sequences differ (seen 2026-12-07)."""
    target, draft = bf16_pair
    prompts = held_out_prompts(load_tokenizer(MODELS / "target"), count=8, prompt_tokens=128)
    verifier = TargetEngine.on_model(target, max_cached_tokens=16 * 512, max_seq_len=512, row_block=BLOCK)
    drafter = DraftEngine.on_model(draft, max_cached_tokens=16 * 512, max_seq_len=512)
    assert speculated(drafter, verifier, prompts, k=3) == target_alone(verifier, prompts)


def test_auto_blocks_a_reduced_precision_target_on_a_gpu_only():
    def model(dtype, device):
        return SimpleNamespace(dtype=dtype, device=torch.device(device))   # what row_block reads of a model

    auto = ModelSpec(path="models/target")
    assert huggingface.row_block(auto, "target", model(torch.bfloat16, "cuda")) == huggingface.ROW_BLOCK
    assert huggingface.row_block(auto, "target", model(torch.float16, "cuda")) == huggingface.ROW_BLOCK
    assert huggingface.row_block(auto, "target", model(torch.bfloat16, "cpu")) is None
    assert huggingface.row_block(auto, "target", model(torch.float32, "cuda")) is None
    assert huggingface.row_block(auto, "draft", model(torch.bfloat16, "cuda")) is None
    assert huggingface.row_block(ModelSpec(path="models/target", compile="on"), "target",
                                 model(torch.bfloat16, "cuda")) is None
    assert huggingface.row_block(ModelSpec(path="models/target", row_block=32), "target",
                                 model(torch.bfloat16, "cpu")) == 32
    assert huggingface.row_block(ModelSpec(path="models/target", row_block=0), "target",
                                 model(torch.bfloat16, "cuda")) is None
    with pytest.raises(ValueError):
        ModelSpec(path="models/target", row_block=-1)
