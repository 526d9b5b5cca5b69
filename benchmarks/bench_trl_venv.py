"""TRL's own virtual environments for ``rayppo bench --compare trl``, one per compared trainer
(``TRL_PPO``, ``TRL_GRPO``): where each goes, whether it is ready, how a half-made one is cleared,
and its one install (``ensure_trl_venv``). TRL's pinned torch must not replace rayppo's, so the
comparison runs in an environment of its own; and TRL 1.13 removed the value-head
``PPOTrainer`` that the PPO comparison runs, so GRPO is compared with TRL's current release and
PPO with the last release that has it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from rayppo.errors import RayppoError
from rayppo.models.paths import cache_root

HERE = Path(__file__).resolve().parent


@dataclass(frozen=True)
class TrlPins:
    """One TRL environment's exact requirements, its folder's name and the variable naming another."""

    requirements: tuple[str, ...]
    """``name==version`` each; ``venv_state`` checks every one is installed at that version."""
    folder: str
    """``.FOLDER`` beside the repository, or ``FOLDER`` in rayppo's cache (``choose_trl_venv``)."""
    env: str
    """Names the environment's folder, over the default choice."""

    @property
    def trl(self) -> str:
        """The pinned TRL release: ``1.16.0``."""
        return next(r.split("==")[1] for r in self.requirements if r.startswith("trl=="))


TRL_PPO = TrlPins(("torch==2.13.0", "trl==1.12.0", "requests==2.34.2"),  # its GRPOTrainer imports requests
                  "venv-trl", "RAYPPO_TRL_VENV")
"""TRL 1.12, for ``ppo.advantage=gae`` (``trl_ppo.py``): the last release with the value-head
``trl.experimental.ppo.PPOTrainer``. ``RAYPPO_TRL_VENV`` (the name from before there were two
environments) names its folder."""
TRL_GRPO = TrlPins(("torch==2.13.0", "trl==1.16.0", "transformers==5.25.0", "accelerate==1.16.0",
                    "datasets==5.2.0"),
                   "venv-trl-1.16", "RAYPPO_TRL_GRPO_VENV")
"""TRL's current release, for ``ppo.advantage=grpo`` (``trl_grpo.py``'s ``GRPOTrainer``), with the
transformers, accelerate and datasets releases it was checked against (pip's choice on 2026-12-06;
its GRPOTrainer no longer imports requests). ``RAYPPO_TRL_GRPO_VENV`` names its folder."""


RENDEZVOUS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
"""torch.distributed's rendezvous variables: an in-process learner rank (``trainer=reference``)
sets them in its process (``learner.learner_engine.join_learner_group``)."""


def trl_environment() -> dict[str, str]:
    """This process's environment for a TRL child, less ``RENDEZVOUS``: inherited, accelerate takes
    them for a group of its own and binds the rank's port again (EADDRINUSE)."""
    return {k: v for k, v in os.environ.items() if k not in RENDEZVOUS}


def venv_state(path: Path, pins: TrlPins) -> str:
    """What ``path`` holds, as a TRL environment for ``pins``: ``ready`` (bin/python and
    ``pins.requirements``' exact versions installed), ``missing``, ``a dangling symlink``, ``a file``
    or ``half-made (...)`` (an interrupted or failed install: pip writes a package's dist-info last)."""
    if path.is_symlink() and not path.exists():
        return "a dangling symlink"
    if not path.exists():
        return "missing"
    if not path.is_dir():
        return "a file"
    if not (path / "bin" / "python").exists():
        return "half-made (no bin/python)"
    sites = list(path.glob("lib/python*/site-packages"))
    for name, version in (r.split("==") for r in pins.requirements):
        # torch's dist-info carries a local version: torch-2.13.0+cpu.dist-info
        if not any(any(site.glob(f"{name.replace('-', '_')}-{version}*.dist-info")) for site in sites):
            return f"half-made (no {name}=={version})"
    return "ready"


def _writable(folder: Path) -> bool:
    """Whether a folder can be made in ``folder``: tried, since ``os.access`` answers yes to root
    where the filesystem still refuses (read-only mounts aside)."""
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".rayppo-probe-", dir=folder))
        return True
    except OSError:
        return False


@dataclass
class TrlVenv:
    """Where one TRL environment (``pins``) lives, and why there."""

    path: Path
    why: str
    pins: TrlPins

    @property
    def state(self) -> str:
        return venv_state(self.path, self.pins)


def choose_trl_venv(pins: TrlPins, repo: Path = HERE.parent, environ: dict[str, str] | None = None) -> TrlVenv:
    """The folder that ``pins.env`` names when set; else ``.venv-trl`` (``.venv-trl-1.16``: a dot and
    ``pins.folder``) beside the repository when it is ready or the repository folder is writable;
    else ``venv-trl`` (``pins.folder``) in rayppo's cache (``cache_root``)."""
    named = (os.environ if environ is None else environ).get(pins.env)
    if named:
        return TrlVenv(Path(named).expanduser().absolute(), f"from {pins.env}", pins)
    beside = repo / f".{pins.folder}"
    if venv_state(beside, pins) == "ready" or _writable(repo):
        return TrlVenv(beside, "beside the repository", pins)
    return TrlVenv(cache_root() / pins.folder, f"{repo} is not writable", pins)


VENV_ENTRIES = {"bin", "include", "lib", "lib64", "share", "pyvenv.cfg"}
"""What ``python -m venv`` and pip put at the top of an environment: a half-made folder holding
anything else is not ours to remove."""


def clear_leftovers(venv: TrlVenv, state: str) -> None:
    """Make room for a new environment at ``venv.path`` (in ``state``): a link that leads to no
    ready environment is removed (its target, maybe not ours, is left alone), a half-made
    environment deleted. A file, or a folder with more than a venv in it, is refused."""
    path = venv.path
    if path.is_symlink():
        path.unlink()
    elif state == "a file" or (state.startswith("half-made") and
                               not all(child.name in VENV_ENTRIES for child in path.iterdir())):
        what = "a file" if state == "a file" else f"{state} but holds more than a virtual environment"
        raise RayppoError(f"TRL {venv.pins.trl}'s environment: {path} ({venv.why}) is {what}; move it, or set "
                          f"{venv.pins.env} to a new folder")
    elif state.startswith("half-made"):
        shutil.rmtree(path)


def install_line(venv: TrlVenv, state: str) -> str:
    """The one line ``ensure_trl_venv`` prints before it installs: where, why, and that it is once."""
    redo = "" if state == "missing" else f"it was {state}, so it is rebuilt: "
    return (f"TRL {venv.pins.trl}'s environment: {venv.path} ({venv.why}): {redo}a one-time install of "
            f"{' '.join(venv.pins.requirements)}, reused by later --compare trl runs")


def ensure_trl_venv(venv: TrlVenv) -> Path:
    """One pinned TRL release (``venv.pins``) in its own virtual environment (TRL pins other
    versions than rayppo): made once where ``choose_trl_venv`` says, remade over a dangling link or
    a half-made install. Returns its python."""
    state = venv.state
    python = venv.path / "bin" / "python"
    if state == "ready":
        return python
    clear_leftovers(venv, state)
    print(install_line(venv, state), file=sys.stderr)
    venv.path.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv.path)], check=True)
    subprocess.run([str(python), "-m", "pip", "install", "--quiet", *venv.pins.requirements], check=True)
    return python
