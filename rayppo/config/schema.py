"""One dataclass tree for the whole job: YAML file + dotted command-line overrides.

    rayppo train --config job.yaml ppo.clip_eps=0.1 rollout.batch_size=128

Every field has a docstring (the string under it), which ``rayppo config`` prints and the docs'
config reference is generated from (``reference_page.py``). The system's sections (roles, cluster,
checks, stops, outputs) are in ``system.py``. ``load.py`` parses, converts types and runs
the cross-field checks of ``checks.py``; ``derived.py`` holds what the fields imply. Every error
names the field it is about.
"""

from __future__ import annotations

import ast
import dataclasses
from dataclasses import dataclass, field
from typing import Any

from rayppo.choices import (
    Advantage,
    Dtype,
    KLEstimator,
    KLMode,
    LossAgg,
    LrSchedule,
    OffpolicyAdvantages,
    RolloutCorrection,
    TrainerKind,
    TruncationSetting,
    ValueTargets,
)
from rayppo.config.distill_section import DistillConfig
from rayppo.config.preference_section import PreferenceConfig
from rayppo.config.system import (
    SECTION,
    ChecksConfig,
    ClusterConfig,
    GeneratorConfig,
    LearnerConfig,
    OutputConfig,
    RewardConfig,
    ScorerConfig,
    StopConfig,
)
from rayppo.errors import RayppoError


class ConfigError(RayppoError, ValueError):
    """A bad configuration value; the message starts with the dotted field name."""


@dataclass
class ModelConfig:
    policy: str = "embedded"
    """Local Hugging Face causal-LM folder for the policy (and its tokenizer), or ``embedded`` for
    the tiny Llama that rayppo builds and warms up itself (no download)."""
    reference: str | None = None
    """Folder of the frozen reference policy pi_ref; default: the initial policy."""
    critic: str | None = None
    """Folder whose backbone initialises the critic V_w (a value head is added); default: the
    policy. A reward-model folder works too."""
    dtype: Dtype = "float32"
    """Parameter dtype of the trained models: ``float32`` or ``bfloat16``."""
    cache_dir: str | None = None
    """Where the embedded model is built and cached; default ``$RAYPPO_CACHE`` or
    ``~/.cache/rayppo``."""


@dataclass
class DataConfig:
    prompts: str = "embedded"
    """Prompts: a ``.jsonl`` file (one JSON object per line), a ``.parquet`` file, a Hugging Face
    ``datasets`` folder written by ``save_to_disk`` (split ``data.split``), or ``embedded`` for
    the default task's generated prompts."""
    prompt_column: str = "prompt"
    """Column (JSON key) that holds the prompt: a string, or a chat conversation (a list of
    ``{role, content}`` messages, rendered with the policy tokenizer's chat template and its
    generation prompt). The row's other columns reach the reward (``reward.function``)."""
    split: str = "train"
    """Split of a ``datasets`` folder saved from a ``DatasetDict`` (ignored for files)."""
    shuffle: bool = True
    """Shuffle the prompts each pass over the dataset."""


