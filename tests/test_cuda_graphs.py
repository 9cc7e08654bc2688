"""CUDA graphs (replicas/engines/huggingface/cuda_graphs.py) on a CPU: what can go wrong outside
the capture itself, namely the buckets, the padding of rows, positions and keys, the inputs
copied into a bucket's own tensors, and the window gathered by slot index.

No CUDA here, so the 'capture' these tests give the forward reruns the pass on the bucket's
inputs at every replay: the same function of the same tensors a CUDA graph replays, without
the recording. The graph capture itself runs on a GPU only (cluster/bench/gpu_check.py)."""

from __future__ import annotations

import pytest
import torch

from cluster.bench.gpu_check import GREEDY_PROMPTS, greedy_alone, speculate
from cluster.config import ModelSpec
from replicas.engines.huggingface import DraftEngine, TargetEngine, cuda_graphs_for
from replicas.engines.huggingface.cuda_graphs import Bucket, GraphedForward, rerun_capture
from replicas.engines.huggingface.loading import load_causal_lm
from replicas.engines.huggingface.model_runner import ExtendCall, ModelRunner
from tests.test_fused_cpu import grouped_query_llama
from tests.test_llama_forward import random_batches

LOGIT_ATOL = 1e-4     # float32 summed in another order (padded rows and keys): a few 1e-6


def graphed(model, max_seq_len: int = 128) -> ModelRunner:
    runner = ModelRunner(model, 1 << 12, max_seq_len)      # its 32 slots allocated whole, as graphs need
    runner.replay_graphs(rerun_capture)
    assert isinstance(runner.decoder, GraphedForward)
    return runner


def models():
    yield "target-float32", load_causal_lm(ModelSpec(path="models/target", dtype="float32"))
    yield "target-bfloat16", load_causal_lm(ModelSpec(path="models/target", dtype="bfloat16"))
    yield "grouped-query", grouped_query_llama()


@pytest.mark.parametrize("name, model", list(models()), ids=lambda v: v if isinstance(v, str) else "")
def test_replayed_passes_give_the_eager_forwards_logits_and_caches(name, model):
    """Ragged batches of prefills, decode steps and verifies: the logits, and every sequence's
    cached keys and values afterwards (the writes of padded rows and positions went to the
    scratch slot only). bfloat16's attention adds masked keys as exact zeros: bitwise."""
    eager, replayed = ModelRunner(model, 1 << 16, 128), graphed(model)
    bitwise = model.dtype == torch.bfloat16
    for step, calls in enumerate(random_batches(model.config.vocab_size, seed=5, steps=30)):
        for call, a, b in zip(calls, eager.extend_batch(calls), replayed.extend_batch(calls), strict=True):
            gap = (a.logits - b.logits).abs().max().item()
            assert gap == 0 if bitwise else gap < LOGIT_ATOL, f"step {step}, {call.seq_id}: {gap}"
            for (ka, va), (kb, vb) in zip(eager.cached(call.seq_id), replayed.cached(call.seq_id), strict=True):
                assert torch.allclose(ka, kb, atol=LOGIT_ATOL) and torch.allclose(va, vb, atol=LOGIT_ATOL), step
    counts = replayed.graph_counts
    assert counts["replayed"] > counts["captured"] > 3 and counts["eager"] >= 1, counts


