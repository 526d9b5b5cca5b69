"""The config's system sections: the roles and their resources (generators, reference and reward
scorers, learner), the cluster, the run's checks, stops and outputs. The algorithm's sections and
the root of the tree are in ``schema.py``, which imports these."""

from __future__ import annotations

from dataclasses import dataclass, field

from rayppo.choices import (
    GeneratorBackend,
    LoraExport,
    LoraSync,
    Packing,
    SyncFault,
    TensorParallelLayout,
    WandbMode,
    WeightSync,
    ZeroStage,
)

# What a resumed run (``rayppo train --resume``, ``rayppo scale``) may change is said on the field,
# ``field(metadata=...)``, and read by ``schema.resume_kinds``; everything else would change the math.
RESOURCE: dict[str, str] = {"resume": "resource"}
"""An actor's resources (CPUs, GPUs, threads, cores, the fleet's floor): where the work runs, not its math."""
SPLIT: dict[str, str] = {"resume": "split"}
"""The split of the work over actors: the learner's DeepSpeed state is resharded on load
(``learner/learner_state.py``); the update is the same up to the order of its reductions."""
SECTION: dict[str, str] = {"resume": "section"}
"""On a section of ``Config``: every field of it (stops, outputs, the cluster)."""


@dataclass
class ScorerConfig:
    num: int = field(default=1, metadata=SPLIT)
    """Actors for this role; a rollout is split across them."""
    cpus: float = field(default=0.25, metadata=RESOURCE)
    """Ray CPUs per actor."""
    threads: int | None = field(default=None, metadata=RESOURCE)
    """torch threads per actor; default (``config.derived.role_threads``): where the stages take turns
    on this machine (a local instance, max_staleness 0, no GPU) every core, shared with the other
    scorer's actors; else its CPU share rounded down (at least 1)."""
    gpus: float = field(default=0.0, metadata=RESOURCE)
    """GPUs per actor (fractions share a GPU)."""
    resources: dict[str, float] = field(default_factory=dict, metadata=RESOURCE)
    """Extra Ray resources per actor."""
    micro_batch_tokens: int = 16384
    """Padded tokens per forward pass of this role's model (the reference policy, a reward model):
    rows sorted by length and cut like ``learner.micro_batch_tokens``, results back in row order.
    0: fixed batches in row order (64 rows for the reference, ``reward.batch_size`` for a reward
    model), each padded to its longest row."""
    cores: list[int] | None = field(default=None, metadata=RESOURCE)
    """CPU cores every actor of this role is pinned to (all its threads and child processes),
    e.g. ``[0]``. Roles on disjoint cores no longer slow each other down, as roles on separate
    GPUs would not (``rayppo bench`` of ``rollout.max_staleness``). Core numbers of the node
    the actor runs on (Linux); default: not pinned, the OS schedules."""


