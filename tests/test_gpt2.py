"""GPT-2 through a vLLM generator (issue 47, item 11): the family of many tutorials, TRL's included.

transformers' GPT-2 sends its projections as ``Conv1D`` weights ``[in, out]``; vLLM holds them
transposed, and on CPU inside a oneDNN kernel. The generator's weight check read them in the sent
layout and handed the kernel a probe of the wrong width: the process aborted in ``malloc`` right
after the first weight load (``actors/conv1d_weights.py``). The policy of the report (2 layers,
128 wide, head_dim 64, tied head, random init) must now sample with the learner's log-probs, have
every synced tensor verified, and have a projection left a bf16 step behind or perturbed caught
under its own name.
"""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch
import transformers

from rayppo.actors.conv1d_weights import transposed_names
from rayppo.actors.generator import GeneratorEngine, SamplingSettings, VLLMSettings
from rayppo.actors.reference import ReferenceEngine
from rayppo.data.prompts import PromptBatch
from rayppo.learner.full_weights import full_tensors
from rayppo.learner.guard import check_weights
from rayppo.models.checkpoint_names import checkpoint_tensors
from rayppo.models.export import write_pretrained
from rayppo.models.fingerprint import sent_prints
from rayppo.models.weights import pack_weights
from test_model_families import _caught as caught  # pytest puts tests/ on the path

PROMPTS = ["say 7 :", "write 3 :", "give 1 :", "repeat 5 :"] * 2


def _gpt2(tokenizer, folder: Path) -> transformers.GPT2LMHeadModel:
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=len(tokenizer), n_layer=2, n_embd=128, n_head=2, n_positions=256,
                                     bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                                     pad_token_id=tokenizer.pad_token_id)
    transformers.GPT2LMHeadModel(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return transformers.GPT2LMHeadModel.from_pretrained(folder)


def _mismatch(generator: GeneratorEngine, folder: Path, tokenizer) -> float:
    """Largest |generator - learner| log-prob over the sampled tokens (the learner's forward, temperature 1)."""
    rollout = generator.generate(PromptBatch(PROMPTS, [tokenizer(t)["input_ids"] for t in PROMPTS]), seed=0)
    expected = ReferenceEngine(str(folder)).ref_logprobs(rollout)
    return max(abs(a - b) for got, want in zip(rollout.logprobs, expected) for a, b in zip(got, want))


@pytest.mark.slow
def test_a_gpt2_policy_samples_the_learners_logprobs_and_its_synced_weights_are_verified(tokenizer, tmp_path,
                                                                                        monkeypatch):
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    model = _gpt2(tokenizer, tmp_path / "start")
    assert model.config.tie_word_embeddings and model.config.n_embd // model.config.n_head == 64
    generator = GeneratorEngine(str(tmp_path / "start"), SamplingSettings(max_new_tokens=8), backend="vllm",
                                vllm=VLLMSettings(kv_cache_gib=1))
    try:
        assert _mismatch(generator, tmp_path / "start", tokenizer) < 1e-4
        generator_ = torch.Generator().manual_seed(1)
        with torch.no_grad():  # one "update": every weight moved by 1% of its RMS
            for p in model.parameters():
                p.add_(0.01 * p.square().mean().sqrt() * torch.randn(p.shape, generator=generator_))
        named = {name: t.clone() for name, t in checkpoint_tensors(model, full_tensors(model))}
        conv1d = {n for n in named if n.endswith(".weight") and any(p in n for p in ("c_attn", "c_proj", "c_fc"))}
        shapes = {n: list(t.shape) for n, t in named.items()}
        assert generator.backend.llm.collective_rpc(lambda w: transposed_names(w.get_model(), shapes))[0] == conv1d
        generator.load_weights(pack_weights(named, 1))
        # Every sent tensor verified, the Conv1D projections (held transposed, in a oneDNN kernel) included.
        assert check_weights(sent_prints(named), generator.weight_fingerprints(), 0, 1) == len(named)
        write_pretrained(named.items(), tmp_path / "start", tmp_path / "updated")
        tokenizer.save_pretrained(tmp_path / "updated")
        assert _mismatch(generator, tmp_path / "updated", tokenizer) < 1e-4  # it samples the new weights
        # A projection left one bf16 step of lr 1e-6 behind, or perturbed, is named (as for every family).
        for hit in ("transformer.h.1.mlp.c_fc.weight", "transformer.h.0.attn.c_proj.weight"):  # [128, 512], square
            caught(generator, named, hit)
    finally:
        del generator
        gc.collect()
