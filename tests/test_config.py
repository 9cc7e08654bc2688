"""cluster.yaml validation: every problem is reported with its key path, model folders are
checked (and resolved against the config file's folder), and `specserve config check` reports
the same problems on stderr with a non-zero exit. No Ray needed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from cluster.config import DEFAULT_CONFIG_FILE, ClusterConfig, ConfigError, VllmOptions, load_config, parse_config

REPO = Path(__file__).resolve().parent.parent
SPECSERVE = Path(sys.executable).parent / "specserve"
VOCAB = 512


def make_model_dir(path: Path, vocab_size: int = VOCAB, max_position_embeddings: int = 2048, **shape) -> Path:
    """A folder with just the config.json that config validation reads."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({
        "model_type": "llama", "vocab_size": vocab_size,
        "max_position_embeddings": max_position_embeddings, **shape}))
    return path


@pytest.fixture
def models(tmp_path) -> dict[str, Path]:
    return {"target": make_model_dir(tmp_path / "target"), "draft": make_model_dir(tmp_path / "draft")}


def base_data(models: dict[str, Path], **sections) -> dict:
    data = {"models": {"target": {"path": str(models["target"])}, "draft": {"path": str(models["draft"])}}}
    data.update(sections)
    return data


def problems_of(data, base: Path) -> list[str]:
    with pytest.raises(ConfigError) as info:
        parse_config(data, base=base)
    assert info.value.problems, "a ConfigError must list at least one problem"
    for problem in info.value.problems:
        assert problem in str(info.value)
    return info.value.problems