@dataclass
class RewardConfig(ScorerConfig):
    function: str | None = "rayppo.tasks.digits:reward"
    """Verifier ``module:function`` called as ``f(prompt: str, response: str, **row) -> float``;
    ``row`` holds the prompt row's other columns (e.g. ``answer``), passed when the function
    takes them (named, or ``**kwargs``). The module is imported from the current directory first
    (``rayppo submit`` ships it). Setting ``reward.model`` or ``reward.url`` clears this default."""
    model: str | None = None
    """Folder of a Hugging Face sequence-classification reward model (one label). Prompt and
    response are rendered with the reward model's own chat template when its tokenizer has one
    (a chat prompt as its conversation, then the response as the assistant turn), else as
    ``prompt + " " + response`` text, and re-tokenised with its own tokenizer."""
    url: str | None = None
    """HTTP reward endpoint: POST ``{"prompts": [...], "responses": [...], "messages": [...],
    "rows": [...]}`` (``messages``: each chat prompt's conversation or null; ``rows``: each
    prompt row's other columns), answer ``{"scores": [...]}`` (one float per response)."""
    normalize: bool = True
    """Serve a ``reward.model`` as (r_φ − mean) / std with the mean and std of its held-out
    responses that ``rayppo reward-model`` wrote beside it (``reward_stats.json``): a fixed unit,
    so ``ppo.kl_coef`` weighs the same against any reward model (docs/reward-models.md). A folder
    without the file is served as it is."""
    gold_function: str | None = None
    """A gold scorer ``module:function`` (a verifier, called as ``reward.function`` is) recorded
    beside the reward on the same rows (``reward/gold_mean``, ``eval/gold/mean``) and never
    trained on: with a learned ``reward.model`` it shows how far the proxy has drifted from the
    truth (docs/reward-models.md, "Proxy versus gold"). Both are drawn against KL(pi || pi_ref),
    so a run with ``ppo.kl_coef=0`` loads the reference too, to measure that KL only."""
    timeout_s: float = 30.0
    """Seconds per HTTP request, and per call of a verifier function (which runs in a child
    process that is killed past it, so a hanging verifier cannot stall the run)."""
    timeout_score: float | None = None
    """Score of a response whose verifier call ran past ``timeout_s``; null stops the run with an
    error naming the prompt instead."""
    retries: int = 3
    """HTTP endpoint: attempts per batch before the job fails (exponential back-off)."""
    batch_size: int = 32
    """Responses per HTTP request, and per reward-model forward pass when ``micro_batch_tokens`` is 0."""


@dataclass
class ChecksConfig:
    max_logprob_mismatch: float | None = None
    """Correctness guard: largest allowed |log pi_old (generator) - log pi (learner)| over the
    tokens of the first minibatch, measured before the update. Above it the run stops before
    training on the rollout, naming the iteration and the generator. Default by ``model.dtype``:
    1e-3 in float32 (a healthy sync measures ~1e-5); not checked in bfloat16, where the per-token
    gap of healthy kernels has a heavy tail (0.3-0.54 nats measured on SmolLM2-135M) and
    ``max_logprob_kl`` is the check."""
    max_logprob_kl: float | None = None
    """Correctness guard: largest allowed mean, over each generator's tokens of the first minibatch,
    of k3 = exp(d) - 1 - d, d = log pi - log pi_old (the estimate of KL(generator || learner) per token;
    no token adds more than half this limit: ``learner/guard.generator_kl``),
    before the update. Default by ``model.dtype``: 1e-6 in float32 (healthy: ~1e-10), 1e-2 in
    bfloat16 (healthy on SmolLM2-135M: 1.2e-3; a generator sampling at T = 0.9 for a learner at 1.0:
    1.7e-2; the bound is a typical PPO update's whole trust-region KL, docs/real-model.md)."""
    verify_sync: bool = True
    """After every weight sync each generator fingerprints the weights it actually holds and the
    run stops, naming generator, tensor and iteration, if they differ from what learner rank 0
    sent. Metric ``sync/verified`` is 1.0 when every generator matched (0.0 when the check is off;
    NaN with full weights on tensor-parallel vLLM generators, which are not fingerprinted yet;
    their LoRA adapters are, worker by worker)."""
    sync_fault: SyncFault = "none"
    """Testing only: make every generator break its weight loads on purpose, to show the guard
    stopping the run: ``none``, ``skip_all`` (load nothing; with LoRA adapter sync, keep serving
    the previous adapter), ``skip_tensor`` / ``perturb_tensor`` (skip, or add 1% of its RMS to,
    the tensor ``sync_fault_tensor``), ``drop_adapter`` (adapter sync: load it, then serve every
    request with no adapter)."""
    sync_fault_tensor: str = "model.layers.0.mlp.down_proj.weight"
    """Testing only: the (Hugging Face) tensor name ``sync_fault`` hits."""


