"""TRL's on-policy distillation on rayppo's distillation workload, timed per step (runs in TRL's own venv).

    python benchmarks/trl_distill.py --spec spec.json --out trl.json

``spec.json`` (written by ``rayppo bench --workload smollm2-distill --compare trl``,
``distill_bench.py``) names the student, the teacher, the prompts rayppo drew at each of its
iterations, in order, and the shape. The two sides are set alike:

- one rayppo iteration = one TRL optimiser step on one generation batch: TRL's
  ``DistillationTrainer`` samples one completion per prompt, so each prompt is listed
  ``samples_per_prompt`` times in a row and the dataset is not shuffled: step i trains on rayppo's
  iteration i's prompts, the same number of responses;
- ``beta=1.0``: the reverse KL(pi || pi_T) (``beta`` selects the divergence there, 0 forward, 1
  reverse); the completions are always the student's own (on-policy); ``temperature`` the
  sampling temperature, which TRL also applies to both models' logits in the loss, as rayppo's
  teacher scores at the sampling temperature;
- the learning rate, its schedule over the same number of steps (``lr_scheduler_type``:
  rayppo's ``ppo.lr_schedule``, no warm-up, to 0: ``distill_bench.check_like_for_like``), AdamW's
  weight decay and the gradient clip as rayppo's (transformers exempts biases and norm weights from
  the decay, rayppo does not: the same at the recipe's decay of 0);
- ``use_vllm=False``: ``rayppo bench`` runs TRL on CPU, where TRL's vLLM path does not run
  (``docs/benchmarks.md``); bf16 autocast over fp32 weights and the teacher in bf16 for a bf16
  workload; gradient checkpointing as rayppo's learner has it.

What differs by design, and is in the result: TRL's loss is the full-vocabulary divergence at
every completion token (``_chunked_divergence_loss``: the teacher's whole next-token distribution
each position), rayppo's the sampled-token estimate in the clipped policy-gradient loss
(docs/distillation.md). The student after the last step is saved for the bench to evaluate beside
rayppo's on the same held-out problems.

Pinned: trl 1.16.0 (``TRL_GRPO`` in ``bench_trl_venv.py``, the same environment). Fields read
from its ``trl/trainer/distillation_config.py`` and ``distillation_trainer.py``: the stable
``DistillationConfig``/``DistillationTrainer`` (``trl.experimental.distillation`` re-exports them with a
deprecation warning); the generation batch is ``per_device_train_batch_size`` x
``gradient_accumulation_steps`` prompts (``_get_train_sampler``), its ``bf16`` defaults to True and
``learning_rate`` to 1e-6 (both set here).
"""

from __future__ import annotations

import json

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, TrainerCallback
from trl import DistillationConfig, DistillationTrainer
from trl_common import StepClock, setup


class LogKeeper(TrainerCallback):
    """Each step's logged figures (``logging_steps=1``): the mean completion length, the loss."""

    def __init__(self) -> None:
        self.logs: list[dict[str, float]] = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "completions/mean_length" in logs:
            self.logs.append(dict(logs))


def main() -> None:
    s = setup(__doc__.splitlines()[0])
    spec = s.spec
    n, steps = spec["samples_per_prompt"], spec["warmup"] + spec["iterations"]
    prompts = [p for batch in spec["prompt_batches"][:steps] for p in batch for _ in range(n)]
    rows = len(spec["prompt_batches"][0]) * n
    teacher = AutoModelForCausalLM.from_pretrained(spec["teacher"], dtype=s.frozen_dtype)
    config = DistillationConfig(
        output_dir=spec["output_dir"], report_to="none", save_strategy="no", use_cpu=True, bf16=s.bf16, fp16=False,
        seed=spec["seed"], disable_tqdm=True, logging_steps=1, shuffle_dataset=False,
        per_device_train_batch_size=rows, gradient_accumulation_steps=1, max_steps=steps,
        max_completion_length=spec["max_new_tokens"], temperature=spec["temperature"],
        generation_kwargs={"min_new_tokens": spec["max_new_tokens"]} if spec["ignore_eos"] else {},
        learning_rate=spec["lr"], lr_scheduler_type=spec["lr_schedule"], warmup_steps=0,
        weight_decay=spec["weight_decay"], max_grad_norm=spec["max_grad_norm"],  # 0: no clipping, on both sides
        beta=1.0, use_vllm=False, gradient_checkpointing=spec["gradient_checkpointing"],
    )
    clock, kept = StepClock(), LogKeeper()
    trainer = DistillationTrainer(model=s.policy, teacher_model=teacher, args=config,
                                  train_dataset=Dataset.from_dict({"prompt": prompts}), processing_class=s.tokenizer,
                                  callbacks=[clock, kept])
    trainer.train()
    trainer.save_model(spec["student_out"])
    s.tokenizer.save_pretrained(spec["student_out"])
    walls = [{"wall_s": b - a, "gc_s": 0.0, "completion_tokens": log["completions/mean_length"] * rows,
              "loss": log.get("loss")} for a, b, log in zip(clock.stamps, clock.stamps[1:], kept.logs)]
    json.dump({"trl_version": __import__("trl").__version__, "trainer": "DistillationTrainer",
               "mixed_precision": str(trainer.accelerator.mixed_precision), "threads": torch.get_num_threads(),
               "steps": len(walls), "iterations": walls}, open(s.out, "w"), indent=1)


if __name__ == "__main__":
    main()
