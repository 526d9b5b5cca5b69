"""The GPU path: CUDA vLLM generators, NCCL learner group and NCCL weight broadcast (opt-in).

Run on a GPU machine with ``RAYPPO_GPU_TESTS=1 pytest tests/test_gpu.py``. The CPU build of this
project cannot exercise CUDA or NCCL, so these tests are skipped elsewhere; the same code paths
run on CPU with gloo in ``test_weight_sync.py`` and ``test_distributed.py``.
"""

from __future__ import annotations

import os

import pytest
import torch

from rayppo.config.derived import weight_sync_backend
from rayppo.config.load import load_config

OPTED_IN = os.environ.get("RAYPPO_GPU_TESTS") == "1"
pytestmark = [pytest.mark.gpu, pytest.mark.slow,
              pytest.mark.skipif(not OPTED_IN, reason="GPU tests are opt-in: RAYPPO_GPU_TESTS=1 on a CUDA machine")]

# fp32 on GPUs: vLLM's and transformers' attention kernels differ in summation order only.
MISMATCH_TOLERANCE = 2e-3


@pytest.fixture(scope="module", autouse=True)
def local_ray():
    import ray

    ray.init(address="local", include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def _run(overrides: list[str], n: int) -> list[dict[str, float]]:
    from rayppo.trainers.distributed import DistributedTrainer

    trainer = DistributedTrainer(load_config(None, overrides))
    try:
        return [trainer.iteration() for _ in range(n)]
    finally:
        trainer.close()


BASE = ["rollout.batch_size=32", "ppo.lr=0.003", "learner.num_ranks=1", "generators.gpu_memory_utilization=0.25",
        "generators.enforce_eager=true"]


@pytest.mark.skipif(torch.cuda.device_count() < 1, reason="needs a CUDA GPU")
def test_shared_gpu_run_syncs_through_the_object_store():
    """All roles on one GPU (fractional shares): weights go device -> host -> device."""
    overrides = BASE + ["learner.gpus_per_rank=0.4", "generators.gpus_per_worker=0.4", "reference.gpus=0.1",
                        "reward.gpus=0.1"]
    assert weight_sync_backend(load_config(None, overrides)) is None
    records = _run(overrides, 3)
    assert max(r["logprob_mismatch/max"] for r in records) < MISMATCH_TOLERANCE
    assert records[2]["kl/ref_mean"] > 1e-4


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs: NCCL cannot join two ranks on one GPU")
def test_nccl_broadcast_sync_end_to_end():
    """Learner on GPU 0, vLLM generator on GPU 1: each sync is an NCCL broadcast GPU to GPU."""
    overrides = BASE + ["learner.gpus_per_rank=1", "generators.gpus_per_worker=1"]
    assert weight_sync_backend(load_config(None, overrides)) == "nccl"
    records = _run(overrides, 3)
    assert max(r["logprob_mismatch/max"] for r in records) < MISMATCH_TOLERANCE
    assert records[2]["kl/ref_mean"] > 1e-4
    assert records[-1]["sync/bytes"] > 0


@pytest.mark.skipif(torch.cuda.device_count() < 1, reason="needs a CUDA GPU")
def test_every_role_given_a_gpu_share_runs_on_it():
    """Reference, reward model and the hf generator place their models on the GPU Ray gave them."""
    from rayppo.machine.role_resources import Engine
    from rayppo.trainers.distributed import DistributedTrainer

    overrides = BASE + ["generators.backend=hf", "learner.gpus_per_rank=0.4", "generators.gpus_per_worker=0.4",
                        "reference.gpus=0.1", "reward.gpus=0.1"]
    trainer = DistributedTrainer(load_config(None, overrides))
    try:
        for group in (trainer.generators, trainer.reference, trainer.learner.ranks):
            assert all("cuda" in line for line in group.get(group.call_all(Engine.ready)))
        trainer.iteration()
    finally:
        trainer.close()


@pytest.mark.skipif(torch.cuda.device_count() < 1, reason="needs a CUDA GPU")
def test_colocated_run_sleeps_vllm_and_syncs_by_cuda_ipc():
    """cluster.colocate_all on one GPU: vLLM sleeps while the learner trains and takes the new
    weights as CUDA-IPC handles from the learner rank on its GPU."""
    from rayppo.trainers.distributed import DistributedTrainer

    overrides = BASE + ["cluster.colocate_all=true", "learner.gpus_per_rank=1"]
    assert weight_sync_backend(load_config(None, overrides)) == "ipc"
    trainer = DistributedTrainer(load_config(None, overrides))
    try:
        records = [trainer.iteration() for _ in range(3)]
    finally:
        trainer.close()
    assert not any("skipped" in event for event in trainer.schedule.events)
    assert max(r["logprob_mismatch/max"] for r in records) < MISMATCH_TOLERANCE
    assert [r["sync/verified"] for r in records] == [1.0] * 3
    assert records[2]["kl/ref_mean"] > 1e-4


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs for tensor parallelism")
def test_tensor_parallel_generator_on_one_node_with_the_mp_executor():
    """generators.gpus_per_worker=2: the actor holds both GPUs, vLLM's mp executor uses them."""
    from rayppo.trainers.distributed import DistributedTrainer

    overrides = [o for o in BASE if "gpu_memory" not in o] + ["generators.gpus_per_worker=2",
                                                              "learner.weight_sync=object_store"]
    trainer = DistributedTrainer(load_config(None, overrides))
    try:
        records = [trainer.iteration() for _ in range(2)]
    finally:
        trainer.close()
    assert max(r["logprob_mismatch/max"] for r in records) < MISMATCH_TOLERANCE


LORA = ["learner.lora_rank=4", "learner.lora_alpha=32", "ppo.lr=0.01"]


def _adapter_bytes() -> int:
    """fp32 A and B of the embedded policy's r = 4 adapter: what an adapter sync moves per generator."""
    from rayppo.models.loading import resolve_model_path
    from rayppo.models.shape import lora_params, read_shape

    return lora_params(read_shape(resolve_model_path("embedded")), 4) * 4


@pytest.mark.parametrize("transport", [
    pytest.param(["cluster.colocate_all=true", "learner.gpus_per_rank=1", "learner.weight_sync=ipc"], id="cuda-ipc",
                 marks=pytest.mark.skipif(torch.cuda.device_count() < 1, reason="needs a CUDA GPU")),
    pytest.param(["learner.gpus_per_rank=1", "generators.gpus_per_worker=1", "learner.weight_sync=broadcast"], id="nccl",
                 marks=pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs for NCCL")),
    pytest.param(["learner.gpus_per_rank=1", "generators.gpus_per_worker=2", "learner.weight_sync=object_store"],
                 id="tensor-parallel", marks=pytest.mark.skipif(torch.cuda.device_count() < 3, reason="needs 3 CUDA GPUs")),
])
def test_a_lora_adapter_alone_reaches_vllm_over_each_gpu_transport(transport):
    """LoRA adapter sync on GPUs: the colocated CUDA-IPC handover (one run: the adapter), the
    NCCL broadcast, and a tensor-parallel generator (each worker's whole adapter fingerprinted):
    every sync moves A and B alone and is verified; the adapter moves the policy."""
    overrides = BASE + LORA + transport
    records = _run(overrides, 3)
    assert [r["sync/verified"] for r in records] == [1.0] * 3
    assert records[-1]["sync/bytes"] == _adapter_bytes()
    assert max(r["logprob_mismatch/max"] for r in records) < MISMATCH_TOLERANCE
    assert records[2]["kl/ref_mean"] > 1e-4
