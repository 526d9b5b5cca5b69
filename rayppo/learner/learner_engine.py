"""One learner rank: DeepSpeed ZeRO engines for the policy and the critic.

``LearnerEngine`` is a plain class (the learner group wraps it in a Ray actor at spawn time).
Each rank joins one torch.distributed group (gloo on CPU, nccl on GPU), holds a shard of every
rollout (rows dealt by tokens, ``data/micro_batches.py``), and runs the learn step on it
(``step.py``, the in-process trainer's too) with DeepSpeed doing gradient averaging, ZeRO partitioning and the optimiser step.
Its checkpoints (and resharding them onto another split) are ``learner_state.py``'s.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from rayppo.config.derived import has_critic, lora_sync, policy_exports, role_gpus
from rayppo.config.schema import Config
from rayppo.data.rollout import Rollout
from rayppo.learner.adapter_weights import (
    ADAPTER_FOLDER,
    adapter_config,
    adapter_tensors,
    policy_lora,
    save_adapter,
    wrap_lora,
)
from rayppo.learner.broadcast_sender import IpcChunk, SyncEndpoint, SyncLayout, WeightSender, free_port, ipc_chunk
from rayppo.learner.experience import check_staleness
from rayppo.learner.learner_state import LearnerSplit, load_states, save_states
from rayppo.learner.lr_schedule import lr_scaler
from rayppo.learner.policy_sync import PolicySync
from rayppo.learner.step import BatchShard, LearnerModels, LearnResult, LearnSettings, StepInputs, adamw, learn
from rayppo.learner.update import OptimiserSteps
from rayppo.learner.zero_sizes import zero_sizes
from rayppo.machine.matmul_rate import peak_rate
from rayppo.machine.role_resources import Engine, model_size
from rayppo.models.export import write_policy
from rayppo.models.fingerprint import SentPrint
from rayppo.models.loading import Critic, load_causal_lm, load_tokenizer, prepare_for_training, resolve_model_path
from rayppo.models.packing import pack_mode
from rayppo.models.shape import ModelShape, layer_params, read_shape
from rayppo.models.varlen_attention import use_varlen_attention
from rayppo.models.weights import WeightsPayload


class TorchCollective:
    """Sums and maxima over the learner ranks' torch.distributed group."""

    def __init__(self, world_size: int, device: torch.device):
        self.world_size = world_size
        self.device = device

    def _reduce(self, x: torch.Tensor, op: dist.ReduceOp.RedOpType) -> torch.Tensor:
        y = x.detach().clone().to(self.device)
        dist.all_reduce(y, op=op)
        return y.to(x.device)

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        return self._reduce(x, dist.ReduceOp.SUM)

    def max(self, x: torch.Tensor) -> torch.Tensor:
        return self._reduce(x, dist.ReduceOp.MAX)


def deepspeed_config(cfg: Config, world_size: int, shape: ModelShape) -> dict[str, Any]:
    """ZeRO stage, buckets sized to the model ``shape`` (``zero_sizes.py``), optimiser and
    precision from the config; backward/step are called by hand."""
    stage = cfg.learner.zero_stage
    largest = max(layer_params(shape), shape.vocab * shape.hidden)
    zero: dict[str, Any] = {"stage": stage, **zero_sizes(shape.hidden, largest, stage)}
    if cfg.learner.offload and cfg.learner.zero_stage >= 1:
        zero["offload_optimizer"] = {"device": "cpu"}
        if cfg.learner.zero_stage == 3:
            zero["offload_param"] = {"device": "cpu"}
    return {
        "train_batch_size": world_size,
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        # A minibatch is as many micro-batches as its tokens need (learner.micro_batch_tokens): the
        # caller owns the boundary, backward() accumulates and step() reduces and updates
        # (deepspeed/runtime/engine.py, 0.19.8: ``backward``, ``step``; ZeRO-2/3 reduce per backward).
        "managed_gradient_accumulation": False,
        # The optimiser is ours (``step.adamw``), handed to ``deepspeed.initialize``: no "optimizer"
        # entry. Under offload it runs on the host, where torch's fused AdamW is the fast one.
        "zero_force_ds_cpu_optimizer": False,
        "gradient_clipping": cfg.ppo.max_grad_norm,
        "zero_optimization": zero,
        "bf16": {"enabled": cfg.model.dtype == "bfloat16"},
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }


def join_learner_group(engine: Engine, gpus: float, rank: int, world_size: int, master: tuple[str, int],
                       num_threads: int | None) -> None:
    """Threads and device of a learner rank (``engine``), then its place in the torch.distributed
    group of ``world_size`` ranks (gloo on CPU, nccl on GPU) that DeepSpeed's engines use, which
    meets at ``master`` (rank 0's address and port)."""
    master_addr, master_port = master
    engine.set_threads(num_threads)
    use_cuda = engine.init_device(gpus, "learner").type == "cuda"
    # DeepSpeed binds the rank to cuda:LOCAL_RANK: the device Ray gave this actor.
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(engine.device.index or 0),
                       "MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port)})
    import deepspeed

    if not use_cuda:
        _skip_shm_comm_op()
    _drop_stale_world_clone()
    deepspeed.init_distributed(dist_backend="nccl" if use_cuda else "gloo", auto_mpi_discovery=False)


def _drop_stale_world_clone() -> None:
    """Forget DeepSpeed's clone of a world group that no longer exists.

    DeepSpeed keeps a clone of the world group from the first engine a process builds
    (deepspeed/utils/groups.py, 0.19.8: ``_clone_world_group`` caches ``_WORLD_GROUP``) and reads
    it in every later ``deepspeed.initialize`` (``_get_broadcast_src_rank``). When something else
    in the process tore the world down with torch's own call (an in-process vLLM engine's cleanup
    does), the clone is no longer registered and the next engine of the process fails "Group ...
    is not registered" (seen in the test suite: an in-process reward-model rank after such a
    teardown). A rank in a Ray actor never meets this: one engine per process."""
    from deepspeed.utils import groups

    clone = groups._WORLD_GROUP
    if clone is not None and (not dist.is_initialized() or clone not in dist.distributed_c10d._world.pg_group_ranks):
        groups._release_process_group_references()


def leave_learner_group() -> None:
    """Leave the process group. A rank that lives in a Ray actor is killed with it; one built
    in a plain process (``benchmarks/gpu_smoke.py``, the in-process group of tests) must leave
    before the interpreter exits: a gloo group torn down by interpreter finalisation can abort
    the process ("terminate called without an active exception", exit -6) after its work succeeded."""
    if dist.is_initialized():
        # DeepSpeed's own teardown also drops the groups it cached (deepspeed/comm/comm.py,
        # destroy_process_group -> utils/groups._release_process_group_references, 0.19.8):
        # torch's alone left a stale clone of the world group, and the next in-process engine
        # failed "Group ... is not registered".
        import deepspeed.comm

        deepspeed.comm.destroy_process_group()


@contextmanager
def partitioned_loading(ds_config: dict[str, Any]) -> Iterator[None]:
    """Under ZeRO-3, models built inside are loaded partitioned: each rank materialises only its
    share of every parameter, never the whole model (a 70B policy would otherwise need ranks x
    140 GB of host memory before DeepSpeed partitions it). transformers does this while an
    ``HfDeepSpeedConfig`` of a stage-3 config is alive: ``from_pretrained`` builds the model under
    ``deepspeed.zero.Init`` and rank 0 copies each module's weights into its gathered parameters
    (``_load_state_dict_into_zero3_model``, transformers/integrations/deepspeed.py, 5.19), so the
    other ranks never read the checkpoint's tensors. Parameters made outside (the critic's value
    head) are partitioned by ``deepspeed.initialize``. Other stages: nothing changes."""
    if ds_config["zero_optimization"]["stage"] != 3:
        yield
        return
    from transformers.integrations.deepspeed import HfDeepSpeedConfig, unset_hf_deepspeed_config

    hold = HfDeepSpeedConfig(ds_config)  # transformers keeps only a weak reference to it
    try:
        yield
    finally:
        unset_hf_deepspeed_config()
        del hold


def load_models(cfg: Config, policy_path: Path, critic_path: Path | None,
                ds_config: dict[str, Any]) -> tuple[torch.nn.Module, torch.nn.Module | None]:
    """pi_theta and V_w of one rank, ready for ``deepspeed.initialize``: loaded (partitioned
    under ZeRO-3), in train mode, LoRA adapters on the policy when asked. ``critic_path`` None:
    a critic-free estimator, no critic is built."""
    with partitioned_loading(ds_config):
        # Under ZeRO-3 only rank 0 reads the checkpoints; the others take part in the gathers.
        elsewhere = ds_config["zero_optimization"]["stage"] == 3 and dist.get_rank() != 0
        policy = load_causal_lm(policy_path, cfg.model.dtype, elsewhere)
        critic = None if critic_path is None else Critic.from_pretrained(critic_path, cfg.model.dtype, cfg.seed,
                                                                           elsewhere, cfg.reward.normalize)
    for model in (policy, critic) if critic is not None else (policy,):
        prepare_for_training(model, cfg.learner.gradient_checkpointing)
    if cfg.learner.lora_rank > 0:
        policy = wrap_lora(policy, policy_lora(cfg.learner.lora_rank, cfg.learner.lora_alpha), cfg.seed)
    return policy, critic


