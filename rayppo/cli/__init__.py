"""``rayppo`` command line: train, pairs, reward-model, scale, plan, bench, submit, status, logs, stop, config.

    rayppo train                                   # the embedded default, end to end
    rayppo plan --config job.yaml --cluster-resources '{"GPU": 8, "CPU": 64}'   # will it fit?
    rayppo train --config job.yaml ppo.clip_eps=0.1 --rollout.batch_size=128
    rayppo bench --workload tiny --compare trl     # throughput, side by side with TRL
    rayppo submit --address http://head:8265 --config job.yaml --wait   # on a Ray cluster
    rayppo scale runs/exp1 generators.num=4        # a running job's new split, from its next iteration
    rayppo config                                  # every config field, default and meaning
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the commands import their modules when run: `rayppo config` starts without Ray
    from rayppo.cluster.jobs import JobStanding

PLAN_EPILOG = """Estimates each role's peak memory per actor from the models' config.json (no model is
loaded) and checks CPUs, GPUs, per-GPU memory and total RSS against the cluster: exit 0 when it
fits, 2 with one line per missing thing and its fix. Config overrides as for 'rayppo train', e.g.
  rayppo plan --config job.yaml --cluster-resources '{"GPU": 8, "CPU": 64, "memory": 512e9}'
  rayppo plan --address auto --json"""

EPILOG = """overrides: any config field as section.field=value (or --section.field=value), e.g.
  rayppo train ppo.clip_eps=0.1 rollout.max_new_tokens=64 output.dir=runs/exp1
  'rayppo config' lists every field with its default and meaning."""


SCALE_EPILOG = """The running driver takes the request after its current iteration, writes a checkpoint and
resumes from it on the new split in the same process: new generators sample from the next
iteration on (with the same noise per row as before), a new learner split loads the checkpoint
resharded. Fields: learner.num_ranks, learner.zero_stage (1 <-> 2), generators.num,
reference.num, reward.num, and each role's resources (generators.gpus_per_worker,
learner.gpus_per_rank, *.cpus*, *.threads, *.cores, *.resources). E.g.
  rayppo scale runs/exp1 generators.num=4
  rayppo scale runs/exp1 learner.num_ranks=2 generators.num=1"""


def _collect_overrides(extra: list[str]) -> list[str]:
    """Turn ``key=v``, ``--key=v`` and ``--key v`` into ``key=v`` strings."""
    out, i = [], 0
    while i < len(extra):
        item = extra[i]
        if item.startswith("--") and "=" not in item and i + 1 < len(extra):
            out.append(f"{item[2:]}={extra[i + 1]}")
            i += 2
            continue
        out.append(item[2:] if item.startswith("--") else item)
        i += 1
    return out


def _address(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--address", help="Ray dashboard address (default: $RAY_ADDRESS or http://127.0.0.1:8265)")


def _submit_parser(sub: argparse._SubParsersAction) -> None:
    submit = sub.add_parser(
        "submit", help="submit a training (or benchmark) job to a Ray cluster (Ray Jobs API)",
        formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EPILOG,
    )
    _address(submit)
    submit.add_argument("--config", metavar="FILE", help="YAML config file")
    submit.add_argument("--env", action="append", default=[], metavar="KEY=VALUE", help="environment variable for the job")
    submit.add_argument("--bench", metavar="WORKLOAD", help="run `rayppo bench --workload WORKLOAD` instead of training")
    submit.add_argument("--no-ship-code", action="store_true",
                        help="use the rayppo installed on the cluster instead of shipping this checkout's")
    submit.add_argument("--working-dir", default=".", metavar="DIR",
                        help="project folder shipped as the job's working directory: your reward module, prompt "
                             "files, configs (default: the current directory; .git, venvs, runs/ and what "
                             ".gitignore/.rayignore exclude stay behind)")
    submit.add_argument("--no-working-dir", action="store_true", help="ship only job.yaml (and the code)")
    submit.add_argument("--job-id", help="submission id (default: generated)")
    submit.add_argument("--wait", action="store_true", help="follow the logs until the job ends; exit 0 only on success")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rayppo", description="PPO for language models on the token-level MDP.",
        formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EPILOG,
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    train = sub.add_parser(
        "train", help="train a policy with PPO (the embedded default when given nothing)",
        formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EPILOG,
    )
    train.add_argument("--config", metavar="FILE", help="YAML config file (sections as in 'rayppo config')")
    train.add_argument("--no-progress", action="store_true", help="no progress bar (for logs)")
    train.add_argument("--verbose", "-v", action="store_true",
                       help="show everything the libraries and actors print (by default it goes to "
                            "output.dir/logs/: driver.log and <role>-<i>.log)")
    train.add_argument("--resume", metavar="DIR", help="continue the run in DIR from its latest checkpoint, with "
                                                        "DIR's config (overrides may change resources, stop.*, "
                                                        "output.* and cluster.*)")
    scale = sub.add_parser(
        "scale", help="change a running job's split over actors (generators.num, learner.num_ranks, ...) from "
                      "its next iteration",
        formatter_class=argparse.RawDescriptionHelpFormatter, epilog=SCALE_EPILOG,
    )
    scale.add_argument("run_dir", metavar="DIR", help="the run's folder (its output.dir)")
    scale.add_argument("changes", nargs="*", metavar="FIELD=VALUE", help="the new split, e.g. generators.num=4")
    plan = sub.add_parser(
        "plan", help="pre-flight: will the job fit? actors, CPUs/GPUs, placement group and peak memory per role",
        formatter_class=argparse.RawDescriptionHelpFormatter, epilog=PLAN_EPILOG,
    )
    plan.add_argument("--config", metavar="FILE", help="YAML config file (as for 'rayppo train')")
    plan.add_argument("--address", help="Ray cluster to read the resources of (as cluster.address: auto, "
                                        "ray://host:10001, host:6379); default: cluster.address, else $RAY_ADDRESS "
                                        "(host:port), else this machine")
    plan.add_argument("--cluster-resources", metavar="JSON",
                      help='the cluster\'s resources instead of connecting, e.g. \'{"GPU": 8, "CPU": 64, "memory": 512e9}\' '
                           "(memory in bytes; custom resources by name)")
    plan.add_argument("--gpu-memory-gib", type=float, metavar="GIB",
                      help="memory of one GPU (default: from the connected cluster's accelerator type, else 80)")
    plan.add_argument("--prompt-tokens", type=int, metavar="N",
                      help="longest prompt in tokens (default: the longest of data.prompts by the policy's "
                           "tokenizer; the embedded prompts' for the embedded model; else max_model_len - "
                           "rollout.max_new_tokens)")
    plan.add_argument("--json", action="store_true", help="print the plan as JSON")
    bench = sub.add_parser(
        "bench", help="throughput benchmark of a named workload (optionally against TRL)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="workloads are defined in benchmarks/workloads.yaml; extra section.field=value overrides apply on top",
    )
    bench.add_argument("--workload", default="tiny",
                       help="workload name (tiny, small, smollm2-grpo-bf16, smollm2-distill, gpu-0.5b, ...)")
    bench.add_argument("--compare", choices=["trl"],
                       help="also run TRL on the identical workload (its PPO, GRPO or DistillationTrainer)")
    bench.add_argument("--output", default="runs/bench", metavar="DIR", help="where bench.json and plots go")
    bench.add_argument("--warmup", type=int, help="warm-up iterations (default: the workload's)")
    bench.add_argument("--iters", type=int, help="measured iterations (default: the workload's)")
    bench.add_argument("--sweep", nargs="+", default=[], metavar="KEY=V1,V2",
                       help="scaling sweep, e.g. --sweep generators.num=1,2 learner.num_ranks=1,2; keys that move "
                            "together: --sweep learner.num_ranks:learner.threads=1:2,2:1")
    bench.add_argument("--skip-alone", action="store_true", help="do not measure the stages alone")
    bench.add_argument("--verbose", "-v", action="store_true",
                       help="show the libraries' output here too (by default it goes to DIR/logs/)")
    _submit_parser(sub)
    from rayppo.cli.preference_commands import add_pairs_parser
    from rayppo.cli.preference_commands import add_parser as add_reward_model

    add_pairs_parser(sub)
    add_reward_model(sub)
    for name, text in (("status", "show a job's status (no JOB: list the cluster's jobs; a run folder: where that "
                                  "run stands, its generator fleet included)"),
                       ("logs", "print a job's logs"), ("stop", "stop a running job")):
        job = sub.add_parser(name, help=text)
        optional: dict[str, Any] = {"nargs": "?"} if name == "status" else {}
        job.add_argument("job_id", metavar="JOB", **optional)
        _address(job)
        if name == "logs":
            job.add_argument("--follow", "-f", action="store_true", help="keep printing until the job ends")
    config = sub.add_parser("config", help="print every config field with its default and meaning")
    shape = config.add_mutually_exclusive_group()
    shape.add_argument("--yaml", action="store_true", help="print the defaults as a YAML file instead")
    shape.add_argument("--markdown", action="store_true",
                       help="print the reference page of the docs (docs/config.md) instead")
    return parser


def cmd_train(args: argparse.Namespace, overrides: list[str]) -> int:
    from rayppo.console import console
    from rayppo.errors import RayppoError, raise_preempted
    from rayppo.plan.inputs import check_inputs
    from rayppo.run.tracking import check_trackers

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, raise_preempted)  # start-up stops cleanly; the loop has its own rule
    console.setup(None, args.verbose)  # warnings of the checks below, before the run folder exists
    from rayppo.cli.setup import run_config

    cfg, resume = run_config(args.config, args.resume, overrides)
    check_inputs(cfg)  # models, prompts, reward function: before anything heavy is imported
    check_trackers(cfg)
    if cfg.trainer == "distributed":
        from rayppo.plan.fit import preflight

        missing = preflight(cfg)  # before any process starts; 'rayppo plan' shows memory too
        if missing:
            raise RayppoError("this job does not fit: " + "; ".join(missing))
    if resume is None:
        from rayppo.run.folder import claim_output_dir

        claim_output_dir(cfg)  # one run per folder (output.overwrite to replace it)
    console.setup(cfg.output.dir, args.verbose)
    console.phase(_headline(cfg, resume))
    from rayppo.cli.setup import build_first_use_models, exit_code, quiet_libraries

    quiet_libraries(args.verbose)  # first: building a model saves it, which draws a bar and imports DeepSpeed
    build_first_use_models(cfg, [cfg.model.policy, cfg.model.reference])
    from rayppo.train import train

    result = train(cfg, progress=not args.no_progress, resume=resume)
    print(result.summary())
    return exit_code(result.stop_reason)


def _headline(cfg, resume) -> str:
    """``rayppo train: 40 iterations of 64 prompts (embedded task) -> runs/default``."""
    from rayppo.cli.setup import model_and_data

    model, data = model_and_data(cfg)
    what = f"resuming {resume.parent.parent}" if resume is not None else f"output {cfg.output.dir}/"
    n = cfg.rollout.samples_per_prompt
    groups = f" x {n} samples" if n > 1 else ""
    estimator = f", ppo.advantage={cfg.ppo.advantage}" if cfg.ppo.advantage != "gae" else ""
    return (f"rayppo train: {model}, {data}, {cfg.stop.iterations} iterations of {cfg.rollout.batch_size} prompts"
            f"{groups}{estimator}, trainer={cfg.trainer}; {what}")


def cmd_scale(args: argparse.Namespace, overrides: list[str]) -> int:
    from rayppo.run.scale import request_scale

    said = request_scale(args.run_dir, _collect_overrides(args.changes) + overrides)
    print(f"rayppo scale: {said} in {args.run_dir}, from the next iteration its driver starts (a checkpoint, then "
          f"a resume on the new split)")
    return 0


def cmd_plan(args: argparse.Namespace, overrides: list[str]) -> int:
    """Print the plan; exit 0 when the job fits, 2 with one line per missing thing."""
    import json

    from rayppo.config.load import load_config
    from rayppo.plan import fit as plan

    cfg = load_config(args.config, overrides)
    available, source = plan.cluster_resources(cfg, args.address, args.cluster_resources)
    gib = args.gpu_memory_gib or plan.accelerator_gib(available) or 80.0
    result = plan.make_plan(cfg, available, source, gib, args.prompt_tokens)
    print(json.dumps(plan.plan_json(cfg, result), indent=1) if args.json else plan.render(cfg, result))
    return 0 if not result.missing else 2


def cmd_bench(args: argparse.Namespace, overrides: list[str]) -> int:
    """Runs ``benchmarks/bench.py`` of this source checkout (benchmarks are not installed)."""
    import importlib.util

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "bench.py"
    if not path.is_file():
        print(f"rayppo: error: {path} not found: rayppo bench runs from a source checkout", file=sys.stderr)
        return 2
    from rayppo.console import console

    console.setup(args.output, args.verbose)  # as for train: the libraries' output to DIR/logs/
    from rayppo.cli.setup import quiet_libraries

    quiet_libraries(args.verbose)
    spec = importlib.util.spec_from_file_location("rayppo_benchmarks", path)
    assert spec is not None and spec.loader is not None  # a .py file: its source loader is found
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    module.run(args.workload, args.output, args.compare, args.warmup, args.iters, args.sweep, overrides, args.skip_alone)
    return 0


def cmd_submit(args: argparse.Namespace, overrides: list[str]) -> int:
    from rayppo.cluster import jobs
    from rayppo.config.load import load_config
    from rayppo.config.schema import ConfigError

    cfg = load_config(args.config, overrides)  # checked here, before anything reaches the cluster
    env = {}
    for item in args.env:
        if "=" not in item:
            raise ConfigError(f"--env {item!r}: expected KEY=VALUE")
        key, value = item.split("=", 1)
        env[key] = value

    note = jobs.pin_output_dir(cfg)
    if note:
        print(note)
    with jobs.answered(args.address):
        shipment = jobs.Shipment(env, ship_code=not args.no_ship_code, bench=args.bench, submission_id=args.job_id,
                                 working_dir=None if args.no_working_dir else Path(args.working_dir))
        job_id = jobs.submit(cfg, args.address, shipment)
        print(f"submitted {job_id}")
        if not args.wait:
            print(f"follow it with: rayppo logs {job_id} --follow   (status: rayppo status {job_id})")
            return 0
        final = jobs.wait(job_id, args.address)
    print(f"job {job_id}: {final}; its outputs: {cfg.output.dir}/")
    return 0 if final == "SUCCEEDED" else 1


def _job_status(standing: JobStanding) -> str:
    """A job's state, and where its run stands when its folder is readable here (``rayppo status
    DIR``'s lines: iterations, the generator fleet, the latest checkpoint). Put together here: the
    cluster's jobs may not import the run's status, a floor above them."""
    from rayppo.errors import RayppoError
    from rayppo.run.status import run_status

    try:
        lines = run_status(standing.run_dir) if standing.run_dir else []
    except (RayppoError, OSError):  # not started yet, or on storage this machine does not see
        lines = []
    return "\n".join([standing.state, *(f"  {line}" for line in lines)])


def cmd_job(args: argparse.Namespace) -> int:
    if args.command == "status" and args.job_id and Path(args.job_id).is_dir():  # a run folder, not a job
        from rayppo.run.status import run_status

        print("\n".join(run_status(args.job_id)))
        return 0
    from rayppo.cluster import jobs

    with jobs.answered(args.address):
        if args.command == "status" and args.job_id is None:
            print("\n".join(jobs.list_jobs(args.address)) or "no jobs on this cluster")
        elif args.command == "status":
            print(f"{args.job_id}: {_job_status(jobs.status(args.job_id, args.address))}")
        elif args.command == "logs":
            jobs.logs(args.job_id, args.address, args.follow)
        else:
            print(f"{args.job_id}: {jobs.stop(args.job_id, args.address)}")
    return 0


def cmd_config(args: argparse.Namespace) -> int:
    from rayppo.config.schema import Config, field_docs, to_dict

    if args.yaml:
        import yaml

        print(yaml.safe_dump(to_dict(Config()), sort_keys=False), end="")
        return 0
    if args.markdown:
        from rayppo.config.reference_page import reference_markdown

        print(reference_markdown(), end="")
        return 0
    for name, default, doc in field_docs():
        print(f"{name} = {default}\n    {doc}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Exit 0 on success; 2 with one line ``rayppo: error: ...`` naming the problem for every
    bad input (``RayppoError``), with no traceback; 130 after a Ctrl-C, 143 after a SIGTERM."""
    from rayppo.errors import RayppoError  # nothing heavy: errors are caught before any import below

    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if args.command in ("config", "status", "logs", "stop") and extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    from rayppo.cli.preference_commands import cmd_pairs, cmd_reward_model

    commands = {"train": cmd_train, "scale": cmd_scale, "plan": cmd_plan, "bench": cmd_bench, "submit": cmd_submit,
                "pairs": cmd_pairs, "reward-model": cmd_reward_model}
    try:
        if args.command in commands:
            return commands[args.command](args, _collect_overrides(extra))
        if args.command in ("status", "logs", "stop"):
            return cmd_job(args)
        return cmd_config(args)
    except RayppoError as exc:
        print(f"rayppo: error: {_one_line(exc)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:
        from rayppo.errors import PreemptedError

        preempted = isinstance(exc, PreemptedError)
        print(f"rayppo: {'terminated (SIGTERM)' if preempted else 'interrupted'}", file=sys.stderr)
        return 143 if preempted else 130
    except BrokenPipeError:  # `rayppo config | head`: the reader has gone, nothing to say
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
        return 0
    finally:
        if "rayppo.console" in sys.modules:
            sys.modules["rayppo.console"].console.close()


def _one_line(exc: BaseException) -> str:
    """The message on one line. An error raised in an actor reaches the driver wrapped in Ray's
    ``RayTaskError(RewardError)``, whose text is Ray's header (``ray::RewardEngine.scores() (pid=...,
    actor_id=...)``, colour codes) and the remote traceback: only the original exception's own
    message is kept."""
    from rayppo.errors import plain, unwrapped

    return plain(str(unwrapped(exc)))