@dataclass
class RolloutConfig:
    batch_size: int = 64
    """Prompts per PPO iteration; the batch holds batch_size x ``samples_per_prompt`` responses."""
    samples_per_prompt: int = 1
    """n: responses sampled per prompt, a *group* (GRPO's G, veRL's ``rollout.n``). Each row carries
    its group's id, every group statistic keys on it; a prompt's n samples go to one generator
    (vLLM's prefix cache holds the prompt once), each with its own noise. The group estimators
    (``ppo.advantage``) need n >= 2; 1 samples one response per prompt."""
    max_new_tokens: int = 12
    """Response length limit T; a response cut here is a truncation (see ``truncation``)."""
    temperature: float = 1.0
    """Sampling temperature; the learner recomputes log-probs as log_softmax(logits / T)."""
    top_p: float = 1.0
    """Nucleus sampling threshold; must be 1.0. Below 1 the sampler draws from a renormalised
    nucleus while the learner and the reference score the full ``log_softmax(logits / T)``, so
    the PPO ratio and every KL_t would be off by up to ``-log top_p``: refused at load."""
    ignore_eos: bool = False
    """Always generate ``max_new_tokens`` tokens (fixed-length throughput benchmarks)."""
    truncation: TruncationSetting = "auto"
    """How a response cut at ``max_new_tokens`` (finish reason ``length``) enters the return.
    ``auto``: ``bootstrap`` with a critic (``ppo.advantage=gae``), ``terminal`` without one (there
    is no V(S_T) to bootstrap from). ``bootstrap`` (a cut is a time limit, not an end): the episode was ended artificially, so its score r_phi
    is *not* added (it is still logged in ``reward/mean``) and GAE bootstraps with V(S_T), the
    critic's estimate of everything still to come, the score included. ``terminal``: the cut
    response is final: r_phi on its last token and bootstrap 0 (TRL's and OpenRLHF's choice)."""
    missing_eos_penalty: float = 0.0
    """``truncation=terminal`` only: subtracted from the score of every cut response (a push
    towards ending with EOS); 0 disables."""
    overlong_buffer: int = 0
    """L of DAPO's overlong shaping: a response longer than ``max_new_tokens`` - L tokens has its
    score lowered linearly, reaching -``overlong_penalty`` at ``max_new_tokens``. 0 disables."""
    overlong_penalty: float = 1.0
    """The score lost by a response of ``max_new_tokens`` tokens under ``overlong_buffer``."""
    dynamic_sampling_rounds: int = 0
    """DAPO's dynamic sampling with a group estimator: groups whose rewards are all equal (every
    advantage 0) are dropped and up to this many extra batches of prompts are sampled and rewarded
    until ``batch_size`` informative groups are in hand (``dynamic/*`` metrics count the rounds and
    the dropped groups); only kept rows reach the reference and the learner. 0 disables.
    Synchronous iteration only."""
    max_staleness: int = 0
    """k: how many policy versions a row may lag behind the learner that trains on it. 0: the
    synchronous iteration (generate, score, learn, sync in lock-step). k >= 1: the asynchronous
    pipeline: generators sample the next batches with the newest weights they hold while the
    learner trains, scoring runs as its own stage, and the learner corrects for the lag
    (``ppo.is_clip``, ``ppo.value_targets``); a row older than k versions is dropped and
    counted (``async/dropped_rows``). Distributed trainer, weights through the object store."""
    partial_tokens: int = 0
    """Partial rollouts (asynchronous mode): a generator call samples at most this many tokens of
    each response; the unfinished ones are continued in its next call with the weights it then
    holds, so no call waits on the longest response of a long-tailed batch. A batch then trains the
    groups finished in its calls (its row count varies around ``batch_size``); every token records
    the version that sampled it (``Rollout.token_versions``) and a row whose oldest token lags more
    than ``max_staleness`` versions is dropped with its group. Pays when lengths are long-tailed
    (p99 several times the median); 0 (off) otherwise. Must be below ``max_new_tokens``."""
    environment: str | None = None
    """Multi-turn episodes: ``module:Class`` of the environment the policy talks to (docs/multi-turn.md),
    imported like ``reward.function`` (and shipped by ``rayppo submit``). Each prompt row (a chat
    conversation) starts an episode: the policy's turn, the environment's observation as the next
    message, and so on; its turn rewards add to ``reward.*`` (which an environment makes optional).
    ``max_new_tokens`` then bounds the whole episode after the prompt. null: single-turn responses."""
    max_turns: int = 4
    """Multi-turn: policy turns per episode at most; an episode still going after them is cut
    (finish reason ``length``, see ``truncation``)."""
    turn_tokens: int = 0
    """Multi-turn: tokens per policy turn at most (a turn cut before its end-of-turn token ends the
    episode as cut); 0: what is left of the episode's ``max_new_tokens``."""
    environment_timeout_s: float = 30.0
    """Multi-turn: seconds per environment step; past it the environment's process is killed and the
    step counts as failed."""
    environment_timeout_reward: float | None = None
    """Multi-turn: a failed or timed-out step ends its episode with this turn reward; null stops the
    run with an error naming the environment, the prompt and the turn."""
    environment_workers: int = 4
    """Multi-turn: environment processes per generator; the steps of one turn run on them at once."""
    episode_seconds: float = 0.0
    """Multi-turn: seconds a generator call's episodes may run; those still going after a turn that
    ends past them are cut there (finish reason ``length``, no observation appended). 0: no limit."""
    observation_role: str = "user"
    """Multi-turn: the chat role of an observation message (``tool`` for tool results, when the
    policy's chat template has that role)."""


