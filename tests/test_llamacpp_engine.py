"""The llama.cpp engine (replicas/engines/llamacpp): GGUF files written from the test models,
run through llama.cpp's own library.

- Its logits are transformers' on the same weights (an independent forward), so the GGUF
  export and llama.cpp's RoPE layout are right.
- A position's logits do not depend on the pass that computed them (alone, in a window, among
  other sequences, in a pass of many positions): llama.cpp's CPU kernels change summation
  order with the pass's size, and the runner keeps every pass on one side of those changes.
- Greedy speculation equals this engine's own target alone token for token, for k 1, 3, 5,
  the draft model and lookup drafts, and with mixed engines (a llama.cpp draft for the
  transformers target and the other way round).
- Sampled speculation passes the chi-square test against the target's exact distribution.
- The target engine's own drafts in a lone call's window of two (the position it computes
  anyway) keep greedy output the target alone's and sampled output its distribution; a
  call that does not speculate, or is not alone, gets none.
- A served cluster on llama.cpp (both pools) answers over HTTP exactly as its target alone.
- A file whose vocabulary differs from the router's tokenizer is refused; so is a config
  that names a GGUF file without a tokenizer or on another engine.
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from cluster.bench.prompts import fresh_prompts
from cluster.config import ConfigError, ModelSpec, parse_config
from cluster.status import own_drafts_text
from replicas.drafting.lookup import lookup_drafts
from replicas.drafting.suffix import OutputCache, suffix_drafts
from replicas.engines.huggingface import DraftEngine, TargetEngine
from replicas.engines.huggingface.loading import load_causal_lm
from replicas.engines.huggingface.model_runner import ExtendCall
from replicas.engines.llamacpp import LlamaCppDraftEngine, LlamaCppTargetEngine, build
from replicas.engines.llamacpp.gguf_export import export, export_model, folder_vocabulary, write_gguf
from replicas.engines.llamacpp.runner import RETIRED_KEPT, LlamaCppRunner
from replicas.engines.llamacpp.vocabulary import VocabularyMismatch, check_vocabulary
from replicas.protocol import ProposeRequest, VerifyRequest
from replicas.sampling import GREEDY
from replicas.tokenizer import load_tokenizer
from tests.conftest import cluster_config, deploy
from tests.http_client import complete
from training.tiny_models import tiny_llama
from tests.test_sampling_exactness import (ALPHA, SAMPLES, SETTINGS, VOCAB, chi_square_p_value, exact_joint,
                                           speculative_pairs)

BUNDLED = {"target": "models/target", "draft": "models/draft"}


@pytest.fixture(scope="module")
def gguf_files(zoo, tmp_path_factory) -> dict[str, str]:
    """The zoo's target and perturbed draft, and the bundled pair, as float32 GGUF files."""
    root = tmp_path_factory.mktemp("gguf")
    folders = {"zoo-target": zoo.target, "zoo-draft": zoo.drafts["perturbed"], **BUNDLED}
    return {name: str(export(folder, root / f"{name}.gguf")) for name, folder in folders.items()}


def runner(path: str, **options) -> LlamaCppRunner:
    return LlamaCppRunner(path, 16384, 512, **options)


def test_llamacpp_computes_the_transformers_logits_of_the_exported_model(zoo, gguf_files):
    """Float32 throughout (flash attention off, a float32 cache): transformers' logits to
    float32's rounding. With flash attention (the runner's default, for exactness) llama.cpp
    scores attention in half precision: within a few hundredths here."""
    model = load_causal_lm(ModelSpec(path=zoo.target))
    ids = load_tokenizer(zoo.target).encode("class Stack:\n    def push(self, item):\n        self.items.append(item)\n")
    with torch.no_grad():
        want = model(torch.tensor([ids])).logits[0].float()
    exact, fused = (runner(gguf_files["zoo-target"], kv_type="f32", flash_attention=flash).extend_batch(
        [ExtendCall("a", ids, len(ids))])[0].logits for flash in (False, True))
    assert exact.shape == want.shape
    assert torch.allclose(exact, want, atol=1e-4, rtol=1e-4), (exact - want).abs().max()
    assert torch.allclose(fused, want, atol=0.05), (fused - want).abs().max()


