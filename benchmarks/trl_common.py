"""What the TRL comparison scripts (``trl_ppo.py``, ``trl_grpo.py``, ``trl_distill.py``) start
with: the spec that ``rayppo bench --compare trl`` wrote, and the models it names; and the clock
of their optimiser steps (runs in TRL's venv: only torch, transformers and the standard library)."""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer, TrainerCallback


@dataclass
class Setup:
    out: str
    """Where the script writes its per-iteration timings (JSON)."""
    spec: dict[str, Any]
    tokenizer: Any
    policy: torch.nn.Module
    """The trained policy, fp32 weights (under bf16 autocast for a bf16 workload)."""
    reward: torch.nn.Module | None
    """The frozen reward model: bf16 for a bf16 workload; None when the spec names none (distillation)."""
    bf16: bool
    frozen_dtype: torch.dtype


def setup(description: str) -> Setup:
    """Parse ``--spec``/``--out``, seed torch, load the tokenizer (left padding), policy and reward model."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--spec", required=True, help="workload spec JSON written by rayppo bench")
    parser.add_argument("--out", required=True, help="where to write the per-iteration timings (JSON)")
    args = parser.parse_args()
    spec = json.loads(open(args.spec).read())
    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(spec["policy"])
    tokenizer.padding_side = "left"
    # bf16 (the *-bf16 workloads): the trained models keep fp32 weights and run under bf16
    # autocast (TrainingArguments.bf16, accelerate's mixed precision); the frozen ones are bf16.
    bf16 = bool(spec.get("bf16", False))
    frozen = torch.bfloat16 if bf16 else torch.float32
    policy = AutoModelForCausalLM.from_pretrained(spec["policy"], dtype=torch.float32)
    reward = (AutoModelForSequenceClassification.from_pretrained(spec["reward_model"], dtype=frozen)
              if spec.get("reward_model") else None)
    return Setup(args.out, spec, tokenizer, policy, reward, bf16, frozen)


class StepClock(TrainerCallback):
    """Wall time at the start and after every optimiser step."""

    def __init__(self) -> None:
        self.stamps: list[float] = []

    def on_train_begin(self, args, state, control, **kwargs):
        self.stamps.append(time.perf_counter())

    def on_step_end(self, args, state, control, **kwargs):
        self.stamps.append(time.perf_counter())
        print(f"  TRL step {len(self.stamps) - 1}/{args.max_steps}: {self.stamps[-1] - self.stamps[-2]:.2f} s",
              flush=True)
