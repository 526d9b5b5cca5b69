"""What every command that loads models does first: built-in models built once, and the
libraries' own output kept to the log files."""

from __future__ import annotations


def build_first_use_models(cfg, names: list[str]) -> None:
    """Built-in models and GGUF files become folders here, once, before any actor loads them
    (each says so on the terminal; later runs find them in ``model.cache_dir``)."""
    from rayppo.console import console
    from rayppo.models.paths import BUILTIN_MODELS, built_on_first_use, embedded_path

    for name in dict.fromkeys(names):
        if not built_on_first_use(name) or (embedded_path(cfg.model.cache_dir, name) / "config.json").is_file():
            continue
        what = (BUILTIN_MODELS[name].first_use if name in BUILTIN_MODELS
                else "the GGUF file dequantized to fp32 safetensors, with its tokenizer")
        console.phase(f"building the {name} model in {embedded_path(cfg.model.cache_dir, name)} (first use only: {what})")
        from rayppo.models.loading import resolve_model_path

        resolve_model_path(name, cfg.model.cache_dir)


def quiet_libraries(verbose: bool) -> None:
    """transformers' per-file progress bars off (one progress bar per run: "Writing model shards"
    at every save) and, unless verbose, its advisory warnings to the log file instead of the
    terminal; DeepSpeed told it runs on the CPU where no GPU is. Called before any model is built or
    loaded: saving one imports DeepSpeed (through accelerate), which on its first use warns on
    stdout, through a handler of its own, that it fell back to the CPU."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    import os

    import torch

    if not torch.cuda.is_available():  # read by DeepSpeed's get_accelerator, instead of its warning
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    if not verbose:
        hf_logging.disable_default_handler()
        hf_logging.enable_propagation()  # to the root logger: logs/driver.log


def run_config(config_file: str | None, resume: str | None, overrides: list[str]):  # noqa: ANN201 - (Config, Path | None)
    """``(config, checkpoint)`` of a command that starts a run or, with ``--resume DIR``,
    continues one from its latest checkpoint with DIR's own config (``overrides`` on top)."""
    from rayppo.config.load import load_config
    from rayppo.config.schema import ConfigError

    if not resume:
        return load_config(config_file, overrides), None
    if config_file:
        raise ConfigError("--resume takes the run's own config; use overrides, not --config")
    from rayppo.run.checkpoint import resume_config

    return resume_config(resume, overrides)


def model_and_data(cfg) -> tuple[str, str]:  # noqa: ANN001 - Config (imported lazily by the commands)
    """How a command's headline names the policy and the prompts (``embedded model``, ``embedded task``)."""
    model = "embedded model" if cfg.model.policy == "embedded" else cfg.model.policy
    return model, "embedded task" if cfg.data.prompts == "embedded" else cfg.data.prompts


def exit_code(stop_reason: str) -> int:
    """A command's exit status: 130 after a Ctrl-C, 143 after a SIGTERM (128 + the signal, as shells
    report), else 0."""
    return {"interrupted": 130, "preempted": 143}.get(stop_reason, 0)
