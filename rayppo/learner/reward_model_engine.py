"""One rank of the reward-model learner group: r_φ under DeepSpeed ZeRO, trained with the
Bradley–Terry loss (``bradley_terry.py``) on its share of each step's pairs.

r_φ is a transformers sequence classifier with one label: the backbone of ``preference.backbone``
with a scalar head (``score``) on the hidden state of the last token that is not the pad token,
which is where the reward actor's classifier reads it too (``models/sequence_scores.py``). Its
folder (``save``) is what ``AutoModelForSequenceClassification.from_pretrained`` and
``reward.model=`` load, with the tokenizer and chat template it was trained with.

The group, placement, checkpoints and resharding are the PPO learner's (``learner_engine.py``,
``learner_state.py``); only the model and the step differ.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from rayppo.config.derived import role_gpus
from rayppo.config.schema import Config
from rayppo.learner.bradley_terry import bradley_terry_loss, pair_sums
from rayppo.learner.learner_engine import (
    TorchCollective,
    deepspeed_config,
    gathered,
    join_learner_group,
    leave_learner_group,
    partitioned_loading,
)
from rayppo.learner.learner_state import LearnerSplit, load_states, save_states
from rayppo.learner.step import adamw
from rayppo.machine.role_resources import Engine, model_size
from rayppo.models.loading import load_tokenizer, prepare_for_training, resolve_model_path
from rayppo.models.reward_model import backbone_name, scalar_head_model
from rayppo.models.shape import read_shape

CHECKPOINT_ENGINE = "reward_model"
"""The folder of r_φ's DeepSpeed states in a checkpoint."""


class RewardModelLearner(Engine):
    """r_φ of one rank; ``train_step`` is one optimiser step on this rank's pairs of the step."""

    def __init__(self, cfg: Config, rank: int, world_size: int, master_addr: str, master_port: int,
                 num_threads: int | None = None):
        join_learner_group(self, role_gpus(cfg, "learner"), rank, world_size, (master_addr, master_port), num_threads)
        import deepspeed  # here, not at module level: the driver imports this module only to spawn ranks

        self.cfg, self.rank, self.world_size = cfg, rank, world_size
        self.collective = TorchCollective(world_size, self.device)
        path = resolve_model_path(backbone_name(cfg), cfg.model.cache_dir)
        self.tokenizer = load_tokenizer(path)
        self.pad_id = int(self.tokenizer.pad_token_id)
        ds_config = deepspeed_config(cfg, world_size, read_shape(path))
        with partitioned_loading(ds_config):
            model = scalar_head_model(path, cfg.model.dtype, self.pad_id, cfg.seed)
        prepare_for_training(model, cfg.learner.gradient_checkpointing)
        f = cfg.preference
        self.model, *_ = deepspeed.initialize(model=model, optimizer=adamw(list(model.parameters()), f.lr,
                                                                            f.weight_decay), config=ds_config)
        self.steps = 0

    def _scores(self, rows: list[list[int]]) -> torch.Tensor:
        """``[n]`` float32 r_φ of each token list, right-padded into one batch: the classifier
        reads each row at its last non-pad token, as it does when serving."""
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, row in enumerate(rows):
            ids[i, :len(row)] = torch.tensor(row, dtype=torch.long)
            mask[i, :len(row)] = 1
        logits = self.model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device), use_cache=False).logits
        return logits[:, 0].float()

    def _pair_scores(self, chosen: list[list[int]], rejected: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """``([p] r_φ(x, y_w), [p] r_φ(x, y_l))`` in one forward pass over the 2p texts."""
        scores = self._scores(chosen + rejected)
        return scores[:len(chosen)], scores[len(chosen):]

    def train_step(self, chosen: list[list[int]], rejected: list[list[int]]) -> torch.Tensor:
        """One optimiser step on this rank's pairs (the same count on every rank); returns the
        step's ``pair_sums`` over every rank (before the step's update).

        Each micro-batch's loss is its pairs' sum of −log σ(r_w − r_l) over this rank's pair
        count, so the accumulated gradient is this rank's mean; DeepSpeed averages the ranks'
        gradients: the step follows the mean over all the step's pairs."""
        micro = self.cfg.preference.micro_pairs
        sums = torch.zeros(4, dtype=torch.float32)
        for start in range(0, len(chosen), micro):
            c, r = self._pair_scores(chosen[start:start + micro], rejected[start:start + micro])
            share = len(c) / len(chosen)  # bradley_terry_loss is this micro-batch's mean
            self.model.backward(bradley_terry_loss(c, r) * share)
            sums += pair_sums(c.detach(), r.detach()).cpu()
        self.model.step()
        self.steps += 1
        return self.collective.sum(sums)

    @torch.no_grad()
    def score_rows(self, rows: list[list[int]], passes: int) -> list[float]:
        """r_φ of each token list of this rank's share (held-out responses), 2 x ``micro_pairs``
        per forward pass. ``passes``: the forward passes every rank makes (the largest share's):
        under ZeRO-3 each forward gathers parameters with the other ranks, so a rank with fewer
        rows runs the rest on a placeholder and drops what it scores."""
        micro, out = 2 * self.cfg.preference.micro_pairs, []
        for k in range(passes):
            part = rows[k * micro:(k + 1) * micro]
            scores = self._scores(part or [[self.pad_id]])
            out += scores.tolist() if part else []
        return out

    def steps_done(self) -> int:
        """Optimiser steps taken (a restored checkpoint's included)."""
        return self.steps

    def save(self, out_dir: str) -> None:
        """r_φ as a transformers folder with its tokenizer (rank 0 writes; every rank joins
        ZeRO-3's gathers)."""
        with gathered(self.model.module, self.cfg.learner.zero_stage):
            if self.rank == 0:
                self.model.module.save_pretrained(out_dir)
                self.tokenizer.save_pretrained(out_dir)
        if self.world_size > 1:
            dist.barrier()  # the folder is whole before any rank reports it written

    def save_checkpoint(self, path: str) -> None:
        """r_φ's DeepSpeed states (weights, Adam moments, step) under ``path``."""
        save_states(Path(path), {CHECKPOINT_ENGINE: self.model}, self.steps, self.rank, self._split())

    def load_checkpoint(self, path: str) -> int:
        """Load what ``save_checkpoint`` wrote (resharded for another split); returns the steps done."""
        self.steps = load_states(Path(path), {CHECKPOINT_ENGINE: self.model}, self.rank, self._split())
        return self.steps

    def _split(self) -> LearnerSplit:
        return LearnerSplit(num_ranks=self.world_size, zero_stage=self.cfg.learner.zero_stage)

    def describe(self) -> str:
        import deepspeed

        ranks = f"{self.world_size} rank{'s' if self.world_size > 1 else ''}"
        return (f"DeepSpeed {deepspeed.__version__} ZeRO-{self.cfg.learner.zero_stage}, {ranks} over "
                f"{dist.get_backend()}, reward model {model_size(self.model.module)}, {self.device_info()} each")

    def close(self) -> None:
        """Drop the engine and leave the process group."""
        self.model = None
        leave_learner_group()
