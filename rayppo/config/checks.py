"""Cross-field checks of the config tree: ranges, the algorithm's constraints, and the layouts of
roles on CPUs and GPUs that NCCL, vLLM and DeepSpeed accept. ``validate`` runs at load
(``rayppo.config.load_config``); every error is a ``ConfigError`` that starts with the field.
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
from typing import Any
from urllib.parse import urlsplit

from rayppo.choices import GROUP_ESTIMATORS, choices_text
from rayppo.config.derived import (
    adapter_blockers,
    batch_rows,
    lora_sync,
    role_gpus,
    tensor_parallel_size,
    truncation_mode,
    weight_sync_backend,
)
from rayppo.config.schema import Config, ConfigError


def _require(ok: bool, name: str, message: str, value: Any) -> None:
    if not ok:
        raise ConfigError(f"{name}: {message}, got {value!r}")


def check_choice(value: Any, hint: Any, name: str) -> Any:
    """``value`` as the member of the ``Literal`` type ``hint`` it names (``"2"`` names 2), or a
    ``ConfigError`` listing the choices, with the nearest one for a typo."""
    choices = typing.get_args(hint)
    for choice in choices:
        if value == choice or (not isinstance(value, bool) and str(value) == str(choice)):
            return choice
    close = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1, cutoff=0.6)
    raise ConfigError(f"{name}: {choices_text(choices)}, got {value!r}" + (f" (did you mean {close[0]}?)" if close else ""))


def _check_choices(obj: Any, prefix: str = "") -> None:
    """Every ``Literal``-typed field of the tree holds one of its choices (a config built in code
    is checked as a loaded one is)."""
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            _check_choices(value, f"{prefix}{f.name}.")
        elif typing.get_origin(hints[f.name]) is typing.Literal:
            check_choice(value, hints[f.name], f"{prefix}{f.name}")


def _check_async(cfg: Config) -> None:
    """``rollout.max_staleness``: what the asynchronous pipeline needs."""
    k, partial = cfg.rollout.max_staleness, cfg.rollout.partial_tokens
    _require(k >= 0, "rollout.max_staleness", "must be >= 0", k)
    _require(partial >= 0, "rollout.partial_tokens", "must be >= 0 (0: off)", partial)
    _require(partial == 0 or k >= 1, "rollout.partial_tokens",
             "continues responses with newer weights, which needs the asynchronous pipeline "
             "(rollout.max_staleness >= 1); use 0", partial)
    _require(partial < cfg.rollout.max_new_tokens, "rollout.partial_tokens",
             f"must be below rollout.max_new_tokens={cfg.rollout.max_new_tokens} (0: off)", partial)
    if k == 0:
        return
    _require(cfg.trainer == "distributed", "rollout.max_staleness",
             "needs trainer=distributed (the reference trainer is synchronous; use 0)", k)
    _require(not cfg.cluster.colocate_all, "rollout.max_staleness",
             "cannot overlap generation and learning with cluster.colocate_all=true (they take turns on one "
             "device); use 0", k)
    _require(weight_sync_backend(cfg) is None, "rollout.max_staleness",
             "updates each generator between its own batches, which needs learner.weight_sync=object_store "
             f"(a broadcast stops every generator at once); got learner.weight_sync={cfg.learner.weight_sync}", k)


def _check_episodes(cfg: Config) -> None:
    """``rollout.environment``: multi-turn episodes and their budgets."""
    r = cfg.rollout
    _require(r.max_turns >= 1, "rollout.max_turns", "must be >= 1", r.max_turns)
    _require(0 <= r.turn_tokens <= r.max_new_tokens, "rollout.turn_tokens",
             f"must be in [0, rollout.max_new_tokens={r.max_new_tokens}] (0: the episode's budget left)", r.turn_tokens)
    _require(r.environment_timeout_s > 0, "rollout.environment_timeout_s", "must be > 0", r.environment_timeout_s)
    _require(r.environment_workers >= 1, "rollout.environment_workers", "must be >= 1", r.environment_workers)
    _require(r.episode_seconds >= 0, "rollout.episode_seconds", "must be >= 0 (0: no limit)", r.episode_seconds)
    if r.environment is None:
        return
    _require(":" in r.environment, "rollout.environment", "must look like 'module:Class'", r.environment)
    _require(r.partial_tokens == 0, "rollout.partial_tokens",
             "cannot cut the turns of multi-turn episodes (rollout.environment); use 0", r.partial_tokens)
    _require(not r.ignore_eos, "rollout.ignore_eos",
             "would never end a policy turn of a multi-turn episode (rollout.environment); use false", r.ignore_eos)
    _require(bool(r.observation_role), "rollout.observation_role", "must name a chat role", r.observation_role)


def _check_groups(cfg: Config) -> None:
    """Groups of samples, the estimator, where the KL goes and how rows split into minibatches."""
    r, p = cfg.rollout, cfg.ppo
    n = r.samples_per_prompt
    _require(n >= 1, "rollout.samples_per_prompt", "must be >= 1", n)
    _require(n >= 2 or p.advantage not in GROUP_ESTIMATORS, "rollout.samples_per_prompt",
             f"must be >= 2 with ppo.advantage={p.advantage}: its baseline is the other samples of the prompt "
             "(with one sample every advantage is 0)", n)
    _require(p.group_std_floor > 0, "ppo.group_std_floor", "must be > 0", p.group_std_floor)
    _require(r.truncation != "bootstrap" or p.advantage == "gae", "rollout.truncation",
             f"bootstrap needs a critic's V(S_T), and ppo.advantage={p.advantage} trains none: use auto or terminal",
             r.truncation)
    _require(0 <= r.overlong_buffer <= r.max_new_tokens, "rollout.overlong_buffer",
             f"must be in [0, rollout.max_new_tokens={r.max_new_tokens}]", r.overlong_buffer)
    _require(r.overlong_penalty >= 0, "rollout.overlong_penalty", "must be >= 0", r.overlong_penalty)
    rounds = r.dynamic_sampling_rounds
    _require(rounds >= 0, "rollout.dynamic_sampling_rounds", "must be >= 0", rounds)
    _require(rounds == 0 or p.advantage in GROUP_ESTIMATORS, "rollout.dynamic_sampling_rounds",
             f"drops groups of equal rewards, which only a group estimator ({', '.join(GROUP_ESTIMATORS)}) "
             f"cannot learn from; ppo.advantage={p.advantage}", rounds)
    _require(rounds == 0 or r.max_staleness == 0, "rollout.dynamic_sampling_rounds",
             f"runs in the synchronous iteration only (rollout.max_staleness={r.max_staleness})", rounds)
    _require(batch_rows(cfg) % p.minibatches == 0, "ppo.minibatches",
             f"must divide the batch's rows, rollout.batch_size x rollout.samples_per_prompt = {r.batch_size} x {n}",
             p.minibatches)


def validate(cfg: Config) -> Config:
    """Check ranges and cross-field constraints; raise ``ConfigError`` naming the field.

    This part covers the algorithm's sections; ``_validate_system`` the roles and resources."""
    _check_choices(cfg)
    _check_sampling(cfg)
    _check_ppo(cfg)
    _check_async(cfg)
    _check_episodes(cfg)
    _check_stops(cfg)
    _check_reward(cfg)
    _validate_outputs(cfg)
    _validate_preference(cfg)
    _validate_distill(cfg)
    return _validate_system(cfg)