def test_a_positions_logits_do_not_depend_on_the_pass_that_computes_it(gguf_files):
    """The last position of each prompt: computed alone (one position), as the last of a
    window, beside other sequences' single steps, and in a pass of 200 positions with a long
    prompt's prefill. All within a few float32 roundings (measured 1.9e-6 at most), where
    llama.cpp's own choice of kernel by the pass's size moves them by 1e-4 to 1e-3: a single
    position's matrix-vector path, and flash attention's tiled kernel from 64 positions."""
    tokenizer = load_tokenizer(BUNDLED["target"])
    prompts = fresh_prompts(tokenizer, 5, 24)
    filler = fresh_prompts(tokenizer, 6, 200)[5]
    engine = runner(gguf_files["target"])

    def last(tag: str, calls_of) -> list[torch.Tensor]:
        for i, ids in enumerate(prompts):
            engine.extend_batch([ExtendCall(f"{tag}{i}", ids[:-1], 1)])      # the rest cached
        return calls_of(tag)

    alone = last("alone", lambda tag: [engine.extend_batch([ExtendCall(f"{tag}{i}", ids, 1)])[0].logits[0]
                                       for i, ids in enumerate(prompts)])
    window = last("window", lambda tag: [engine.extend_batch([ExtendCall(f"{tag}{i}", ids, 4)])[0].logits[-1]
                                         for i, ids in enumerate(prompts)])
    batched = last("batched", lambda tag: [e.logits[0] for e in engine.extend_batch(
        [ExtendCall(f"{tag}{i}", ids, 1) for i, ids in enumerate(prompts)])])
    crowded = last("crowded", lambda tag: [engine.extend_batch(
        [ExtendCall(f"{tag}{i}", ids, 1), ExtendCall(f"filler{i}", filler, 1)])[0].logits[0]
        for i, ids in enumerate(prompts)])
    for name, got in (("window", window), ("batched", batched), ("crowded", crowded)):
        for a, b in zip(alone, got):
            assert (a - b).abs().max() <= 1e-5, f"{name}: {(a - b).abs().max()}"


def test_only_the_latest_finished_sequences_keep_their_cells(gguf_files):
    """A finished sequence's cells stay for a later one's prefix, but only the RETIRED_KEPT
    latest: llama.cpp's attention visits every cell up to the highest in use, so each cell
    kept lengthens every later pass. The latest still gives its whole prompt."""
    engine = runner(gguf_files["target"])
    prompts = fresh_prompts(load_tokenizer(BUNDLED["target"]), RETIRED_KEPT + 4, 32)
    for i, ids in enumerate(prompts):
        engine.extend_batch([ExtendCall(f"done{i}", ids, 1)])
        engine.retire(f"done{i}")
    held = engine.describe()
    assert held["retired_sequences"] == RETIRED_KEPT
    assert held["cached_tokens"] == 32 * RETIRED_KEPT
    assert [engine.holds(f"done{i}") for i in range(len(prompts))] == [False] * 4 + [True] * RETIRED_KEPT
    shared_before = held["shared_prefix_positions"]
    engine.extend_batch([ExtendCall("next turn", prompts[-1] + prompts[0][:3], 1)])
    assert engine.describe()["shared_prefix_positions"] - shared_before == 32


def test_a_lone_step_runs_as_a_window_of_two_unless_measuring(gguf_files):
    """A lone sequence's single-token step computes its previous position again, so it takes
    the same kernels as a verify window (docs/ENGINES.md, 1.5-2x the cost of one position);
    lone_step_window off (measurement only, cluster/bench/llamacpp_passes.py --lone)
    computes the one new position."""
    ids = fresh_prompts(load_tokenizer(BUNDLED["target"]), 1, 24)[0]
    fed = {}
    for window in (True, False):
        engine = runner(gguf_files["target"], lone_step_window=window)
        engine.extend_batch([ExtendCall("lone", ids[:-1], 1)])
        fed[window] = engine.extend_batch([ExtendCall("lone", ids, 1)])[0].positions_fed
    assert fed == {True: 2, False: 1}