@dataclass
class PPOConfig:
    epochs: int = 4
    """M: passes over each rollout batch."""
    minibatches: int = 2
    """Minibatches per epoch (one optimiser step each); must divide the batch's rows,
    rollout.batch_size x rollout.samples_per_prompt."""
    advantage: Advantage = "gae"
    """The advantage estimator. ``gae``: GAE over a learned critic V_w (PPO). Critic-free (no
    critic model, optimizer, value pass or checkpoint): ``grpo`` (group-normalised score),
    ``dr_grpo`` (group-centred score; pair it with ``loss_agg=seq-mean-token-sum-norm``), ``rloo``
    (leave-one-out baseline), ``reinforce_pp`` (per-token discounted returns of the shaped reward,
    whitened over the batch; n = 1 works), ``reinforce_pp_baseline`` (group-centred score, then
    whitened). Formulas: docs/estimators.md."""
    group_std_floor: float = 1e-6
    """sigma_min of ``advantage=grpo``: A_i = (r_i - mean) / max(std, sigma_min), so a group whose
    rewards differ by rounding only is not blown up (a group of exactly equal rewards gets 0)."""
    kl_mode: KLMode = "reward"
    """Where the KL to the reference goes. ``reward``: -kl_coef KL_t shapes the per-token reward
    (PPO; a group estimator groups r_i - kl_coef sum_t KL_t). ``loss``: kl_coef times the k3
    estimate, aggregated like the policy loss, is added to the loss and the score is r_i (GRPO).
    kl_coef = 0 (not adaptive) loads no reference model anywhere, unless ``reward.gold_function``
    is set: the reference then only measures KL(pi || pi_ref), the x axis of the gold figure."""
    lr: float = 3e-4
    """Policy learning rate (AdamW)."""
    critic_lr: float = 1e-3
    """Critic learning rate (AdamW)."""
    lr_schedule: LrSchedule = "constant"
    """Both learning rates over the run's ``stop.iterations``, set at each iteration's update:
    ``constant``; ``linear`` decay to ``lr_end`` of them; ``cosine`` (half a cosine) to ``lr_end``.
    Adam moves every weight by about ``lr`` per step whatever the gradient's size, so a run that
    must settle near a target (distillation from a nearby teacher, docs/distillation.md) needs
    the steps to shrink. Formulas: ``learner/lr_schedule.py``."""
    lr_warmup: int = 0
    """Iterations of linear warm-up before the schedule: iteration i < w trains at (i + 1) / (w + 1)
    of the rate (0: none)."""
    lr_end: float = 0.0
    """The decaying schedules' rate at the end of ``stop.iterations``, as a fraction of ``lr``."""
    weight_decay: float = 0.0
    """AdamW weight decay (policy and critic)."""
    max_grad_norm: float = 1.0
    """Gradient clipping norm for policy and critic (0 disables)."""
    clip_eps: float = 0.2
    """epsilon of the clipped surrogate: rho is clipped to [1 - eps, 1 + eps]."""
    clip_eps_high: float | None = None
    """DAPO's clip-higher: the upper bound becomes 1 + clip_eps_high (0.28 with clip_eps 0.2 in
    the paper), so unlikely tokens with a positive advantage can grow; null: clip_eps."""
    value_clip: float | None = 0.2
    """Value clipping range around the rollout's values; null disables (``advantage=gae``)."""
    vf_coef: float = 0.5
    """c1: weight of the value loss in the total loss (``advantage=gae``)."""
    entropy_coef: float = 0.0
    """Weight of the entropy bonus (subtracted from the loss)."""
    gamma: float = 1.0
    """Discount; 1.0 is standard for language (no discounting within a response)."""
    lam: float = 0.95
    """GAE lambda."""
    kl_coef: float = 0.02
    """beta: weight of the per-token KL penalty in the shaped reward (initial value if adaptive).
    With k1 a sampled token earns beta x (log pi_ref - log pi): keep beta times the log-ratio the
    run reaches on wrong tokens below the task's reward per right token, or the shaped return stops
    telling them apart (0.02 for the default task, derived in docs/quickstart.md)."""
    kl_estimator: KLEstimator = "k1"
    """Per-token KL estimator of ``kl_mode=reward``: ``k1``, ``k2`` or ``k3`` (``kl_mode=loss``
    always uses k3, which is >= 0 and whose gradient is the KL's)."""
    adaptive_kl: bool = False
    """Adapt beta towards ``kl_target`` (Ziegler et al. 2019) instead of keeping it fixed."""
    kl_target: float = 6.0
    """Target KL (nats per response) of the adaptive controller."""
    kl_horizon: float = 10000.0
    """Horizon (in responses) of the adaptive controller."""
    whiten_advantages: bool = True
    """``advantage=gae``: whiten advantages over the whole rollout batch before the update (the
    group estimators are normalised by their own formula; ``reinforce_pp*`` always whiten)."""
    loss_agg: LossAgg = "token-mean"
    """Policy-loss aggregation: ``token-mean`` (every valid token of the minibatch, on every rank,
    weighs the same), ``seq-mean-token-mean`` (each response's token mean, then the mean over
    responses) or ``seq-mean-token-sum-norm`` (the sum over tokens / (responses x
    rollout.max_new_tokens): Dr. GRPO's constant)."""
    is_clip: float = 2.0
    """Cap of the truncated importance weight w_t = min(pi_prox / mu, is_clip) on the decoupled
    policy loss (mu: the generator's policy that sampled the row, pi_prox: the learner's at the
    start of the update; the clip applies to pi_theta / pi_prox): asynchronous mode, and rollout
    correction (``rollout_correction``)."""
    rollout_correction: RolloutCorrection = "auto"
    """Correct for the gap between the generator's log-probs mu and the learner's pi_prox at the
    same weights (bf16 numerics; staleness in asynchronous mode): ``none`` (the plain clipped loss
    with ratio pi_theta / mu, also in asynchronous mode, where pi_prox still sets the KL term and
    the stale tokens' value targets); ``tis`` (token-level
    truncated importance weights, the decoupled loss with ``is_clip``); ``tis+geo_mask`` (also
    masks each row whose geometric-mean ratio exp(mean_t log(pi_prox / mu)) leaves
    exp(+-geo_mask_bound)). ``auto``: ``none`` in float32 (mu = pi_prox to 1e-5), ``tis+geo_mask``
    in bfloat16, ``tis`` in asynchronous mode (whose staleness would leave the band by design).
    Costs one forward pass without gradient over the batch (pi_prox) where the synchronous
    iteration had none, except when the update is one step of one pass (``ppo.epochs`` =
    ``ppo.minibatches`` = 1): pi_prox is then its own forward (docs/async.md). Metrics ``correction/*``."""
    geo_mask_bound: float = 0.04
    """``rollout_correction=tis+geo_mask``: a row is masked (out of every loss term, normaliser and
    metric of the update) when |mean_t log(pi_prox / mu)| exceeds this many nats. Set at the
    measured p99 of healthy bf16 rows of SmolLM2-135M (0.040; max 0.084, std ~0.017): the ~1% of
    rows whose numerics drifted most are not trained on, and more go as soon as anything drifts.
    (At 0.1 the mask never fired on the real model, and ``tis+geo_mask`` acted as ``tis``.)"""
    value_targets: ValueTargets = "vtrace"
    """Asynchronous mode: ``vtrace`` computes the critic's targets with per-token truncated
    importance weights (rho_t = min(vtrace_rho_clip, pi_prox / mu), c_t = min(vtrace_c_clip,
    pi_prox / mu)) so the critic estimates V of the current policy; ``gae``: plain GAE, which on
    stale rows estimates V of the behaviour policy. Identical when no row is stale."""
    vtrace_rho_clip: float = 1.0
    """rho-bar of ``value_targets=vtrace``: truncates the current token's weight in the value target."""
    vtrace_c_clip: float = 1.0
    """c-bar of ``value_targets=vtrace``: truncates the trace (how far later tokens' errors reach back)."""
    offpolicy_advantages: OffpolicyAdvantages = "gae"
    """Asynchronous mode with ``value_targets=vtrace``: the policy's advantages. ``gae``: GAE of
    the V-trace-trained critic's TD errors along the sampled tokens (the loss's weight w_t
    corrects the current token's sampling, later tokens are not reweighted); ``retrace``:
    A_t = delta_t + gamma lam min(vtrace_c_clip, q_{t+1}) A_{t+1}, Retrace's traces (docs/async.md).
    ``gae`` reached the default task's reward in fewer iterations at k = 1 and 2 (docs/async.md,
    "Which k"): the traces cut the end-of-response reward's way back."""


