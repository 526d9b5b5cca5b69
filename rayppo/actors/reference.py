"""The reference role: log pi_ref of each response token under the frozen SFT policy."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from rayppo.data.micro_batches import scoring_batches
from rayppo.data.rollout import Rollout
from rayppo.machine.role_resources import Engine, Resources, model_size
from rayppo.models.loading import load_causal_lm, load_tokenizer, resolve_model_path
from rayppo.models.packing import cut_layout, scoring_layout
from rayppo.models.sequences import PackedBatch, pack, policy_forward
from rayppo.models.varlen_attention import use_varlen_attention


class ReferenceEngine(Engine):
    """Frozen pi_ref. ``ref_logprobs`` scores a rollout's responses in batches.

    Log-probs use the same temperature as the sampler, so KL_t compares the two policies'
    sampling distributions (the ones PPO's ratio and the reward shaping talk about).
    """

    section = "reference"
    """The config section of this role's actors (its ``cores`` are named in errors)."""

    def __init__(self, model_path: str, temperature: float = 1.0, batch_size: int = 64, dtype: str = "float32",
                 micro_batch_tokens: int = 0, resources: Resources = Resources()):
        self.set_threads(resources.threads)
        self.init_device(resources.gpus, self.section)
        model_path = str(resolve_model_path(model_path))
        self.model = load_causal_lm(model_path, dtype).to(self.device).eval().requires_grad_(False)
        self.pad_id = load_tokenizer(model_path).pad_token_id
        self.temperature = temperature
        self.batch_size = batch_size
        self.micro_batch_tokens = micro_batch_tokens
        self.layout = scoring_layout(self.model.config)
        if self.layout == "varlen":
            use_varlen_attention(self.model)

    def describe(self) -> str:
        return f"transformers, {model_size(self.model)}, {self.device_info()}"

    @torch.no_grad()
    def ref_logprobs(self, rollout: Rollout) -> list[list[float]]:
        """``[B][T_b]`` log pi_ref(y_t | S_{t-1}) for every response token (0 on an episode's observation tokens)."""
        out: list[list[float]] = [[] for _ in range(len(rollout))]
        for rows, batch, lengths in self.micro_batches(rollout):
            logprobs, _ = policy_forward(self.model, batch, self.temperature)
            for i, row, n in zip(rows, logprobs, lengths):
                out[i] = row[:n].tolist()
        return out

    def micro_batches(self, rollout: Rollout) -> Iterator[tuple[list[int], PackedBatch, list[int]]]:
        """``(rows, batch, response lengths)`` of each micro-batch of ``rollout`` to score: rows of about
        equal processed tokens (``micro_batch_tokens``), or fixed runs of rows, packed as this model lays them out."""
        for rows in scoring_batches(*rollout.lengths(), self.micro_batch_tokens, self.batch_size,
                                    cut_layout(self.layout)):
            part = rollout.select(rows)
            batch = pack(part.prompt_ids, part.response_ids, self.pad_id, part.action_mask)
            yield rows, (batch.packed(self.layout) if self.layout else batch).to(self.device), part.lengths()[1]