def greedy_runs(target, draft, prompts: list[list[int]], k: int, tokens: int, tag: str,
                lookup: str | None = None, batch: int = 16) -> list[list[int]]:
    """Each prompt's first `tokens` greedy tokens, `batch` sequences verified together per
    round: drafts from `draft` (k of them), from lookup ("ngram", "suffix"), or none (k 0:
    the target alone, one position a call)."""
    outputs = OutputCache(max_tokens=1 << 16)
    results = []
    for first in range(0, len(prompts), batch):
        sequences = {i: list(prompts[i]) for i in range(first, min(len(prompts), first + batch))}
        while live := [i for i in sequences if len(sequences[i]) - len(prompts[i]) < tokens]:
            if k and lookup is None:
                proposals = draft.propose([ProposeRequest(f"{tag}{i}", sequences[i], k, GREEDY, 0) for i in live])
                drafts = {i: p.tokens for i, p in zip(live, proposals)}
            elif k:
                drafts = {i: (lookup_drafts(sequences[i], k) if lookup == "ngram"
                              else suffix_drafts(sequences[i], k, outputs)) for i in live}
            else:
                drafts = {i: [] for i in live}
            verdicts = target.verify([VerifyRequest(f"{tag}{i}", sequences[i], drafts[i], None, GREEDY, 0)
                                      for i in live])
            for i, verdict in zip(live, verdicts):
                sequences[i] += verdict.tokens
        for i, ids in sequences.items():
            results.append(ids[len(prompts[i]):len(prompts[i]) + tokens])
            outputs.add(prompts[i], results[-1])
            target.release(f"{tag}{i}")
    return results


@pytest.fixture(scope="module")
def bundled_engines(gguf_files):
    return (LlamaCppTargetEngine(runner(gguf_files["target"]), None),
            LlamaCppDraftEngine(runner(gguf_files["draft"]), None))


@pytest.fixture(scope="module")
def fresh(bundled_engines) -> list[list[int]]:
    return fresh_prompts(load_tokenizer(BUNDLED["target"]), 32, 48)


@pytest.fixture(scope="module")
def target_alone(bundled_engines, fresh) -> list[list[int]]:
    target, draft = bundled_engines
    return greedy_runs(target, draft, fresh, 0, 64, "alone")


@pytest.mark.parametrize("k", (1, 3, 5))
def test_greedy_with_the_draft_model_equals_the_target_alone(bundled_engines, fresh, target_alone, k):
    target, draft = bundled_engines
    got = greedy_runs(target, draft, fresh, k, 64, f"draft-k{k}")
    assert [i for i, (a, b) in enumerate(zip(got, target_alone)) if a != b] == []


@pytest.mark.parametrize("method", ("ngram", "suffix"))
def test_greedy_with_lookup_drafts_equals_the_target_alone(bundled_engines, fresh, target_alone, method):
    target, draft = bundled_engines
    got = greedy_runs(target, draft, fresh, 5, 64, method, lookup=method)
    assert [i for i, (a, b) in enumerate(zip(got, target_alone)) if a != b] == []


def test_greedy_with_mixed_engines_equals_each_target_alone(bundled_engines, fresh):
    """A llama.cpp draft for the transformers target, and a transformers draft for the
    llama.cpp target: each exact against its own target alone."""
    llama_target, llama_draft = bundled_engines
    hf_target = TargetEngine.on_model(load_causal_lm(ModelSpec(path=BUNDLED["target"])), 16384, 512)
    hf_draft = DraftEngine.on_model(load_causal_lm(ModelSpec(path=BUNDLED["draft"])), 16384, 512)
    prompts = fresh[:16]
    for target, draft, name in ((hf_target, llama_draft, "hf-target"), (llama_target, hf_draft, "llama-target")):
        alone = greedy_runs(target, draft, prompts, 0, 48, f"{name}-alone")
        got = greedy_runs(target, draft, prompts, 3, 48, f"{name}-mixed")
        assert got == alone, name