def _check_sampling(cfg: Config) -> None:
    """The rollout's sampling and the generators' log-prob checks."""
    r = cfg.rollout
    _require(r.batch_size >= 1, "rollout.batch_size", "must be >= 1", r.batch_size)
    _require(r.max_new_tokens >= 1, "rollout.max_new_tokens", "must be >= 1", r.max_new_tokens)
    _require(r.temperature > 0, "rollout.temperature", "must be > 0", r.temperature)
    _require(r.top_p == 1.0, "rollout.top_p", "must be 1.0: nucleus sampling renormalises the sampled "
             "distribution, which the learner's and reference's log_softmax(logits / T) do not model, so the "
             "PPO ratio and KL would be silently wrong", r.top_p)
    _require(r.missing_eos_penalty >= 0, "rollout.missing_eos_penalty", "must be >= 0", r.missing_eos_penalty)
    _require(r.missing_eos_penalty == 0 or truncation_mode(cfg) == "terminal", "rollout.missing_eos_penalty",
             "applies only with rollout.truncation=terminal (under bootstrap a cut row has no score)",
             r.missing_eos_penalty)
    limit = cfg.checks.max_logprob_mismatch
    _require(limit is None or limit > 0, "checks.max_logprob_mismatch", "must be > 0 or null", limit)
    kl = cfg.checks.max_logprob_kl
    _require(kl is None or kl > 0, "checks.max_logprob_kl", "must be > 0 or null", kl)


