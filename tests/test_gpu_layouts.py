"""The GPU path's logic, tested on CPU: device per role, placement layouts, tensor parallelism,
the bounded ZeRO-3 gather, and the colocated schedule. What needs CUDA is in test_gpu.py."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from rayppo.cluster.placement import plan_groups, role_specs, total_demand
from rayppo.config.load import load_config
from rayppo.learner.full_weights import full_tensors
from rayppo.machine.role_resources import DeviceError, Resources, engine_device

NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")


# ------------------------------------------------------------------------------------ devices
def test_engine_device_is_cpu_without_gpus_and_the_first_visible_gpu_with_them(monkeypatch):
    monkeypatch.delenv("RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES", raising=False)
    assert engine_device(0.0, "reference") == torch.device("cpu")
    # Ray masks CUDA_VISIBLE_DEVICES to the actor's GPUs: a share of one is still cuda:0.
    assert engine_device(0.1, "reference", cuda_available=True) == torch.device("cuda", 0)
    # Masking disabled by the cluster: the GPU Ray assigned, by its index on the node.
    monkeypatch.setenv("RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES", "1")
    assert engine_device(1, "learner", cuda_available=True, visible="<unset>", ray_gpu_ids=["3"]) == torch.device("cuda", 3)
    assert engine_device(1, "learner", cuda_available=True, visible="2,3,6", ray_gpu_ids=["6"]) == torch.device("cuda", 2)


def test_a_role_given_gpus_where_cuda_is_missing_is_an_error_naming_it():
    with pytest.raises(DeviceError, match=r"^reward: given 0.5 GPU\(s\) but this process sees no CUDA device"):
        engine_device(0.5, "reward", cuda_available=False, visible="")


@NO_CUDA
def test_every_engine_takes_its_device_from_its_gpus(embedded_dir, reward_model_dir):
    """Each role's constructor asks the base class for its device: given a GPU on this CPU-only
    machine, each refuses by name instead of silently running on the CPU."""
    from rayppo.actors.generator import GeneratorActor, GeneratorEngine, SamplingSettings
    from rayppo.actors.reference import ReferenceEngine
    from rayppo.actors.reward import ModelScorer, RewardEngine
    from rayppo.cluster.learner_group import LearnerGroup

    with pytest.raises(DeviceError, match="^reference: given 1 GPU"):
        ReferenceEngine(str(embedded_dir), resources=Resources(gpus=1.0))
    with pytest.raises(DeviceError, match="^reward: given 0.25 GPU"):
        RewardEngine(ModelScorer(str(reward_model_dir)), resources=Resources(gpus=0.25))
    with pytest.raises(DeviceError, match="^generators: given 1 GPU"):
        GeneratorEngine(str(embedded_dir), SamplingSettings(4), backend="hf", actor=GeneratorActor(resources=Resources(gpus=1.0)))
    with pytest.raises(DeviceError, match="^learner: given 1 GPU"):
        LearnerGroup(load_config(None, ["learner.num_ranks=1", "learner.gpus_per_rank=1"]), placement=None)


# ---------------------------------------------------------------------------------- placement
def _members(plan):
    return sorted(plan.members)


def test_one_node_tensor_parallel_generator_holds_all_its_gpus_in_one_bundle():
    cfg = load_config(None, ["generators.gpus_per_worker=4", "generators.num=2", "learner.gpus_per_rank=1"])
    gen = next(p for p in plan_groups(cfg) if p.name == "generators")
    assert gen.bundles == [{"CPU": 0.5, "GPU": 4.0}] * 2 and not gen.capture_child_tasks


def test_tensor_parallel_across_nodes_is_one_group_of_one_gpu_bundles_per_engine():
    cfg = load_config(None, ["generators.gpus_per_worker=4", "generators.num=2", "learner.gpus_per_rank=1",
                             "generators.tensor_parallel_layout=across_nodes"])
    groups = [p for p in plan_groups(cfg) if p.name.startswith("generator-")]
    assert [g.name for g in groups] == ["generator-0", "generator-1"]
    for i, group in enumerate(groups):
        # vLLM's ray executor puts one worker in each one-GPU bundle; the actor holds no GPU.
        assert group.bundles == [{"CPU": 0.5, "GPU": 1.0}] + [{"GPU": 1.0}] * 3
        assert group.members == [("generators", i, 0)] and group.capture_child_tasks
    assert next(s for s in role_specs(cfg) if s.name == "generators").bundle == {"CPU": 0.5}
    assert total_demand(plan_groups(cfg))["GPU"] == 8 + 2  # 2 engines x TP 4, 2 learner ranks


def test_colocated_mode_puts_rank_i_and_actor_i_of_every_role_on_gpu_i():
    cfg = load_config(None, ["cluster.colocate_all=true", "learner.gpus_per_rank=1", "learner.num_ranks=2",
                             "generators.num=2", "learner.cpus_per_rank=1"])
    (plan,) = plan_groups(cfg)
    assert plan.name == "colocated"
    # Bundle 0: rank 0 (1 CPU), generator 0 (0.5), reference and reward (0.25 each); bundle 1
    # has no reference or reward actor. One GPU each, whatever the actors' fractions.
    assert plan.bundles == [{"CPU": 2.0, "GPU": 1.0}, {"CPU": 1.5, "GPU": 1.0}]
    assert _members(plan) == sorted([("learner", 0, 0), ("learner", 1, 1), ("generators", 0, 0),
                                     ("generators", 1, 1), ("reference", 0, 0), ("reward", 0, 0)])
    gpus = {s.name: s.bundle.get("GPU", 0.0) for s in role_specs(cfg)}
    # The default reward is a verifier function: no GPU share, no CUDA context for it.
    assert gpus == {"learner": 0.4, "generators": 0.4, "reference": 0.1, "reward": 0.0}
    with_model = load_config(None, ["cluster.colocate_all=true", "learner.gpus_per_rank=1", "reward.function=null",
                                    "reward.model=some/folder"])
    shares = {s.name: s.bundle.get("GPU", 0.0) for s in role_specs(with_model)}
    assert shares["reward"] == 0.1 and sum(shares.values()) == pytest.approx(1.0)  # all four fit one GPU


# ------------------------------------------------------------------------------ full tensors
def test_full_tensors_are_the_state_dict_in_order(embedded_dir):
    model = AutoModelForCausalLM.from_pretrained(embedded_dir)
    streamed = list(full_tensors(model))
    state = model.state_dict()
    assert [n for n, _ in streamed] == list(state)
    assert all(torch.equal(t, state[n]) for n, t in streamed)


def test_full_tensors_of_a_lora_model_are_the_merged_weights_under_base_names(embedded_dir):
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(AutoModelForCausalLM.from_pretrained(embedded_dir),
                           LoraConfig(r=4, lora_alpha=32, target_modules="all-linear", lora_dropout=0.0))
    torch.manual_seed(0)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.1)  # B starts at 0: make the deltas non-zero
    streamed = dict(full_tensors(model))
    merged = model.merge_and_unload().state_dict()  # peft's own merge, for comparison
    assert list(streamed) == list(merged)
    # Same sum W + s B A in the same dtype; peft and rayppo may order the two terms differently.
    for name, tensor in streamed.items():
        assert torch.allclose(tensor, merged[name], rtol=0, atol=1e-6 * float(merged[name].abs().max()) + 1e-7), name


def test_zero3_sync_gathers_one_module_at_a_time(embedded_dir):
    """While rank 0 streams the policy for a sync, at most one module's parameters are gathered."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    from rayppo.cluster.learner_group import LearnerGroup

    learner = LearnerGroup(load_config(None, ["learner.num_ranks=1", "learner.zero_stage=3"]), placement=None)
    engine = learner.ranks.actors[0]
    params = list(engine.policy.module.parameters())
    assert all(p.ds_status == ZeroParamStatus.NOT_AVAILABLE for p in params)  # partitioned at rest
    largest = max(sum(p.ds_numel for p in m.parameters(recurse=False)) for m in engine.policy.module.modules())
    peak, count = 0, 0
    for _name, _tensor in engine.sync_stream.full():
        gathered = [p for p in params if p.ds_status == ZeroParamStatus.AVAILABLE]
        peak = max(peak, sum(p.ds_numel for p in gathered))
        count += 1
    total = sum(p.ds_numel for p in params)
    assert count == len(engine.policy.module.state_dict())
    assert 0 < peak <= largest < total / 4  # one module at a time, never the model
    assert all(p.ds_status == ZeroParamStatus.NOT_AVAILABLE for p in params)  # all released again
    # The limits behind it are the model's, not DeepSpeed's 5e8 / 1e9-element defaults: buckets of
    # h^2, at most one decoder layer or the embedding gathered (learner/zero_sizes.py).
    from rayppo.models.shape import layer_params, read_shape

    shape = read_shape(embedded_dir)
    for ds in (engine.policy, engine.critic):
        assert ds.zero_reduce_bucket_size() == shape.hidden ** 2
        assert ds.zero_prefetch_bucket_size() == int(0.9 * shape.hidden ** 2)
        assert ds.zero_max_live_parameters() == ds.zero_max_reuse_distance() == max(layer_params(shape),
                                                                                   shape.vocab * shape.hidden)