@dataclass
class StopConfig:
    iterations: int = 40
    """PPO iterations (rollout + update) to run."""
    kl_budget: float = 20.0
    """Stop early once the mean KL(pi || pi_ref) per response exceeds this many nats."""
    gold_patience: int = 0
    """With a gold scorer (``reward.gold_function``): stop, with a checkpoint, once the held-out
    gold mean has not improved on its best for this many evaluations while the held-out proxy
    reward rose over them (over-optimisation of a learned reward model); 0: off."""
    sigterm_grace_s: float = 25.0
    """SIGTERM (``ray job stop``, ``rayppo stop``, Kubernetes eviction, spot reclaim) is a
    preemption: the run finishes the iteration in flight and writes its checkpoint when that fits
    in this many seconds (estimated from the last iteration and checkpoint), then exits 143; when
    it cannot, it stops at once and names the checkpoint that stands. The default fits
    Kubernetes' 30 s termination grace; ``rayppo submit`` sets Ray's SIGKILL delay above it."""


@dataclass
class OutputConfig:
    dir: str = "runs/default"
    """Run folder: metrics.jsonl, TensorBoard events, plot.png, the final policy and critic."""
    save_rollouts: bool = False
    """Write every iteration's rollouts to ``DIR/rollouts/iter_XXXXX.parquet``: per row the prompt and
    response ids and text, log-probs (old and reference), score, group id, and the advantages (and,
    with a critic, returns) the update trained on."""
    tensorboard: bool = True
    """Also write TensorBoard event files to ``DIR/tb``."""
    save_model: bool = True
    """Save the final policy (Hugging Face format) and critic to ``DIR/policy``, ``DIR/critic``."""
    lora_export: LoraExport = "both"
    """A LoRA policy's export (with ``save_model``): ``merged`` (``DIR/policy``, W + s B A, loads
    with ``from_pretrained`` alone), ``adapter`` (``DIR/policy-adapter``, a peft folder that
    ``PeftModel.from_pretrained(base, DIR/policy-adapter)`` loads on the base model; a few MB) or
    ``both``."""
    checkpoint_every: int = 20
    """Write a checkpoint every N iterations to ``DIR/checkpoints/iter_NNNNNN`` (0: only on Ctrl-C
    and correctness-guard stops). A checkpoint holds everything the next iteration depends on:
    policy and critic with their optimizer states (DeepSpeed, every ZeRO partition), beta, the
    prompt order and position, the iteration; sampling is seeded per iteration from ``seed``.
    It is written to a temporary folder, renamed into place, then ``checkpoints/latest`` is
    updated, so a crash while writing leaves the previous one intact. 20 suits iterations of a
    minute or more (at most 20 iterations are redone after a failure); lower it for slow ones."""
    keep_checkpoints: int = 2
    """How many of the newest checkpoints to keep (older ones are deleted after a new one is in
    place)."""
    overwrite: bool = False
    """Start a new run in a ``dir`` that already holds one (its metrics, models, checkpoints and
    TensorBoard files are deleted first); without it such a start is refused (``--resume DIR``
    continues a run instead)."""
    samples_every: int = 10
    """Every N iterations print a few of the batch's responses (prompt, response, reward) and
    write them to TensorBoard as text; 0 never."""
    samples_shown: int = 3
    """How many responses ``samples_every`` shows."""
    wandb_project: str | None = None
    """Also log metrics, samples and the resolved config to this Weights & Biases project
    (``pip install wandb``)."""
    wandb_mode: WandbMode = "online"
    """``online``, ``offline`` (written under ``dir/wandb``; ``wandb sync`` uploads it later) or
    ``disabled``."""
    mlflow_uri: str | None = None
    """Also log metrics and the resolved config to MLflow: a tracking server URL or a local
    folder (``pip install mlflow-skinny``)."""
    run_name: str | None = None
    """Run name in W&B and MLflow; default: the last part of ``dir``."""
    mfu: bool = True
    """Per-stage FLOP rates in every iteration's metrics: ``perf/tflops/<stage>``,
    ``perf/tokens_per_s/<stage>`` and ``perf/mfu/<stage>``, the last over a matmul rate measured
    once at the start (about a second, in ``model.dtype`` on the learner's threads or GPU;
    docs/benchmarks.md, "MFU per stage"). false: no probe and no ``perf/mfu/*``."""