def _check_ppo(cfg: Config) -> None:
    """The update's ranges: epochs and minibatches, the groups, the clips, the estimators' constants."""
    p = cfg.ppo
    _require(p.epochs >= 1, "ppo.epochs", "must be >= 1", p.epochs)
    _require(p.minibatches >= 1, "ppo.minibatches", "must be >= 1", p.minibatches)
    _check_groups(cfg)
    _require(0 < p.clip_eps < 1, "ppo.clip_eps", "must be in (0, 1)", p.clip_eps)
    _require(p.clip_eps_high is None or 0 < p.clip_eps_high < 1, "ppo.clip_eps_high", "must be in (0, 1) or null",
             p.clip_eps_high)
    _require(p.value_clip is None or p.value_clip > 0, "ppo.value_clip", "must be > 0 or null", p.value_clip)
    _require(0 < p.gamma <= 1, "ppo.gamma", "must be in (0, 1]", p.gamma)
    _require(0 <= p.lam <= 1, "ppo.lam", "must be in [0, 1]", p.lam)
    _require(p.kl_coef >= 0, "ppo.kl_coef", "must be >= 0", p.kl_coef)
    _require(p.kl_target > 0, "ppo.kl_target", "must be > 0", p.kl_target)
    _require(p.kl_horizon > 0, "ppo.kl_horizon", "must be > 0", p.kl_horizon)
    _require(p.lr > 0, "ppo.lr", "must be > 0", p.lr)
    _require(p.critic_lr > 0, "ppo.critic_lr", "must be > 0", p.critic_lr)
    _require(0 <= p.lr_end <= 1, "ppo.lr_end", "must be in [0, 1] (a fraction of ppo.lr)", p.lr_end)
    _require(0 <= p.lr_warmup < cfg.stop.iterations, "ppo.lr_warmup",
             f"must be >= 0 and below stop.iterations ({cfg.stop.iterations})", p.lr_warmup)
    _require(p.vf_coef >= 0, "ppo.vf_coef", "must be >= 0", p.vf_coef)
    _require(p.geo_mask_bound > 0, "ppo.geo_mask_bound", "must be > 0 (nats)", p.geo_mask_bound)
    _require(p.is_clip >= 1, "ppo.is_clip", "must be >= 1 (a cap below 1 would down-weight on-policy tokens)",
             p.is_clip)
    _require(p.vtrace_rho_clip > 0, "ppo.vtrace_rho_clip", "must be > 0", p.vtrace_rho_clip)
    _require(0 < p.vtrace_c_clip <= p.vtrace_rho_clip, "ppo.vtrace_c_clip",
             f"must be in (0, ppo.vtrace_rho_clip={p.vtrace_rho_clip:g}] (V-trace needs c-bar <= rho-bar)",
             p.vtrace_c_clip)


def _check_stops(cfg: Config) -> None:
    """When the run stops, and how often it writes a checkpoint."""
    _require(cfg.stop.iterations >= 1, "stop.iterations", "must be >= 1", cfg.stop.iterations)
    _require(cfg.stop.kl_budget > 0, "stop.kl_budget", "must be > 0", cfg.stop.kl_budget)
    _require(cfg.stop.gold_patience >= 0, "stop.gold_patience", "must be >= 0 (0: off)", cfg.stop.gold_patience)
    _require(cfg.stop.gold_patience == 0 or (cfg.reward.gold_function is not None and cfg.eval.every > 0),
             "stop.gold_patience", "compares held-out gold and proxy: it needs reward.gold_function and eval.every > 0",
             cfg.stop.gold_patience)
    _require(cfg.output.checkpoint_every >= 0, "output.checkpoint_every", "must be >= 0", cfg.output.checkpoint_every)
    _require(cfg.output.keep_checkpoints >= 1, "output.keep_checkpoints", "must be >= 1", cfg.output.keep_checkpoints)


