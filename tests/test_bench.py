"""`specserve bench` end to end against a served app: the fresh workload (every request a prompt
never sent before), both sampling settings, both load modes, every speculation mode (target
only, the server's default, each method with k the server's choice and with k fixed, overlap
on and off) with repeats, every baseline, and the three outputs (table, JSON with the
documented keys, PNG); then the repeated workload."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from cluster.cli import main

METHODS = ["draft_model", "ngram", "suffix", "hybrid"]


def _config(tmp_path, zoo):
    config = tmp_path / "cluster.yaml"
    config.write_text(yaml.safe_dump({
        "models": {"target": {"path": str(zoo.target)}, "draft": {"path": str(zoo.drafts["perturbed"])}},
        "limits": {"context_length": 512}, "speculation": {"k": 4, "overlap": "auto"}}))
    return config


def test_bench_reports_speculation_against_its_baselines(apps, zoo, tmp_path, capsys):
    out = tmp_path / "bench.json"
    code = main(["bench", "--url", apps["perturbed"], "--app", "spec-perturbed", "--config", str(_config(tmp_path, zoo)),
                 "--concurrency", "1", "3", "--sampling", "greedy", "sampled", "--request-rate", "20",
                 "--num-requests", "3", "--requests-per-client", "2", "--max-tokens", "12", "--prompt-tokens", "16",
                 "--fixed-k", "2",
                 "--repeats", "2", "--hf-prompts", "1", "--out", str(out)])
    assert code == 0
    report = json.loads(out.read_text())
    assert report["workload"] == "fresh" and report["ignore_eos"] is True
    assert report["sampling"] == {"greedy": {"temperature": 0}, "sampled": {"temperature": 0.8, "top_p": 0.95}}
    closed, opened = report["closed_loop"], report["open_loop"]
    assert [(run["concurrency"], run["sampling"]) for run in closed] == [
        (1, "greedy"), (1, "sampled"), (3, "greedy"), (3, "sampled")]
    assert [(run["concurrency"], run["sampling"]) for run in opened] == [("20.0/s", "greedy"), ("20.0/s", "sampled")]
    modes = ["target_only", "default", *METHODS, *(f"{m}_k2" for m in METHODS), "overlap", "no_overlap"]
    looked_up = {"ngram": 0, "suffix": 0}
    for run in closed + opened:
        assert run["modes"] == modes
        requests = 3 if run["mode"] == "open" else max(3, 2 * run["concurrency"])
        for mode in modes:
            summary = run[mode]
            assert len(summary["output_tokens_per_s_runs"]) == 2             # --repeats 2
            assert summary["failed"] == 0 and summary["requests"] == requests
            # ignore_eos: every request yields exactly max_tokens, in every mode and sampling
            assert summary["output_tokens"] == run["target_only"]["output_tokens"] == requests * 12
        assert set(run["speedups"]) == set(modes) and run["speedups"]["target_only"] == 1.0
        assert all(ratio > 0 for ratio in run["speedups"].values()) and run["noise"] >= 0
        assert run["speedup_vs_target_only"] == run["speedups"]["default"] > 0
        assert set(run["speedup_intervals"]) == set(modes) - {"target_only"}
        assert all(0 <= low <= high for low, high in run["speedup_intervals"].values())   # 2 repeats: wide
        if isinstance(report["ideal"], dict):      # the draft_model mode's speedup over the ideal's
            assert run["efficiency_vs_ideal"] > 0
        else:
            assert run["efficiency_vs_ideal"] is None
        # the router's adaptive control after each run of a speculating mode, reached through --app
        assert "settling_after_each_run" not in run["target_only"]
        for mode in modes[1:]:
            for key in ("settling_after_each_run", "k_by_method_after_each_run"):
                states = run[mode][key]
                assert len(states) == 2 and all(s == "not available" or isinstance(s, dict) for s in states), states
        # k fixed by the request
        assert all(run[f"{method}_k2"]["mean_k"] <= 2 for method in METHODS)
        assert run["draft_model_k2"]["mean_k"] > 0
        # drafts by kind (k fixed): the draft pool's in draft_model, lookup's in ngram, suffix's in
        # suffix (lookup finds a match in some phases only: 12 tokens after a fresh prompt)
        pool, lookup, suffix = (run[f"{m}_k2"]["by_kind"] for m in ("draft_model", "ngram", "suffix"))
        assert _drafted(pool, "draft_model") > 0 and _drafted(pool, "ngram") == 0
        assert _drafted(lookup, "draft_model") == _drafted(lookup, "suffix") == 0
        assert _drafted(suffix, "ngram") == _drafted(suffix, "draft_model") == 0
        looked_up["ngram"] += _drafted(lookup, "ngram")
        looked_up["suffix"] += _drafted(suffix, "suffix")
        alone = run["target_only"]
        assert 1 <= alone["tokens_per_round"] <= 4     # up to pools.target.decode_steps target steps per call
        assert alone["acceptance_rate"] == 0
        spec = run["draft_model_k2"]
        assert 0 < spec["acceptance_rate"] <= 1 and spec["mean_verify_batch"] >= 1
        assert spec["coordination_ms_per_round"] >= 0
        if run["sampling"] == "greedy":
            assert spec["tokens_per_round"] > 1
        assert run["no_overlap"]["lookahead_hit_rate"] == run["no_overlap"]["draft_hidden_share"] == 0.0
    assert min(looked_up.values()) > 0
    # every request of the run had a prompt never sent before: 2 warm-ups each of default and
    # draft_model, a first wave of target_only at each concurrency, then every mode, repeat and phase
    sent = 2 * 2 + (1 + 3) + 2 * 2 * len(modes) * ((3 + 6) + 3)
    assert report["prompts"] == {"sent": sent, "distinct": sent}
    ideal = report["ideal"]
    if isinstance(ideal, str):     # the server's own k for draft_model may be 0 every round at this load
        assert ideal == "skipped: the draft_model mode drafted nothing"
    else:                          # from the draft_model mode at the first greedy phase
        assert ideal["cost_ratio"] > 0 and ideal["ideal_speedup"] > 0
        assert ideal["phase"] == "1 greedy" and ideal["mean_k"] > 0
    assert report["hf_assisted"]["identical_outputs"] is True
    assert set(report["summary"]) == {"speedup_vs_target_only", "efficiency_vs_ideal", "speedups_by_mode", "noise",
                                      "speedup_intervals", "hf_assisted_speedup"}
    phases = {f"{c} {s}" for c in (1, 3, "20.0/s") for s in ("greedy", "sampled")}
    assert set(report["summary"]["speedup_vs_target_only"]) == phases
    assert report["vllm"].startswith("skipped")
    png = out.with_suffix(".png")
    assert report["plot"] == str(png) and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    printed = capsys.readouterr().out
    assert f"fresh prompts: {sent} sent, {sent} distinct" in printed
    for phase in ("C=1 greedy: default ", "C=1 sampled: default ", "C=3 greedy: default ", "C=20.0/s sampled: default "):
        assert phase in printed
    assert "hybrid_k2" in printed and "(noise " in printed and "transformers assisted generation" in printed


def _drafted(by_kind: dict, kind: str) -> int:
    return by_kind.get(kind, {}).get("drafted_tokens", 0)


def test_the_repeated_workload_sends_the_same_prompts_to_every_mode(apps, zoo, tmp_path):
    out = tmp_path / "bench.json"
    code = main(["bench", "--url", apps["perturbed"], "--app", "spec-perturbed", "--config", str(_config(tmp_path, zoo)),
                 "--workload", "repeated", "--sampling", "greedy", "--concurrency", "2", "--modes", "suffix",
                 "--num-requests", "2", "--requests-per-client", "2", "--max-tokens", "8", "--prompt-tokens", "16",
                 "--out", str(out)])
    assert code == 0
    report = json.loads(out.read_text())
    [run] = report["closed_loop"]
    assert report["workload"] == "repeated" and run["modes"] == ["target_only", "suffix"]
    assert run["suffix"]["output_tokens"] == run["target_only"]["output_tokens"] == 4 * 8
    # 2 warm-ups (target_only: --modes left out default and draft_model), a wave of 2, 4 a mode
    assert report["prompts"]["sent"] == 2 + 2 + 2 * 4 and report["prompts"]["distinct"] <= 4
    assert report["ideal"].startswith("skipped") and report["hf_assisted"].startswith("skipped")


def test_a_vllm_run_that_fails_is_reported_not_raised(zoo):
    # This venv has no vLLM: pointed at it, the baseline script fails to import vllm, and the
    # bench says so in its report instead of losing the whole run.
    import sys

    from cluster.bench.vllm_compare import compare

    result = compare(sys.executable, zoo.target, zoo.drafts["perturbed"], [[1, 2, 3]], 4, 2, [1])
    assert isinstance(result, str) and result.startswith("failed: vLLM target_only run gave no report")
    assert "vllm" in result


def test_a_paired_interval_holds_the_speedup_and_narrows_where_the_pairs_agree():
    from cluster.bench.run import _paired_interval
    # the machine drifts by 40 % across repeats, the mode runs 0.9x its pair in each
    alone = [1000.0, 700.0, 850.0]
    steady = _paired_interval([0.9 * a for a in alone], alone)
    assert steady[0] == pytest.approx(0.9, abs=1e-6) and steady[1] == pytest.approx(0.9, abs=1e-6)
    spread = _paired_interval([950.0, 600.0, 800.0], alone)
    assert spread[0] < 0.9 < spread[1] and spread[1] - spread[0] > 0.05
    assert _paired_interval([900.0], [1000.0]) is None


def test_each_phase_is_compared_with_llama_cpps_best_server():
    """specserve bench --llama-server: every specserve mode over the fastest of llama.cpp's
    servers in the phase, and the target alone over llama.cpp's alone."""
    from cluster.bench.run import _against_llamacpp

    rate = {"target_only": 40.0, "default": 60.0, "llamacpp_serve_alone": 50.0, "llamacpp_serve_draft": 80.0,
            "llamacpp_serve_ngram": 70.0}
    got = _against_llamacpp({name: {"output_tokens_per_s": value} for name, value in rate.items()})
    assert got == {"best_llamacpp": "llamacpp_serve_draft", "target_only_vs_best_llamacpp": 0.5,
                   "default_vs_best_llamacpp": 0.75, "target_only_vs_llamacpp_serve_alone": 0.8}


