"""TRL's GRPO on a rayppo group workload, timed per iteration (runs in TRL's own venv).

    python benchmarks/trl_grpo.py --spec spec.json --out trl.json

``spec.json`` (written by ``rayppo bench --compare trl`` for a ``ppo.advantage=grpo`` workload)
names the model folders, the unique prompts and the shape. The two sides are set alike:

- one rayppo iteration = one TRL generation round: ``generation_batch_size`` = prompts x
  ``num_generations`` rows, ``steps_per_generation`` = ``ppo.minibatches`` optimiser steps of
  ``per_device_train_batch_size`` = rows / minibatches, ``num_iterations`` = ``ppo.epochs``;
- ``beta`` = ``ppo.kl_coef`` (rayppo's ``ppo.kl_mode=loss``: k3 in the loss; 0 loads no reference
  on either side), ``scale_rewards=group`` (GRPO's std), ``loss_type=dapo`` (the token mean over
  the whole batch: rayppo's ``token-mean``), ``epsilon`` = ``ppo.clip_eps``;
- every response ``max_completion_length`` tokens (``min_new_tokens``: rayppo's ``ignore_eos``);
- ``use_vllm=False`` (no vLLM on TRL's CPU path), bf16 autocast and gradient checkpointing as the
  rayppo side has them.

A callback stamps each optimiser step; an iteration is ``steps_per_generation`` of them.

Pinned: trl 1.16.0 (``TRL_GRPO`` in ``bench_trl_venv.py``, its own environment; PPO stays on
1.12). Field names read from its ``trl/trainer/grpo_config.py``: the same 77 ``GRPOConfig`` fields
as 1.12's, so the arguments below are unchanged; what 1.16 does differently with them:

- ``pad_to_multiple_of`` now defaults to ``"auto"``, which ``GRPOConfig.__post_init__`` resolves to
  ``None`` off Neuron (grpo_config.py: ``128 if self.device.type == "neuron" else None``): no
  padding of the prompts and completions, as in 1.12 and rayppo;
- the log-probabilities come from a fused LM head (``add_fused_lm_head``, trainer/utils.py: no full
  logits) called ``with self.accelerator.autocast():``, so the bf16 workloads' log-prob passes run
  under bf16 autocast as the update does;
- ``generation_kwargs`` still update the ``GenerationConfig`` of ``transformers.generate``
  (grpo_trainer.py: ``generation_kwargs.update(args.generation_kwargs)``): ``min_new_tokens`` holds;
- ``beta == 0.0`` still loads no reference model (grpo_trainer.py: ``if self.beta == 0.0: ...
  self.ref_model = None``), and ``use_transformers_continuous_batching`` (new) stays off.
"""

from __future__ import annotations

import json

import torch
from datasets import Dataset
from trl import GRPOConfig, GRPOTrainer
from trl_common import StepClock, setup


def main() -> None:
    s = setup(__doc__.splitlines()[0])
    spec, tokenizer, policy, reward, bf16 = s.spec, s.tokenizer, s.policy, s.reward, s.bf16
    dataset = Dataset.from_dict({"prompt": spec["prompts"]})
    rows = len(spec["prompts"]) * spec["num_generations"]
    steps = spec["minibatches"]
    config = GRPOConfig(
        output_dir=spec["output_dir"], report_to="none", save_strategy="no", use_cpu=True, bf16=bf16, fp16=False,
        seed=0, disable_tqdm=True, logging_steps=1 << 30, shuffle_dataset=False,
        num_generations=spec["num_generations"], generation_batch_size=rows, per_device_train_batch_size=rows // steps,
        gradient_accumulation_steps=1, num_iterations=spec["epochs"],
        max_steps=(spec["warmup"] + spec["iterations"]) * steps * spec["epochs"],
        max_completion_length=spec["max_new_tokens"], temperature=spec["temperature"],
        # Fixed lengths as rayppo's ignore_eos; else generation stops at EOS as rayppo's does.
        generation_kwargs={"min_new_tokens": spec["max_new_tokens"]} if spec.get("ignore_eos", True) else {},
        learning_rate=spec["lr"], beta=spec["kl_coef"], epsilon=spec["clip_eps"], scale_rewards="group",
        loss_type="dapo", use_vllm=False, gradient_checkpointing=spec["gradient_checkpointing"],
    )
    clock = StepClock()
    trainer = GRPOTrainer(model=policy, reward_funcs=[reward], args=config, train_dataset=dataset,
                          processing_class=tokenizer, reward_processing_classes=[tokenizer], callbacks=[clock])
    trainer.train()
    per = steps * spec["epochs"]  # optimiser steps per generation round (one rayppo iteration)
    ends = clock.stamps[::per]
    walls = [{"wall_s": b - a, "gc_s": 0.0} for a, b in zip(ends, ends[1:])]
    json.dump({"trl_version": __import__("trl").__version__, "trainer": "GRPOTrainer",
               "mixed_precision": str(trainer.accelerator.mixed_precision),  # "bf16" for a bf16 workload
               "threads": torch.get_num_threads(), "iterations": walls[spec["warmup"]:]}, open(s.out, "w"), indent=1)


if __name__ == "__main__":
    main()