def _check_reward(cfg: Config) -> None:
    """Exactly one reward (or an environment's), its limits, the gold scorer beside it."""
    sources = (cfg.reward.function, cfg.reward.model, cfg.reward.url)
    chosen = sum(x is not None for x in sources)
    alone = cfg.rollout.environment is not None or cfg.distill.teacher is not None  # something else trains
    _require(chosen == 1 or (chosen == 0 and alone), "reward.function",
             "set exactly one of reward.function, reward.model and reward.url (none only with rollout.environment, "
             "whose turn rewards are then the whole reward, or a distill.teacher: pure distillation)", sources)
    _require(cfg.reward.timeout_s > 0, "reward.timeout_s", "must be > 0", cfg.reward.timeout_s)
    _require(cfg.reward.retries >= 1, "reward.retries", "must be >= 1", cfg.reward.retries)
    if cfg.reward.url is not None:  # never file://, ftp:// or a bare path: only a scorer over HTTP
        url = urlsplit(cfg.reward.url)
        _require(url.scheme in ("http", "https") and bool(url.netloc), "reward.url",
                 "must be an http:// or https:// URL", cfg.reward.url)
    if cfg.reward.function is not None:
        _require(":" in cfg.reward.function, "reward.function", "must look like 'module:function'", cfg.reward.function)
    if cfg.reward.gold_function is not None:
        _require(":" in cfg.reward.gold_function, "reward.gold_function", "must look like 'module:function'",
                 cfg.reward.gold_function)
        _require(sources[0] is not None or sources[1] is not None or sources[2] is not None, "reward.gold_function",
                 "is recorded beside a reward; set reward.function, reward.model or reward.url too", sources)
    _require(cfg.reward.batch_size >= 1, "reward.batch_size", "must be >= 1", cfg.reward.batch_size)


def _validate_distill(cfg: Config) -> None:
    """The ``distill`` section: its weight, discount and estimator, and what a teacher cannot run with yet."""
    d = cfg.distill
    if d.teacher is None:
        return
    _require(d.coef > 0, "distill.coef", "must be > 0 (the weight of the reverse KL to the teacher)", d.coef)
    _require(0 <= d.gamma <= 1, "distill.gamma", "must be in [0, 1]", d.gamma)
    _require(d.task_reward >= 0, "distill.task_reward", "must be >= 0 (0: pure distillation)", d.task_reward)
    _require(d.gamma == 0 or d.mode == "reward", "distill.gamma", "discounts the distillation rewards of "
             "distill.mode=reward; the loss term is per token", d.gamma)
    _require(not d.center or d.mode == "reward", "distill.center", "centres the advantages of distill.mode=reward; "
             "the loss term has none", d.center)
    _require(d.gamma == 0 or cfg.rollout.environment is None, "distill.gamma", "must be 0 with a multi-turn "
             "rollout.environment (the reward-to-go would cross the observations)", d.gamma)
    _require(not (d.mode == "loss" and d.estimator == "k1"), "distill.estimator", "k1 as a loss term has the gradient "
             "grad log pi(y_t) whatever the teacher says (zero in expectation on the student's samples): use k2 "
             "(the reverse KL's gradient) or k3 (the forward KL's), or auto", d.estimator)
    _require(d.topk >= 0, "distill.topk", "must be >= 0 (0: the sampled token's estimate)", d.topk)
    _require(not d.topk or d.mode == "loss", "distill.topk", "is the loss term's full-distribution KL: it needs "
             "distill.mode=loss (a reward scores the sampled token only)", d.topk)
    _require(not d.topk or d.estimator == "auto", "distill.estimator", "estimates the KL from the sampled token; "
             "with distill.topk the loss is the top-k KL itself, so leave it auto", d.estimator)
    _require(not cfg.cluster.colocate_all, "distill.teacher", "cannot run with cluster.colocate_all yet (the teacher "
             "has no place on the learner ranks' GPUs): give it its own actors", d.teacher)