@dataclass
class ClusterConfig:
    address: str | None = None
    """Ray cluster to join (``auto``: ``$RAY_ADDRESS``, else the cluster ``ray start`` runs on this
    machine; ``ray://host:10001``, ``host:6379``); null joins ``$RAY_ADDRESS`` if that is a
    ``host:port``, else starts a private local Ray instance sized to this machine (beside any
    cluster running here, and says so) and shuts it down at the end."""
    num_cpus: float | None = None
    """Logical CPUs of the local Ray instance; default: the machine's cores, or what the roles
    ask for when that is more (oversubscribing a small machine is fine: the stages of an
    iteration take turns, so the roles rarely compute at once)."""
    placement_timeout_s: float = 60.0
    """How long to wait for the roles' placement groups before failing with what is missing; and
    how long a replacement generator may find no place (its node gone, no other with room) before
    the run goes on without it (``generators.min_num``)."""
    colocate: bool = False
    """Place the reference and reward actors in the learner's placement group (same nodes)."""
    colocate_all: bool = False
    """Colocated mode: every role shares the learner's GPUs (one bundle per learner rank holds
    that rank, a generator, and the reference and reward actors). vLLM sleeps (weights to host
    memory, KV cache freed) while the learner trains and wakes up for the weight sync, so a
    policy, critic, reference and reward model fit where the disaggregated layout would not.
    Needs ``learner.gpus_per_rank`` 0 or 1 and at most one generator per rank; on CPUs the same
    schedule runs with sleep/wake skipped (vLLM refuses sleep mode on CPU)."""
    actor_env: dict[str, str] = field(default_factory=dict)
    """Environment variables for every actor process, over rayppo's defaults (which include
    ``NCCL_NVLS_ENABLE=0``: NVLS can hang or corrupt data with Ray's per-actor
    ``CUDA_VISIBLE_DEVICES`` on H100/H200 nodes, NVIDIA/nccl#1906; set it to 1 here to undo)."""
    max_actor_restarts: int = 3
    """Generator, reference and reward actors that die (SIGKILL, OOM, node loss) or miss
    ``call_timeout_s`` are replaced and their share of the work is redone; a learner rank that
    does restarts the learner group from the latest checkpoint. At most this many restarts (all
    roles together) within any ``restart_window`` completed iterations: more is a crash loop, and
    the run stops naming the role, the actor, the cause and the command to resume. Sporadic faults
    are survived for as long as the run lasts."""
    restart_window: int = 10
    """The crash-loop window of ``max_actor_restarts``, in completed iterations (redone ones
    count): a restart older than that no longer counts against the budget."""
    call_timeout_s: float = 1800.0
    """Deadline of one generate or scoring call of one actor (its share of a rollout batch), and
    of each learner call (a PPO iteration's update, a checkpoint). Past it the actor counts as
    hung: its threads' stacks go to its log, it is replaced and its share redone (a learner rank:
    the learner group restarts from the latest checkpoint). Size it above the slowest honest call
    (long responses on a slow GPU take minutes)."""
    sync_timeout_s: float = 600.0
    """How long joining the weight-sync group and each broadcast (NCCL or gloo) may wait for
    the other side before the run fails."""