def lone_calls(target, prompts: list[list[int]], steps: int, tokens: int, tag: str,
               engine_drafts: bool) -> tuple[list[list[int]], int]:
    """Each prompt's first `tokens` greedy tokens from lone calls (one sequence a call) of
    `steps` passes without drafts of the router's; and the most tokens any call gave."""
    results, most = [], 0
    for i, prompt in enumerate(prompts):
        sequence = list(prompt)
        while len(sequence) - len(prompt) < tokens:
            [verdict] = target.verify([VerifyRequest(f"{tag}{i}", sequence, [], None, GREEDY, 0, steps=steps,
                                                     engine_drafts=engine_drafts)])
            assert verdict.accepted == 0          # the engine's own drafts are not the router's
            sequence += verdict.tokens
            most = max(most, len(verdict.tokens))
        target.release(f"{tag}{i}")
        results.append(sequence[len(prompt):len(prompt) + tokens])
    return results, most


def test_engine_drafts_in_lone_windows_keep_greedy_output_the_target_alones(bundled_engines, fresh, target_alone):
    """A lone call's single position runs as a window of two; with engine_drafts its second
    place holds a prompt-lookup draft, verified by the rule. The output is the batched target
    alone's (computed apart, 16 sequences a call, no drafts), and some calls gave more tokens
    than their passes: drafts were kept. Without engine_drafts a call gives one token a pass."""
    target, _ = bundled_engines
    got, most = lone_calls(target, fresh[:16], 3, 64, "own", engine_drafts=True)
    assert [i for i, (a, b) in enumerate(zip(got, target_alone)) if a != b] == []
    assert most > 3
    plain, most = lone_calls(target, fresh[:4], 3, 16, "plain", engine_drafts=False)
    assert plain == [ids[:16] for ids in target_alone[:4]] and most == 3


def test_engine_drafts_go_only_to_lone_calls(bundled_engines, fresh):
    """Two sequences in one call: each computes its one new position, no engine draft."""
    target, _ = bundled_engines
    calls = [VerifyRequest(f"pair{i}", list(fresh[i]), [], None, GREEDY, 0, engine_drafts=True) for i in range(2)]
    first = target.verify(calls)
    second = target.verify([replace(call, tokens=call.tokens + v.tokens) for call, v in zip(calls, first)])
    assert [v.positions_fed for v in second] == [1, 1] and [len(v.tokens) for v in second] == [1, 1]
    for call in calls:
        target.release(call.seq_id)


ENGINE_DRAFT_PROMPT = [1, 2, 3, 1, 2]    # its last tokens occurred before: prompt lookup drafts 3


@pytest.mark.parametrize("setting", [*sorted(SETTINGS), "seeded"])
def test_sampled_engine_drafts_keep_the_targets_distribution(sampling_pair, setting):
    """The first two tokens of lone calls of two passes each, with engine drafts, sampled:
    the chi-square test against the target's exact joint distribution. Every first call
    carries the engine's draft (token 3), and it is kept in some samples, not all."""
    target, _, files = sampling_pair
    params = SETTINGS.get(setting, SETTINGS["plain"])
    verifier = LlamaCppTargetEngine(runner(files["target"]), None)
    prompt = ENGINE_DRAFT_PROMPT
    counts = torch.zeros(VOCAB, VOCAB)
    for i in range(SAMPLES):
        sequence, call = list(prompt), 0
        while len(sequence) < len(prompt) + 2:
            seed = i * 1_000_003 + call
            [verdict] = verifier.verify([VerifyRequest(
                f"own{i}", sequence, [], None, params, seed, noise_seed=i if setting == "seeded" else None,
                prompt_len=len(prompt), steps=2, engine_drafts=True)])
            sequence += verdict.tokens
            call += 1
        verifier.release(f"own{i}")
        counts[sequence[len(prompt)], sequence[len(prompt) + 1]] += 1
    assert verifier.engine_drafts["sent"] >= SAMPLES and 0 < verifier.engine_drafts["kept"] < SAMPLES
    assert chi_square_p_value(counts, exact_joint(target, params, prompt)) > ALPHA


@pytest.fixture(scope="module")
def sampling_pair(tmp_path_factory):
    """test_sampling_exactness.py's pair (8 tokens, far apart), in both engines."""
    target = tiny_llama("target", VOCAB, eos_token_id=0, seed=21, initializer_range=0.15)
    draft = tiny_llama("draft", VOCAB, eos_token_id=0, seed=22, initializer_range=0.15)
    root = tmp_path_factory.mktemp("pair")
    vocabulary = [f"<t{i}>" for i in range(VOCAB)]
    files = {name: str(export_model(model, vocabulary, root / f"{name}.gguf"))
             for name, model in (("target", target), ("draft", draft))}
    return target, draft, files


