"""The package's layering holds: imports run top-down, no module imports itself in a circle, and
Ray, vLLM and DeepSpeed stay in the modules that spawn, call or wrap them.

Read from the source (ast), every import counted wherever it sits (a function-local import is a
dependency too); a name under ``if TYPE_CHECKING:`` counts for the layering but not for circles,
since it is never executed."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "rayppo"

LAYERS: list[tuple[str, ...]] = [
    ("rayppo.cli",),                                    # the commands
    ("rayppo.train",),                                  # the run loop: progress, metrics, checkpoints
    ("rayppo.trainers", "rayppo.plan"),                 # the iterations; the checks before a run
    ("rayppo.run",),                                    # what a run writes and reads back (its status too)
    ("rayppo.plan.flops",),                             # a stage's useful FLOPs (run/mfu.py counts with them)
    ("rayppo.cluster",),                                # Ray plumbing
    ("rayppo.actors",),                                 # the roles' engines
    ("rayppo.episodes",),                               # multi-turn episodes: the turn loop, environments
    ("rayppo.usercode",),                               # the user's code: imported, in child processes
    ("rayppo.learner",),                                # DeepSpeed learner
    ("rayppo.config",),                                 # the dataclass tree, its checks and loading
    ("rayppo.machine", "rayppo.models", "rayppo.data"),  # the machine a role runs on; models; prompts, rollouts
    ("rayppo.tasks",),                                  # built-in tasks and their reward functions
    ("rayppo.console", "rayppo.errors"),                # the ground floor: the terminal, the errors
    ("rayppo.token_math", "rayppo.choices",            # per-token tensor helpers, the named choices,
     "rayppo.models.vocab_head"),                       # the LM head: importable from anywhere
]
"""Top first. A module may import one of a lower layer, or one of its own package."""

THIRD_PARTY = {
    "ray": ("rayppo.cluster", "rayppo.actors", "rayppo.machine.role_resources"),
    "vllm": ("rayppo.actors.generator", "rayppo.actors.vllm_backend", "rayppo.actors.vllm_adapters",
             "rayppo.actors.weight_receiver", "rayppo.actors.cpu_moe", "rayppo.actors.cpu_lora"),
    "deepspeed": ("rayppo.learner.learner_engine", "rayppo.learner.reward_model_engine", "rayppo.learner.learner_state"),
}
"""Who may import them: Ray where actors are spawned or called, in the engine base (an actor asks
Ray for its own GPUs and node); vLLM in the generator engine (its vLLM backend and adapter serving), its
weight-transfer plugin and its CPU MoE and LoRA patches, DeepSpeed in
the learner engines (PPO's and the reward model's) and their checkpoints (DeepSpeed's universal-checkpoint converter)."""


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _type_checking_lines(tree: ast.AST) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                lines.update(range(child.lineno, child.end_lineno + 1))
    return lines


def _imports(path: Path, modules: set[str]) -> list[tuple[str, int, bool]]:
    """``(imported module, line, executed)`` for every import in the file."""
    tree = ast.parse(path.read_text())
    typing_only = _type_checking_lines(tree)
    found = []
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # ``from rayppo.learner import ppo`` imports the module rayppo.learner.ppo
            subs = [f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in modules]
            names = subs or [node.module]
        found += [(name, node.lineno, node.lineno not in typing_only) for name in names]
    return found


def _layer(module: str) -> tuple[int, str]:
    """(layer index, the package prefix it matched) by the longest matching prefix."""
    best = max(((i, p) for i, layer in enumerate(LAYERS) for p in layer if module == p or module.startswith(p + ".")),
               key=lambda ip: len(ip[1]), default=None)
    assert best is not None, f"{module} is in no layer: add it to LAYERS"
    return best


def _package(module: str) -> str:
    parts = module.split(".")
    return ".".join(parts[:2])


def test_every_module_has_a_layer():
    for module in _modules():
        if module != "rayppo":
            _layer(module)


def _back_arrows(module: str, path: Path, modules: set[str]) -> list[str]:
    """The imports of ``module`` (source at ``path``) that run against the layering."""
    mine, pkg = _layer(module)[0], _package(module)
    return [f"{path.name}:{line} imports {name}" for name, line, _ in _imports(path, modules)
            if name in modules and name != "rayppo" and not (_layer(name)[0] > mine or _package(name) == pkg)]


def test_imports_run_top_down():
    modules = _modules()
    wrong = [arrow for m, p in modules.items() if m != "rayppo" for arrow in _back_arrows(m, p, set(modules))]
    assert wrong == [], "imports against the layering:\n" + "\n".join(wrong)


def _circles(graph: dict[str, list[str]]) -> list[str]:
    """Every circle a depth-first walk of ``graph`` (module -> modules it imports) meets."""
    state: dict[str, int] = {}
    stack: list[str] = []
    circles: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for n in graph.get(m, []):
            if state.get(n) == 1:
                circles.append(" -> ".join(stack[stack.index(n):] + [n]))
            elif n not in state:
                visit(n)
        stack.pop()
        state[m] = 2

    for m in graph:
        if m not in state:
            visit(m)
    return circles


def test_no_import_circle():
    modules = _modules()
    graph = {m: sorted({n for n, _, run in _imports(p, set(modules)) if run and n in modules and n != m})
             for m, p in modules.items()}
    assert _circles(graph) == [], "import circles:\n" + "\n".join(_circles(graph))


def test_ray_vllm_and_deepspeed_stay_where_they_belong():
    modules = _modules()
    wrong = []
    for module, path in modules.items():
        for name, line, _ in _imports(path, set(modules)):
            top = name.split(".")[0]
            allowed = THIRD_PARTY.get(top)
            if allowed and not any(module == a or module.startswith(a + ".") for a in allowed):
                wrong.append(f"{path.relative_to(PACKAGE.parent)}:{line} imports {name}")
    assert wrong == [], "\n".join(wrong)


def test_pure_math_imports_only_torch():
    """The bottom layer and the PPO math import torch and the standard library, the math also
    the bottom layer's helpers and choices: no config object, no role."""
    modules = _modules()
    for module in (*LAYERS[-1], "rayppo.learner.ppo", "rayppo.learner.group_math", "rayppo.learner.rewards",
                   "rayppo.learner.action_tokens"):
        names = {name for name, _, _ in _imports(modules[module], set(modules))}
        tops = {name.split(".")[0] for name in names - set(LAYERS[-1])}
        assert tops <= {"torch", "__future__", "math", "dataclasses", "typing"}, (module, tops)


def test_the_rollout_record_needs_no_torch():
    """The record that crosses processes is lists and Arrow; the learner makes its tensors
    (``learner/rollout_tensors.py``), so the record needs no torch to be read or written."""
    modules = _modules()
    tops = {name.split(".")[0] for name, _, _ in _imports(modules["rayppo.data.rollout"], set(modules))}
    assert "torch" not in tops, tops


def test_the_root_holds_entry_points_and_the_ground_floor_only():
    loose = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert loose == ["__init__.py", "choices.py", "console.py", "errors.py", "token_math.py", "train.py"], loose
    assert (PACKAGE / "cli" / "__init__.py").is_file()  # the commands: a package of their own
    assert all((PACKAGE / d / "__init__.py").read_text().strip() == "" for d in
               ("actors", "cluster", "config", "data", "learner", "machine", "models", "plan", "run", "tasks", "trainers"))


def test_the_checks_catch_a_back_arrow_and_a_circle(tmp_path):
    """The checker itself: a learner module importing the cluster, and a bottom-layer module
    importing the config, are reported; importing down is not."""
    modules = set(_modules())
    bad = tmp_path / "update.py"
    bad.write_text("from rayppo.cluster.group import ActorGroup\nimport torch\n"
                   "from rayppo.config.schema import PPOConfig\n")
    assert _back_arrows("rayppo.learner.update", bad, modules) == ["update.py:1 imports rayppo.cluster.group"]
    assert _back_arrows("rayppo.choices", bad, modules) == [
        "update.py:1 imports rayppo.cluster.group", "update.py:3 imports rayppo.config.schema"]
    graph = {"a": ["b"], "b": ["c"], "c": ["a"], "d": ["a"]}
    assert _circles(graph) == ["a -> b -> c -> a"]
    assert _circles({"a": ["b"], "b": []}) == []


def test_the_cluster_and_the_learner_may_not_import_the_run_or_the_plan(tmp_path):
    """The imports that once ran up the floors are reported: the cluster reading the run's status
    (its fleet file's name now lives in ``cluster/fleet_file.py``, a job's run lines are put
    together by the command), the learner timing the matmul rate through the plan (now
    ``rayppo/machine/matmul_rate.py``, below the learner)."""
    modules = set(_modules())
    bad = tmp_path / "upward.py"
    bad.write_text("from rayppo.run.status import run_status\nfrom rayppo.plan.flops import learn_flops\n"
                   "from rayppo.plan import fit\n")
    everything = ["upward.py:1 imports rayppo.run.status", "upward.py:2 imports rayppo.plan.flops",
                  "upward.py:3 imports rayppo.plan.fit"]
    assert _back_arrows("rayppo.cluster.fleet", bad, modules) == everything
    assert _back_arrows("rayppo.cluster.jobs", bad, modules) == everything
    assert _back_arrows("rayppo.learner.learner_engine", bad, modules) == everything
    assert _back_arrows("rayppo.run.status", bad, modules) == ["upward.py:3 imports rayppo.plan.fit"]