@dataclass
class GeneratorConfig:
    num: int = field(default=1, metadata=SPLIT)
    """G: generator actors; the prompts of an iteration are split across them."""
    min_num: int = field(default=1, metadata=RESOURCE)
    """The fewest generators the run goes on with. A generator whose node is gone and whose
    replacement finds no place within ``cluster.placement_timeout_s`` leaves the fleet: the others
    take its share of the next batches (the same rows: a row's sampling noise does not depend on
    the split), and it rejoins once the cluster has room again (its weights brought to the current
    version and checked first). Below this many the run stops with a checkpoint and the command to
    resume. Colocated mode (``cluster.colocate_all``) never shrinks: a generator shares its node
    with a learner rank."""
    backend: GeneratorBackend = "vllm"
    """``vllm`` (vLLM engine) or ``hf`` (transformers generate, for models vLLM cannot load)."""
    cpus_per_worker: float = field(default=0.5, metadata=RESOURCE)
    """Ray CPUs per generator (its torch/OpenMP threads follow this share)."""
    threads: int | None = field(default=None, metadata=RESOURCE)
    """torch/OpenMP threads per generator; default (``config.derived.role_threads``): where the
    stages take turns on this machine (a local instance, max_staleness 0, no GPU) its share of every
    core among the generators; else its CPU share rounded down (at least 1)."""
    gpus_per_worker: float = field(default=0.0, metadata=RESOURCE)
    """GPUs per generator: above 1 it is vLLM's tensor-parallel size; a fraction shares one GPU
    with other roles (vLLM's memory share follows it, see ``gpu_memory_utilization``)."""
    tensor_parallel_size: int | None = None
    """vLLM tensor-parallel workers per generator; default: ``gpus_per_worker`` when above 1,
    else 1. With GPUs it must equal ``gpus_per_worker``; on CPUs each worker is a process."""
    tensor_parallel_layout: TensorParallelLayout = "one_node"
    """Where a tensor-parallel generator's GPUs are: ``one_node`` (the actor holds all its GPUs
    on one node and vLLM runs its ``mp`` executor) or ``across_nodes`` (one placement group of
    one-GPU bundles per generator, the actor holds no GPU, vLLM's ``ray`` executor places a
    worker in each bundle)."""
    gpu_memory_utilization: float | None = None
    """vLLM: share of each GPU's *whole* memory the engine may use (weights, activations, KV
    cache). Default: 0.85 x the generator's GPU share (0.85 with whole GPUs, 0.34 at
    ``gpus_per_worker=0.4``), or 0.4 in colocated mode (the learner keeps its weights and
    optimizer states on the GPU while vLLM is awake). A value above the share is refused."""
    max_model_len: int | None = None
    """vLLM: longest prompt + response; default: what the job needs, its longest prompt (training and
    held-out) + ``rollout.max_new_tokens``, within the model's context. Not the model's whole
    context by default: vLLM refuses to start when one sequence that long does not fit its KV
    cache (a 128k-token Llama 3.1 8B needs 16 GiB of it)."""
    kv_cache_gib: float = 1.0
    """vLLM on CPU: KV-cache size in GiB (VLLM_CPU_KVCACHE_SPACE)."""
    enforce_eager: bool = True
    """vLLM: skip graph capture/compilation (faster start; set false for long GPU runs)."""
    resources: dict[str, float] = field(default_factory=dict, metadata=RESOURCE)
    """Extra Ray resources per generator, e.g. ``{generator_node: 1}`` to pin to node types."""
    cores: list[int] | None = field(default=None, metadata=RESOURCE)
    """CPU cores every generator (and its vLLM workers) is pinned to; see ``reference.cores``."""