def _validate_preference(cfg: Config) -> None:
    """The reward-model run's section (``rayppo reward-model``)."""
    f = cfg.preference
    _require(0 <= f.held_out < 1, "preference.held_out", "must be in [0, 1)", f.held_out)
    _require(f.epochs >= 1, "preference.epochs", "must be >= 1", f.epochs)
    _require(f.micro_pairs >= 1, "preference.micro_pairs", "must be >= 1", f.micro_pairs)
    _require(f.batch_pairs >= 1, "preference.batch_pairs", "must be >= 1", f.batch_pairs)
    _require(not f.pairs or f.batch_pairs % cfg.learner.num_ranks == 0, "preference.batch_pairs",
             f"must be a positive multiple of learner.num_ranks={cfg.learner.num_ranks} (every rank takes the same "
             "number of pairs per step)", f.batch_pairs)
    _require(f.lr > 0, "preference.lr", "must be > 0", f.lr)
    _require(f.weight_decay >= 0, "preference.weight_decay", "must be >= 0", f.weight_decay)
    _require(f.max_tokens >= 2, "preference.max_tokens", "must be >= 2", f.max_tokens)
    _require(f.eval_every >= 0, "preference.eval_every", "must be >= 0 (0: after each epoch)", f.eval_every)
    _require(f.samples_per_prompt >= 2, "preference.samples_per_prompt", "must be >= 2 (a pair needs two responses)",
             f.samples_per_prompt)
    _require(f.pairs_per_prompt >= 1, "preference.pairs_per_prompt", "must be >= 1", f.pairs_per_prompt)
    _require(f.max_pairs >= 0, "preference.max_pairs", "must be >= 0 (0: no limit)", f.max_pairs)


def _validate_outputs(cfg: Config) -> None:
    """The eval section and what a run reports."""
    e, o = cfg.eval, cfg.output
    _require(e.every >= 0, "eval.every", "must be >= 0 (0 disables evaluation)", e.every)
    _require(e.samples >= 0, "eval.samples", "must be >= 0", e.samples)
    _require(e.greedy or e.samples > 0 or e.every == 0, "eval.samples",
             "evaluation needs eval.samples > 0 or eval.greedy=true (or eval.every=0 to turn it off)", e.samples)
    _require(o.samples_every >= 0, "output.samples_every", "must be >= 0", o.samples_every)
    _require(o.samples_shown >= 1, "output.samples_shown", "must be >= 1", o.samples_shown)


def _validate_gpus(cfg: Config) -> None:
    """GPU shares, tensor parallelism and colocation: layouts NCCL and vLLM accept."""
    g, lr_, c = cfg.generators, cfg.learner, cfg.cluster
    _require(0 <= lr_.gpus_per_rank <= 1, "learner.gpus_per_rank", "must be in [0, 1]", lr_.gpus_per_rank)
    # Two ranks of one NCCL group on one GPU: NCCL refuses ("Duplicate GPU detected").
    _require(lr_.num_ranks == 1 or lr_.gpus_per_rank in (0, 1), "learner.gpus_per_rank",
             f"a fraction of a GPU per rank needs learner.num_ranks=1 (with learner.num_ranks={lr_.num_ranks} "
             "two ranks of one NCCL group could land on one GPU, which NCCL refuses); use whole GPUs, or "
             "cluster.colocate_all=true to share each rank's GPU with the other roles", lr_.gpus_per_rank)
    _require(g.gpus_per_worker <= 1 or float(g.gpus_per_worker).is_integer(), "generators.gpus_per_worker",
             "above 1 must be a whole number (the tensor-parallel size)", g.gpus_per_worker)
    tp = tensor_parallel_size(g)
    _require(tp >= 1, "generators.tensor_parallel_size", "must be >= 1", g.tensor_parallel_size)
    _require(tp == 1 or g.backend == "vllm", "generators.tensor_parallel_size", "above 1 needs generators.backend=vllm",
             tp)
    _require(g.gpus_per_worker == 0 or tp == max(1, int(g.gpus_per_worker)), "generators.tensor_parallel_size",
             f"must equal generators.gpus_per_worker={g.gpus_per_worker:g} (one GPU per tensor-parallel worker)", tp)
    _require(g.tensor_parallel_layout == "one_node" or (g.gpus_per_worker >= 1 and g.backend == "vllm"),
             "generators.tensor_parallel_layout", "across_nodes needs vLLM generators with whole GPUs "
             "(vLLM's ray executor, which places the workers, is refused on CPU)", g.tensor_parallel_layout)
    util = g.gpu_memory_utilization
    _require(util is None or 0 < util <= 1, "generators.gpu_memory_utilization", "must be in (0, 1] or null", util)
    share = min(1.0, g.gpus_per_worker or 1.0)
    _require(util is None or c.colocate_all or util <= share + 1e-9, "generators.gpu_memory_utilization",
             f"vLLM sizes itself against the whole GPU: with generators.gpus_per_worker={g.gpus_per_worker:g} it "
             f"may use at most {share:g} of it (leave it unset for 0.85 x the share)", util)
    if c.colocate_all:
        _validate_colocated(cfg)


