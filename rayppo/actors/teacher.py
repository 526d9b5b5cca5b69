"""The teacher role of on-policy distillation: log pi_T of each token the student sampled, and the
teacher's own held-out answers (its score beside the student's). docs/distillation.md."""

from __future__ import annotations

import gc
from dataclasses import dataclass

from rayppo.actors.generator import GeneratorActor, GeneratorEngine
from rayppo.actors.hf_backend import SamplingSettings
from rayppo.actors.reference import ReferenceEngine
from rayppo.data.prompts import PromptBatch
from rayppo.data.rollout import Rollout, TeacherScores
from rayppo.episodes.turn_loop import EpisodeSettings
from rayppo.machine.role_resources import Resources
from rayppo.models.sequences import top_forward
from rayppo.models.teacher import teacher_folder


@dataclass(frozen=True)
class TeacherScoring:
    """How the teacher scores a rollout (``distill``)."""

    micro_batch_tokens: int = 0
    """Processed tokens per forward pass (``distill.micro_batch_tokens``; 0: fixed runs of rows)."""
    topk: int = 0
    """k > 0: the teacher's k most likely tokens per response position too (``distill.topk``)."""


class TeacherEngine(ReferenceEngine):
    """The frozen teacher pi_T. It scores as the reference does (same temperature, micro-batches
    and packing), with another model: ``teacher_logprobs``. ``evaluate`` samples the teacher's own
    responses as a generator would, for the held-out comparison."""

    section = "distill"

    def __init__(self, model_path: str, sampling: SamplingSettings, dtype: str = "float32",
                 scoring: TeacherScoring = TeacherScoring(), resources: Resources = Resources(),
                 episodes: EpisodeSettings | None = None):
        model_path = str(teacher_folder(model_path))  # a run's folder means its policy/
        super().__init__(model_path, sampling.temperature, dtype=dtype, micro_batch_tokens=scoring.micro_batch_tokens,
                         resources=resources)
        self.model_path, self.sampling, self.dtype, self.resources = model_path, sampling, dtype, resources
        self.episodes = episodes  # multi-turn: its held-out answers are episodes, as the student's
        self.topk = scoring.topk

    def describe(self) -> str:
        return f"{self.model_path}, {super().describe()}"

    def teacher_logprobs(self, rollout: Rollout) -> TeacherScores:
        """log pi_T(y_t | S_{t-1}) of every response token ``[B][T_b]`` (0 on an episode's observation
        tokens) and, with ``topk`` = k > 0, the teacher's k most likely tokens at every response
        position and their log-probs ``[B][T_b][k]`` (``distill.topk``)."""
        if not self.topk:
            return TeacherScores(self.ref_logprobs(rollout))
        n = len(rollout)
        scores = TeacherScores([[] for _ in range(n)], [[] for _ in range(n)], [[] for _ in range(n)])
        for rows, batch, lengths in self.micro_batches(rollout):
            logprobs, top, ids = top_forward(self.model, batch, self.topk, self.temperature)
            for i, a, b, c, t in zip(rows, logprobs, top, ids, lengths):
                scores.logprobs[i], scores.top_logprobs[i], scores.top_ids[i] = (
                    a[:t].tolist(), b[:t].tolist(), c[:t].tolist())
        return scores

    def evaluate(self, prompts: PromptBatch, temperature: float, samples: int, seed: int) -> Rollout:
        """``GeneratorEngine.evaluate`` with the teacher's weights (transformers' sampler, the same
        row seeds): the teacher's held-out responses. The teacher is frozen, so a run asks once;
        the sampling copy of the model is loaded for the call and freed after it."""
        sampler = GeneratorEngine(self.model_path, self.sampling, backend="hf", dtype=self.dtype,
                                  episodes=self.episodes, actor=GeneratorActor(resources=self.resources))
        try:
            return sampler.evaluate(prompts, temperature, samples, seed)
        finally:
            del sampler
            gc.collect()
