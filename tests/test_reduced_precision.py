"""A target in bfloat16 (replicas/engines/huggingface/invariance.py): its lean forward is
batch-invariant, so greedy speculation equals its own single steps token for token, which
SDPA's attention did not give (measured: 1-2 of 16 held-out sequences differed within 128
tokens); a target whose forward fails the check runs in float32."""

from __future__ import annotations

import logging
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from cluster.config import ClusterConfig, ModelSpec
from replicas.engines import huggingface
from replicas.engines.huggingface import DraftEngine, TargetEngine
from replicas.engines.huggingface.invariance import batch_invariant
from replicas.engines.huggingface.loading import load_causal_lm
from replicas.tokenizer import load_tokenizer
from replicas.engines.huggingface import llama_forward
from replicas.engines.huggingface.model_runner import ExtendCall, ModelRunner
from replicas.protocol import ProposeRequest, VerifyRequest
from replicas.sampling import GREEDY
from tests.conftest import cluster_config, deploy
from tests.http_client import complete
from training.corpus import held_out_prompts

MODELS = Path(__file__).resolve().parents[1] / "models"

NEW_TOKENS = 128
BATCH = 8


@pytest.fixture(scope="module")
def bf16_pair():
    return (load_causal_lm(ModelSpec(path="models/target", dtype="bfloat16")),
            load_causal_lm(ModelSpec(path="models/draft", dtype="bfloat16")))


def test_the_lean_bf16_forward_passes_the_check_and_sdpa_through_the_modules_fails_it(bf16_pair):
    target, _ = bf16_pair
    assert batch_invariant(ModelRunner(target, 8192))
    assert not batch_invariant(ModelRunner(target, 8192, lean=False))


def target_alone(verifier: TargetEngine, prompts: list[list[int]]) -> list[list[int]]:
    """One sequence at a time, one position a call: the target's own greedy choices."""
    outputs = []
    for i, prompt in enumerate(prompts):
        tokens = list(prompt)
        while len(tokens) - len(prompt) < NEW_TOKENS:
            [verdict] = verifier.verify([VerifyRequest(f"alone-{i}", tokens, [], None, GREEDY, 0)])
            tokens += verdict.tokens
        verifier.release(f"alone-{i}")
        outputs.append(tokens[len(prompt):len(prompt) + NEW_TOKENS])
    return outputs


def speculated(drafter: DraftEngine, verifier: TargetEngine, prompts: list[list[int]], k: int) -> list[list[int]]:
    """Rounds over a batch of sequences at once: each verify computes k + 1 positions of
    every row, beside rows at other lengths."""
    sequences = {f"spec-{i}": list(prompt) for i, prompt in enumerate(prompts)}
    lengths = {seq_id: len(tokens) for seq_id, tokens in sequences.items()}
    while live := [s for s, tokens in sequences.items() if len(tokens) - lengths[s] < NEW_TOKENS]:
        proposals = drafter.propose([ProposeRequest(s, sequences[s], k, GREEDY, seed=0) for s in live])
        verdicts = verifier.verify([VerifyRequest(s, sequences[s], p.tokens, None, GREEDY, 0)
                                    for s, p in zip(live, proposals)])
        for seq_id, verdict in zip(live, verdicts):
            sequences[seq_id] += verdict.tokens
    return [tokens[lengths[s]:lengths[s] + NEW_TOKENS] for s, tokens in sequences.items()]


@pytest.mark.parametrize("k", [2, 4])
def test_bf16_greedy_speculation_in_batches_equals_the_bf16_target_alone(bf16_pair, k):
    target, draft = bf16_pair
    prompts = held_out_prompts(load_tokenizer(MODELS / "target"), count=16, prompt_tokens=128)
    verifier = TargetEngine.on_model(target, max_cached_tokens=16 * 512, max_seq_len=512)
    drafter = DraftEngine.on_model(draft, max_cached_tokens=16 * 512, max_seq_len=512)
    alone = target_alone(verifier, prompts)
    together = [out for start in range(0, len(prompts), BATCH)
                for out in speculated(drafter, verifier, prompts[start:start + BATCH], k)]
    differing = [i for i, (a, b) in enumerate(zip(alone, together)) if a != b]
    assert not differing, f"sequences {differing} differ from the target alone"


def target_spec(dtype: str):
    config = ClusterConfig.model_validate({"models": {"target": {"path": "models/target", "dtype": dtype}}})
    return config.models.target, config.pools.target


def test_a_target_failing_the_check_runs_in_float32_with_a_warning_its_first_copy_freed(monkeypatch, caplog):
    spec, pool = target_spec("bfloat16")
    described = huggingface.build("target", spec, pool, 512).describe()
    assert (described["dtype"], described["dtype_scores_ms"]) == ("bfloat16", None)   # named: not measured
    probed, alive_at_reload, load = [], [], huggingface._runner

    def fails(runner) -> bool:
        probed.append(weakref.ref(runner.model))
        return False

    def loads(spec, pool, max_seq_len, role):
        if spec.dtype == "float32":     # the reload: the bfloat16 weights must be gone by now
            alive_at_reload.append(probed[0]() is not None)
        return load(spec, pool, max_seq_len, role)

    monkeypatch.setattr("replicas.engines.huggingface.invariance.batch_invariant", fails)
    monkeypatch.setattr(huggingface, "_runner", loads)
    serve_logger = logging.getLogger("ray.serve")     # Ray Serve's logger may not propagate to the root
    serve_logger.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.WARNING, logger="ray.serve"):
            engine = huggingface.build("target", spec, pool, 512)
    finally:
        serve_logger.removeHandler(caplog.handler)
    assert engine.describe()["dtype"] == "float32"
    assert "not batch-invariant" in caplog.text
    assert next(engine.runner.model.parameters()).dtype == torch.float32
    assert alive_at_reload == [False]          # never two copies of the weights at once


