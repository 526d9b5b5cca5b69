"""``rayppo pairs``: preference pairs made from a verifier, for a user without a preference set.

For each prompt of ``data.prompts``, the policy (``model.policy``) samples
``preference.samples_per_prompt`` responses at ``rollout.temperature`` on the generator a PPO run
would use (``generators.backend``: vLLM by default, in this process, no Ray); the verifier
(``reward.function``) scores them; the best are paired with the worst, a pair only where the
verifier strictly prefers one (a right answer over a wrong one), at most
``preference.pairs_per_prompt`` per prompt. The file written (``preference.pairs``) is the one
``rayppo reward-model`` reads: ``prompt`` (the row's text or conversation), ``chosen``,
``rejected``, and the two scores. ``preference.max_pairs`` stops it early; so do Ctrl-C and
SIGTERM, between batches (``run/stop.py``), the file written a batch at a time in whole lines.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

from rayppo.actors.generator import GeneratorEngine
from rayppo.actors.reward import RewardEngine
from rayppo.actors.settings import reward_args
from rayppo.cluster.roles import generator_args
from rayppo.config.derived import generator_context
from rayppo.config.schema import Config
from rayppo.console import console
from rayppo.data.prompts import PromptSet
from rayppo.data.rollout import Rollout
from rayppo.models.loading import load_tokenizer, resolve_model_path
from rayppo.models.shape import max_positions
from rayppo.run.progress import Bar
from rayppo.run.stop import StopRequest
from rayppo.trainers.iteration import group_shares
from rayppo.trainers.loop import load_prompts


@dataclass
class PairsResult:
    """What ``make_verifier_pairs`` wrote."""

    pairs: int
    prompts: int
    """Prompts sampled."""
    undecided: int
    """Prompts whose responses the verifier scored all alike (no pair)."""
    path: Path
    seconds: float
    stop_reason: str = "completed"
    """``completed`` (every prompt, or ``preference.max_pairs``), ``interrupted`` (Ctrl-C) or
    ``preempted`` (SIGTERM): the file holds the pairs of every batch done before the stop."""

    def summary(self) -> str:
        said = "pairs" if self.stop_reason == "completed" else self.stop_reason
        return (f"{said}: {self.pairs} pairs from {self.prompts} prompts ({self.undecided} gave no pair: every "
                f"response scored alike) in {self.seconds:.0f} s, written to {self.path}")


@dataclass(frozen=True)
class _Engines:
    """What a batch of pairs passes through: the policy's generator, then the verifier."""

    generator: GeneratorEngine
    verifier: RewardEngine


