"""``rayppo pairs`` and ``rayppo reward-model``: preference pairs from a verifier, and r_φ trained
on pairs (docs/reward-models.md).

    rayppo pairs reward.function=my_task:verify data.prompts=prompts.jsonl preference.pairs=pairs.jsonl
    rayppo reward-model preference.pairs=pairs.jsonl output.dir=runs/rm
    rayppo reward-model --config rm.yaml learner.num_ranks=2 model.dtype=bfloat16
    rayppo reward-model --resume runs/rm
    rayppo train reward.model=runs/rm/reward_model model.critic=runs/rm/reward_model
"""

from __future__ import annotations

import argparse

EPILOG = """Reads the preference section (pairs, held-out fraction, epochs, batch, lr) and the learner's
(learner.num_ranks, learner.zero_stage, model.dtype, output.*, cluster.*), e.g.
  rayppo reward-model preference.pairs=pairs.jsonl preference.epochs=2 output.dir=runs/rm
A pair file has columns prompt (text or messages), chosen and rejected (.jsonl, .parquet or a
datasets folder). The trained r_phi is written to output.dir/reward_model, the folder
reward.model= takes. 'rayppo config' lists every field."""


def _command(sub: argparse._SubParsersAction, name: str, text: str, epilog: str) -> argparse.ArgumentParser:
    """A subcommand with ``--config`` and ``--no-progress`` (overrides follow as for ``train``)."""
    command = sub.add_parser(name, help=text, formatter_class=argparse.RawDescriptionHelpFormatter, epilog=epilog)
    command.add_argument("--config", metavar="FILE", help="YAML config file (sections as in 'rayppo config')")
    command.add_argument("--no-progress", action="store_true", help="no progress bar (for logs)")
    return command


def add_parser(sub: argparse._SubParsersAction) -> None:
    rm = _command(sub, "reward-model", "train a reward model r_phi on preference pairs (Bradley-Terry)", EPILOG)
    rm.add_argument("--resume", metavar="DIR", help="continue the reward-model run in DIR from its latest checkpoint")
    rm.add_argument("--verbose", "-v", action="store_true",
                    help="show everything the libraries and actors print (by default: output.dir/logs/)")


PAIRS_EPILOG = """Samples preference.samples_per_prompt responses per prompt of data.prompts from model.policy
(rollout.temperature, rollout.max_new_tokens), scores them with reward.function and writes
preference.pairs: the best-scored response paired with the worst where the verifier prefers it, e.g.
  rayppo pairs data.prompts=arithmetic reward.function=rayppo.tasks.arithmetic:reward \\
      model.policy=smollm2-135m-instruct preference.pairs=runs/pairs.jsonl"""


def add_pairs_parser(sub: argparse._SubParsersAction) -> None:
    pairs = _command(sub, "pairs", "make preference pairs from a verifier: sample k responses per prompt, pair right "
                                   "with wrong", PAIRS_EPILOG)
    pairs.add_argument("--verbose", "-v", action="store_true",
                       help="show everything the libraries print (by default it goes to logs/pairs.log beside "
                            "preference.pairs)")


def cmd_pairs(args: argparse.Namespace, overrides: list[str]) -> int:
    """Exit 0 when done; 130 after a Ctrl-C, 143 after a SIGTERM, the pairs written so far kept."""
    import signal
    import threading
    from pathlib import Path

    from rayppo.config.load import load_config
    from rayppo.config.schema import ConfigError
    from rayppo.console import console
    from rayppo.errors import raise_preempted

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, raise_preempted)  # start-up stops cleanly; the sampling has its own rule
    console.setup(None, args.verbose)
    cfg = load_config(args.config, overrides)
    if not cfg.preference.pairs:
        raise ConfigError("preference.pairs: the file to write is not set (e.g. preference.pairs=pairs.jsonl)")
    if not cfg.reward.function:
        raise ConfigError("reward.function: 'rayppo pairs' labels responses with a verifier function (module:function)")
    from rayppo.cli.setup import build_first_use_models, exit_code, model_and_data, quiet_libraries
    from rayppo.plan.inputs import check_inputs

    check_inputs(cfg)  # the model, the prompts and the verifier, before anything is sampled
    folder = Path(cfg.preference.pairs).parent
    console.setup(folder, args.verbose, log_name="pairs")  # logs/pairs.log beside the pair file
    model, data = model_and_data(cfg)
    log = console.log_file
    logs = f"; the libraries' output to {console.user_path(log)}" if log is not None and not args.verbose else ""
    console.phase(f"rayppo pairs: {model}, {data}, {cfg.preference.samples_per_prompt} samples per prompt -> "
                  f"{cfg.preference.pairs}{logs}")
    quiet_libraries(args.verbose)
    build_first_use_models(cfg, [cfg.model.policy])
    from rayppo.trainers.verifier_pairs import make_verifier_pairs

    with console.captured():  # vLLM's engine runs in this process: its output to the log, as an actor's
        result = make_verifier_pairs(cfg, progress=not args.no_progress)
    print(result.summary())
    return exit_code(result.stop_reason)


def cmd_reward_model(args: argparse.Namespace, overrides: list[str]) -> int:
    from rayppo.config.schema import ConfigError
    from rayppo.console import console

    console.setup(None, args.verbose)
    from rayppo.cli.setup import run_config

    cfg, resume = run_config(args.config, args.resume, overrides)
    if not cfg.preference.pairs:
        raise ConfigError("preference.pairs: the pair file to train on is not set (e.g. preference.pairs=pairs.jsonl)")
    from rayppo.cli.setup import build_first_use_models, quiet_libraries
    from rayppo.models.reward_model import backbone_name
    from rayppo.trainers.reward_model_trainer import prepared_pairs

    quiet_libraries(args.verbose)  # first: building a model saves it (a bar; DeepSpeed's CPU warning)
    build_first_use_models(cfg, [backbone_name(cfg)])
    prepared_pairs(cfg)  # a bad file or row fails here, before the run folder is claimed or a model loads
    if resume is None:
        from rayppo.run.folder import claim_output_dir

        claim_output_dir(cfg)
    console.setup(cfg.output.dir, args.verbose)
    console.phase(f"rayppo reward-model: {backbone_name(cfg)} + a scalar head on {cfg.preference.pairs}, "
                  f"trainer={cfg.trainer}; output {cfg.output.dir}/")
    from rayppo.trainers.reward_model_trainer import train_reward_model

    print(train_reward_model(cfg, progress=not args.no_progress, resume=resume).summary())
    return 0