class LearnerEngine(Engine):
    """Policy pi_theta and critic V_w (None under a critic-free estimator) of one rank; ``train``
    does one PPO iteration on a shard."""

    def __init__(self, cfg: Config, rank: int, world_size: int, master_addr: str, master_port: int,
                 num_threads: int | None = None):
        join_learner_group(self, role_gpus(cfg, "learner"), rank, world_size, (master_addr, master_port), num_threads)
        import deepspeed  # here, not at module level: the driver imports this module only to spawn ranks

        self.cfg, self.rank, self.world_size = cfg, rank, world_size
        self.collective = TorchCollective(world_size, self.device)
        m = cfg.model
        policy_path = resolve_model_path(m.policy, m.cache_dir)
        critic_path = resolve_model_path(m.critic or m.policy, m.cache_dir) if has_critic(cfg.ppo) else None
        self.tokenizer = load_tokenizer(policy_path)
        policy_ds = deepspeed_config(cfg, world_size, read_shape(policy_path))
        policy, critic = load_models(cfg, policy_path, critic_path, policy_ds)
        # The critic shares the policy's family unless model.critic names another: pack only if both can.
        modes = {pack_mode(cfg.learner.packing, getattr(getattr(model, "backbone", model), "config", None))
                 for model in (policy, critic) if model is not None}
        self.pack_mode = modes.pop() if len(modes) == 1 else ""
        if self.pack_mode == "varlen":
            for model in (policy, critic):
                if model is not None:
                    use_varlen_attention(model)
        trained = [p for p in policy.parameters() if p.requires_grad]
        self.policy, *_ = deepspeed.initialize(model=policy, optimizer=adamw(trained, cfg.ppo.lr, cfg.ppo.weight_decay),
                                               config=policy_ds)
        self.critic = None  # a critic-free estimator: no model, optimizer, value pass or checkpoint
        if critic is not None and critic_path is not None:  # loaded exactly when there is a critic path
            critic_ds = deepspeed_config(cfg, world_size, read_shape(critic_path))
            self.critic, *_ = deepspeed.initialize(
                model=critic, optimizer=adamw(list(critic.parameters()), cfg.ppo.critic_lr, cfg.ppo.weight_decay),
                config=critic_ds)
        self.settings = LearnSettings.of(cfg)
        self.models = LearnerModels(self.policy, self.critic, self._steps(), self.collective, self.device,
                                    self.tokenizer.pad_token_id, self.pack_mode)
        self.version = 0
        self._targets: tuple[list[list[float]], list[list[float]]] = ([], [])
        self.sender: WeightSender | None = None  # rank 0, once open_weight_sync has run
        gather = _zero3_gather if cfg.learner.zero_stage == 3 else None
        self.sync_stream = PolicySync(self.policy.module, lora_sync(cfg)[0], gather, rank)  # what a sync sends
        self._ipc_stream: Iterator[list[tuple[str, torch.Tensor]]] | None = None  # a sync in progress
        self._ipc_held: IpcChunk | None = None  # the run the generator is loading

    def train(self, shard: Rollout, owned: list[int], generators: list[int], kl_coef: float, iteration: int
              ) -> LearnResult:
        """Values, shaped rewards, advantages, global whitening and M epochs of PPO on this rank's rows.

        ``shard`` holds the global rows ``owned`` (ascending) of a rollout whose rows ``generators``
        drew (one entry per row: its length is the batch's). Its rows
        may lag the learner by up to ``rollout.max_staleness`` versions (0: none); with a lag
        allowed, the off-policy corrections of ``experience.py`` apply.
        """
        check_staleness(shard.policy_version, self.version, self.cfg.rollout.max_staleness)
        result, exp = learn(self.models, BatchShard(shard, owned, len(generators), generators),
                            StepInputs(iteration=iteration, version=self.version, kl_coef=kl_coef), self.settings)
        self.version = result.version
        if self.cfg.output.save_rollouts:  # what the update trained on, for the rollout files
            self._targets = exp.trained_targets(self.critic is not None)
        return dataclasses.replace(result, metrics=result.metrics | {"policy/version": float(result.version)})

    def skip_update(self) -> LearnResult:
        """An iteration with no row to train on (every row too stale): the weights stay, the version
        advances, so that the pipeline's one version per batch (its lead and staleness
        arithmetic) holds; the weights are published again under it."""
        self.version += 1
        self._targets = ([], [])
        return LearnResult(version=self.version, kl_ref=None,
                           metrics={"policy/version": float(self.version), "async/skipped_update": 1.0})

    def trained_targets(self) -> tuple[list[list[float]], list[list[float]]]:
        """``(advantages, returns)`` of this rank's rows of the last ``train`` (``Rollout.advantages``,
        ``.returns``); kept only with ``output.save_rollouts``."""
        return self._targets

    def _steps(self) -> OptimiserSteps:
        """DeepSpeed's backward of each engine, then both steps (clipping, ZeRO reduction, zeroing)."""
        policy, critic, ppo = self.policy, self.critic, self.cfg.ppo
        scale_lr = lr_scaler(policy.optimizer, ppo.lr, critic.optimizer if critic is not None else None, ppo.critic_lr)
        if critic is None:
            return OptimiserSteps(policy.backward, None, policy.step, scale_lr)

        def step_both() -> None:
            policy.step()
            critic.step()

        return OptimiserSteps(policy.backward, critic.backward, step_both, scale_lr)

    def policy_weights(self) -> WeightsPayload | None:
        """The policy as a ``WeightsPayload`` for the object store (rank 0; None elsewhere): its
        LoRA adapter alone under ``learner.lora_sync=adapter``, else the full weights
        (``policy_sync.py``). Collective under ZeRO-3."""
        return self.sync_stream.payload(self.version)

    def sent_fingerprints(self) -> dict[str, SentPrint] | None:
        """Fingerprints of the weights of the last sync (rank 0; None elsewhere): the learner's
        half of the weight check."""
        return self.sync_stream.sent if self.rank == 0 else None

    @staticmethod
    def free_port() -> int:
        """A TCP port free on this rank's node (the sync group's store binds it next)."""
        return free_port()

    def open_weight_sync(self, endpoint: SyncEndpoint) -> SyncLayout | None:
        """Rank 0 joins the sync group as its root; returns the stream layout (rank 0).

        Blocks until every generator has joined; call on all ranks (ZeRO-3 gathers to find shapes).
        """
        layout = self.sync_stream.layout()
        if self.rank != 0:
            return None
        self.sender = WeightSender(endpoint, layout.specs, self.device)
        return layout

    def send_weights(self) -> int:
        """Broadcast the current policy (or its adapter) to the sync group, one gathered module at
        a time; returns bytes delivered (0 off rank 0)."""
        stream = self.sync_stream.fingerprinted()
        if self.rank != 0:
            _drain(stream)
            return 0
        if self.sender is None:
            raise RuntimeError("send_weights before open_weight_sync: the sync group is not open")
        return self.sender.send(stream)

    def ipc_next(self) -> IpcChunk | None:
        """The next run of policy tensors as CUDA-IPC handles, for the generator on this rank's GPU
        (colocated mode; ranks without a generator return None), or None after the last.

        Collective (ZeRO-3 gathers): all ranks call it together, until it returns None. A run
        stays valid until the next call, which is when the driver has seen the generator load
        it (``PolicySync.ipc_runs``: one run, or one decoder layer at a time)."""
        if self._ipc_stream is None:
            self._ipc_stream = self.sync_stream.ipc_runs(self.cfg.learner.zero_stage)
        run = next(self._ipc_stream, None)
        if run is None:
            self._ipc_stream, self._ipc_held = None, None
            return None
        adapter = self.sync_stream.adapter_config() if self.sync_stream.adapter else None
        self._ipc_held = ipc_chunk(run, adapter=adapter) if self.rank < self.cfg.generators.num else None
        return self._ipc_held

    def save_checkpoint(self, path: str) -> None:
        """DeepSpeed states of policy and critic under ``path`` and the split that wrote them
        (``learner_state.py``: ``save_states``). No ``critic/`` folder without a critic."""
        save_states(Path(path), self._engines(), self.version, self.rank, self._split())

    def load_checkpoint(self, path: str) -> int:
        """Load what ``save_checkpoint`` wrote (weights, optimizer moments and steps), resharded
        when it was written by another number of ranks or ZeRO stage; returns the policy version."""
        self.version = load_states(Path(path), self._engines(), self.rank, self._split())
        return self.version

    def _engines(self) -> dict[str, Any]:
        """The DeepSpeed engines a checkpoint holds, by folder name."""
        return {"policy": self.policy} | ({"critic": self.critic} if self.critic is not None else {})

    def _split(self) -> LearnerSplit:
        """This learner's split: its ranks and ZeRO stage (what a checkpoint records)."""
        return LearnerSplit(num_ranks=self.world_size, zero_stage=self.cfg.learner.zero_stage)

    def save(self, out_dir: str) -> None:
        """Final models in Hugging Face format: the policy is its sync stream written as
        safetensors shards (``models/export.py``: no second copy of the model on rank 0), the critic
        its ``save_pretrained``. Rank 0 writes; every rank joins the gathers."""
        out = Path(out_dir)
        exports = policy_exports(self.cfg)
        if "merged" in exports:
            stream = self.sync_stream.full()
            if self.rank == 0:
                base = resolve_model_path(self.cfg.model.policy, self.cfg.model.cache_dir)
                write_policy(stream, base, self.tokenizer, out / "policy")
            else:
                _drain(stream)
        if "adapter" in exports:
            self._save_adapter(out / ADAPTER_FOLDER)
        if self.critic is None:
            return
        with gathered(self.critic.module, self.cfg.learner.zero_stage):
            if self.rank == 0:
                self.critic.module.save_pretrained(out / "critic")

    def _save_adapter(self, out: Path) -> None:
        """The LoRA adapter as a peft folder (rank 0 writes; every rank joins ZeRO-3's gathers)."""
        named = {name: t.to("cpu", copy=True) for name, t in adapter_tensors(self.policy.module, self.sync_stream.gather)}
        if self.rank == 0:
            save_adapter(named, adapter_config(self.policy.module), self.cfg.model.policy, out)

    def matmul_rate(self, tokens: int) -> float:
        """FLOP/s of this rank's device (its GPU, or its CPU threads) on the matmul the policy runs
        most, in ``model.dtype`` (``machine.matmul_rate.peak_rate``): the denominator of ``perf/mfu/*``."""
        shape = read_shape(resolve_model_path(self.cfg.model.policy, self.cfg.model.cache_dir))
        return peak_rate(self.cfg.model.dtype, torch.get_num_threads(), shape.hidden, shape.intermediate, tokens,
                         self.device)

    def describe(self) -> str:
        import deepspeed

        lora = f" + LoRA r={self.cfg.learner.lora_rank}" if self.cfg.learner.lora_rank else ""
        return (f"DeepSpeed {deepspeed.__version__} ZeRO-{self.cfg.learner.zero_stage}, {self.world_size} rank{'s' if self.world_size > 1 else ''} "
                f"over {dist.get_backend()}, policy {model_size(self.policy.module)}{lora}{' + critic' if self.critic is not None else ', no critic'}, "
                f"{self.device_info()} each")

    def close(self) -> None:
        """Drop the engines and leave the process group (``leave_learner_group``)."""
        self.policy = self.critic = None
        leave_learner_group()


