"""Per-stage throughput figures of an iteration: ``perf/tokens_per_s/<stage>``,
``perf/tflops/<stage>`` and ``perf/mfu/<stage>`` (docs/benchmarks.md, "MFU per stage").

    achieved FLOP/s = the stage's useful FLOPs for this rollout (plan/flops.py) / its seconds (StageTimes)
    MFU             = achieved / the matmul rate measured once at the start (rayppo/machine/matmul_rate.py)

The trainers measure the rate (``output.mfu``) where the learner computes and hand it to
``StageCounter``; a stage that did not run (no reference at ``ppo.kl_coef = 0``: its time is 0)
reports nothing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from rayppo.config.derived import has_critic, uses_reference
from rayppo.config.schema import Config
from rayppo.data.rollout import Rollout
from rayppo.models.loading import resolve_model_path
from rayppo.models.shape import ModelShape, read_shape
from rayppo.models.teacher import teacher_folder
from rayppo.plan.flops import LearnPasses, Sequences, StageFlops, reference_flops, stage_flops
from rayppo.run.stage_times import StageTimes

STAGES = ("generate", "reference", "reward", "learn", "teacher")


def stage_metrics(flops: StageFlops, seconds: dict[str, float], rate: float | None,
                  tokens: dict[str, int] | None = None) -> dict[str, float]:
    """``perf/tflops/<stage>`` (achieved: FLOPs / seconds / 1e12), ``perf/mfu/<stage>`` (achieved
    FLOP/s / ``rate``; none when ``rate`` is None) and ``perf/tokens_per_s/<stage>`` (``tokens``
    / seconds) of each stage with seconds > 0 (``seconds``: by stage name, or as the ``time/*``
    figures of a metrics record read back, a benchmark's); FLOP figures only for a stage that runs
    a model (FLOPs > 0)."""
    out: dict[str, float] = {}
    for stage, stage_flops_ in flops.as_dict().items():
        s = seconds.get(stage, seconds.get(f"time/{stage}", 0.0))
        if not s > 0:
            continue
        if tokens and stage in tokens:
            out[f"perf/tokens_per_s/{stage}"] = tokens[stage] / s
        if stage_flops_ > 0:
            achieved = stage_flops_ / s
            out[f"perf/tflops/{stage}"] = achieved / 1e12
            if rate is not None and rate > 0 and math.isfinite(rate):
                out[f"perf/mfu/{stage}"] = achieved / rate
    return out


def stage_tokens(seq: Sequences) -> dict[str, int]:
    """The tokens each stage processes: generation its generated tokens, the scoring passes (the
    teacher's included) and the learner every prompt and response token (the learner's once, not
    per epoch)."""
    total = sum(seq.lengths)
    return {"generate": seq.response_tokens, "reference": total, "reward": total, "learn": total, "teacher": total}


def rollout_sequences(rollout: Rollout) -> Sequences:
    """The token counts of a rollout record (``prompt_ids``, ``response_ids``); a prompt an
    earlier row has (a group's other samples) is a repeated one (``Sequences.repeated_prompts``)."""
    seen: set[tuple[int, ...]] = set()
    repeated = []
    for prompt in rollout.prompt_ids:
        key = tuple(prompt)
        if key in seen:
            repeated.append(len(prompt))
        seen.add(key)
    return Sequences([len(p) + len(r) for p, r in zip(rollout.prompt_ids, rollout.response_ids)],
                     sum(len(r) for r in rollout.response_ids), repeated)


def _shape(name: str | None, cache_dir: str | None) -> ModelShape | None:
    """The shape of a model folder; None for no model, or one whose ``config.json`` is not here."""
    if name is None:
        return None
    path = resolve_model_path(name, cache_dir)
    return read_shape(path) if (Path(path) / "config.json").is_file() else None


def probe_tokens(cfg: Config) -> int:
    """Rows of the rate probe's matmul: about a minibatch's response tokens (at most 4096)."""
    rows = cfg.rollout.batch_size * cfg.rollout.samples_per_prompt
    return max(64, min(4096, rows * cfg.rollout.max_new_tokens // max(cfg.ppo.minibatches, 1)))


@dataclass
class StageCounter:
    """The models of each stage (read once) and the measured rate: an iteration's ``perf/*`` figures."""

    policy: ModelShape
    reference: ModelShape | None
    reward: ModelShape | None
    critic: ModelShape | None
    epochs: int
    minibatches: int
    proximal: bool
    lora: bool = False
    """The learner trains a LoRA policy (``learner.lora_rank``): no gradient for its frozen weights."""
    rate: float | None = None
    """FLOP/s of the probe (``machine.matmul_rate.peak_rate``), set by the trainer; None: not measured."""
    teacher: ModelShape | None = None
    """The distillation teacher's shape (``distill.teacher``); None without one."""

    @classmethod
    def of(cls, cfg: Config) -> StageCounter:
        """The shapes ``cfg``'s stages run (its models already built: the trainers resolve them first)."""
        m = cfg.model
        policy = _shape(m.policy, m.cache_dir)
        assert policy is not None, f"model.policy={m.policy}: no config.json"
        return cls(policy, _shape(m.reference or m.policy, m.cache_dir) if uses_reference(cfg) else None,
                   _shape(cfg.reward.model, m.cache_dir),
                   _shape(m.critic or m.policy, m.cache_dir) if has_critic(cfg.ppo) else None,
                   cfg.ppo.epochs, cfg.ppo.minibatches, cfg.rollout.max_staleness > 0, cfg.learner.lora_rank > 0,
                   teacher=read_shape(teacher_folder(cfg.distill.teacher, m.cache_dir)) if cfg.distill.teacher else None)

    def flops(self, seq: Sequences) -> StageFlops:
        """Each stage's useful FLOPs for a rollout of these token counts."""
        flops = stage_flops(self.policy, self.reference, self.reward, self.critic, seq,
                            LearnPasses(self.epochs, self.minibatches, self.proximal, self.lora))
        if self.teacher is not None:
            flops.teacher = reference_flops(self.teacher, seq)  # the same forward, another model
        return flops

    def metrics(self, rollout: Rollout, times: StageTimes) -> dict[str, float]:
        """The ``perf/*`` figures of the iteration that trained ``rollout`` in ``times``."""
        if not len(rollout):
            return {}
        seq = rollout_sequences(rollout)
        seconds = {"generate": times.generate, "reference": times.reference, "reward": times.reward,
                   "learn": times.learn, "teacher": times.teacher or 0.0}  # by the stage names of StageFlops (STAGES)
        return stage_metrics(self.flops(seq), seconds, self.rate, stage_tokens(seq))