def _validate_colocated(cfg: Config) -> None:
    g, lr_ = cfg.generators, cfg.learner
    _require(lr_.gpus_per_rank in (0, 1), "learner.gpus_per_rank", "must be 0 or 1 with cluster.colocate_all "
             "(each rank's GPU hosts the other roles)", lr_.gpus_per_rank)
    for name, count in (("generators.num", g.num), ("reference.num", cfg.reference.num), ("reward.num", cfg.reward.num)):
        _require(count <= lr_.num_ranks, name, f"with cluster.colocate_all at most learner.num_ranks={lr_.num_ranks} "
                 "(one per learner GPU)", count)
    for name, gpus in (("generators.gpus_per_worker", g.gpus_per_worker), ("reference.gpus", cfg.reference.gpus),
                       ("reward.gpus", cfg.reward.gpus)):
        _require(gpus == 0, name, "is set by cluster.colocate_all (every role shares its learner rank's GPU); "
                 "leave it at 0", gpus)
    _require(tensor_parallel_size(g) == 1, "generators.tensor_parallel_size",
             "must be 1 with cluster.colocate_all (one generator worker per learner GPU)", g.tensor_parallel_size)


def _validate_weight_sync(cfg: Config) -> None:
    g, lr_, mode = cfg.generators, cfg.learner, cfg.learner.weight_sync
    gen_gpus = role_gpus(cfg, "generators")
    _require(weight_sync_backend(cfg) != "ipc" or cfg.checks.sync_fault == "none", "checks.sync_fault",
             "is not implemented for the CUDA-IPC weight sync (use learner.weight_sync=object_store)",
             cfg.checks.sync_fault)
    if mode == "ipc":
        _require(cfg.cluster.colocate_all and lr_.gpus_per_rank == 1 and g.backend == "vllm", "learner.weight_sync",
                 "ipc needs cluster.colocate_all=true, learner.gpus_per_rank=1 and vLLM generators (CUDA-IPC "
                 "hands a GPU's tensors to another process on the same GPU)", mode)
    if mode == "broadcast":
        _require((lr_.gpus_per_rank > 0) == (gen_gpus > 0), "learner.weight_sync", "broadcast needs generators "
                 "and the learner both on GPUs or both on CPUs (use object_store)", mode)
        _require(not gen_gpus or (lr_.gpus_per_rank >= 1 and gen_gpus >= 1 and not cfg.cluster.colocate_all),
                 "learner.weight_sync", "broadcast over NCCL needs whole GPUs per learner rank and generator (NCCL "
                 "cannot join two processes sharing one GPU; use object_store, or ipc when colocated)", mode)


def _check_cores(cfg: Config, name: str, cores: list[int] | None) -> None:
    """``<role>.cores``: a non-empty list of distinct core numbers, for the distributed system's actors."""
    if cores is None:
        return
    _require(len(cores) > 0 and all(isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in cores),
             name, "must be a non-empty list of CPU core numbers (>= 0), e.g. [0, 1], or null", cores)
    _require(len(set(cores)) == len(cores), name, "lists a core twice", cores)
    _require(cfg.trainer == "distributed", name, "pins the distributed system's actors; trainer=reference runs "
             "in this process (use taskset), unset it", cores)