def _drain(stream: Iterator[tuple[str, torch.Tensor]]) -> None:
    """Follow rank 0 through a stream's gathers without using the tensors (they are collective)."""
    for _ in stream:
        pass


def gathered(module: torch.nn.Module, zero_stage: int):
    """Full parameters of ``module`` inside the block: ZeRO-3 gathers its partitions (a collective)."""
    if zero_stage != 3:
        return nullcontext()
    return _zero3_gather(list(module.parameters()))


def _zero3_gather(params: list[torch.nn.Parameter]):
    """DeepSpeed ZeRO-3: the full values of ``params`` inside the block, on every rank."""
    import deepspeed

    return deepspeed.zero.GatheredParameters(params, modifier_rank=None)


def _skip_shm_comm_op() -> None:
    """Keep DeepSpeed from JIT-compiling its shared-memory all-reduce op on CPU (~30 s with a
    C++ compiler on a fresh machine, printed as "deepspeed_shm_comm_op built successfully").

    DeepSpeed 0.19.8 builds it in ``TorchBackend.__init__`` (deepspeed/comm/torch.py,
    ``build_shm_op``) whenever ``deepspeed.ops.__compatible_ops__`` marks it compatible, and uses
    it only in ``inference_all_reduce`` (tensor-parallel inference); ZeRO training reduces with
    torch.distributed (gloo here). ``deepspeed/ops/__init__.py`` caches that dict on first access
    so that edits to it persist, which is what this relies on."""
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