LOAD_PROBE = """
import os, sys
rank, world, port, path, partitioned = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5] == "1"
os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
import deepspeed
from rayppo.config.load import load_config
from rayppo.learner.learner_engine import _skip_shm_comm_op, deepspeed_config, partitioned_loading
from rayppo.models.loading import load_causal_lm
from rayppo.models.shape import read_shape
_skip_shm_comm_op()
deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
ds = deepspeed_config(load_config(None, ["learner.zero_stage=3", f"model.policy={path}"]), world, read_shape(path))
from transformers import AutoConfig, AutoModelForCausalLM
AutoModelForCausalLM._model_mapping[type(AutoConfig.from_pretrained(path))]  # the model's code imported first
def rss(kind):  # RssAnon: private memory (heap, tensors); VmRSS: also the checkpoint's pages mapped in
    return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith(kind + ":"))
before = rss("RssAnon"), rss("VmRSS")
if partitioned:
    with partitioned_loading(ds):
        model = load_causal_lm(path, weights_elsewhere=rank != 0)
else:  # as the learner loaded before: the whole model on every rank, read whole when deepspeed.initialize
    model = load_causal_lm(path)  # partitions it (here: every tensor read once); transformers maps the file in
    sum(float(p.sum()) for p in model.parameters())
print("GROWTH", rank, rss("RssAnon") - before[0], rss("VmRSS") - before[1])
if not partitioned:
    sys.exit(0)
import torch
from safetensors.torch import load_file
saved = load_file(os.path.join(path, "model.safetensors"))
with deepspeed.zero.GatheredParameters(list(model.parameters())):  # each partition holds the file's values
    print("EQUAL", rank, all(torch.equal(p, saved[n]) for n, p in model.named_parameters() if n in saved))
deepspeed.comm.barrier()  # leave together: a gloo group torn down at exit while a peer runs can abort
deepspeed.comm.destroy_process_group()
"""