@dataclass
class EvalConfig:
    prompts: str | None = None
    """Held-out prompts, in the formats of ``data.prompts`` (split ``eval.split``); null: the
    embedded task's held-out split when ``data.prompts`` is ``embedded``, else no evaluation."""
    split: str = "test"
    """Split of a ``datasets`` folder for ``eval.prompts``."""
    every: int = 10
    """Evaluate the current policy every N iterations and after the last one; 0 disables.
    Reported as ``eval/reward/mean`` (and ``eval/pass_rate``, ``eval/pass@k`` for verifier
    rewards) in metrics.jsonl, TensorBoard, the trackers and the plot."""
    samples: int = 4
    """Responses per eval prompt sampled at ``rollout.temperature``, as in training (so
    ``eval/reward/mean`` compares with ``reward/mean``); ``eval/pass@k`` counts a prompt solved
    when any of its k = samples responses passes. 0: greedy responses only."""
    greedy: bool = False
    """Also one greedy (temperature 0) response per eval prompt: ``eval/greedy/reward/mean`` and
    ``eval/greedy/pass_rate`` (the headline figures when ``samples`` is 0)."""
    at_start: bool = False
    """Also evaluate the policy as it starts, before the first update of a new run: the same figures
    under ``initial/`` in iteration 0's record (``initial/eval/greedy/pass_rate``, ...), so a run
    shows its own before and after."""
    pass_threshold: float = 1.0
    """A response passes when its reward is at least this (``eval/pass_rate``, ``eval/pass@k``)."""


