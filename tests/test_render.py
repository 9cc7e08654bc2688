"""Everything deployable comes from one cluster.yaml: the committed KubeRay manifests are
exactly what `specserve render k8s` makes of k8s/cluster.yaml; they validate against the
KubeRay CRD schemas (unknown fields rejected), their serveConfigV2 against Ray Serve's schema
and our own strict one, and their Service against Kubernetes' schema; the Serve config
carries every deployment option that `specserve up` applies."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import jsonschema
import pytest
import yaml
from ray.serve.schema import ServeDeploySchema

from cluster.config import ClusterConfig, load_config
from cluster.kuberay import render_k8s
from cluster.render import render_serve_config

REPO = Path(__file__).resolve().parent.parent
K8S_CONFIG = REPO / "k8s" / "cluster.yaml"
CRDS = REPO.parent / "shared" / "kuberay"
SPECSERVE = Path(sys.executable).parent / "specserve"


@pytest.fixture(scope="module")
def manifests() -> dict[str, dict]:
    return {name: yaml.safe_load((REPO / "k8s" / name).read_text()) for name in ("rayservice.yaml", "rayjob.yaml")}


def test_the_committed_manifests_are_exactly_the_rendered_ones():
    for name, text in render_k8s(K8S_CONFIG).items():
        committed = (REPO / "k8s" / name).read_text()
        assert committed == text, f"k8s/{name} differs from `specserve render k8s`: render again and commit"


def test_a_change_to_the_cluster_config_shows_as_drift(tmp_path):
    changed = yaml.safe_load(K8S_CONFIG.read_text())
    changed["pools"]["target"]["tp_size"] = 4
    (tmp_path / "k8s").mkdir()
    (tmp_path / "k8s" / "cluster.yaml").write_text(yaml.safe_dump(changed))
    (tmp_path / "models").symlink_to(REPO / "models")
    rendered = render_k8s(tmp_path / "k8s" / "cluster.yaml")
    body = lambda text: text.split("\n", 1)[1]     # noqa: E731 - the header names the source
    assert body(rendered["rayservice.yaml"]) != body((REPO / "k8s" / "rayservice.yaml").read_text())
    group = _group(yaml.safe_load(rendered["rayservice.yaml"]), "large-gpu")
    assert group["rayStartParams"]["num-gpus"] == "4"


def _strict(schema):
    """The CRD schema with unknown fields rejected wherever it lists the known ones."""
    schema = copy.deepcopy(schema)

    def walk(node):
        if isinstance(node, dict):
            if "properties" in node and "additionalProperties" not in node \
                    and not node.get("x-kubernetes-preserve-unknown-fields"):
                node["additionalProperties"] = False
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)
    walk(schema)
    return schema


def _crd_schema(file: str) -> dict:
    crd = yaml.safe_load((CRDS / file).read_text())
    [version] = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    return _strict(version["schema"]["openAPIV3Schema"])


@pytest.mark.skipif(not CRDS.is_dir(), reason=f"the KubeRay CRDs are not here ({CRDS}): they are data kept "
                                              f"beside the project, not in it")
@pytest.mark.parametrize("name, crd", [("rayservice.yaml", "ray.io_rayservices.yaml"),
                                       ("rayjob.yaml", "ray.io_rayjobs.yaml")])
def test_the_manifests_validate_against_the_kuberay_crds(manifests, name, crd):
    schema = _crd_schema(crd)
    jsonschema.validate(manifests[name], schema)
    broken = copy.deepcopy(manifests[name])
    cluster = broken["spec"].get("rayClusterConfig") or broken["spec"]["rayClusterSpec"]
    cluster["workerGroupSpecs"][0]["maxReplica"] = 3          # a typo must not pass
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, schema)


def test_serve_config_v2_validates_with_serve_and_with_our_own_schema(manifests):
    serve = yaml.safe_load(manifests["rayservice.yaml"]["spec"]["serveConfigV2"])
    ServeDeploySchema.model_validate(serve)
    [app] = serve["applications"]
    assert app["import_path"] == "cluster.serve_app:build"
    cluster = ClusterConfig.model_validate(app["args"]["cluster"])      # strict: unknown keys fail
    assert cluster.models.target.path == Path("/app/models/target")
    by_name = {d["name"]: d for d in app["deployments"]}
    assert set(by_name) == {"router", "draft", "target"}
    assert by_name["target"]["placement_group_strategy"] == "STRICT_PACK"
    assert by_name["target"]["placement_group_bundles"] == [{"CPU": 2.0, "GPU": 1.0, "large_gpu": 1.0}] * 2
    assert by_name["draft"]["ray_actor_options"]["resources"] == {"small_gpu": 1.0}
    assert by_name["draft"]["autoscaling_config"]["max_replicas"] == 4
    assert "ConsistentHashRouter" in by_name["target"]["request_router_config"]["request_router_class"]
    misspelt = copy.deepcopy(app["args"]["cluster"])
    misspelt["pools"]["draft"]["max_replica"] = 3
    with pytest.raises(Exception, match="max_replica"):
        ClusterConfig.model_validate(misspelt)


def test_a_vllm_target_leaves_the_shards_gpus_to_vllms_workers(tmp_path):
    """With engine vllm, vLLM's own Ray workers hold one GPU per bundle: the replica in bundle
    0 holds its CPUs only, or bundle 0's worker never finds its GPU."""
    from cluster.render import serve_config

    raw = yaml.safe_load(K8S_CONFIG.read_text())
    raw["pools"]["target"]["engine"] = "vllm"
    config = ClusterConfig.model_validate({**raw, "models": {role: {"path": str(REPO / "models" / role)}
                                                             for role in ("target", "draft")}})
    [app] = serve_config(config, raw)["applications"]
    target = {d["name"]: d for d in app["deployments"]}["target"]
    assert target["placement_group_bundles"] == [{"CPU": 2.0, "GPU": 1.0, "large_gpu": 1.0}] * 2
    assert target["ray_actor_options"]["num_gpus"] == 0
    assert target["ray_actor_options"]["num_cpus"] == 2.0


