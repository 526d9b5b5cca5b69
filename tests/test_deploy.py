"""deploy/: every YAML parses, the KubeRay manifests match the CRD fields, entrypoints parse.

Kubernetes cannot run here. The schema below is written from KubeRay's v1 API reference
(RayCluster, RayJob, HeadGroupSpec, WorkerGroupSpec): field names and types, and the rule that
``rayStartParams`` is a map of strings. Pod templates are Kubernetes' own type and only checked
to be mappings with a ``spec.containers`` list.
"""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest
import yaml

from rayppo.cli import _collect_overrides, build_parser
from rayppo.config import load_config

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"

STR, INT, BOOL, NUM, MAP, LIST = str, int, bool, (int, float), dict, list
POD_TEMPLATE = "PodTemplateSpec"
STRING_MAP = "map[string]string"

WORKER_GROUP = {
    "groupName": STR, "replicas": INT, "minReplicas": INT, "maxReplicas": INT, "idleTimeoutSeconds": INT,
    "rayStartParams": STRING_MAP, "template": POD_TEMPLATE, "scaleStrategy": MAP, "suspend": BOOL,
    "numOfHosts": INT,
}
HEAD_GROUP = {
    "serviceType": STR, "headService": MAP, "enableIngress": BOOL, "rayStartParams": STRING_MAP,
    "template": POD_TEMPLATE,
}
RAY_CLUSTER_SPEC = {
    "rayVersion": STR, "enableInTreeAutoscaling": BOOL, "autoscalerOptions": MAP,
    "headServiceAnnotations": MAP, "headGroupSpec": HEAD_GROUP, "workerGroupSpecs": [WORKER_GROUP],
    "suspend": BOOL, "managedBy": STR, "gcsFaultToleranceOptions": MAP, "authOptions": MAP,
}
RAY_JOB_SPEC = {
    "entrypoint": STR, "runtimeEnvYAML": STR, "rayClusterSpec": RAY_CLUSTER_SPEC, "clusterSelector": MAP,
    "shutdownAfterJobFinishes": BOOL, "ttlSecondsAfterFinished": INT, "activeDeadlineSeconds": INT,
    "submissionMode": STR, "jobId": STR, "metadata": MAP, "entrypointNumCpus": NUM, "entrypointNumGpus": NUM,
    "entrypointResources": STR, "submitterPodTemplate": POD_TEMPLATE, "submitterConfig": MAP, "suspend": BOOL,
    "backoffLimit": INT, "deletionStrategy": MAP, "managedBy": STR,
}
SUBMISSION_MODES = {"K8sJobMode", "HTTPMode", "InteractiveMode", "SidecarMode"}


def check(value, schema, path: str) -> list[str]:
    """Errors of ``value`` against ``schema`` (a field map, a one-item list, or a leaf type)."""
    if schema == POD_TEMPLATE:
        ok = isinstance(value, dict) and isinstance(value.get("spec", {}).get("containers"), list)
        return [] if ok else [f"{path}: not a pod template with spec.containers"]
    if schema == STRING_MAP:
        if not isinstance(value, dict):
            return [f"{path}: expected a map"]
        return [f"{path}.{k}: must be a string, got {type(v).__name__}" for k, v in value.items() if not isinstance(v, str)]
    if isinstance(schema, list):
        if not isinstance(value, list):
            return [f"{path}: expected a list"]
        return [e for i, item in enumerate(value) for e in check(item, schema[0], f"{path}[{i}]")]
    if isinstance(schema, dict):
        if not isinstance(value, dict):
            return [f"{path}: expected a mapping"]
        errors = [f"{path}.{k}: not a field of the CRD" for k in value if k not in schema]
        return errors + [e for k, v in value.items() if k in schema for e in check(v, schema[k], f"{path}.{k}")]
    if schema is INT and isinstance(value, bool):
        return [f"{path}: expected int, got bool"]
    return [] if isinstance(value, schema) else [f"{path}: expected {schema}, got {type(value).__name__}"]