@pytest.mark.parametrize("setting", sorted(SETTINGS))
@pytest.mark.parametrize("engines", ("llamacpp", "llamacpp-draft", "llamacpp-target"))
def test_sampled_speculation_on_llamacpp_has_the_targets_distribution(sampling_pair, setting, engines):
    target, draft, files = sampling_pair
    params = SETTINGS[setting]
    verifier = LlamaCppTargetEngine(runner(files["target"]), None) if engines != "llamacpp-draft" else None
    drafts = LlamaCppDraftEngine(runner(files["draft"]), None) if engines != "llamacpp-target" else None
    counts = speculative_pairs(target, draft, params, seed=5, verifier=verifier, drafts=drafts)
    assert chi_square_p_value(counts, exact_joint(target, params)) > ALPHA


def test_a_file_whose_tokens_differ_from_the_tokenizer_is_refused(zoo, tmp_path):
    model = load_causal_lm(ModelSpec(path=zoo.target))
    vocabulary = folder_vocabulary(zoo.target)
    tokens = list(vocabulary.tokens)
    tokens[10], tokens[11] = tokens[11], tokens[10]
    swapped = replace(vocabulary, tokens=tokens)
    config = model.config.to_dict()
    same = write_gguf(config, model.state_dict(), vocabulary, tmp_path / "same.gguf")
    check_vocabulary(runner(str(same)), zoo.target)
    other = write_gguf(config, model.state_dict(), swapped, tmp_path / "swapped.gguf")
    with pytest.raises(VocabularyMismatch, match="2 of .* token ids name other tokens"):
        check_vocabulary(runner(str(other)), zoo.target)


def gguf_config(gguf_files, zoo, **sections):
    data = {"models": {"target": {"path": gguf_files["zoo-target"], "tokenizer": str(zoo.target)},
                       "draft": {"path": gguf_files["zoo-draft"], "tokenizer": str(zoo.drafts["perturbed"])}},
            "pools": {"draft": {"engine": "llamacpp"}, "target": {"engine": "llamacpp"}}}
    for key, value in sections.items():
        data[key] = {**data.get(key, {}), **value}
    return data


def test_config_refuses_a_gguf_file_without_its_tokenizer_or_engine(gguf_files, zoo):
    data = gguf_config(gguf_files, zoo)
    parse_config(data, base=Path.cwd())
    without_tokenizer = {**data, "models": {**data["models"], "target": {"path": gguf_files["zoo-target"]}}}
    with pytest.raises(ConfigError, match="is a GGUF file: give tokenizer"):
        parse_config(without_tokenizer, base=Path.cwd())
    other_engine = {**data, "pools": {"draft": {"engine": "llamacpp"}}}
    with pytest.raises(ConfigError, match="runs on engine: llamacpp"):
        parse_config(other_engine, base=Path.cwd())
    folder_on_llamacpp = {**data, "models": {**data["models"], "target": {"path": str(zoo.target)}}}
    with pytest.raises(ConfigError, match="runs GGUF files only"):
        parse_config(folder_on_llamacpp, base=Path.cwd())


def test_without_llama_cpp_python_the_engine_names_the_extra(gguf_files, zoo, monkeypatch):
    config = parse_config(gguf_config(gguf_files, zoo), base=Path.cwd())
    monkeypatch.setitem(sys.modules, "llama_cpp", None)           # what an install without the extra has
    monkeypatch.delitem(sys.modules, "replicas.engines.llamacpp.runner")
    with pytest.raises(RuntimeError, match=r"specserve\[llamacpp\]"):
        build("target", config.models.target, config.pools.target, 512)