def group_pairs(responses: list[str], scores: list[float], limit: int) -> list[tuple[int, int]]:
    """``(chosen, rejected)`` indices into one prompt's responses: the best-scored paired with the
    worst, the second best with the second worst, ... while the first scores strictly higher;
    a response text is used once at most and never paired with itself. An empty response (the
    policy ended at once) is left out: a pair file refuses it (``data.pairs.read_pairs``)."""
    distinct: dict[str, int] = {}  # each text once, at its best score's place
    for i in sorted(range(len(responses)), key=lambda i: (-scores[i], i)):
        if responses[i].strip():
            distinct.setdefault(responses[i].strip(), i)
    ranked = list(distinct.values())
    out = []
    for k in range(min(limit, len(ranked) // 2)):
        best, worst = ranked[k], ranked[-1 - k]
        if scores[best] <= scores[worst]:
            break
        out.append((best, worst))
    return out


def make_verifier_pairs(cfg: Config, progress: bool = True) -> PairsResult:
    """Sample, score and pair as the module says; write ``preference.pairs`` (JSON Lines). Ctrl-C
    and SIGTERM stop it as they stop a run (``run/stop.py``): after the batch in flight, or at once
    on a second Ctrl-C; either way the file ends at a whole line, after the pairs of the batches done."""
    start, f = time.monotonic(), cfg.preference
    policy = str(resolve_model_path(cfg.model.policy, cfg.model.cache_dir))
    positions = max_positions(policy)
    limit = cfg.generators.max_model_len or positions
    prompts, _ = load_prompts(cfg, load_tokenizer(policy), limit - cfg.rollout.max_new_tokens if limit else None)
    context = generator_context(cfg.generators.max_model_len, positions, max(len(ids) for ids in prompts.ids),
                                cfg.rollout.max_new_tokens)
    result = PairsResult(0, 0, 0, Path(f.pairs), 0.0)
    result.path.parent.mkdir(parents=True, exist_ok=True)
    stop = StopRequest(cfg.stop.sigterm_grace_s, step="batch", checkpoint=False)
    with stop.installed():  # from here: a Ctrl-C while the engine starts stops before the first batch
        try:
            # The PPO run's generator in this process: vLLM samples a 512-response batch ~10x faster
            # than transformers' generate on SmolLM2 (docs/reward-models.md).
            generator = GeneratorEngine(**{**generator_args(cfg, context, 0), "model_path": policy})
            try:
                _write_pairs(cfg, prompts, _Engines(generator, RewardEngine(**reward_args(cfg, 0.0))), stop, progress,
                             result)
            finally:
                generator.close()
        except KeyboardInterrupt:  # a second Ctrl-C, or a SIGTERM without the time to finish the batch
            result.stop_reason = stop.requested or "interrupted"
    result.seconds = time.monotonic() - start
    if result.pairs == 0 and result.stop_reason == "completed":
        console.phase(f"the verifier scored every prompt's {f.samples_per_prompt} responses alike: no pair in "
                      f"{result.path}")
    return result


def _write_pairs(cfg: Config, prompts: PromptSet, engines: _Engines, stop: StopRequest, progress: bool,
                 result: PairsResult) -> None:
    """The batches of ``prompts`` sampled, scored and paired, until every prompt is done,
    ``preference.max_pairs`` are written or a stop is asked for (taken between batches). A batch's
    lines are written at once and flushed, so the file ends at a whole line whenever the process
    stops; ``result`` counts what is written."""
    f, per_batch = cfg.preference, max(1, cfg.rollout.batch_size)
    batches = range(0, len(prompts), per_batch)
    bar = Bar(len(batches), 0, progress, desc="pairs", unit="batch",
              figures=lambda m: {"pairs": f"{m['pairs']:.0f}", "pairs/min": f"{m['pairs_per_min']:.0f}"})
    sampling = time.monotonic()  # the rate is the sampling's, the engine's start-up apart
    try:
        with result.path.open("w", encoding="utf-8") as out:
            for b, first in enumerate(batches):
                if stop.requested:  # asked for during the batch before, or while the engine started
                    result.stop_reason = stop.requested
                    return
                begun = time.monotonic()
                stop.iteration_begins()
                (batch,) = group_shares(prompts.select(range(first, min(first + per_batch, len(prompts)))), 1,
                                        f.samples_per_prompt)
                rollout = engines.generator.generate(batch, seed=cfg.seed * 1_000_003 + b)
                rows, none = _pair_rows(rollout, engines.verifier.scores(rollout), f.pairs_per_prompt)
                rows = rows[:f.max_pairs - result.pairs] if f.max_pairs else rows
                out.write("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows))  # one call: whole
                out.flush()
                result.pairs, result.undecided = result.pairs + len(rows), result.undecided + none
                result.prompts += len(batch) // f.samples_per_prompt
                stop.iteration_done(time.monotonic() - begun)
                bar.update({"pairs": result.pairs, "pairs_per_min": 60 * result.pairs / (time.monotonic() - sampling)})
                if f.max_pairs and result.pairs >= f.max_pairs:
                    return
    finally:
        bar.close()


def _pair_rows(rollout: Rollout, scores: list[float], limit: int) -> tuple[list[dict], int]:
    """The pair rows of one scored rollout (groups in order), and how many groups gave none."""
    groups: dict[int, list[int]] = {}
    for row, group in enumerate(rollout.group_id):
        groups.setdefault(group, []).append(row)
    conversations, rows, undecided = rollout.conversations(), [], 0
    for members in groups.values():
        texts = [rollout.response_text[i] for i in members]
        chosen = group_pairs(texts, [scores[i] for i in members], limit)
        undecided += not chosen
        first = members[0]
        prompt = conversations[first] or rollout.prompt_text[first]
        rows += [{"prompt": prompt, "chosen": texts[w], "rejected": texts[lo],
                  "chosen_score": scores[members[w]], "rejected_score": scores[members[lo]]} for w, lo in chosen]
    return rows, undecided
