"""TRL's ``RewardTrainer`` on rayppo's preference pairs, timed per optimiser step (runs in TRL's
own venv, ``TRL_GRPO``'s: trl 1.16.0).

    python benchmarks/trl_reward.py --spec spec.json --out trl.json

``spec.json`` (written by ``benchmarks/reward_model_speed.py`` or ``tests/test_reward_model.py``)
names the backbone folder and holds the pairs already tokenised by rayppo (``chosen_ids``,
``rejected_ids``: the same token sequences on both sides). TRL takes tokenised pairs as they are
(``RewardTrainer._prepare_dataset``: "already preprocessed (tokenized), skip the processing
steps"), pads chosen and rejected right into one batch of 2B rows (``DataCollatorForPreference``)
and computes −logsigmoid(r_w − r_l).mean() (``compute_loss``, trl/trainer/reward_trainer.py), as
rayppo's ``bradley_terry_loss`` does. The two sides are set alike: ``per_device_train_batch_size``
= ``preference.batch_pairs``, one optimiser step per batch, AdamW at the same lr and no weight
decay, a constant schedule, no warm-up, gradient clipping at ``ppo.max_grad_norm``, bf16 autocast
for a bf16 workload (fp32 weights: TRL's mixed precision), no shuffling (rayppo's order is given).

``--loss-only``: instead of training, the loss TRL computes on the spec's pairs with the model as
it is (``compute_loss`` on one collated batch), written as ``{"loss": ...}``.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from datasets import Dataset
from transformers import AutoModelForSequenceClassification, AutoTokenizer, TrainerCallback
from trl import RewardConfig, RewardTrainer


class StepClock(TrainerCallback):
    """The wall time of each optimiser step."""

    def __init__(self) -> None:
        self.seconds: list[float] = []
        self._began = 0.0

    def on_step_begin(self, args, state, control, **kwargs):  # noqa: ANN001, ANN201 - TrainerCallback's signature
        self._began = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):  # noqa: ANN001, ANN201
        self.seconds.append(time.perf_counter() - self._began)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spec", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--loss-only", action="store_true")
    args = parser.parse_args()
    spec = json.loads(open(args.spec).read())
    torch.manual_seed(0)
    torch.set_num_threads(int(spec.get("threads", torch.get_num_threads())))
    tokenizer = AutoTokenizer.from_pretrained(spec["model"])
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForSequenceClassification.from_pretrained(spec["model"], num_labels=1, dtype=torch.float32)
    model.config.pad_token_id = tokenizer.pad_token_id
    pairs = Dataset.from_dict({"chosen_ids": spec["chosen_ids"], "rejected_ids": spec["rejected_ids"]})
    config = RewardConfig(output_dir=spec["work_dir"], per_device_train_batch_size=spec["batch_pairs"],
                          gradient_accumulation_steps=1, learning_rate=spec["lr"], weight_decay=0.0,
                          lr_scheduler_type="constant", warmup_steps=0, max_grad_norm=spec["max_grad_norm"],
                          max_steps=spec.get("steps", 1), bf16=bool(spec.get("bf16", False)), logging_steps=1 << 30,
                          save_strategy="no", report_to=[], disable_tqdm=True, dataloader_num_workers=0,
                          max_length=None, seed=0, use_cpu=not torch.cuda.is_available())
    clock = StepClock()
    trainer = RewardTrainer(model=model, args=config, train_dataset=pairs, processing_class=tokenizer, callbacks=[clock])
    trainer._get_train_sampler = lambda *a, **k: torch.utils.data.SequentialSampler(trainer.train_dataset)  # rayppo's order
    if args.loss_only:
        batch = trainer.data_collator([pairs[i] for i in range(len(pairs))])
        model.train()
        with torch.no_grad():
            loss = trainer.compute_loss(model, batch)
        json.dump({"loss": loss.item()}, open(args.out, "w"))
        return
    trainer.train()
    json.dump({"step_s": clock.seconds}, open(args.out, "w"))


if __name__ == "__main__":
    main()