RETURN_FREED_MEMORY = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_ARENA_MAX": "1"}
"""glibc: allocations over 64 KiB mmapped (unmapped when freed), one arena for every thread."""


@pytest.mark.slow
def test_zero3_ranks_load_only_their_partition(tmp_path):
    """Under ZeRO-3 a rank other than 0 holds only its partition and reads no tensor of the
    checkpoint (rank 0 copies each module's weights into the gathered parameters): its RSS grows by
    half the model and one gathered layer, where a whole load (the learner before) grows by the
    model. The model: 16 layers of 3.2M parameters (193 MiB in fp32), one layer 12 MiB; the bound
    is the midpoint of the two outcomes, 0.75 x the model. Measured after the load.
    glibc returns freed memory here (``RETURN_FREED_MEMORY``): otherwise its per-thread arenas keep
    the gathered modules' freed buffers (+110 MB), the allocator's retention, not the rank's."""
    import os
    import subprocess
    import sys

    from transformers import LlamaConfig, LlamaForCausalLM

    from rayppo.learner.broadcast_sender import free_port

    config = LlamaConfig(vocab_size=128, hidden_size=512, intermediate_size=1376, num_hidden_layers=16,
                         num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=256)
    model = LlamaForCausalLM(config)
    size = sum(p.numel() for p in model.parameters()) * 4
    model.save_pretrained(tmp_path)
    del model

    def start(rank: int, world: int, port: int, partitioned: bool) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-c", LOAD_PROBE, str(rank), str(world), str(port), str(tmp_path),
                                 "1" if partitioned else "0"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, env={**os.environ, **RETURN_FREED_MEMORY})

    port = free_port()
    procs = [start(0, 2, port, True), start(1, 2, port, True)]
    outs = [proc.communicate(timeout=300)[0] for proc in procs]
    plain = start(0, 1, free_port(), False)  # after the pair: two processes per two cores
    outs.append(plain.communicate(timeout=300)[0])
    assert [p.returncode for p in procs + [plain]] == [0, 0, 0], "\n".join(out[-2000:] for out in outs)
    assert all(f"EQUAL {rank} True" in outs[rank] for rank in (0, 1))  # the partitions hold the file's values
    (anon, rss), (_, plain_rss) = [
        [int(x) for x in next(line for line in out.splitlines() if line.startswith("GROWTH")).split()[2:]]
        for out in (outs[1], outs[2])]
    print(f"model {size / 2**20:.0f} MiB; rank 1 of 2 grows {anon / 2**20:.0f} MiB private, {rss / 2**20:.0f} MiB "
          f"RSS; a whole load grows {plain_rss / 2**20:.0f} MiB RSS")
    assert plain_rss >= size  # what the whole load costs (the checkpoint mapped in): the test tells them apart
    assert rss < 0.75 * size  # half the model, one gathered layer and no page of the checkpoint