def test_a_served_cluster_on_llamacpp_answers_as_its_target_alone(ray_serve, gguf_files, zoo):
    """Both pools on llama.cpp behind a real router: over HTTP, greedy completions with drafts
    (k 1, 3, 5) equal the same server's completions with speculation off, and its replicas say
    they run llama.cpp. Speculation off, the target adds no drafts of its own either."""
    config = cluster_config(zoo.target, zoo.drafts["perturbed"])
    data = gguf_config(gguf_files, zoo, limits=config.limits.model_dump(),
                       speculation={"method": "draft_model"})
    for role in ("draft", "target"):
        data["pools"][role]["resources"] = {"num_cpus": 0.1}
    from ray import serve

    url = deploy(ray_serve, "llamacpp", parse_config(data, base=Path.cwd()))
    target = serve.get_deployment_handle("target", app_name="llamacpp")
    prompts = ("import os\n", "class Stack:\n    def __init__(self):\n        self.items = []\n")
    try:
        alone = [complete(url, prompt, max_tokens=32, speculation={"enabled": False})["choices"][0]
                 for prompt in prompts]
        assert target.describe.remote().result()["engine_drafts"]["sent"] == 0
        for prompt, plain in zip(prompts, alone):
            for k in (1, 3, 5):
                got = complete(url, prompt, max_tokens=32, speculation={"k": k})
                assert got["choices"][0]["token_ids"] == plain["token_ids"], k
                assert got["speculation"]["drafted_tokens"] > 0
        described = target.describe.remote().result()
        assert described["engine"] == "llamacpp"
        sent, kept = described["engine_drafts"]["sent"], described["engine_drafts"]["kept"]
        assert sent > 0    # a verify call's further steps carry the target's own drafts
        assert own_drafts_text([described]) == f", own drafts kept {kept} of {sent}"
    finally:
        serve.delete("llamacpp")    # its replicas would hold memory and threads for every later module


def test_a_missing_gguf_file_is_written_from_its_tokenizer_folder_in_the_type_its_name_says(zoo, tmp_path):
    """`specserve up` with cluster-llamacpp.yaml's layout: the files are made, not shipped."""
    from cluster.app import ensure_gguf_files
    import gguf

    data = {"models": {"target": {"path": str(tmp_path / "target-q8_0.gguf"), "tokenizer": str(zoo.target)},
                       "draft": {"path": str(tmp_path / "draft.gguf"), "tokenizer": str(zoo.drafts["perturbed"])}},
            "pools": {"draft": {"engine": "llamacpp"}, "target": {"engine": "llamacpp"}}}
    config = parse_config(data, base=Path.cwd())
    ensure_gguf_files(config, say=lambda line: None)
    kinds = {name: {t.tensor_type.name for t in gguf.GGUFReader(tmp_path / name).tensors}
             for name in ("target-q8_0.gguf", "draft.gguf")}
    assert kinds == {"target-q8_0.gguf": {"Q8_0", "F32"}, "draft.gguf": {"F32"}}
    nowhere = {**data, "models": {**data["models"], "draft": {"path": str(tmp_path / "x.gguf"),
                                                             "tokenizer": str(tmp_path)}}}
    with pytest.raises(ConfigError, match="no such GGUF file .* and no safetensors"):
        parse_config(nowhere, base=Path.cwd())


def test_a_replica_writes_its_missing_gguf_file_on_its_own_node(zoo, tmp_path):
    """A KubeRay pod or a `ray job submit` worker has the tokenizer folder in its image but no
    file that a start elsewhere wrote: the engine writes it where it runs, whole (no partial
    file left), and serves from it."""
    path = tmp_path / "models" / "draft.gguf"
    data = {"models": {"target": {"path": str(zoo.target)},
                       "draft": {"path": str(path), "tokenizer": str(zoo.drafts["perturbed"])}},
            "pools": {"draft": {"engine": "llamacpp"}}}
    config = parse_config(data, base=Path.cwd())
    engine = build("draft", config.models.draft, config.pools.draft, 512)
    assert path.is_file() and [p.name for p in path.parent.iterdir()] == ["draft.gguf"]
    assert engine.describe()["engine"] == "llamacpp"
    assert engine.describe()["lone_step_window"] is False   # a draft's lone steps compute one position
    written = path.stat().st_mtime_ns
    build("draft", config.models.draft, config.pools.draft, 512)
    assert path.stat().st_mtime_ns == written          # an existing file is read, not written again