def test_worker_groups_carry_the_node_kinds_the_pools_ask_for(manifests):
    for name in ("rayservice.yaml", "rayjob.yaml"):
        document = manifests[name]
        small, large = _group(document, "small-gpu"), _group(document, "large-gpu")
        assert small["rayStartParams"]["resources"] == '"{\\"small_gpu\\":1}"'
        assert large["rayStartParams"]["resources"] == '"{\\"large_gpu\\":2}"'     # one node: a whole TP group
        assert large["rayStartParams"]["num-gpus"] == "2"
        assert (large["minReplicas"], large["maxReplicas"]) == (1, 2)
        cluster = document["spec"].get("rayClusterConfig") or document["spec"]["rayClusterSpec"]
        assert cluster["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"
        assert cluster["enableInTreeAutoscaling"] is True


def test_replicas_reserving_half_a_gpu_share_nodes_of_whole_gpus(tmp_path):
    """`ray start --num-gpus` and `nvidia.com/gpu` take whole numbers: draft replicas of half a
    GPU each get one-GPU nodes, two replicas a node, and half as many nodes; every GPU pod
    mounts a memory-backed /dev/shm (NCCL's buffers outgrow Docker's 64 MB)."""
    changed = yaml.safe_load(K8S_CONFIG.read_text())
    changed["pools"]["draft"]["resources"] = {"num_cpus": 1, "num_gpus": 0.5, "custom": {"small_gpu": 1}}
    changed["pools"]["draft"]["autoscaling"].update(min_replicas=1, max_replicas=5)
    (tmp_path / "k8s").mkdir()
    (tmp_path / "k8s" / "cluster.yaml").write_text(yaml.safe_dump(changed))
    (tmp_path / "models").symlink_to(REPO / "models")
    document = yaml.safe_load(render_k8s(tmp_path / "k8s" / "cluster.yaml")["rayservice.yaml"])
    draft, target = _group(document, "small-gpu"), _group(document, "large-gpu")
    assert draft["rayStartParams"]["num-gpus"] == "1"
    assert draft["rayStartParams"]["num-cpus"] == "2" and draft["rayStartParams"]["resources"] == '"{\\"small_gpu\\":2}"'
    assert (draft["minReplicas"], draft["maxReplicas"]) == (1, 3)
    for group, gpus in ((draft, "1"), (target, "2")):
        pod = group["template"]["spec"]
        [container] = pod["containers"]
        assert container["resources"]["limits"]["nvidia.com/gpu"] == gpus
        assert container["volumeMounts"] == [{"name": "dshm", "mountPath": "/dev/shm"}]
        assert pod["volumes"] == [{"name": "dshm", "emptyDir": {"medium": "Memory"}}]
    if CRDS.is_dir():
        jsonschema.validate(document, _crd_schema("ray.io_rayservices.yaml"))


def test_the_serve_service_is_a_valid_kubernetes_service(manifests):
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    service = {"apiVersion": "v1", "kind": "Service", **manifests["rayservice.yaml"]["spec"]["serveService"]}
    kubernetes_validate.validate(service, "1.30", strict=True)
    assert service["spec"]["type"] == "LoadBalancer"
    assert service["spec"]["ports"][0]["targetPort"] == 8000


def test_the_serve_config_holds_what_specserve_up_applies(tmp_path):
    text = render_serve_config(REPO / "cluster.yaml", models_dir="/srv/models", models_uri=None)
    document = yaml.safe_load(text)
    ServeDeploySchema.model_validate(document)
    [app] = document["applications"]
    assert app["args"]["cluster"]["models"]["target"]["path"] == "/srv/models/target"
    router = {d["name"]: d for d in app["deployments"]}["router"]
    config = load_config(REPO / "cluster.yaml")
    gate = config.pools.router
    assert router["max_ongoing_requests"] == gate.max_ongoing_requests + gate.max_queued_requests + 1024
    uri = yaml.safe_load(render_serve_config(REPO / "cluster.yaml", None, "s3://bucket/models.zip"))
    [app] = uri["applications"]
    assert app["runtime_env"] == {"working_dir": "s3://bucket/models.zip"}
    assert app["args"]["cluster"]["models"]["draft"]["path"] == "draft"


def _group(document: dict, name: str) -> dict:
    cluster = document["spec"].get("rayClusterConfig") or document["spec"]["rayClusterSpec"]
    [group] = [g for g in cluster["workerGroupSpecs"] if g["groupName"] == name]
    return group


@pytest.mark.parametrize("ingress", ["haproxy", "proxy"])
def test_the_ingress_reaches_serves_controller_and_the_routers_in_the_serve_config(tmp_path, ingress):
    """HAProxy is a setting of the controller (it starts HAProxy) and of the router replicas
    (they open their own HTTP ports): both must carry it, and neither with the Python proxy."""
    raw = yaml.safe_load((REPO / "cluster.yaml").read_text())
    raw["server"]["ingress"] = ingress
    (tmp_path / "cluster.yaml").write_text(yaml.safe_dump(raw))
    (tmp_path / "models").symlink_to(REPO / "models")
    document = yaml.safe_load(render_serve_config(tmp_path / "cluster.yaml", None, None))
    ServeDeploySchema.model_validate(document)
    router = {d["name"]: d for d in document["applications"][0]["deployments"]}["router"]
    router_env = router["ray_actor_options"].get("runtime_env", {}).get("env_vars", {})
    controller_env = (document.get("controller_options") or {}).get("runtime_env", {}).get("env_vars", {})
    expected = {"RAY_SERVE_ENABLE_HA_PROXY": "1"} if ingress == "haproxy" else {}
    for env in (router_env, controller_env):
        assert {key: env[key] for key in env if key == "RAY_SERVE_ENABLE_HA_PROXY"} == expected


@pytest.mark.skipif(not CRDS.is_dir(), reason=f"the KubeRay CRDs are not here ({CRDS})")
def test_a_llamacpp_draft_pool_on_cpu_nodes_beside_a_gpu_target_renders_valid(tmp_path):
    """Mixed engines on Kubernetes: the draft a GGUF file on llama.cpp, CPU nodes only, the
    target the transformers engine on GPUs. The manifests validate against the KubeRay CRDs
    and the Serve config against Serve's schema and ours; the draft's file and tokenizer are
    under the image's models folder (each replica writes the file there if it is missing,
    test_llamacpp_engine.py)."""
    raw = yaml.safe_load(K8S_CONFIG.read_text())
    raw["models"]["draft"] = {"path": "../models/gguf/draft-q8_0.gguf", "tokenizer": "../models/draft"}
    raw["pools"]["draft"].update(engine="llamacpp", resources={"num_cpus": 4}, llamacpp={"threads": 4})
    (tmp_path / "k8s").mkdir()
    (tmp_path / "k8s" / "cluster.yaml").write_text(yaml.safe_dump(raw))
    (tmp_path / "models").symlink_to(REPO / "models")
    rendered = {name: yaml.safe_load(text) for name, text in render_k8s(tmp_path / "k8s" / "cluster.yaml").items()}
    for name, crd in (("rayservice.yaml", "ray.io_rayservices.yaml"), ("rayjob.yaml", "ray.io_rayjobs.yaml")):
        jsonschema.validate(rendered[name], _crd_schema(crd))
    serve = yaml.safe_load(rendered["rayservice.yaml"]["spec"]["serveConfigV2"])
    ServeDeploySchema.model_validate(serve)
    [app] = serve["applications"]
    cluster = ClusterConfig.model_validate(app["args"]["cluster"])
    assert cluster.models.draft.path == Path("/app/models/draft-q8_0.gguf")
    assert cluster.models.draft.tokenizer == Path("/app/models/draft")
    assert (cluster.pools.draft.engine, cluster.pools.target.engine) == ("llamacpp", "huggingface")
    draft = {d["name"]: d for d in app["deployments"]}["draft"]
    assert draft["ray_actor_options"].get("num_gpus", 0) == 0 and draft["ray_actor_options"]["num_cpus"] == 4
