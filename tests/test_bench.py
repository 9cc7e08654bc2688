"""`specserve bench` end to end against a served app: both load modes, every speculation mode
(adaptive, fixed k, a k sweep, target-only, overlap on and off) with repeats, every baseline, and the three
outputs (table, JSON with the documented keys, PNG)."""

from __future__ import annotations

import json

import yaml

from cluster.cli import main


def test_bench_reports_speculation_against_its_baselines(apps, zoo, tmp_path, capsys):
    config = tmp_path / "cluster.yaml"
    config.write_text(yaml.safe_dump({
        "models": {"target": {"path": str(zoo.target)}, "draft": {"path": str(zoo.drafts["perturbed"])}},
        "limits": {"context_length": 512}, "speculation": {"k": 4, "overlap": "auto", "adaptive_lookup": True}}))
    out = tmp_path / "bench.json"
    code = main(["bench", "--url", apps["perturbed"], "--app", "spec-perturbed", "--config", str(config), "--concurrency", "1", "3",
                 "--request-rate", "20", "--num-requests", "3", "--max-tokens", "12", "--prompt-tokens", "16",
                 "--sweep-k", "2", "--repeats", "2", "--hf-prompts", "1", "--out", str(out)])
    assert code == 0
    report = json.loads(out.read_text())
    assert [run["concurrency"] for run in report["closed_loop"]] == [1, 3]
    fixed = ["adaptive", "speculative", "target_only", "ngram", "suffix", "hybrid", "hybrid_adaptive",
             "ngram_adaptive", "suffix_adaptive", "overlap", "no_overlap"]   # overlap may be on
    for run in report["closed_loop"]:             # the sweep at every concurrency
        assert run["modes"] == fixed + ["k=2"]
    # the router's choice, after each run (the served app's lookup requests take k fixed: only adaptive's)
    choices = report["closed_loop"][0]["adaptive"]["choice_after_each_run"]
    assert len(choices) == 2 and all(set(c) >= {"choice", "settled_after_rounds", "tokens_per_s"} for [c] in choices)
    assert [c["rounds"] for [c] in report["closed_loop"][0]["ngram_adaptive"]["choice_after_each_run"]] == [0, 0]
    hybrid = [c["rounds"] for [c] in report["closed_loop"][0]["hybrid_adaptive"]["choice_after_each_run"]]
    assert 0 < hybrid[0] < hybrid[1]          # hybrid requests without a k follow hybrid's own choice
    for run in report["closed_loop"]:
        assert run["no_overlap"]["lookahead_hit_rate"] == run["no_overlap"]["draft_hidden_share"] == 0.0
    for run in report["closed_loop"]:
        for mode in run["modes"]:
            assert len(run[mode]["output_tokens_per_s_runs"]) == 2       # --repeats 2
            assert run[mode]["output_tokens"] == run["target_only"]["output_tokens"]   # greedy: same tokens
        assert run["speedups"]["target_only"] == 1.0 and run["noise"] >= 0
        assert run[mode]["requests"] == max(3, 2 * run["concurrency"])
    assert report["closed_loop"][0]["k=2"]["mean_k"] <= 2 and report["closed_loop"][0]["speculative"]["mean_k"] > 2
    for run in report["closed_loop"] + report["open_loop"]:
        spec, alone = run["speculative"], run["target_only"]
        assert spec["failed"] == alone["failed"] == 0
        assert spec["output_tokens"] == alone["output_tokens"] > 0   # greedy: the same tokens
        assert spec["tokens_per_round"] > 1
        # drafts by kind: the draft pool's in the draft_model modes, lookup's in the ngram mode
        lookup = run["ngram"]["by_kind"]
        assert spec["by_kind"]["draft_model"]["drafted_tokens"] > 0 and spec["by_kind"]["ngram"]["drafted_tokens"] == 0
        assert lookup["ngram"]["drafted_tokens"] > 0 and lookup["draft_model"]["drafted_tokens"] == 0
        suffix = run["suffix"]["by_kind"]
        assert suffix["suffix"]["drafted_tokens"] > 0 == suffix["ngram"]["drafted_tokens"]
        assert 1 < alone["tokens_per_round"] <= 4     # several target steps per call (pools.target.decode_steps)
        assert 0 < spec["acceptance_rate"] <= 1 and alone["acceptance_rate"] == 0
        assert spec["mean_verify_batch"] >= 1 and spec["coordination_ms_per_round"] >= 0
        assert run["speedup_vs_target_only"] > 0 and run["efficiency_vs_ideal"] > 0
    assert report["ideal"]["cost_ratio"] > 0 and report["ideal"]["ideal_speedup"] > 0
    assert report["hf_assisted"]["identical_outputs"] is True
    assert set(report["summary"]) == {"speedup_vs_target_only", "efficiency_vs_ideal", "speedups_by_mode", "noise",
                                      "hf_assisted_speedup"}
    assert report["vllm"].startswith("skipped")
    png = out.with_suffix(".png")
    assert report["plot"] == str(png) and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    printed = capsys.readouterr().out
    assert "speedup_vs_target_only" in printed and "transformers assisted generation" in printed


def test_a_vllm_run_that_fails_is_reported_not_raised(zoo):
    # This venv has no vLLM: pointed at it, the baseline script fails to import vllm, and the
    # bench says so in its report instead of losing the whole run.
    import sys

    from cluster.bench.vllm_compare import compare

    result = compare(sys.executable, zoo.target, zoo.drafts["perturbed"], [[1, 2, 3]], 4, 2, [1])
    assert isinstance(result, str) and result.startswith("failed: vLLM target_only run gave no report")
    assert "vllm" in result
