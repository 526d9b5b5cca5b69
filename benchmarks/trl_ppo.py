"""TRL's PPO on a rayppo benchmark workload, timed per iteration (runs in its own venv).

    python benchmarks/trl_ppo.py --spec spec.json --out trl.json

``spec.json`` (written by ``rayppo bench --compare trl``) names the model folders, prompts and
PPO shape. TRL 1.12's ``trl.experimental.ppo.PPOTrainer`` runs one rollout + update per
"update"; a callback stamps the end of each. ``gc.collect`` is wrapped so the report can also
give TRL's time with its per-iteration garbage collections measured out.
"""

from __future__ import annotations

import gc
import json
import time

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, TrainerCallback
from trl.experimental.ppo import PPOConfig, PPOTrainer
from trl_common import setup

_collect = gc.collect
GC_SECONDS = [0.0]


def timed_collect(*args, **kwargs):
    start = time.perf_counter()
    try:
        return _collect(*args, **kwargs)
    finally:
        GC_SECONDS[0] += time.perf_counter() - start


class StepClock(TrainerCallback):
    """Wall time and gc time at the end of every PPO update."""

    def __init__(self) -> None:
        self.stamps: list[tuple[float, float]] = []

    def on_train_begin(self, args, state, control, **kwargs):
        self.stamps.append((time.perf_counter(), GC_SECONDS[0]))

    def on_step_end(self, args, state, control, **kwargs):
        self.stamps.append((time.perf_counter(), GC_SECONDS[0]))
        (t0, _), (t1, _) = self.stamps[-2:]
        print(f"  TRL iteration {len(self.stamps) - 1}/{args.num_total_batches}: {t1 - t0:.2f} s", flush=True)


def main() -> None:
    s = setup(__doc__.splitlines()[0])
    spec, tokenizer, policy, reward, bf16 = s.spec, s.tokenizer, s.policy, s.reward, s.bf16
    gc.collect = timed_collect  # TRL calls gc.collect() twice per update
    ref = AutoModelForCausalLM.from_pretrained(spec["policy"], dtype=s.frozen_dtype)
    value = AutoModelForSequenceClassification.from_pretrained(spec["reward_model"], dtype=torch.float32)
    ids = tokenizer(spec["prompts"])["input_ids"]
    dataset = Dataset.from_dict({"input_ids": ids})

    iterations = spec["warmup"] + spec["iterations"]
    config = PPOConfig(
        output_dir=spec["output_dir"], report_to="none", save_strategy="no", use_cpu=True,
        bf16=bf16, fp16=False, seed=0, disable_tqdm=True,
        per_device_train_batch_size=spec["batch_size"], gradient_accumulation_steps=1,
        local_rollout_forward_batch_size=spec["batch_size"],
        num_ppo_epochs=spec["epochs"], num_mini_batches=spec["minibatches"],
        # stop_token "eos": TRL cuts each response after its first EOS and pads the batch to its
        # longest; None keeps every row at response_length (rayppo's ignore_eos).
        response_length=spec["max_new_tokens"], stop_token=None if spec.get("ignore_eos", True) else "eos",
        temperature=spec["temperature"],
        total_episodes=iterations * spec["batch_size"], num_sample_generations=0,
        learning_rate=spec["lr"], kl_coef=spec["kl_coef"], logging_steps=1 << 30,
        gradient_checkpointing=spec["gradient_checkpointing"],
    )
    clock = StepClock()
    trainer = PPOTrainer(args=config, processing_class=tokenizer, model=policy, ref_model=ref,
                         reward_model=reward, train_dataset=dataset, value_model=value, callbacks=[clock])
    trainer.train()
    stamps = clock.stamps
    rows = [{"wall_s": t1 - t0, "gc_s": g1 - g0} for (t0, g0), (t1, g1) in zip(stamps, stamps[1:])]
    json.dump({"trl_version": __import__("trl").__version__, "threads": torch.get_num_threads(),
               "iterations": rows[spec["warmup"]:]}, open(s.out, "w"), indent=1)


if __name__ == "__main__":
    main()