@dataclass
class LearnerConfig:
    num_ranks: int = field(default=2, metadata=SPLIT)
    """N: learner ranks, one torch.distributed group (gloo on CPU, nccl on GPU)."""
    cpus_per_rank: float = field(default=0.5, metadata=RESOURCE)
    """Ray CPUs per rank."""
    threads: int | None = field(default=None, metadata=RESOURCE)
    """torch threads per rank; default (``config.derived.role_threads``): where the stages take turns
    on this machine (a local instance, max_staleness 0, no GPU) the cores divided among the ranks;
    else its CPU share rounded down (at least 1)."""
    gpus_per_rank: float = field(default=0.0, metadata=RESOURCE)
    """GPUs per rank: 0, 1, or a fraction to share one GPU with other roles."""
    zero_stage: ZeroStage = field(default=2, metadata=SPLIT)
    """DeepSpeed ZeRO stage 0-3 for policy and critic."""
    offload: bool = False
    """ZeRO: keep optimizer states (and, at stage 3, parameters) in CPU memory."""
    micro_batch_tokens: int = 16384
    """Padded tokens per forward/backward pass of the learner: each rank's rows of a minibatch are
    sorted by length and cut into micro-batches of at most this many tokens (rows x its longest
    prompt + longest response), gradients accumulated into one optimiser step, every loss
    normalised by the whole minibatch's counts (so the update is the unsplit one). Ranks get the
    minibatch's rows dealt by tokens. Bounds activation memory and pays for tokens, not for the
    padding of a batch's longest response; a row longer than this is a pass of its own. The
    experience pass (values, log pi_prox) is cut the same way. 0: one pass per minibatch."""
    packing: Packing = "auto"
    """How a micro-batch's rows are laid out (``models/packing.py``), the same numbers in each:
    ``padded``, left-padded prompts then right-padded responses, with an attention mask;
    ``right_padded``, each sequence from column 0, rows as wide as the pass's longest sequence, no
    attention mask (the padding is after every real token), so SDPA keeps its fused causal kernel;
    ``packed``, several sequences end to end in a row, positions restarted, no attention across
    them: one row under flash-attention 2 (its varlen kernel) and under SDPA for the plain-causal
    families of ``models.shape.VARLEN_MODELS`` (attention per sequence, fused kernel,
    no block mask), else rows as wide as the longest sequence, which SDPA takes as a block mask.
    ``auto``: packed where no block mask is needed, else right_padded for the families whose
    transformers attention reads the position ids (``models.packing.PACKING_MODELS``), else padded.
    The reference's passes follow the same choice. Measured: docs/benchmarks.md."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass (less memory, more compute). The trained
    models run in train mode with every dropout at 0, so checkpointing is active and the first
    PPO ratio is still exactly 1."""
    lora_rank: int = 0
    """LoRA rank on the policy (peft, every linear layer of the decoder); 0 trains all weights."""
    lora_alpha: float = 16.0
    """LoRA alpha (scaling = alpha / rank)."""
    lora_sync: LoraSync = "auto"
    """How a LoRA policy reaches the generators (docs/lora.md): ``adapter``, only the adapter's
    A and B travel and the generators serve them on the base model they loaded once (vLLM's LoRA
    serving; peft on the hf backend), a few % of the bytes; ``merged``, W + (alpha / r) B A under
    the base model's names, as a full-weight sync; ``auto``, adapter where it works (every
    transport of ``learner.weight_sync``, tensor-parallel generators, a rank vLLM serves), else
    merged, with one line at start saying why."""
    resources: dict[str, float] = field(default_factory=dict, metadata=RESOURCE)
    """Extra Ray resources per rank, e.g. ``{learner_node: 1}``."""
    cores: list[int] | None = field(default=None, metadata=RESOURCE)
    """CPU cores every rank is pinned to; see ``reference.cores``."""
    weight_sync: WeightSync = "auto"
    """How new weights reach the generators: ``broadcast`` (learner rank 0 broadcasts over a
    process group with the generators' inference workers: NCCL when both roles have whole GPUs,
    gloo when neither has GPUs), ``object_store`` (rank 0 puts them once in Ray's object store,
    every generator reads them), ``ipc`` (colocated mode on GPUs: each learner rank's GPU hands
    CUDA-IPC handles to the generator on the same GPU, no copy), or ``auto`` (ipc when colocated
    on GPUs, broadcast between whole GPUs, else object store; always object store when
    ``rollout.max_staleness`` > 0, which updates one generator at a time)."""