def write_yaml(path: Path, data) -> Path:
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def run_check(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    return subprocess.run([str(SPECSERVE), "config", "check", *args], capture_output=True, text=True,
                          timeout=120, cwd=cwd, env=env)


# --- a valid config -------------------------------------------------------------------------

def test_minimal_valid_config_takes_defaults(models, tmp_path):
    config = parse_config(base_data(models), base=tmp_path)
    assert isinstance(config, ClusterConfig)
    assert config.models.target.path == models["target"].resolve()
    assert config.models.draft.path == models["draft"].resolve()
    assert config.pools.target.tp_size == 1
    assert config.speculation.k <= config.speculation.max_k
    assert config.limits.default_max_tokens <= config.limits.max_tokens


def test_repo_default_cluster_yaml_parses():
    """The shipped cluster.yaml is valid and serves the bundled models."""
    config = load_config(REPO / DEFAULT_CONFIG_FILE)
    assert config.models.target.placeholder is None and config.models.draft.placeholder is None
    # Its relative paths are resolved against the repository root, not the current folder.
    assert config.models.target.path == (REPO / "models/target").resolve()
    assert config.models.draft.path == (REPO / "models/draft").resolve()


# --- unknown keys ----------------------------------------------------------------------------

@pytest.mark.parametrize("where, expected", [
    (("replicsa",), "replicsa"),
    (("pools", "draft", "replicsa"), "pools.draft.replicsa"),
    (("pools", "target", "resources", "num_gpu"), "pools.target.resources.num_gpu"),
    (("pools", "router", "resources", "cpus"), "pools.router.resources.cpus"),
    (("pools", "draft", "kv_cache", "max_seqs"), "pools.draft.kv_cache.max_seqs"),
    (("models", "target", "dtpye"), "models.target.dtpye"),
    (("speculation", "kk"), "speculation.kk"),
    (("serverr",), "serverr"),
], ids=lambda v: ".".join(v) if isinstance(v, tuple) else None)
def test_unknown_key_is_named_by_its_path(models, tmp_path, where, expected):
    data = base_data(models)
    node = data
    for key in where[:-1]:
        node = node.setdefault(key, {})
    node[where[-1]] = 1
    problems = problems_of(data, tmp_path)
    assert f"{expected}: unknown key" in problems


def test_every_unknown_key_is_reported_at_once(models, tmp_path):
    data = base_data(models, pools={"draft": {"replicsa": 2}, "target": {"tp": 1}}, limitz={})
    problems = problems_of(data, tmp_path)
    assert set(problems) == {"pools.draft.replicsa: unknown key", "pools.target.tp: unknown key",
                             "limitz: unknown key"}


# --- wrong types and values ------------------------------------------------------------------

@pytest.mark.parametrize("section, key_path", [
    ({"pools": {"draft": {"replicas": "two"}}}, "pools.draft.replicas"),
    ({"speculation": {"k": [1]}}, "speculation.k"),
    ({"speculation": {"enabled": "maybe"}}, "speculation.enabled"),
    ({"speculation": {"method": "suffix_tree"}}, "speculation.method"),
    ({"speculation": {"method": "ngram", "methods": ["draft_model"]}}, "speculation"),
    ({"pools": {"target": {"decode_steps": 0}}}, "pools.target.decode_steps"),
    ({"pools": {"target": {"engine": "vllm"}}, "speculation": {"method": "hybrid"}}, "(top level)"),
    ({"pools": {"target": {"resources": {"num_cpus": "lots"}}}}, "pools.target.resources.num_cpus"),
    ({"pools": {"draft": {"resources": {"custom": {"small_gpu": "one"}}}}},
     "pools.draft.resources.custom.small_gpu"),
    ({"server": {"port": 70000}}, "server.port"),
    ({"pools": {"draft": {"replicas": 0}}}, "pools.draft.replicas"),
    ({"limits": {"context_length": 1}}, "limits.context_length"),
    ({"pools": "everything"}, "pools"),
    ({"pools": {"router": {"max_queued_requests": -1}}}, "pools.router.max_queued_requests"),
    ({"pools": {"draft": {"call_timeout_ms": 0}}}, "pools.draft.call_timeout_ms"),
    ({"limits": {"max_body_bytes": 100}}, "limits.max_body_bytes"),
    ({"limits": {"request_timeout_s": "soon"}}, "limits.request_timeout_s"),
    ({"server": {"api_keys_file": "no-such-keys-file"}}, "server.api_keys_file"),
    ({"pools": {"draft": {"engine": "vllm"}}}, "pools.draft.engine"),      # vLLM runs targets only
    ({"pools": {"target": {"engine": "tensorrt"}}}, "pools.target.engine"),
    ({"pools": {"target": {"vllm": {"memory_utilization": 1.5}}}}, "pools.target.vllm.memory_utilization"),
    ({"speculation": {"overlap": "sometimes"}}, "speculation.overlap"),
], ids=lambda v: v if isinstance(v, str) else "")
def test_wrong_type_or_value_is_named_by_its_path(models, tmp_path, section, key_path):
    problems = problems_of(base_data(models, **section), tmp_path)
    assert len(problems) == 1, problems
    assert problems[0].startswith(f"{key_path}: "), problems


def test_api_keys_file_resolves_against_the_config_files_folder(models, tmp_path):
    (tmp_path / "keys").write_text("sk-1\n")
    config = parse_config(base_data(models, server={"api_keys_file": "keys"}), base=tmp_path)
    assert config.server.api_keys_file == (tmp_path / "keys").resolve()


def test_model_dtype_and_placeholder_must_be_known_values(models, tmp_path):
    data = base_data(models)
    data["models"]["target"]["dtype"] = "float8"
    data["models"]["draft"]["placeholder"] = "tiny"
    problems = problems_of(data, tmp_path)
    assert any(p.startswith("models.target.dtype: ") for p in problems), problems
    assert any(p.startswith("models.draft.placeholder: ") for p in problems), problems


def test_missing_models_section(tmp_path):
    problems = problems_of({"pools": {}}, tmp_path)
    assert any(p.startswith("models: ") for p in problems), problems


def test_top_level_must_be_a_mapping(tmp_path):
    for data in (None, [], ["models"], "models"):
        problems = problems_of(data, tmp_path)
        assert problems == ["(top level): expected a mapping of keys"]


def test_tp_size_must_split_heads_and_mlp_evenly(tmp_path):
    shape = {"num_attention_heads": 6, "num_key_value_heads": 2, "intermediate_size": 10}
    target = make_model_dir(tmp_path / "target", **shape)
    draft = make_model_dir(tmp_path / "draft", **shape)
    models = {"target": target, "draft": draft}
    config = parse_config(base_data(models, pools={"target": {"tp_size": 2}, "draft": {"tp_size": 2}}), base=tmp_path)
    assert (config.pools.target.tp_size, config.pools.draft.tp_size) == (2, 2)   # independent of each other
    problems = problems_of(base_data(models, pools={"target": {"tp_size": 4}}), tmp_path)
    assert problems == ["pools.target.tp_size: num_attention_heads (6) is not divisible by tp_size 4",
                        "pools.target.tp_size: num_key_value_heads (2) is not divisible by tp_size 4",
                        "pools.target.tp_size: intermediate_size (10) is not divisible by tp_size 4"]


def test_shards_need_resources_of_their_own(models, tmp_path):
    data = base_data(models, pools={"target": {"tp_size": 2, "resources": {"num_cpus": 0}}})
    [problem] = problems_of(data, tmp_path)
    assert problem.startswith("pools.target: ") and "bundle" in problem


def test_only_the_target_waits_for_its_active_sequences_by_default(models, tmp_path):
    pools = parse_config(base_data(models), base=tmp_path).pools
    assert pools.target.batching.wait_for_active and not pools.draft.batching.wait_for_active
    # a partial batching section keeps the pool's own defaults
    partial = parse_config(base_data(models, pools={"target": {"batching": {"max_batch_size": 8}}}), base=tmp_path)
    assert partial.pools.target.batching.wait_for_active


def test_both_pools_waiting_for_active_sequences_is_rejected(models, tmp_path):
    problems = problems_of(base_data(models, pools={"draft": {"batching": {"wait_for_active": True}}}), tmp_path)
    assert len(problems) == 1
    assert problems[0].startswith("pools") and "wait_for_active" in problems[0]


def test_k_above_max_k(models, tmp_path):
    problems = problems_of(base_data(models, speculation={"k": 5, "max_k": 4}), tmp_path)
    assert len(problems) == 1
    assert problems[0].startswith("speculation")
    assert "k (5)" in problems[0] and "max_k (4)" in problems[0]


def test_k_equal_to_max_k_is_fine(models, tmp_path):
    config = parse_config(base_data(models, speculation={"k": 4, "max_k": 4}), base=tmp_path)
    assert config.speculation.k == config.speculation.max_k == 4


def test_default_max_tokens_above_max_tokens(models, tmp_path):
    data = base_data(models, limits={"max_tokens": 64, "default_max_tokens": 128})
    problems = problems_of(data, tmp_path)
    assert len(problems) == 1
    assert problems[0].startswith("limits")
    assert "default_max_tokens" in problems[0] and "max_tokens" in problems[0]


def test_default_max_tokens_above_default_cap_when_only_it_is_given(models, tmp_path):
    """max_tokens defaults to 1024, so a larger default_max_tokens alone is inconsistent too."""
    problems = problems_of(base_data(models, limits={"default_max_tokens": 5000}), tmp_path)
    assert any("default_max_tokens" in p for p in problems), problems


# --- model folders ---------------------------------------------------------------------------

def test_missing_model_directory_names_models_target_path(models, tmp_path):
    data = base_data(models)
    data["models"]["target"]["path"] = str(tmp_path / "nowhere")
    problems = problems_of(data, tmp_path)
    assert len(problems) == 1
    assert problems[0].startswith("models.target.path: ")
    assert "missing model directory" in problems[0]
    assert str(tmp_path / "nowhere") in problems[0]


def test_folder_without_config_json_names_models_draft_path(models, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    data = base_data(models)
    data["models"]["draft"]["path"] = str(empty)
    problems = problems_of(data, tmp_path)
    assert len(problems) == 1
    assert problems[0].startswith("models.draft.path: ")
    assert "config.json" in problems[0]


def test_both_missing_model_directories_are_reported(tmp_path):
    data = {"models": {"target": {"path": "no/target"}, "draft": {"path": "no/draft"}}}
    problems = problems_of(data, tmp_path)
    assert [p.split(":")[0] for p in problems] == ["models.target.path", "models.draft.path"]


def test_missing_directory_is_allowed_for_a_placeholder(tmp_path):
    data = {"models": {"target": {"path": "m/target", "placeholder": "target"},
                       "draft": {"path": "m/draft", "placeholder": "draft"}}}
    config = parse_config(data, base=tmp_path)
    assert config.models.target.path == (tmp_path / "m/target").resolve()
    assert not config.models.target.path.exists()


def test_relative_paths_resolve_against_the_config_files_folder(tmp_path, monkeypatch):
    config_dir = tmp_path / "deploy"
    make_model_dir(config_dir / "models" / "t")
    make_model_dir(config_dir / "models" / "d")
    config_file = write_yaml(config_dir / "cluster.yaml",
                             {"models": {"target": {"path": "models/t"}, "draft": {"path": "models/d"}}})
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)

    config = load_config(config_file)
    assert config.models.target.path == (config_dir / "models" / "t").resolve()
    assert config.models.draft.path == (config_dir / "models" / "d").resolve()
    assert config.models.target.path.is_absolute()

    # A relative path to the config file itself works as well.
    config = load_config(os.path.relpath(config_file, elsewhere))
    assert config.models.target.path == (config_dir / "models" / "t").resolve()


def test_relative_paths_do_not_resolve_against_the_cwd(tmp_path, monkeypatch):
    """The models exist relative to the cwd but not to the config file: that is an error."""
    make_model_dir(tmp_path / "models" / "t")
    make_model_dir(tmp_path / "models" / "d")
    config_dir = tmp_path / "deploy"
    config_dir.mkdir()
    config_file = write_yaml(config_dir / "cluster.yaml",
                             {"models": {"target": {"path": "models/t"}, "draft": {"path": "models/d"}}})
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as info:
        load_config(config_file)
    assert [p.split(":")[0] for p in info.value.problems] == ["models.target.path", "models.draft.path"]


def test_draft_with_a_different_vocabulary_is_rejected(tmp_path):
    target = make_model_dir(tmp_path / "target", vocab_size=512)
    draft = make_model_dir(tmp_path / "draft", vocab_size=1000)
    problems = problems_of(base_data({"target": target, "draft": draft}), tmp_path)
    assert len(problems) == 1
    assert problems[0].startswith("models.draft.path: ")
    assert "1000" in problems[0] and "512" in problems[0]


def test_vocabulary_inside_text_config_is_compared(tmp_path):
    """Multimodal-style config.json files keep the text model's sizes under text_config."""
    target = make_model_dir(tmp_path / "target", vocab_size=512)
    draft = tmp_path / "draft"
    draft.mkdir()
    (draft / "config.json").write_text(json.dumps(
        {"model_type": "x", "text_config": {"vocab_size": 600, "max_position_embeddings": 4096}}))
    problems = problems_of(base_data({"target": target, "draft": draft}), tmp_path)
    assert any(p.startswith("models.draft.path: ") and "600" in p for p in problems), problems


def test_context_length_above_max_position_embeddings_is_rejected(tmp_path):
    target = make_model_dir(tmp_path / "target", max_position_embeddings=256)
    draft = make_model_dir(tmp_path / "draft", max_position_embeddings=4096)
    data = base_data({"target": target, "draft": draft},
                     limits={"context_length": 512, "max_tokens": 64, "default_max_tokens": 16})
    problems = problems_of(data, tmp_path)
    assert len(problems) == 1
    assert problems[0].startswith("limits.context_length: ")
    assert "target" in problems[0] and "256" in problems[0]

    data["limits"]["context_length"] = 256
    assert parse_config(data, base=tmp_path).limits.context_length == 256


def test_context_length_checked_against_the_draft_too(tmp_path):
    target = make_model_dir(tmp_path / "target", max_position_embeddings=4096)
    draft = make_model_dir(tmp_path / "draft", max_position_embeddings=128)
    problems = problems_of(base_data({"target": target, "draft": draft}), tmp_path)
    assert len(problems) == 1
    assert problems[0].startswith("limits.context_length: ") and "draft" in problems[0]


# --- load_config on unreadable files ---------------------------------------------------------

def test_load_config_nonexistent_file(tmp_path):
    with pytest.raises(ConfigError) as info:
        load_config(tmp_path / "nope.yaml")
    assert info.value.source == str(tmp_path / "nope.yaml")
    assert len(info.value.problems) == 1 and info.value.problems[0].startswith("cannot read")


def test_load_config_invalid_yaml(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("models:\n  target: [unclosed\n")
    with pytest.raises(ConfigError) as info:
        load_config(bad)
    assert len(info.value.problems) == 1 and info.value.problems[0].startswith("not valid YAML")


def test_load_config_non_utf8_file(tmp_path):
    bad = tmp_path / "binary.yaml"
    bad.write_bytes(b"\xff\xfe\x00models: {}\n")
    with pytest.raises(ConfigError):
        load_config(bad)


# --- `specserve config check` ----------------------------------------------------------------

def test_cli_check_valid_file(models, tmp_path):
    config_file = write_yaml(tmp_path / "cluster.yaml", base_data(models))
    result = run_check(str(config_file))
    assert result.returncode == 0, result.stderr
    assert "ok" in result.stdout
    assert str(models["target"].resolve()) in result.stdout
    assert result.stderr.strip() == "" or "problem" not in result.stderr


def test_cli_check_defaults_to_cluster_yaml_in_cwd(models, tmp_path):
    write_yaml(tmp_path / "cluster.yaml", base_data(models))
    result = run_check(cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "cluster.yaml: ok" in result.stdout


def test_cli_check_repo_default_config():
    result = run_check(str(REPO / DEFAULT_CONFIG_FILE))
    assert result.returncode == 0, result.stderr
    assert "ok" in result.stdout


def test_cli_check_reports_every_problem_with_its_key_path(models, tmp_path):
    data = base_data(models, pools={"draft": {"replicsa": 2, "replicas": "two"},
                                    "target": {"tp_size": 0}},
                     speculation={"k": [1]})
    data["models"]["target"]["path"] = str(tmp_path / "nowhere")
    data["models"]["draft"]["dtpye"] = "float32"
    config_file = write_yaml(tmp_path / "cluster.yaml", data)
    result = run_check(str(config_file))
    assert result.returncode != 0
    assert "ok" not in result.stdout
    stderr = result.stderr
    expected_paths = ["pools.draft.replicsa: unknown key", "pools.draft.replicas: ",
                      "pools.target.tp_size: ", "speculation.k: ", "models.draft.dtpye: unknown key"]
    for key_path in expected_paths:
        assert key_path in stderr, f"{key_path!r} missing from stderr:\n{stderr}"
    assert str(config_file) in stderr
    assert f"{len(expected_paths)} problem(s)" in stderr
    assert "Traceback" not in stderr


def test_cli_check_reports_model_problems(tmp_path):
    target = make_model_dir(tmp_path / "target", vocab_size=512, max_position_embeddings=128)
    draft = make_model_dir(tmp_path / "draft", vocab_size=300)
    data = {"models": {"target": {"path": "target"}, "draft": {"path": "draft"}},
            "limits": {"context_length": 256, "max_tokens": 64, "default_max_tokens": 16}}
    config_file = write_yaml(tmp_path / "cluster.yaml", data)
    result = run_check(str(config_file))
    assert result.returncode != 0
    assert "models.draft.path: vocabulary size 300" in result.stderr
    assert "limits.context_length: 256 exceeds the target" in result.stderr
    assert target.exists() and draft.exists()


def test_cli_check_nonexistent_file(tmp_path):
    missing = tmp_path / "does-not-exist.yaml"
    result = run_check(str(missing))
    assert result.returncode != 0
    assert str(missing) in result.stderr
    assert "cannot read" in result.stderr and "No such file" in result.stderr
    assert "Traceback" not in result.stderr


def test_cli_check_invalid_yaml(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("models:\n  target: {path: [x\n  draft: :\n")
    result = run_check(str(bad))
    assert result.returncode != 0
    assert str(bad) in result.stderr
    assert "not valid YAML" in result.stderr
    assert "Traceback" not in result.stderr


def test_cli_check_empty_file(tmp_path):
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    result = run_check(str(empty))
    assert result.returncode != 0
    assert "(top level): expected a mapping of keys" in result.stderr


def test_vllms_memory_share_defaults_by_device_kind_and_keeps_an_explicit_one():
    """vLLM's gpu_memory_utilization unset: 0.9 on GPUs (0.2 would not hold an 8 B model's
    16 GB of weights on most GPUs), 0.2 on a CPU host shared with the other pools."""
    assert (VllmOptions().memory_share(on_gpus=True), VllmOptions().memory_share(on_gpus=False)) == (0.9, 0.2)
    assert VllmOptions(memory_utilization=0.5).memory_share(on_gpus=True) == 0.5