def _validate_system(cfg: Config) -> Config:
    """Cross-field checks of the distributed system's sections."""
    r = cfg.rollout
    g, lr_ = cfg.generators, cfg.learner
    _require(g.num >= 1, "generators.num", "must be >= 1", g.num)
    _require(g.num <= r.batch_size, "generators.num", f"must be <= rollout.batch_size={r.batch_size}", g.num)
    _require(1 <= g.min_num <= g.num, "generators.min_num", f"must be in [1, generators.num={g.num}]", g.min_num)
    _require(g.cpus_per_worker > 0, "generators.cpus_per_worker", "must be > 0", g.cpus_per_worker)
    _require(g.gpus_per_worker >= 0, "generators.gpus_per_worker", "must be >= 0", g.gpus_per_worker)
    _validate_gpus(cfg)
    for name, role in (("reference", cfg.reference), ("reward", cfg.reward), ("distill", cfg.distill)):
        _require(role.num >= 1, f"{name}.num", "must be >= 1", role.num)
        _require(role.cpus > 0, f"{name}.cpus", "must be > 0", role.cpus)
        _require(0 <= role.gpus <= 1, f"{name}.gpus", "must be in [0, 1] (one model on one GPU)", role.gpus)
    _require(lr_.num_ranks >= 1, "learner.num_ranks", "must be >= 1", lr_.num_ranks)
    _require(lr_.num_ranks <= batch_rows(cfg), "learner.num_ranks",
             f"must be <= the batch's rows (rollout.batch_size x rollout.samples_per_prompt = {batch_rows(cfg)})",
             lr_.num_ranks)
    _validate_weight_sync(cfg)
    _require(lr_.lora_rank >= 0, "learner.lora_rank", "must be >= 0", lr_.lora_rank)
    _require(cfg.checks.sync_fault != "drop_adapter" or lora_sync(cfg)[0] == "adapter", "checks.sync_fault",
             "drop_adapter needs LoRA adapter sync (learner.lora_rank > 0, learner.lora_sync adapter or auto)",
             cfg.checks.sync_fault)
    blockers = adapter_blockers(cfg) if lr_.lora_rank and lr_.lora_sync == "adapter" else []
    _require(not blockers, "learner.lora_sync", f"adapter sync cannot serve {blockers[0] if blockers else ''} "
             "(learner.lora_sync=auto falls back to merged weights)", lr_.lora_sync)
    placed: tuple[tuple[str, Any], ...] = (("generators", g), ("reference", cfg.reference), ("reward", cfg.reward),
                                           ("distill", cfg.distill), ("learner", lr_))  # every role with threads and cores
    for name, placed_role in placed:
        _require(placed_role.threads is None or placed_role.threads >= 1, f"{name}.threads", "must be >= 1 or null",
                 placed_role.threads)
        _check_cores(cfg, f"{name}.cores", placed_role.cores)
    for name, placed_role in placed[1:]:  # the roles that run forward passes in micro-batches
        _require(placed_role.micro_batch_tokens >= 0, f"{name}.micro_batch_tokens",
                 "must be >= 0 (padded tokens per forward pass; 0: unbucketed)", placed_role.micro_batch_tokens)
    _require(cfg.cluster.placement_timeout_s > 0, "cluster.placement_timeout_s", "must be > 0", cfg.cluster.placement_timeout_s)
    _require(cfg.cluster.max_actor_restarts >= 0, "cluster.max_actor_restarts", "must be >= 0",
             cfg.cluster.max_actor_restarts)
    _require(cfg.cluster.restart_window >= 1, "cluster.restart_window", "must be >= 1", cfg.cluster.restart_window)
    _require(cfg.stop.sigterm_grace_s >= 0, "stop.sigterm_grace_s", "must be >= 0", cfg.stop.sigterm_grace_s)
    _require(cfg.cluster.call_timeout_s > 0, "cluster.call_timeout_s", "must be > 0", cfg.cluster.call_timeout_s)
    _require(cfg.cluster.sync_timeout_s > 0, "cluster.sync_timeout_s", "must be > 0", cfg.cluster.sync_timeout_s)
    return cfg