# ------------------------------------------------------------- tensor parallel and colocation
@pytest.mark.slow
def test_tensor_parallel_generator_actor_samples_what_tp1_samples(local_ray, embedded_dir, tokenizer, monkeypatch):
    """generators.tensor_parallel_size=2 as a Ray actor (vLLM's mp executor, 2 worker processes)
    against a TP=1 engine with the same seed: the same tokens, and log-probs equal to fp32
    rounding (a row-parallel layer sums two partial products instead of one), on the base and
    then serving a LoRA adapter (``learner.lora_sync=adapter``): each worker registers the whole
    adapter and is fingerprinted on its own, from its slot of the LoRA layers (its shard of each
    A or B); the first decoder layer's q/k/v slot cleared on worker 1 alone (vLLM's
    ``reset_lora``, as for an adapter registered but not applied) fails the check naming worker 1."""
    from rayppo.actors.generator import GeneratorActor, GeneratorEngine
    from rayppo.actors.settings import sampling_settings
    from rayppo.cluster.group import ActorGroup, get
    from rayppo.cluster.placement import release, reserve
    from rayppo.cluster.roles import vllm_settings
    from rayppo.cluster.session import ACTOR_ENV
    from rayppo.data.prompts import PromptBatch
    from rayppo.learner.adapter_weights import adapter_config, adapter_tensors, engine_form, scaling, wrap_lora
    from rayppo.learner.guard import WeightSyncError, check_weights
    from rayppo.models.fingerprint import sent_print
    from rayppo.models.loading import load_causal_lm
    from rayppo.models.weights import pack_weights

    texts = ["say 7 :", "write 3 :", "give 1 :", "repeat 5 :"] * 4
    prompts = PromptBatch(texts, [tokenizer(t)["input_ids"] for t in texts])
    lora = ["learner.lora_rank=4", "learner.lora_alpha=32"]
    cfg = load_config(None, ["generators.tensor_parallel_size=2", "learner.num_ranks=1", "generators.cpus_per_worker=1",
                             "learner.cpus_per_rank=0.25", *lora])
    settings = vllm_settings(cfg)
    assert (settings.tensor_parallel_size, settings.executor, settings.lora_rank) == (2, "mp", 4)
    adapted = wrap_lora(load_causal_lm(embedded_dir, "float32"), {"r": 4, "lora_alpha": 32.0, "target_modules": "all-linear"})
    with torch.no_grad():
        for name, p in adapted.named_parameters():
            if "lora_B" in name:
                p.copy_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))))
    named, config = {n: t.clone() for n, t in adapter_tensors(adapted)}, adapter_config(adapted)
    sent = {n: sent_print(engine_form(n, t, scaling(config))) for n, t in named.items()}

    def clear_slot_of_rank_1(worker) -> None:  # defined here: Ray and vLLM's workers take it by value
        """On worker 1 only: vLLM's ``reset_lora`` on layer 0's q/k/v slot of version 1 (LoRA id 2)."""
        if worker.rank == 1:
            manager = worker.model_runner.lora_manager._adapter_manager
            manager.modules["model.layers.0.self_attn.qkv_proj"].reset_lora(manager.lora_index_to_id.index(2))

    placements = reserve(cfg)
    try:
        actor = GeneratorActor(index=0, seed=5, vllm=settings)
        group = ActorGroup(GeneratorEngine, [(str(embedded_dir), sampling_settings(cfg), "vllm", "float32", None, actor)],
                           [placements["generators"].actor_options(0, dict(ACTOR_ENV))])
        tp2 = group.get(group.call_all(GeneratorEngine.generate, prompts, 0))[0]
        group.get(group.call_all(GeneratorEngine.load_weights, pack_weights(named, 1, adapter=config)))
        held = group.get(group.call_all(GeneratorEngine.weight_fingerprints))[0]
        tp2_adapted = group.get(group.call_all(GeneratorEngine.generate, prompts, 0))[0]
        get(group.actors[0].__ray_call__.remote(lambda engine: engine.backend.llm.collective_rpc(clear_slot_of_rank_1)))
        cleared = group.get(group.call_all(GeneratorEngine.weight_fingerprints))[0]
        group.kill()
    finally:
        release(placements)
    assert isinstance(held, list) and len(held) == 2  # one set of prints per worker
    assert check_weights(sent, held, 0, 1) == 2 * len(sent)
    with pytest.raises(WeightSyncError, match=r"generator 0 \(worker 1\) does not hold the weights the learner sent: "
                                              r"base_model\.model\.model\.layers\.0\.self_attn\.q_proj\.lora_A"):
        check_weights(sent, cleared, 0, 1)  # worker 0, checked first, holds the adapter
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    cfg1 = load_config(None, lora)
    tp1 = GeneratorEngine(str(embedded_dir), sampling_settings(cfg1), "vllm", "float32",
                          actor=GeneratorActor(index=0, seed=5, vllm=vllm_settings(cfg1)))
    reference = tp1.generate(prompts, 0)
    tp1.load_weights(pack_weights(named, 1, adapter=config))
    reference_adapted = tp1.generate(prompts, 0)
    for ours, theirs in ((tp2, reference), (tp2_adapted, reference_adapted)):
        assert ours.response_ids == theirs.response_ids
        gap = max(abs(a - b) for x, y in zip(ours.logprobs, theirs.logprobs) for a, b in zip(x, y))
        assert gap < 1e-4  # two fp32 evaluations of one network, as in the other sync tests
    assert reference_adapted.response_ids != reference.response_ids  # the adapter was served
    del tp1