def test_a_bucket_is_captured_once_and_replayed_after():
    model = load_causal_lm(ModelSpec(path="models/target", dtype="float32"))
    runner = graphed(model)
    vocab = model.config.vocab_size
    tokens = {f"s{i}": [(7 * i + j) % (vocab - 1) + 1 for j in range(40)] for i in range(3)}
    runner.extend_batch([ExtendCall(seq_id, t, 1) for seq_id, t in tokens.items()])     # a prefill: eager
    assert runner.graph_counts == {"captured": 0, "replayed": 0, "eager": 1, "dropped": 0}
    for step in range(3):      # decode steps of 3 rows, then verifies of 5 positions: two buckets
        for sequence in tokens.values():
            sequence.append(step + 1)
        runner.extend_batch([ExtendCall(seq_id, t, 1) for seq_id, t in tokens.items()])
    for step in range(2):
        for sequence in tokens.values():
            sequence += [step + 2] * 5
        runner.extend_batch([ExtendCall(seq_id, t, 5) for seq_id, t in tokens.items()])
    assert runner.graph_counts == {"captured": 2, "replayed": 3, "eager": 1, "dropped": 0}
    assert set(runner.decoder.graphs) == {Bucket(4, 1, 64), Bucket(4, 8, 64)}


def test_buckets_cover_what_fits_and_leave_the_rest_eager():
    assert Bucket.covering(3, 1, 100, 2048) == Bucket(4, 1, 128)
    assert Bucket.covering(1, 6, 7, 2048) == Bucket(1, 8, 64)
    assert Bucket.covering(64, 16, 2000, 2048) == Bucket(64, 16, 2048)
    assert Bucket.covering(9, 1, 1500, 1500) == Bucket(16, 1, 1500)      # never past the slot's length
    assert Bucket.covering(65, 1, 10, 2048) is None and Bucket.covering(1, 17, 10, 2048) is None


def test_a_reallocated_storage_drops_the_graphs():
    model = load_causal_lm(ModelSpec(path="models/target", dtype="float32"))
    runner, eager = graphed(model), ModelRunner(model, 1 << 16, 128)
    calls = [ExtendCall("a", [3, 4, 5, 6], 1)]
    for extra in range(3):      # a prefill of 5 positions, then two steps of one: two buckets
        calls = [ExtendCall("a", calls[0].tokens + [extra + 1], 1)]
        runner.extend_batch(calls)
        if extra == 1:
            runner.storage.ensure_capacity(runner.storage.capacity * 2)
    assert runner.graph_counts == {"captured": 3, "replayed": 0, "eager": 0, "dropped": 2}
    got, want = runner.extend_batch(calls)[0], eager.extend_batch(calls)[0]
    assert torch.allclose(got.logits, want.logits, atol=LOGIT_ATOL)


@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_speculation_on_replayed_engines_equals_generate(k):
    """The bundled pair, both engines graphed, against Hugging Face's greedy generate() of the
    target alone (an independent reference)."""
    target = load_causal_lm(ModelSpec(path="models/target", dtype="float32"))
    draft = load_causal_lm(ModelSpec(path="models/draft", dtype="float32"))
    drafter = DraftEngine.on_model(draft, max_cached_tokens=4000, max_seq_len=256)
    verifier = TargetEngine.on_model(target, max_cached_tokens=4000, max_seq_len=256)
    for engine in (drafter, verifier):
        engine.runner.replay_graphs(rerun_capture)
    for i, prompt in enumerate(GREEDY_PROMPTS):
        assert speculate(drafter, verifier, prompt, k, f"k{k}-{i}", 48) == greedy_alone(target, prompt, 48), i
    assert verifier.describe()["cuda_graphs"]["replayed"] > 0


def test_compile_auto_takes_graphs_on_a_gpu_only():
    model = load_causal_lm(ModelSpec(path="models/target", dtype="float32"))
    on_gpu = type("OnGpu", (), {"device": torch.device("cuda", 0)})()
    assert cuda_graphs_for(ModelSpec(path="models/target", compile="auto"), on_gpu)
    assert not cuda_graphs_for(ModelSpec(path="models/target", compile="off"), on_gpu)
    assert not cuda_graphs_for(ModelSpec(path="models/target", compile="auto"), model)     # on this CPU
    # the replica's build asks for the fused CPU forward and graphs together (each applies to
    # its own device): graphs must not be passed over
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device"):
        ModelRunner(model, 1 << 16, 128, fused_cpu=True, cuda_graphs=True)
