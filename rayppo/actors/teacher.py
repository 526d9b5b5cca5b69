"""The teacher role of on-policy distillation: log pi_T of each token the student sampled, and the
teacher's own held-out answers (its score beside the student's). docs/distillation.md."""

from __future__ import annotations

import gc

from rayppo.actors.generator import GeneratorActor, GeneratorEngine
from rayppo.actors.hf_backend import SamplingSettings
from rayppo.actors.reference import ReferenceEngine
from rayppo.data.prompts import PromptBatch
from rayppo.data.rollout import Rollout
from rayppo.episodes.turn_loop import EpisodeSettings
from rayppo.machine.role_resources import Resources
from rayppo.models.teacher import teacher_folder


class TeacherEngine(ReferenceEngine):
    """The frozen teacher pi_T. It scores as the reference does (same temperature, micro-batches
    and packing), with another model: ``teacher_logprobs``. ``evaluate`` samples the teacher's own
    responses as a generator would, for the held-out comparison."""

    section = "distill"

    def __init__(self, model_path: str, sampling: SamplingSettings, dtype: str = "float32",
                 micro_batch_tokens: int = 0, resources: Resources = Resources(),
                 episodes: EpisodeSettings | None = None):
        model_path = str(teacher_folder(model_path))  # a run's folder means its policy/
        super().__init__(model_path, sampling.temperature, dtype=dtype, micro_batch_tokens=micro_batch_tokens,
                         resources=resources)
        self.model_path, self.sampling, self.dtype, self.resources = model_path, sampling, dtype, resources
        self.episodes = episodes  # multi-turn: its held-out answers are episodes, as the student's

    def describe(self) -> str:
        return f"{self.model_path}, {super().describe()}"

    def teacher_logprobs(self, rollout: Rollout) -> list[list[float]]:
        """``[B][T_b]`` log pi_T(y_t | S_{t-1}) of every response token (0 on an episode's observation tokens)."""
        return self.ref_logprobs(rollout)

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
