"""Is a runner's forward pass batch-invariant on this machine?

Speculation is exact only if the target computes a position's logits bitwise the same however
the call around it is shaped: alone as one decode step, as one of a verify's k + 1 positions,
in a prefill, or beside other sequences with longer windows. In float32 the kernels' different
summation orders move logits by about 1e-7 relative, too little to flip a greedy choice in
practice (every exactness test here runs in float32). In bfloat16 one rounding step is 0.4 %,
and flips were measured (docs/BENCHMARKS.md), so a reduced-precision target runs only where
this check passes: the lean forward's attention is built to pass it (llama_forward.py), but
whether a matmul's rows are independent of the batch is up to the kernels of the CPU or GPU
it lands on, so it is measured where the replica starts rather than assumed.
"""

from __future__ import annotations

import torch

from replicas.engines.huggingface.model_runner import ExtendCall, ModelRunner

_PROMPT, _NEW = 32, 8          # the probed sequence: a prefill, then _NEW positions
_OTHERS = ((20, 25, 5), (37, _PROMPT + _NEW, 3))   # beside it: (prefill, then length, logits)


def batch_invariant(runner: ModelRunner) -> bool:
    """Both checks below pass; the probes' caches are released after."""
    return _steps_equal_a_verify(runner) and _prefills_equal_with_drafts_beside_others(runner)


def _steps_equal_a_verify(runner: ModelRunner) -> bool:
    """True if one sequence's logits are bitwise the same computed step by step alone and
    computed as one verify-like call of _NEW + 1 positions beside two other sequences whose
    windows are longer and shorter."""
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(runner.vocab_size, (1 + len(_OTHERS), _PROMPT + _NEW), generator=generator).tolist()
    probed, others = "_invariance-probed", [f"_invariance-{i}" for i in range(len(_OTHERS))]
    try:
        alone = [runner.extend(probed, tokens[0][:length], 1).logits
                 for length in range(_PROMPT, _PROMPT + _NEW + 1)]            # positions 31..39, one at a time
        runner.release(probed)
        runner.extend_batch([ExtendCall(probed, tokens[0][:_PROMPT], 1)]
                            + [ExtendCall(seq, tokens[1 + i][:prefill], 1)
                               for i, (seq, (prefill, _, _)) in enumerate(zip(others, _OTHERS))])
        together = runner.extend_batch([ExtendCall(probed, tokens[0], _NEW + 1)]
                                       + [ExtendCall(seq, tokens[1 + i][:length], logits)
                                          for i, (seq, (_, length, logits)) in enumerate(zip(others, _OTHERS))])
    finally:
        for seq_id in (probed, *others):
            runner.release(seq_id)
    return torch.equal(torch.cat(alone), together[0].logits)


_PREFILL, _PREFILL_ROWS, _DRAFTS = 128, 8, 2


def _prefills_equal_with_drafts_beside_others(runner: ModelRunner) -> bool:
    """True if a prompt's prefill alone gives its last position the same logits as a first
    verify does, which prefills the prompt with drafts on top beside other such rows: the
    call shape of a batch of new requests (_PREFILL_ROWS rows of _PREFILL + _DRAFTS positions).
    On this machine's CPU the first check passed and this one failed before the attention's
    sum over keys was chunked (llama_forward._weighted_values)."""
    generator = torch.Generator().manual_seed(1)
    length = min(_PREFILL + _DRAFTS, runner.max_seq_len)
    rows = min(_PREFILL_ROWS, runner.caches.max_slots)     # a batch the replica's caches can hold
    tokens = torch.randint(runner.vocab_size, (rows, length), generator=generator).tolist()
    names = [f"_invariance-prefill-{i}" for i in range(rows)]
    try:
        alone = runner.extend(names[0], tokens[0][:length - _DRAFTS], 1).logits
        runner.release(names[0])
        together = runner.extend_batch([ExtendCall(name, row, _DRAFTS + 1) for name, row in zip(names, tokens)])
    finally:
        for name in names:
            runner.release(name)
    return torch.equal(alone[0], together[0].logits[0])
