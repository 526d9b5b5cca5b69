"""Resuming on another split of the learner: DeepSpeed ZeRO states written by N ranks, converted by
rayppo's ``to_universal`` (``learner/learner_state.py``: DeepSpeed's own converter), loaded by M ranks,
compared tensor by tensor with the whole (unsharded) state the N ranks held: fp32 master weights,
both Adam moments, steps.

Real DeepSpeed engines in real processes over gloo (torch.multiprocessing), built with rayppo's own
``deepspeed_config``; the engines load through ``universal_load`` as ``LearnerEngine.load_checkpoint``
does."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from rayppo.config.load import load_config
from rayppo.learner.broadcast_sender import free_port

STATES = ("fp32", "exp_avg", "exp_avg_sq")


def _model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                        tie_word_embeddings=True))


def _whole_state(engine) -> dict[str, list[torch.Tensor]]:
    """Every parameter's fp32 weights and Adam moments, gathered whole (collective)."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    return {name: [safe_get_full_fp32_param(p), *(safe_get_full_optimizer_state(p, k) for k in STATES[1:])]
            for name, p in engine.module.named_parameters()}


def _rank(rank: int, world: int, stage: int, port: int, folder: str, mode: str, dtype: str = "float32") -> None:
    import deepspeed

    from rayppo.learner.learner_engine import _skip_shm_comm_op, deepspeed_config
    from rayppo.learner.learner_state import to_universal, universal_load
    from rayppo.learner.step import adamw
    from rayppo.models.shape import shape_from_config

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    _skip_shm_comm_op()
    deepspeed.init_distributed("gloo", auto_mpi_discovery=False)
    cfg = load_config(None, [f"learner.zero_stage={stage}", "ppo.lr=0.01", f"model.dtype={dtype}"])
    model = _model()
    # The shape from the model's own config, not a shared config.json: two ranks writing one file while
    # the other reads it gave an empty read once in CI's run (JSONDecodeError, 2026-12-06).
    shape = shape_from_config(model.config.to_dict())
    engine, *_ = deepspeed.initialize(model=model, optimizer=adamw(list(model.parameters()), 0.01, 0.0),
                                      config=deepspeed_config(cfg, world, shape))
    if mode == "save":
        for step in range(3):  # rows differ by rank, so the ranks' gradients and moments differ
            ids = torch.randint(0, 64, (1, 8), generator=torch.Generator().manual_seed(10 * rank + step))
            engine.backward(engine(input_ids=ids, labels=ids).loss)
            engine.step()
        engine.save_checkpoint(f"{folder}/ckpt/policy", tag="state", save_latest=False)
        whole = _whole_state(engine)
        # Leave the group together before rank 0 converts: a rank that exits while its peer still holds
        # the gloo pairs open can abort in the group's destructor (SIGABRT seen in CI, 2026-12-05).
        _leave()
        if rank == 0:
            torch.save(whole, f"{folder}/whole.pt")
            (Path(folder) / "ckpt" / "learner.json").write_text(f'{{"num_ranks": {world}, "zero_stage": {stage}}}')
            to_universal(Path(folder) / "ckpt", Path(folder) / "ckpt" / "universal", ["policy"])
        return
    with universal_load(engine, True):
        engine.load_checkpoint(f"{folder}/ckpt/universal/policy", tag="state")
    whole = _whole_state(engine)
    steps = {float(s["step"]) for s in engine.optimizer.optimizer.state.values()}
    # The weights the module computes with (bf16: the master weights rounded), before any step.
    module = {name: p.detach().clone() for name, p in engine.module.named_parameters()} if stage < 3 else {}
    _leave()
    if rank == 0:
        torch.save({"whole": whole, "steps": sorted(steps), "module": module}, f"{folder}/loaded.pt")


def _leave() -> None:
    """Every rank reaches this point, then the process group is torn down on all of them at once."""
    import deepspeed

    deepspeed.comm.barrier()
    deepspeed.comm.destroy_process_group()


@pytest.mark.parametrize("stage, before, after, dtype", [(2, 2, 1, "float32"), (1, 1, 2, "float32"), (3, 2, 1, "float32"),
                                                         (2, 2, 1, "bfloat16")])
def test_zero_state_resharded_to_another_rank_count_equals_the_whole_state(tmp_path, stage, before, after, dtype):
    """bf16 too: DeepSpeed keeps fp32 master weights and moments beside the bf16 module; those are
    what is resharded, and the module the new split computes with is the masters rounded to bf16."""
    mp.spawn(_rank, args=(before, stage, free_port(), str(tmp_path), "save", dtype), nprocs=before)
    assert (tmp_path / "ckpt" / "universal" / "learner.json").is_file()  # the finished conversion's mark
    mp.spawn(_rank, args=(after, stage, free_port(), str(tmp_path), "load", dtype), nprocs=after)
    saved = torch.load(tmp_path / "whole.pt")
    loaded = torch.load(tmp_path / "loaded.pt")
    assert loaded["steps"] == [3.0]
    for name, tensors in saved.items():
        for what, a, b in zip(STATES, tensors, loaded["whole"][name]):
            # Copies of the same fp32 numbers (gathered, converted, re-partitioned): equal to the bit.
            assert torch.equal(a, b), (name, what)
    assert any(t[1].abs().sum() > 0 for t in saved.values())  # the moments compared are not all zero
    for name, weight in loaded["module"].items():
        assert weight.dtype == getattr(torch, dtype), name
        assert torch.equal(weight, saved[name][0].to(weight.dtype).reshape(weight.shape)), name
