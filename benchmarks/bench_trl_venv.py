"""TRL's own virtual environment for ``rayppo bench --compare trl``: where it goes, whether it is
ready, how a half-made one is cleared, and its one install (``ensure_trl_venv``). TRL's pinned
torch must not replace rayppo's, so the comparison runs in an environment of its own."""

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
TRL_REQUIREMENTS = ["torch==2.13.0", "trl==1.12.0", "requests==2.34.2"]  # GRPOTrainer imports requests (its vLLM client)
TRL_VENV_ENV = "RAYPPO_TRL_VENV"
"""Names the folder of TRL's virtual environment, over the default choice (``choose_trl_venv``)."""


def venv_state(path: Path) -> str:
    """What ``path`` holds, as a TRL environment: ``ready`` (bin/python and TRL_REQUIREMENTS' exact
    versions installed), ``missing``, ``a dangling symlink``, ``a file`` or ``half-made (...)``
    (an interrupted or failed install: pip writes a package's dist-info last)."""
    if path.is_symlink() and not path.exists():
        return "a dangling symlink"
    if not path.exists():
        return "missing"
    if not path.is_dir():
        return "a file"
    if not (path / "bin" / "python").exists():
        return "half-made (no bin/python)"
    sites = list(path.glob("lib/python*/site-packages"))
    for name, version in (r.split("==") for r in TRL_REQUIREMENTS):
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
    """Where TRL's virtual environment lives, and why there."""

    path: Path
    why: str

    @property
    def state(self) -> str:
        return venv_state(self.path)


def choose_trl_venv(repo: Path = HERE.parent, environ: dict[str, str] | None = None) -> TrlVenv:
    """``RAYPPO_TRL_VENV`` when set; else ``.venv-trl`` beside the repository when it is ready or
    the repository folder is writable; else ``venv-trl`` in rayppo's cache (``cache_root``)."""
    named = (os.environ if environ is None else environ).get(TRL_VENV_ENV)
    if named:
        return TrlVenv(Path(named).expanduser().absolute(), f"from {TRL_VENV_ENV}")
    beside = repo / ".venv-trl"
    if venv_state(beside) == "ready" or _writable(repo):
        return TrlVenv(beside, "beside the repository")
    return TrlVenv(cache_root() / "venv-trl", f"{repo} is not writable")


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
        raise RayppoError(f"TRL's environment: {path} ({venv.why}) is {what}; move it, or set {TRL_VENV_ENV} to "
                          "a new folder")
    elif state.startswith("half-made"):
        shutil.rmtree(path)


def install_line(venv: TrlVenv, state: str) -> str:
    """The one line ``ensure_trl_venv`` prints before it installs: where, why, and that it is once."""
    redo = "" if state == "missing" else f"it was {state}, so it is rebuilt: "
    return (f"TRL's environment: {venv.path} ({venv.why}): {redo}a one-time install of {' '.join(TRL_REQUIREMENTS)}, "
            "reused by later --compare trl runs")


def ensure_trl_venv(venv: TrlVenv | None = None) -> Path:
    """TRL's pinned release in its own virtual environment (TRL pins other versions than rayppo):
    made once where ``choose_trl_venv`` says, remade over a dangling link or a half-made install.
    Returns its python."""
    venv = venv or choose_trl_venv()
    state = venv.state
    python = venv.path / "bin" / "python"
    if state == "ready":
        return python
    clear_leftovers(venv, state)
    print(install_line(venv, state), file=sys.stderr)
    venv.path.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv.path)], check=True)
    subprocess.run([str(python), "-m", "pip", "install", "--quiet", *TRL_REQUIREMENTS], check=True)
    return python