@pytest.mark.slow
def test_colocated_schedule_frees_the_gpu_for_the_learner(local_ray, tmp_path):
    """cluster.colocate_all on CPU: generators start (and are ready) before the other roles, and
    each iteration puts them to sleep before scoring and learning and wakes them for the sync.
    vLLM refuses sleep mode on CPU, so each sleep/wake is recorded as skipped."""
    from rayppo.run.checkpoint import read_driver_state, write_checkpoint
    from rayppo.trainers.distributed import DistributedTrainer

    trainer = DistributedTrainer(load_config(None, ["cluster.colocate_all=true", "learner.num_ranks=1",
                                                    "rollout.batch_size=16", f"output.dir={tmp_path}"]))
    try:
        for _ in range(2):
            trainer.iteration()
        placements = trainer.placements
        # A learner failure between the sleep and the wake-ups: the restore wakes the weights
        # before its sync writes into them, and the KV cache after.
        checkpoint = write_checkpoint(tmp_path, trainer, keep=1)
        trainer.schedule.sleep_generators()
        trainer.restore(checkpoint, read_driver_state(checkpoint))
        assert trainer.schedule.asleep == set()
    finally:
        trainer.close()
    iteration = ["generate", "generators: sleep skipped", "score", "learn", "others: release cached memory",
                 "generators: wake weights skipped", "sync", "others: release cached memory",
                 "generators: wake kv_cache skipped"]
    restore = ["generators: sleep skipped", "others: release cached memory", "generators: wake weights skipped",
               "others: release cached memory", "generators: wake kv_cache skipped"]
    assert trainer.schedule.events == ["spawn generators", "generators ready", "spawn reference, reward, learner",
                                       *iteration, *iteration, *restore]
    group = placements["learner"].groups[0]
    for role in ("generators", "reference", "reward", "learner"):
        assert placements[role].groups == [group] and placements[role].bundles == [0], role


