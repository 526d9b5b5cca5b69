"""The named choices of the config, as ``Literal`` types: each field is typed with one, loading
rejects a value outside it (``config/checks.py``, ``check_choice``), and the math takes them typed.

One place for each list: the config's fields, its checks and ``learner/ppo.py`` all read these.
"""

from __future__ import annotations

from typing import Literal, get_args

GroupEstimator = Literal["grpo", "dr_grpo", "rloo", "reinforce_pp_baseline"]
"""Critic-free estimators whose baseline is the prompt's group of samples."""
Advantage = Literal["gae", "grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline"]
"""``ppo.advantage``: GAE over a critic, or a critic-free estimator (docs/estimators.md)."""
KLMode = Literal["reward", "loss"]
KLEstimator = Literal["k1", "k2", "k3"]
DistillMode = Literal["reward", "loss"]
"""``distill.mode``: where the reverse KL to the teacher enters (docs/distillation.md)."""
DistillEstimator = Literal["auto", "k1", "k2", "k3"]
"""``distill.estimator``: the per-token estimate of KL(pi || pi_T); ``auto``: the mode's own."""
LrSchedule = Literal["constant", "linear", "cosine"]
"""``ppo.lr_schedule``: the learning rate over the run's iterations (``learner/lr_schedule.py``)."""
LossAgg = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
Truncation = Literal["bootstrap", "terminal"]
"""How a response cut at the length limit is valued (resolved from ``rollout.truncation``)."""
TruncationSetting = Literal["auto", "bootstrap", "terminal"]
RolloutCorrection = Literal["auto", "none", "tis", "tis+geo_mask"]
ValueTargets = Literal["gae", "vtrace"]
OffpolicyAdvantages = Literal["gae", "retrace"]
Dtype = Literal["float32", "bfloat16"]
SyncFault = Literal["none", "skip_all", "skip_tensor", "perturb_tensor", "drop_adapter"]
WandbMode = Literal["online", "offline", "disabled"]
GeneratorBackend = Literal["vllm", "hf"]
TensorParallelLayout = Literal["one_node", "across_nodes"]
Packing = Literal["auto", "packed", "right_padded", "padded"]
WeightSync = Literal["auto", "broadcast", "object_store", "ipc"]
LoraSync = Literal["auto", "adapter", "merged"]
LoraExport = Literal["both", "adapter", "merged"]
ZeroStage = Literal[0, 1, 2, 3]
TrainerKind = Literal["distributed", "reference"]

GROUP_ESTIMATORS: tuple[str, ...] = get_args(GroupEstimator)
CRITIC_FREE: tuple[str, ...] = tuple(a for a in get_args(Advantage) if a != "gae")
SYNC_FAULTS: tuple[str, ...] = get_args(SyncFault)


def choices_text(choices: tuple) -> str:
    """``must be a, b or c`` (``must be one of ...`` past four)."""
    names = [str(c) for c in choices]
    if len(names) > 4:
        return f"must be one of {', '.join(names)}"
    return f"must be {', '.join(names[:-1])} or {names[-1]}" if len(names) > 1 else f"must be {names[0]}"