@pytest.fixture(scope="module")
def bf16_cluster(ray_serve):
    from ray import serve

    models = {role: {"path": str(MODELS / role), "dtype": "bfloat16"} for role in ("target", "draft")}
    yield deploy(ray_serve, "bf16", cluster_config(MODELS / "target", MODELS / "draft", models=models))
    serve.delete("bf16")


@pytest.mark.parametrize("method", ["draft_model", "suffix"])
def test_bf16_greedy_through_http_in_batches_equals_the_target_alone(bf16_cluster, method):
    tokenizer = load_tokenizer(MODELS / "target")
    prompts = [tokenizer.decode(ids) for ids in held_out_prompts(tokenizer, count=8, prompt_tokens=128)]
    alone = [complete(bf16_cluster, p, max_tokens=96, speculation={"enabled": False}) for p in prompts]
    with ThreadPoolExecutor(len(prompts)) as pool:      # verifies of 5 positions beside other rows
        speculated = list(pool.map(lambda p: complete(bf16_cluster, p, max_tokens=96,
                                                      speculation={"method": method, "k": 4}), prompts))
    assert all(out["speculation"]["accepted_tokens"] > 0 for out in speculated)
    differing = [i for i, (a, b) in enumerate(zip(alone, speculated))
                 if a["choices"][0]["token_ids"] != b["choices"][0]["token_ids"]]
    assert not differing, f"prompts {differing} differ from the target alone"


def test_bf16_linears_are_prepacked_for_onednn_and_give_bitwise_the_same_logits(bf16_pair, monkeypatch):
    """The lean forward's bfloat16 linears on a CPU run on weights reordered once for oneDNN;
    the logits must be F.linear's, bit for bit, in a batch of rows at several lengths."""
    if not llama_forward._onednn_bfloat16():
        pytest.skip("this CPU has no oneDNN bfloat16 kernels: the linears run as F.linear")
    target, _ = bf16_pair
    packed = ModelRunner(target, 8192)
    assert all(isinstance(getattr(layer, name), llama_forward.PrepackedLinear)
               for layer in packed.decoder.layers for name in ("q", "k", "v", "o", "gate", "up", "down"))
    monkeypatch.setattr(llama_forward, "_onednn_bfloat16", lambda: False)
    plain = ModelRunner(target, 8192)
    assert not isinstance(plain.decoder.layers[0].q, llama_forward.PrepackedLinear)
    generator = torch.Generator().manual_seed(3)
    for new in (1, 5, 40):
        calls = [ExtendCall(f"row-{i}", torch.randint(1, 500, (60 + 17 * i,), generator=generator).tolist(), new)
                 for i in range(3)]
        for a, b in zip(packed.extend_batch(calls), plain.extend_batch(calls)):
            assert torch.equal(a.logits, b.logits)


def test_auto_dtype_is_the_checkpoints_where_the_cpu_computes_it_natively(monkeypatch):
    from replicas.engines.huggingface import loading

    spec = ModelSpec(path=MODELS / "target", dtype="auto")          # its config.json says bfloat16
    cpu = torch.device("cpu")
    monkeypatch.setattr(loading, "_cpu_bfloat16", lambda: True)
    assert loading.model_dtype(spec, cpu) == torch.bfloat16
    monkeypatch.setattr(loading, "_cpu_bfloat16", lambda: False)
    assert loading.model_dtype(spec, cpu) == torch.float32
    assert loading.model_dtype(spec.model_copy(update={"dtype": "bfloat16"}), cpu) == torch.bfloat16


@pytest.mark.parametrize("slowed, expected", [("float32", "bfloat16"), ("bfloat16", "float32")])
def test_auto_dtype_on_a_cpu_runs_in_the_dtype_measured_faster(monkeypatch, slowed, expected):
    """Where both dtypes are exact, 'auto' times both runners at start and keeps the faster:
    here one dtype's forward is made 150 ms slower (far beyond their natural gap: bfloat16 without
    native kernels ran 13 ms slower than float32 on an AVX2 CPU), and the replica must run in the other."""
    from replicas.engines.huggingface import loading

    monkeypatch.setattr(loading, "_cpu_bfloat16", lambda: True)
    extend = ModelRunner.extend_batch

    def slowed_extend(runner, calls):
        if runner.model.dtype == getattr(torch, slowed):
            time.sleep(0.15)
        return extend(runner, calls)

    monkeypatch.setattr(ModelRunner, "extend_batch", slowed_extend)
    config = ClusterConfig.model_validate({"models": {role: {"path": f"models/{role}", "dtype": "auto"}
                                                      for role in ("target", "draft")}})
    engine = huggingface.build("draft", config.models.draft, config.pools.draft, 512)
    scores = engine.describe()["dtype_scores_ms"]
    assert engine.describe()["dtype"] == expected and scores[slowed] > scores[expected] + 100, scores
    assert next(engine.runner.model.parameters()).dtype == getattr(torch, expected)