# --------------------------------------------------------------------------- CUDA-IPC sync
def _fake_export(tensor: torch.Tensor) -> dict[str, tuple]:
    """Stands in for CUDA's IPC export, which needs a GPU: records which storage was shared."""
    return {"GPU-test": (tensor.data_ptr(), tuple(tensor.shape))}


@pytest.mark.parametrize("zero_stage", [2, 3])
def test_ipc_sync_shares_live_parameters_or_one_gathered_tensor_at_a_time(embedded_dir, monkeypatch, zero_stage):
    """Without ZeRO-3 the whole policy is one run of handles to the live parameters (no copy);
    under ZeRO-3 each run is one decoder layer's gathered tensors, copied (the gather is released
    at the next module) and valid until the next call: two Ray round trips per layer, not per
    tensor. Every run is a valid vLLM 0.32 ``IPCWeightTransferUpdateInfo``."""
    import functools
    import pickle

    from vllm.distributed.weight_transfer.ipc_engine import IPCWeightTransferUpdateInfo

    import rayppo.learner.learner_engine as engine_module
    from rayppo.cluster.learner_group import LearnerGroup
    from rayppo.learner.broadcast_sender import ipc_chunk

    monkeypatch.setattr(engine_module, "ipc_chunk", functools.partial(ipc_chunk, export=_fake_export))
    cfg = load_config(None, ["learner.num_ranks=1", f"learner.zero_stage={zero_stage}", "generators.num=1"])
    engine = LearnerGroup(cfg, placement=None).ranks.actors[0]
    names = list(engine.policy.module.state_dict())
    runs = []
    while (run := engine.ipc_next()) is not None:
        IPCWeightTransferUpdateInfo(**run.update_info())  # vLLM's own checks of the layout
        assert pickle.loads(pickle.dumps(run)).held == []  # handles cross processes, tensors never
        runs.append(run)
    assert [n for r in runs for n in r.names] == names
    assert set(engine.sync_stream.sent) == set(names)  # fingerprinted for the guard's check
    if zero_stage == 2:
        (run,) = runs
        live = {p.data_ptr() for p in engine.policy.module.parameters()}
        assert {h["GPU-test"][0] for h in run.ipc_handles} <= live  # handles to the parameters themselves
    else:
        layers = engine.policy.module.config.num_hidden_layers
        in_layers = [r for r in runs if ".layers." in r.names[0]]
        assert len(in_layers) == layers and len(runs) == layers + len(names) - sum(len(r.names) for r in in_layers)
        assert all(len({n.split(".layers.")[1].split(".")[0] for n in r.names}) == 1 for r in in_layers)