def test_llama_server_runs_the_same_files_with_the_speculation_each_mode_names():
    from cluster.bench.llamacpp_server import server_command

    alone = server_command("llama-server", Path("t.gguf"), Path("d.gguf"), "llamacpp_serve_alone", 4, 9000, 16,
                           512, None, repack=False)
    draft = server_command("llama-server", Path("t.gguf"), Path("d.gguf"), "llamacpp_serve_draft", 4, 9000, 16,
                           512, 2, repack=True)
    ngram = server_command("llama-server", Path("t.gguf"), None, "llamacpp_serve_ngram", 4, 9000, 16, 512, None,
                           repack=False)
    assert alone[:3] == ["llama-server", "-m", "t.gguf"] and "--spec-type" not in alone and "--no-repack" in alone
    assert alone[alone.index("-np") + 1] == "16" and alone[alone.index("-c") + 1] == str(16 * 512)
    assert draft[draft.index("-md") + 1] == "d.gguf" and draft[draft.index("--spec-type") + 1] == "draft-simple"
    assert draft[draft.index("--spec-draft-n-max") + 1] == "4" and "--no-repack" not in draft
    assert draft[draft.index("-t") + 1] == "2"
    assert ngram[ngram.index("--spec-type") + 1] == "ngram-simple" and "-md" not in ngram
