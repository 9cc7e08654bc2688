"""A call's decisions leave the device once per pass, whatever its rows (issue 41).

On a GPU each read of a device value (`.tolist()`, `.item()`, `int(t)`, `bool(t)`, `.cpu()`)
stalls the stream until the work before it is done. The engines gather greedy argmaxes,
sampled and Gumbel-max tokens, accepted counts and finiteness flags on the device and read
them together (replicas/device_reads.py). Counted here with a TorchFunctionMode that sees
every read of any tensor, on real engines over the tiny models: a draft call reads once per
step plus once for its q, a verify once per pass, with 2 rows as with 8 of every kind.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch.overrides import TorchFunctionMode

from replicas.engines.huggingface.engine import DraftEngine, TargetEngine
from replicas.protocol import ProposeRequest, Proposal, Verification, VerifyRequest
from replicas.sampling import GREEDY, SamplingParams
from training.tiny_models import tiny_llama

VOCAB, K = 64, 3
SAMPLED = SamplingParams(temperature=0.8, top_p=0.95)
_READS = {"tolist", "item", "__int__", "__float__", "__bool__", "__index__", "cpu", "numpy"}


class HostReads(TorchFunctionMode):
    """Counts reads of tensor values into Python or onto the CPU."""

    def __init__(self):
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in _READS:
            self.counts[name] += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.counts.values())


@pytest.fixture(scope="module")
def pair():
    return (tiny_llama("target", VOCAB, eos_token_id=0, seed=1), tiny_llama("draft", VOCAB, eos_token_id=0, seed=2))


def _kind(i: int) -> tuple[SamplingParams, int | None]:
    """Greedy, sampled and seeded (Gumbel-max) rows in turn."""
    return [(GREEDY, None), (SAMPLED, None), (SAMPLED, 11)][i % 3]


def _prompt(i: int) -> list[int]:
    return [1, 2 + i, 3 + 2 * i, 5]


def _propose(engine: DraftEngine, rows: int) -> list[Proposal]:
    return engine.propose([ProposeRequest(f"s{i}", _prompt(i), K, _kind(i)[0], seed=i, noise_seed=_kind(i)[1],
                                          prompt_len=4) for i in range(rows)])


def _verify(engine: TargetEngine, proposals: list[Proposal], steps: int) -> list[Verification]:
    return engine.verify([VerifyRequest(f"s{i}", _prompt(i), p.tokens, p.probs, _kind(i)[0], seed=i,
                                        noise_seed=_kind(i)[1], prompt_len=4, steps=steps)
                          for i, p in enumerate(proposals)])


@pytest.mark.parametrize("rows", [2, 8])
def test_a_draft_call_reads_once_a_step_and_once_for_its_q(pair, rows):
    _, draft = pair
    engine = DraftEngine.on_model(draft, max_cached_tokens=4096)
    with HostReads() as reads:
        proposals = _propose(engine, rows)
    assert all(isinstance(p, Proposal) and len(p.tokens) == K for p in proposals)
    assert reads.total == K + 1, reads.counts


@pytest.mark.parametrize("rows", [2, 8])
@pytest.mark.parametrize("steps", [1, 3])
def test_a_verify_call_reads_once_a_pass(pair, rows, steps):
    target, draft = pair
    proposals = _propose(DraftEngine.on_model(draft, max_cached_tokens=4096), rows)
    engine = TargetEngine.on_model(target, max_cached_tokens=4096)
    with HostReads() as reads:
        verdicts = _verify(engine, proposals, steps)
    assert all(isinstance(v, Verification) for v in verdicts)
    assert reads.total == steps, reads.counts


def test_outcomes_do_not_depend_on_the_rows_beside_them(pair):
    """Each row decided together with seven others equals it decided alone: greedy, sampled
    and seeded rows, drafts and verdicts (its own generator and noise, whatever the batch)."""
    target, draft = pair
    together_drafts = _propose(DraftEngine.on_model(draft, max_cached_tokens=4096), 8)
    together = _verify(TargetEngine.on_model(target, max_cached_tokens=4096), together_drafts, 2)
    for i in range(8):
        drafter = DraftEngine.on_model(draft, max_cached_tokens=4096)
        [alone_drafts] = drafter.propose([ProposeRequest(f"s{i}", _prompt(i), K, _kind(i)[0], seed=i,
                                                         noise_seed=_kind(i)[1], prompt_len=4)])
        assert alone_drafts.tokens == together_drafts[i].tokens
        [alone] = TargetEngine.on_model(target, max_cached_tokens=4096).verify([VerifyRequest(
            f"s{i}", _prompt(i), alone_drafts.tokens, alone_drafts.probs, _kind(i)[0], seed=i,
            noise_seed=_kind(i)[1], prompt_len=4, steps=2)])
        assert (alone.accepted, alone.tokens) == (together[i].accepted, together[i].tokens)