def test_schema_check_can_fail():
    bad = {"rayVersion": 2.6, "headGroupSpec": {"rayStartParams": {"num-gpus": 1}, "template": {}},
           "workerGroupSpecs": [{"groupName": "g", "replica": 2}]}
    errors = check(bad, RAY_CLUSTER_SPEC, "spec")
    assert "spec.rayVersion: expected <class 'str'>, got float" in errors
    assert "spec.headGroupSpec.rayStartParams.num-gpus: must be a string, got int" in errors
    assert "spec.workerGroupSpecs[0].replica: not a field of the CRD" in errors


@pytest.mark.parametrize("path", sorted(DEPLOY.rglob("*.yaml")), ids=lambda p: p.name)
def test_every_yaml_parses(path):
    assert list(yaml.safe_load_all(path.read_text()))


def test_raycluster_matches_the_crd_and_has_independent_worker_groups():
    manifest = yaml.safe_load((DEPLOY / "kuberay" / "raycluster.yaml").read_text())
    assert (manifest["apiVersion"], manifest["kind"]) == ("ray.io/v1", "RayCluster")
    assert check(manifest["spec"], RAY_CLUSTER_SPEC, "spec") == []
    groups = {g["groupName"]: g for g in manifest["spec"]["workerGroupSpecs"]}
    assert set(groups) == {"generators", "learners"}
    assert "generator_node" in groups["generators"]["rayStartParams"]["resources"]
    assert "learner_node" in groups["learners"]["rayStartParams"]["resources"]


def entrypoint_config(entrypoint: str):
    """Parse a manifest's entrypoint with rayppo's own parser and config loader."""
    argv = shlex.split(entrypoint)
    start = argv.index("rayppo.cli") + 1 if "rayppo.cli" in argv else argv.index("rayppo") + 1
    args, extra = build_parser().parse_known_args(argv[start:])
    assert args.command == "train"
    return load_config(args.config, _collect_overrides(extra))


def test_rayjob_matches_the_crd_and_its_entrypoint_is_a_valid_rayppo_command():
    manifest = yaml.safe_load((DEPLOY / "kuberay" / "rayjob.yaml").read_text())
    assert (manifest["apiVersion"], manifest["kind"]) == ("ray.io/v1", "RayJob")
    assert check(manifest["spec"], RAY_JOB_SPEC, "spec") == []
    assert manifest["spec"]["submissionMode"] in SUBMISSION_MODES
    yaml.safe_load(manifest["spec"]["runtimeEnvYAML"])
    cfg = entrypoint_config(manifest["spec"]["entrypoint"])
    assert cfg.cluster.address == "auto"
    assert cfg.generators.resources == {"generator_node": 1} and cfg.learner.resources == {"learner_node": 1}
    groups = {g["groupName"]: g for g in manifest["spec"]["rayClusterSpec"]["workerGroupSpecs"]}
    # The job's generators and learner ranks fit the worker groups they are pinned to.
    assert cfg.generators.num <= groups["generators"]["replicas"]
    assert cfg.learner.num_ranks <= groups["learners"]["replicas"]


def test_launcher_has_a_node_type_per_role():
    config = yaml.safe_load((DEPLOY / "launcher" / "aws.yaml").read_text())
    for key in ("cluster_name", "provider", "available_node_types", "head_node_type",
                "head_start_ray_commands", "worker_start_ray_commands"):
        assert key in config, key
    types = config["available_node_types"]
    assert config["head_node_type"] in types
    resources = {name: t["resources"] for name, t in types.items()}
    assert any("generator_node" in r for r in resources.values())
    assert any("learner_node" in r for r in resources.values())
    for name, t in types.items():
        assert t["min_workers"] <= t["max_workers"], name


def test_dockerfile_builds_the_gpu_stack():
    text = (DEPLOY / "Dockerfile").read_text()
    assert text.startswith("#") and "\nFROM nvidia/cuda:" in text
    assert 'pip install -e ".[gpu]"' in text and "deepspeed" in text and "vllm" in text
