"""What both TRL comparison scripts (``trl_ppo.py``, ``trl_grpo.py``) start with: the spec that
``rayppo bench --compare trl`` wrote, and the models it names (runs in TRL's venv: only torch,
transformers and the standard library)."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer


@dataclass
class Setup:
    out: str
    """Where the script writes its per-iteration timings (JSON)."""
    spec: dict[str, Any]
    tokenizer: Any
    policy: torch.nn.Module
    """The trained policy, fp32 weights (under bf16 autocast for a bf16 workload)."""
    reward: torch.nn.Module
    """The frozen reward model: bf16 for a bf16 workload."""
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
    reward = AutoModelForSequenceClassification.from_pretrained(spec["reward_model"], dtype=frozen)
    return Setup(args.out, spec, tokenizer, policy, reward, bf16, frozen)
