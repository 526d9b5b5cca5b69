"""``rayppo bench``'s report: the summary of a run (``summarize``: tokens per second, stage times,
idle shares, the learner's FLOP rate, TRL's figures beside), its table and its plots."""

from __future__ import annotations

import json
import os
import statistics
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from rayppo.config.derived import batch_rows, lora_sync, weight_sync_backend
from rayppo.config.schema import Config


def length_stats(rollout) -> dict[str, float]:
    """The measured batch's response lengths: mean, p50, p90, max, and the share cut at the cap."""
    lengths = sorted(len(r) for r in rollout.response_ids)
    n = len(lengths)
    return {"mean": sum(lengths) / n, "p50": lengths[n // 2], "p90": lengths[min(n - 1, int(0.9 * n))],
            "max": lengths[-1], "truncated_share": sum(r == "length" for r in rollout.finish_reason) / n}


def stage_tokens(cfg: Config, rollout, learn: dict[str, float]) -> dict[str, dict[str, float]]:
    """Per stage, the real tokens of the measured batch against the tokens its passes process,
    padding included (``processed / real`` is what padding costs): the reference and reward passes
    as their engines cut them (``data.micro_batches.scoring_batches``), the learner as it counted
    (``tokens/learn_*``, every epoch). Generation pads nothing (vLLM's paged KV cache)."""
    from rayppo.data.micro_batches import padded_tokens, scoring_batches
    from rayppo.models.loading import resolve_model_path
    from rayppo.models.packing import cut_layout, scoring_layout

    prompt, response = rollout.lengths()
    whole = [a + b for a, b in zip(prompt, response)]
    none = [0] * len(whole)  # the reward model scores each text whole (re-tokenised; here the same tokenizer)
    reward = scoring_batches(none, whole, cfg.reward.micro_batch_tokens, cfg.reward.batch_size)
    # The reference engine's layout (``ReferenceEngine.layout``): right-padded rows cost their whole
    # sequence, packed ones (varlen, flash-attention's one row) their real tokens.
    reference_config = resolve_model_path(cfg.model.reference or cfg.model.policy) / "config.json"
    mode = scoring_layout(SimpleNamespace(**json.loads(reference_config.read_text())))
    layout = mode or "padded"
    before, after = (none, whole) if mode else (prompt, response)  # the lengths a pass cuts at
    reference = scoring_batches(before, after, cfg.reference.micro_batch_tokens, 64, cut_layout(mode))
    packed = cut_layout(mode) == "packed"  # a pass processes its real tokens
    out = {"generate": {"real": sum(response), "processed": sum(response)},
           "reference": {"real": sum(whole), "processed": sum(whole) if packed else padded_tokens(before, after, reference),
                         "layout": layout},
           "reward": {"real": sum(whole), "processed": padded_tokens(none, whole, reward)}}
    if "tokens/learn_real" in learn:
        out["learn"] = {"real": learn["tokens/learn_real"], "processed": learn["tokens/learn_processed"],
                        "layout": "packed" if learn.get("tokens/learn_packed") else
                                  "right_padded" if learn.get("tokens/learn_right_padded") else "padded"}
    return {stage: t | {"padding_factor": t["processed"] / max(t["real"], 1)} for stage, t in out.items()}


def _mmm(values: list[float]) -> dict[str, float]:
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def _overlap_bound(col: dict[str, list[float]], learn_factor: float = 1.0) -> dict[str, Any]:
    """What overlapping the stages (``rollout.max_staleness`` >= 1) can buy at best, from this
    run's stage times, when every role has its own device: the iteration shrinks to its busiest
    role's seconds. ``overlap_bound`` is that speed-up; ``idle_floor`` each role's idle share
    then (a role faster than the busiest one waits for it however the work is scheduled).
    ``learn_factor`` scales the learner's seconds: measured synchronously, by the pi_prox pass
    that asynchronous mode adds (``proximal_flops_ratio``)."""
    busy = {s: statistics.median(col[f"time/{s}"]) for s in ("generate", "reference", "reward", "learn")}
    busy["learn"] *= learn_factor
    busiest = max(busy, key=lambda stage: busy[stage])
    return {"overlap_bound": statistics.median(col["time/iteration"]) / busy[busiest], "busiest_stage": busiest,
            "idle_floor": {"generators": 1 - busy["generate"] / busy[busiest],
                           "learners": 1 - busy["learn"] / busy[busiest]}}


STAGES = ("generate", "reference", "reward", "learn")


def stage_rates(arithmetic: dict[str, Any], seconds: dict[str, float]) -> dict[str, Any]:
    """Per stage that ran a model (GFLOP > 0, seconds > 0): ``stage_gflop_per_s`` (its useful
    GFLOP over its median seconds) and ``stage_mfu`` (that over ``matmul_gflop_per_s``, the rate
    measured at the start); the learner's also as ``learn_gflop_per_s`` and ``learn_efficiency``."""
    gflop = arithmetic.get("stage_gflop") or {"learn": arithmetic["learn_gflop"]}
    per_s = {s: g / seconds[s] for s, g in gflop.items() if g > 0 and seconds.get(s, 0) > 0}
    mfu = {s: r / arithmetic["matmul_gflop_per_s"] for s, r in per_s.items()}
    return {"stage_gflop": gflop, "stage_gflop_per_s": per_s, "stage_mfu": mfu,
            "learn_gflop_per_s": per_s["learn"], "learn_efficiency": mfu["learn"]}


def summarize(name: str, cfg: Config, records: list[dict[str, float]], memory: dict[str, int],
              alone: dict[str, float] | None, trl: list[dict[str, float]] | None,
              estimate: dict[str, int] | None = None, arithmetic: dict[str, float] | None = None,
              rollout=None) -> dict[str, Any]:
    """The figures of one benchmark run (bench.json). Token rates count real response tokens
    (rows x mean length per iteration), never padding; TRL's samples the same model, so its
    lengths follow the same distribution and its rate uses the same count."""
    col = {k: [r[k] for r in records] for k in records[0]}
    real = [batch_rows(cfg) * length for length in col["response/length_mean"]]  # rows = prompts x samples
    tokens = statistics.median(real)
    per_iteration = [
        {"iteration_s": r["time/iteration"], "generate_s": r["time/generate"], "reference_s": r["time/reference"],
         "reward_s": r["time/reward"], "learn_s": r["time/learn"], "sync_s": r["time/sync"],
         "generator_idle_s": r["time/iteration"] - r["time/generate"],
         "learner_idle_s": r["time/iteration"] - r["time/learn"], "response_tokens": t}
        for r, t in zip(records, real)
    ]
    iteration = statistics.median(col["time/iteration"])
    # A synchronous run's learner lacks the pi_prox pass that overlapping would add to it.
    learn_factor = (arithmetic or {}).get("proximal_flops_ratio", 1.0) if cfg.rollout.max_staleness == 0 else 1.0
    out: dict[str, Any] = {
        "workload": name,
        "machine": f"{os.cpu_count()} CPU cores" + (f", {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ""),
        "tokens_per_iteration": tokens,
        "end_to_end_tokens_per_s": statistics.median(t / i for t, i in zip(real, col["time/iteration"])),
        "iteration_s": _mmm(col["time/iteration"]),
        "stage_s": {s: _mmm(col[f"time/{s}"]) for s in ("generate", "reference", "reward", "learn", "sync")},
        # A stage that did not run (no reference at ppo.kl_coef = 0) has no rate.
        "stage_tokens_per_s": {s: tokens / statistics.median(col[f"time/{s}"]) for s in STAGES
                               if statistics.median(col[f"time/{s}"]) > 0},
        "idle_s": {"generators": _mmm([p["generator_idle_s"] for p in per_iteration]),
                   "learners": _mmm([p["learner_idle_s"] for p in per_iteration])},
        # Shares of the iteration each role waited (the asynchronous pipeline's goal: both small).
        "idle_share": {"generators": statistics.median(p["generator_idle_s"] / p["iteration_s"] for p in per_iteration),
                       "learners": statistics.median(p["learner_idle_s"] / p["iteration_s"] for p in per_iteration)},
        **_overlap_bound(col, learn_factor),
        "weight_sync": weight_sync_backend(cfg) or "object_store",
        "lora_sync": lora_sync(cfg)[0],  # none without LoRA, adapter or merged
        "sync_bytes": col["sync/bytes"][-1],
        # How far the generators' log-probs are from the learner's, every token of every measured iteration.
        "logprob_mismatch": {"max": max(col["logprob_mismatch/max"]), "mean": statistics.fmean(col["logprob_mismatch/mean"])}
        if "logprob_mismatch/max" in col else None,
        "sync_gb_per_s": statistics.median(b / max(t, 1e-9) / 1e9 for b, t in zip(col["sync/bytes"], col["time/sync"])),
        "sync_share": statistics.median(s / i for s, i in zip(col["time/sync"], col["time/iteration"])),
        # The correctness guard's weight check, as a share of the sync it checks (included in it).
        "sync_verify_share": statistics.median(v / s for v, s in zip(col["time/sync_verify"], col["time/sync"])),
        "peak_memory_bytes": memory,
        "per_iteration": per_iteration,
    }
    if rollout is not None:
        out["lengths"] = length_stats(rollout)
        out["stage_tokens"] = stage_tokens(cfg, rollout, records[-1])
    if estimate:  # the pre-flight plan against what was measured, per role
        out["plan_estimate_bytes"] = estimate
        out["plan_ratio"] = {role: estimate[role] / memory[role] for role in memory if role in estimate}
    if arithmetic:  # each stage's achieved rate against a matmul's, measured on the learner's threads
        out |= arithmetic | stage_rates(arithmetic, {s: statistics.median(col[f"time/{s}"]) for s in STAGES})
    if alone:
        limit = alone["generate"] + max(alone["reference"], alone["reward"]) + alone["learn"]
        out["stages_alone_s"] = alone
        out["overhead_ratio"] = iteration / limit
    if trl:
        walls = [t["wall_s"] for t in trl]
        without_gc = [t["wall_s"] - t["gc_s"] for t in trl]
        out["trl_iteration_s"] = _mmm(walls)
        out["trl_gc_s"] = statistics.median(t["gc_s"] for t in trl)
        out["trl_end_to_end_tokens_per_s"] = tokens / statistics.median(walls)
        out["trl_without_gc_tokens_per_s"] = tokens / statistics.median(without_gc)
        out["ratio_vs_trl"] = out["end_to_end_tokens_per_s"] / out["trl_end_to_end_tokens_per_s"]
        out["ratio_vs_trl_without_gc"] = out["end_to_end_tokens_per_s"] / out["trl_without_gc_tokens_per_s"]
        out["trl_trainer"] = "GRPOTrainer" if cfg.ppo.advantage == "grpo" else "PPOTrainer"
    return out


def print_table(s: dict[str, Any]) -> None:
    def row(label: str, v: dict[str, float]) -> str:
        return f"  {label:<18}{v['min']:>9.3f}{v['median']:>9.3f}{v['max']:>9.3f}"

    print(f"\nworkload {s['workload']} ({s['machine']}), {s['tokens_per_iteration']:,.0f} generated tokens per iteration")
    if "lengths" in s:
        n = s["lengths"]
        print(f"  response lengths     mean {n['mean']:.1f}, p50 {n['p50']}, p90 {n['p90']}, max {n['max']}, "
              f"{100 * n['truncated_share']:.0f}% cut at the cap")
        print("  processed / real     " + ", ".join(f"{k} {v['padding_factor']:.2f}x" + (" (packed)" if v.get("packed") else "")
                                                   for k, v in s["stage_tokens"].items()))
    print(f"  {'seconds':<18}{'min':>9}{'median':>9}{'max':>9}")
    print(row("iteration", s["iteration_s"]))
    for stage, v in s["stage_s"].items():
        print(row(stage, v))
    print(row("generators idle", s["idle_s"]["generators"]))
    print(row("learners idle", s["idle_s"]["learners"]))
    print(f"  idle share           generators {100 * s['idle_share']['generators']:.0f}%, "
          f"learners {100 * s['idle_share']['learners']:.0f}% of the iteration")
    print(f"  overlap bound        {s['overlap_bound']:.2f}x: every role on its own device, the iteration "
          f"could shrink to its busiest stage ({s['busiest_stage']}); idle shares then at least generators "
          f"{100 * s['idle_floor']['generators']:.0f}%, learners {100 * s['idle_floor']['learners']:.0f}%")
    print(f"  end-to-end tokens/s  {s['end_to_end_tokens_per_s']:,.0f}")
    print_stages(s)
    lora = f", LoRA {s['lora_sync']}" if s.get("lora_sync", "none") != "none" else ""
    print(f"  weight sync ({s['weight_sync']}{lora}) {s['sync_bytes'] / 1e6:.1f} MB/iteration, {s['sync_gb_per_s']:.2f} GB/s, "
          f"{100 * s['sync_share']:.1f}% of the iteration; its weight check {100 * s['sync_verify_share']:.0f}% of the sync")
    if s.get("logprob_mismatch"):
        print(f"  log-prob mismatch    max {s['logprob_mismatch']['max']:.2e}, mean {s['logprob_mismatch']['mean']:.2e} nats "
              "(generators against the learner)")
    print("  peak memory (RSS)    " + ", ".join(f"{k} {v / 2**30:.2f} GiB" for k, v in s["peak_memory_bytes"].items()))
    if "plan_ratio" in s:
        print("  rayppo plan's guess  " + ", ".join(f"{k} {s['plan_estimate_bytes'][k] / 2**30:.2f} GiB ({r:.2f}x)"
                                                   for k, r in s["plan_ratio"].items()))
    if "learn_efficiency" in s:
        print(f"  learner arithmetic   {s['learn_gflop']:,.0f} GFLOP in {s['stage_s']['learn']['median']:.1f} s = "
              f"{s['learn_gflop_per_s']:.0f} GFLOP/s; a {' x '.join(map(str, s['matmul_shape']))} "
              f"{s.get('matmul_dtype', '')} matmul on {s.get('matmul_device', 'cpu')} {s['matmul_gflop_per_s']:.0f} GFLOP/s "
              f"-> learn_efficiency {s['learn_efficiency']:.2f}")
        print("  (learn_efficiency: the learner's FLOP rate over a plain matmul's on the same threads, its MFU above; "
              "1.0 is the machine's arithmetic limit)")
    if "overhead_ratio" in s:
        alone = s["stages_alone_s"]
        print("  stages alone         " + ", ".join(f"{k} {v:.3f} s" for k, v in alone.items())
              + f"  -> overhead ratio {s['overhead_ratio']:.2f}")
    if "ratio_vs_trl" in s:
        release = ".".join(s.get("trl_version", "1.12").split(".")[:2])  # bench.json from before: 1.12
        trl = f"TRL {release} {s.get('trl_trainer', 'PPOTrainer')}"
        print(f"  {trl:<21}{s['trl_end_to_end_tokens_per_s']:,.0f} tokens/s "
              f"(iteration {s['trl_iteration_s']['median']:.3f} s, of which gc.collect {s['trl_gc_s']:.3f} s)")
        print(f"  rayppo / TRL         {s['ratio_vs_trl']:.2f}x as shipped, "
              f"{s['ratio_vs_trl_without_gc']:.2f}x against TRL without its gc.collect calls")


def print_stages(s: dict[str, Any]) -> None:
    """Per stage: median seconds, generated tokens/s, achieved GFLOP/s and MFU (where measured)."""
    gflop_per_s, mfu = s.get("stage_gflop_per_s", {}), s.get("stage_mfu", {})
    print(f"  {'stage':<18}{'seconds':>9}{'tokens/s':>11}{'GFLOP/s':>10}{'MFU':>7}")
    for stage in STAGES:
        rate = f"{gflop_per_s[stage]:>10,.1f}{mfu[stage]:>7.2f}" if stage in mfu else f"{'-':>10}{'-':>7}"
        tokens = s["stage_tokens_per_s"].get(stage)
        print(f"  {stage:<18}{s['stage_s'][stage]['median']:>9.3f}{'-' if tokens is None else f'{tokens:,.0f}':>11}{rate}")


def print_sweep(points: list[dict[str, Any]]) -> None:
    """One line per sweep point: tokens/s, speed-up over the first point, idle shares."""
    print(f"\n  {'point':<36}{'tokens/s':>10}{'speed-up':>10}{'gen idle':>10}{'learn idle':>11}")
    for p in points:
        label = " ".join(f"{k}={v}" for k, v in p["point"].items())
        print(f"  {label:<36}{p['end_to_end_tokens_per_s']:>10,.0f}{p['speedup_vs_first']:>9.2f}x"
              f"{100 * p['idle_share']['generators']:>9.0f}%{100 * p['idle_share']['learners']:>10.0f}%")


def plot_stages(s: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = s["per_iteration"]
    fig, ax = plt.subplots(figsize=(7, 3.6))
    bottom = [0.0] * len(rows)
    for stage in ("generate", "reference", "learn", "sync"):
        values = [r[f"{stage}_s"] for r in rows]
        ax.bar(range(len(rows)), values, bottom=bottom, label=stage)
        bottom = [b + v for b, v in zip(bottom, values)]
    other = [r["iteration_s"] - b for r, b in zip(rows, bottom)]
    ax.bar(range(len(rows)), other, bottom=bottom, label="other (orchestration)", color="lightgrey")
    ax.set(title=f"{s['workload']}: time per iteration by stage", xlabel="measured iteration", ylabel="seconds")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_sweep(points: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [" ".join(f"{k.split('.')[-1]}={v}" for k, v in p["point"].items()) for p in points]
    fig, ax = plt.subplots(figsize=(max(5, 1.6 * len(points)), 3.6))
    ax.bar(range(len(points)), [p["end_to_end_tokens_per_s"] for p in points])
    ax.set_xticks(range(len(points)), labels, rotation=20, fontsize=8)
    ax.set(title="scaling sweep: end-to-end tokens/s", ylabel="tokens/s")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# -------------------------------------------------------------------------------------- main
