"""The reference role: log pi_ref of each response token under the frozen SFT policy."""

from __future__ import annotations

import torch

from rayppo.data.rollout import Rollout
from rayppo.engine import Engine, model_size
from rayppo.models.loading import load_causal_lm, load_tokenizer, resolve_model_path
from rayppo.models.sequences import pack, policy_forward


class ReferenceEngine(Engine):
    """Frozen pi_ref. ``ref_logprobs`` scores a rollout's responses in batches.

    Log-probs use the same temperature as the sampler, so KL_t compares the two policies'
    sampling distributions (the ones PPO's ratio and the reward shaping talk about).
    """

    def __init__(self, model_path: str, temperature: float = 1.0, batch_size: int = 64, dtype: str = "float32",
                 num_threads: int | None = None, gpus: float = 0.0):
        self.set_threads(num_threads)
        self.init_device(gpus, "reference")
        model_path = str(resolve_model_path(model_path))
        self.model = load_causal_lm(model_path, dtype).to(self.device).eval().requires_grad_(False)
        self.pad_id = load_tokenizer(model_path).pad_token_id
        self.temperature = temperature
        self.batch_size = batch_size

    def describe(self) -> str:
        return f"transformers, {model_size(self.model)}, {self.device_info()}"

    @torch.no_grad()
    def ref_logprobs(self, rollout: Rollout) -> list[list[float]]:
        """``[B][T_b]`` log pi_ref(y_t | S_{t-1}) for every response token."""
        out: list[list[float]] = []
        for start in range(0, len(rollout), self.batch_size):
            part = rollout.select(range(start, min(start + self.batch_size, len(rollout))))
            batch = pack(part.prompt_ids, part.response_ids, self.pad_id).to(self.device)
            logprobs, _ = policy_forward(self.model, batch, self.temperature)
            out.extend(row[: len(ids)].tolist() for row, ids in zip(logprobs, part.response_ids))
        return out