@dataclass
class Config:
    seed: int = 0
    """Seed for model init, prompt order and sampling."""
    trainer: TrainerKind = "distributed"
    """``distributed``: the Ray system (vLLM generators, reference/reward actors, DeepSpeed
    learner group). ``reference``: the in-process golden path (transformers only)."""
    cluster: ClusterConfig = field(default_factory=ClusterConfig, metadata=SECTION)
    generators: GeneratorConfig = field(default_factory=GeneratorConfig)
    reference: ScorerConfig = field(default_factory=ScorerConfig)
    learner: LearnerConfig = field(default_factory=LearnerConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    ppo: PPOConfig = field(default_factory=PPOConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    preference: PreferenceConfig = field(default_factory=PreferenceConfig)
    distill: DistillConfig = field(default_factory=DistillConfig)
    checks: ChecksConfig = field(default_factory=ChecksConfig)
    stop: StopConfig = field(default_factory=StopConfig, metadata=SECTION)
    output: OutputConfig = field(default_factory=OutputConfig, metadata=SECTION)


def to_dict(cfg: Config) -> dict[str, Any]:
    """The config as plain nested dicts (for YAML dumps, logs and Ray's object store)."""
    return dataclasses.asdict(cfg)


def field_docs(cls: type = Config, prefix: str = "") -> list[tuple[str, str, str]]:
    """``(dotted name, default, docstring)`` for every leaf field, read from the source."""
    import inspect

    docs: dict[str, str] = {}
    for klass in reversed([k for k in cls.__mro__ if dataclasses.is_dataclass(k)]):
        class_def = ast.parse(inspect.getsource(klass)).body[0]
        assert isinstance(class_def, ast.ClassDef)
        body = class_def.body
        for node, nxt in zip(body, body[1:]):
            if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(nxt, ast.Expr)
                    and isinstance(nxt.value, ast.Constant)):
                docs[node.target.id] = " ".join(str(nxt.value.value).split())
    rows: list[tuple[str, str, str]] = []
    instance = cls()
    for f in dataclasses.fields(cls):
        value = getattr(instance, f.name)
        if dataclasses.is_dataclass(value):
            rows.extend(field_docs(type(value), f"{prefix}{f.name}."))
        else:
            rows.append((f"{prefix}{f.name}", repr(value), docs.get(f.name, "")))
    return rows


def resume_kinds(cls: type = Config, prefix: str = "", section: str | None = None) -> dict[str, str]:
    """``{dotted name: kind}`` of every leaf field a resumed run may change, in the tree's order,
    read off the fields' ``resume`` metadata (``system.py``): ``resource``, ``split``, or
    ``section`` for every field of a section marked as a whole. Fields not named change the math."""
    kinds: dict[str, str] = {}
    instance = cls()
    for f in dataclasses.fields(cls):
        kind = f.metadata.get("resume", section)
        value = getattr(instance, f.name)
        if dataclasses.is_dataclass(value):
            kinds.update(resume_kinds(type(value), f"{prefix}{f.name}.", kind))
        elif kind is not None:
            kinds[f"{prefix}{f.name}"] = kind
    return kinds
