"""The model families users fine-tune, through a real vLLM engine and the weight sync.

For each family a tiny random-init model (the embedded tokenizer, 2 layers, 128 wide) is loaded
by a vLLM generator; the learner's sync stream of an updated policy (every weight moved by 1% of
its RMS: ``full_tensors`` then ``checkpoint_tensors``, as ``LearnerEngine`` sends it) is loaded;
then every sent tensor must be verified by its fingerprint, the generator must sample with the
new weights (log-probs equal to the transformers forward's within the fp32 bound the suite uses,
1e-4: a healthy sync measures ~5e-7), and a tensor left one bf16 step of lr 1e-6 behind (skipped on
its way in) or perturbed must fail the check. The same stream
is then written as the run's final export (``models/export.py``): transformers reloads it to the
learner's logits exactly (the same tensors, the same forward: a difference of 0.0), and the
generator holding the synced weights samples the exported model's log-probs.

Mixture-of-experts models run the same test: vLLM's CPU kernel repacks their experts after every
update (``actors/cpu_moe.py``). Families vLLM's CPU backend cannot run this way are checked where
they can be: GPT-NeoX (vLLM runs it through its transformers fallback: the weight check, not the
log-probs). GPT-2, whose Conv1D weights vLLM holds transposed, has its own test at the end.
"""

from __future__ import annotations

import gc
import re
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import transformers
from test_guard import one_ulp

from rayppo.actors.conv1d_weights import transposed_names
from rayppo.actors.generator import GeneratorActor, GeneratorEngine, SamplingSettings, VLLMSettings
from rayppo.actors.held_weights import expert_names
from rayppo.actors.reference import ReferenceEngine
from rayppo.data.prompts import PromptBatch
from rayppo.learner.full_weights import full_tensors
from rayppo.learner.guard import HeldPrints, WeightSyncError, check_weights
from rayppo.models.checkpoint_names import checkpoint_tensors
from rayppo.models.export import write_pretrained
from rayppo.models.fingerprint import as_matrix, kernel_rows, probe_rows, sent_prints, split_rows
from rayppo.models.weights import SyncFault, pack_weights

TINY = dict(hidden_size=128, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=256)
FAMILIES = {  # name -> (model class, config fields): head_dim 32, the smallest vLLM's CPU attention takes
    "llama": ("LlamaForCausalLM", TINY),
    "llama_tied": ("LlamaForCausalLM", TINY | {"tie_word_embeddings": True}),  # SmolLM2, Llama 3.2 1B/3B
    "stablelm": ("StableLmForCausalLM", TINY),  # LayerNorm, partial rotary
    "qwen2": ("Qwen2ForCausalLM", TINY),
    "qwen3": ("Qwen3ForCausalLM", TINY | {"head_dim": 32}),
    "mistral": ("MistralForCausalLM", TINY),
    "gemma": ("GemmaForCausalLM", TINY | {"head_dim": 32}),  # tied head, a module of its own in vLLM
    "gemma2": ("Gemma2ForCausalLM", TINY | {"head_dim": 32}),  # tied head, no lm_head in vLLM
    "phi3": ("Phi3ForCausalLM", TINY),  # fused qkv and gate_up in the checkpoint itself
    "opt": ("OPTForCausalLM", {**TINY, "ffn_dim": 96, "word_embed_proj_dim": 128}),  # LayerNorm, learned positions
    # Granite 3's scales (embeddings, residuals, attention, logits), as its 8B config sets them.
    "granite": ("GraniteForCausalLM", TINY | {"embedding_multiplier": 12.0, "residual_multiplier": 0.22,
                                             "attention_multiplier": 0.0078125, "logits_scaling": 16.0}),
    # Sliding-window layers (8 tokens: the prompts and responses are longer), q/k norms, tied head.
    "gemma3": ("Gemma3ForCausalLM", TINY | {"head_dim": 32, "sliding_window": 8}),
}
MOE = {
    "qwen2_moe": ("Qwen2MoeForCausalLM", TINY | {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                                 "shared_expert_intermediate_size": 48}),
    "mixtral": ("MixtralForCausalLM", TINY | {"num_local_experts": 4, "num_experts_per_tok": 2}),
    "qwen3_moe": ("Qwen3MoeForCausalLM", TINY | {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                                 "head_dim": 32}),
}
PROMPTS = ["say 7 :", "write 3 :", "give 1 :", "repeat 5 :"] * 2


def _model(family: dict, name: str, tokenizer, folder) -> tuple[torch.nn.Module, str]:
    """A random-init model of the family with the embedded tokenizer, saved to ``folder``; reloaded
    from there, as the learner loads it."""
    class_name, fields = family[name]
    model_class = getattr(transformers, class_name)
    torch.manual_seed(0)
    config = model_class.config_class(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                                      eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                                      **fields)
    model_class(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return model_class.from_pretrained(folder), str(folder)


def _exported(named: dict[str, torch.Tensor], base: str, tokenizer, folder) -> str:
    """The sync stream ``named`` written as the learner's final export (``LearnerEngine.save``)."""
    write_pretrained(named.items(), Path(base), Path(folder))
    tokenizer.save_pretrained(folder)
    return str(folder)


def _same_logits_as(model: torch.nn.Module, folder: str, tokenizer) -> float:
    """Largest |logit| difference between ``model`` and the folder reloaded by transformers."""
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(folder)
    ids = torch.tensor([tokenizer(t)["input_ids"] for t in PROMPTS[:4]])
    with torch.no_grad():
        return float((model(ids).logits - reloaded(ids).logits).abs().max())


def _updated(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """One 'update' (every weight moved by 1% of its RMS) and the sync stream of the result."""
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * p.square().mean().sqrt() * torch.randn(p.shape, generator=generator))
    return {name: t.clone() for name, t in checkpoint_tensors(model, full_tensors(model))}


def _mismatch(generator: GeneratorEngine, folder: str, tokenizer) -> float:
    rollout = generator.generate(PromptBatch(PROMPTS, [tokenizer(t)["input_ids"] for t in PROMPTS]), seed=0)
    expected = ReferenceEngine(folder).ref_logprobs(rollout)  # temperature 1: the sampling distribution
    return max(abs(a - b) for got, want in zip(rollout.logprobs, expected) for a, b in zip(got, want))


def lr_step(named: dict[str, torch.Tensor], lr: float, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The stream after one AdamW-sized step (every weight moved by ``lr``, the size of Adam's
    first step), sent in ``dtype``: in bf16 at lr 1e-6 only the elements whose rounding flips
    change (about lr / ulp of them, ~1%)."""
    generator = torch.Generator().manual_seed(3)
    return {n: (t.float() - lr * torch.sign(torch.randn(t.shape, generator=generator))).to(dtype)
            for n, t in named.items()}


def _one_ulp_caught(named: dict[str, torch.Tensor], hold: Callable[[dict[str, torch.Tensor]], HeldPrints | None]) -> int:
    """Every tensor of the stream with its smallest-magnitude nonzero element one ulp off (in the
    stream's dtype; all at once), held by ``hold`` (the fingerprints a generator reports holding a
    stream), is named by the weight check, each on its own. An all-zero tensor (a bias at its zero
    init) has no such element. Returns how many tensors were nudged."""
    nudged = {n: one_ulp(t) for n, t in named.items() if bool(t.any())}
    assert all(int((nudged[n] != named[n]).sum()) == 1 for n in nudged)
    held, sent = hold(named | nudged), sent_prints(named)
    assert isinstance(held, dict)
    for n in nudged:
        with pytest.raises(WeightSyncError, match=rf"does not hold the weights the learner sent: {re.escape(n)} "):
            check_weights({n: sent[n]}, {n: held[n]}, 0, 5)
    return len(nudged)


def _held_by(generator: GeneratorEngine) -> Callable[[dict[str, torch.Tensor]], HeldPrints | None]:
    def hold(stream: dict[str, torch.Tensor]) -> HeldPrints | None:
        generator.sync_fault = SyncFault()
        generator.load_weights(pack_weights(stream, 5))
        return generator.weight_fingerprints()

    return hold


def _caught(generator: GeneratorEngine, named: dict[str, torch.Tensor], hit: str) -> None:
    """The user's worst case: the stream of one bf16 update at lr 1e-6 reaches the engine without
    ``hit`` (``checks.sync_fault=skip_tensor``), so that tensor stays one step behind; the weight
    check names generator, tensor and version. The same stream loaded whole verifies, and so does
    a perturbed tensor get caught; and, before, a one-ulp change of any tensor's smallest element."""
    assert _one_ulp_caught(named, _held_by(generator)) > len(named) // 2
    before = {n: t.to(torch.bfloat16) for n, t in named.items()}
    generator.sync_fault = SyncFault()
    generator.load_weights(pack_weights(before, 2))
    assert check_weights(sent_prints(before), generator.weight_fingerprints(), 0, 2) == len(named)
    after = lr_step(named, 1e-6, torch.bfloat16)
    assert not torch.equal(after[hit], before[hit])
    generator.sync_fault = SyncFault("skip_tensor", hit)
    generator.load_weights(pack_weights(after, 3))
    with pytest.raises(WeightSyncError, match=rf"version 3 \(the update of iteration 2\): generator 0 does not hold "
                                              rf"the weights the learner sent: {hit} "):
        check_weights(sent_prints(after), generator.weight_fingerprints(), 0, 3)
    generator.sync_fault = SyncFault("perturb_tensor", hit)
    generator.load_weights(pack_weights(named, 4))
    with pytest.raises(WeightSyncError, match=rf"does not hold the weights the learner sent: {hit} "):
        check_weights(sent_prints(named), generator.weight_fingerprints(), 0, 4)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(FAMILIES | MOE))
def test_each_family_syncs_verified_samples_the_new_weights_and_catches_a_perturbed_tensor(
        name, tokenizer, tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    model, folder = _model(FAMILIES | MOE, name, tokenizer, tmp_path / "start")
    generator = GeneratorEngine(folder, SamplingSettings(max_new_tokens=8), backend="vllm",
                                actor=GeneratorActor(vllm=VLLMSettings(kv_cache_gib=1)))
    try:
        assert _mismatch(generator, folder, tokenizer) < 1e-4
        named = _updated(model)
        assert not any(n.startswith("lm_head") for n in named) or not model.config.tie_word_embeddings  # sent once
        generator.load_weights(pack_weights(named, 1))
        assert check_weights(sent_prints(named), generator.weight_fingerprints(), 0, 1) == len(named)  # all verified
        # The final export: the same tensors, so transformers' forward of the reloaded folder is the
        # learner's to the bit, and the generator holding the synced weights samples its log-probs.
        exported = _exported(named, folder, tokenizer, tmp_path / "exported")
        assert _same_logits_as(model, exported, tokenizer) == 0.0
        assert _mismatch(generator, exported, tokenizer) < 1e-4  # it samples the new weights
        mlp = [n for n in named if ".layers.1." in n and n.endswith("weight")
               and any(part in n for part in ("mlp", "fc1", "block_sparse_moe"))]  # Mixtral's MoE block
        hit = next((n for n in mlp if ".experts." in n), mlp[0])  # an expert's matrix where there are experts
        _caught(generator, named, hit)
    finally:
        del generator
        gc.collect()


FUSED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"), ("w1", "w3"))
"""Projections vLLM stacks by rows: ``qkv_proj``, ``gate_up_proj``, an expert's ``w13`` (Mixtral's w1/w3)."""


def _stacked(names: list[str]) -> list[list[str]]:
    """The sent names in the row-stacked groups vLLM holds them in (``FUSED``; alone otherwise)."""
    group_of: dict[str, list[str]] = {}
    for name in names:
        for parts in FUSED:
            group = [name.replace(f".{parts[0]}.", f".{p}.") for p in parts] if f".{parts[0]}." in name else []
            if group and all(n in names for n in group):
                group_of |= {n: group for n in group}
    groups: list[list[str]] = []
    for name in names:
        if (group := group_of.get(name, [name])) not in groups:
            groups.append(group)
    return groups


def _engine_layout_prints(named: dict[str, torch.Tensor]) -> dict[str, tuple[float, float]]:
    """What a vLLM CPU generator reports for ``named``, laid out as it holds them
    (``actors/held_weights.py``): q/k/v and gate/up (an expert's too) stacked by rows, the
    vocabulary padded with rows of zeros, every matrix repacked into a kernel that only computes
    x @ W^T and read back through it (``kernel_rows``)."""
    shapes, out = {n: list(t.shape) for n, t in named.items()}, {}
    for group in _stacked(list(named)):
        w = torch.cat([as_matrix(named[n]) for n in group])
        if "embed" in group[0] or "lm_head" in group[0]:
            w = torch.cat([w, torch.zeros(64 - w.shape[0] % 64, w.shape[1], dtype=w.dtype)])
        rows = (kernel_rows(lambda x, w=w: torch.nn.functional.linear(x, w), w.shape[1], w.dtype)
                if named[group[0]].dim() == 2 else probe_rows(w))
        out |= split_rows(rows, group, shapes)
    return out


@pytest.mark.parametrize("name", sorted(FAMILIES | MOE))
def test_one_ulp_of_every_tensors_smallest_element_is_caught_in_vllms_layout(name, tokenizer, tmp_path):
    """Every tensor of each family's sync stream (embedding, q/k/v/o, gate/up/down or fc1/fc2, the
    experts', norms, an untied head), in fp32 and bf16: a faithful copy in vLLM's layout verifies
    to the bit, and its smallest-magnitude nonzero element one ulp off is named. (In fp32 that
    moves the fingerprint by ~2^-24 of the element: under the float64 summation slack allowed
    before, so the old check let it pass.) The slow test above does the same through the engine."""
    model, _ = _model(FAMILIES | MOE, name, tokenizer, tmp_path)
    named = _updated(model)
    for dtype in (torch.float32, torch.bfloat16):
        stream = {n: t.to(dtype) for n, t in named.items()}
        held = _engine_layout_prints(stream)
        assert check_weights(sent_prints(stream), held, 0, 1) == len(stream)
        assert _one_ulp_caught(stream, _engine_layout_prints) > len(stream) // 2


@pytest.fixture
def gpt_neox_class_restored():
    """vLLM's transformers fallback decorates the decoder class itself for torch.compile
    (vllm/model_executor/models/transformers/base.py ``_decorate_for_torch_compile``, vLLM 0.32:
    new bases, ``__init__`` and ``__call__``), so after it has run, ``GPTNeoXModel(config)``
    asserts that no vLLM config is set, in any later test of the same process. This puts the
    class back as it was once the engine is gone. Only tests meet it: rayppo never builds a
    transformers model in a vLLM generator's process."""
    cls = transformers.GPTNeoXModel
    bases, attrs = cls.__bases__, dict(vars(cls))
    yield
    for name in set(vars(cls)) - set(attrs):
        delattr(cls, name)
    for name, value in attrs.items():
        if name not in ("__dict__", "__weakref__") and vars(cls).get(name) is not value:
            setattr(cls, name, value)
    cls.__bases__ = bases


@pytest.mark.slow
def test_gpt_neox_through_vllms_transformers_fallback_is_verified_under_its_own_names(tokenizer, tmp_path,
                                                                                      monkeypatch,
                                                                                      gpt_neox_class_restored):
    """vLLM runs GPT-NeoX on CPU through its transformers fallback, which keeps ``gpt_neox.*`` as
    ``model.*``: the engine's name mapping is applied to the sent names, so every tensor is
    verified and a perturbed MLP tensor is caught (the guard was blind to it). The log-probs are not
    compared here: the reference forward would build transformers' GPT-NeoX class while the engine
    holds it decorated (see the fixture)."""
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    model, folder = _model({"gpt_neox": ("GPTNeoXForCausalLM", TINY)}, "gpt_neox", tokenizer, tmp_path)
    named = _updated(model)
    # Its export reloads to the same logits (before the engine decorates the class; see the fixture).
    assert _same_logits_as(model, _exported(named, folder, tokenizer, tmp_path / "exported"), tokenizer) == 0.0
    generator = GeneratorEngine(folder, SamplingSettings(max_new_tokens=8), backend="vllm",
                                actor=GeneratorActor(vllm=VLLMSettings(kv_cache_gib=1)))
    try:
        generator.load_weights(pack_weights(named, 1))
        assert check_weights(sent_prints(named), generator.weight_fingerprints(), 0, 1) == len(named)
        # Layer 1's fingerprints under the names the engine's HF-to-vLLM mapping gives them (as an
        # engine reporting its own names for some tensors would): each of those is named, not
        # skipped while the rest verify.
        held = generator.weight_fingerprints()
        layer1 = {n: v for n, v in held.items() if ".layers.1." in n}
        renamed = generator.backend.llm.collective_rpc(lambda w: w.get_model().hf_to_vllm_mapper.apply_dict(layer1))[0]
        first = next(n for n in named if n in layer1)
        assert first not in renamed and len(renamed) == len(layer1)
        with pytest.raises(WeightSyncError, match=rf"reports fingerprints of {len(named) - len(layer1)} of the "
                                                  rf"{len(named)} sent tensors, not of {re.escape(first)}, .* and of "
                                                  r"tensors not sent: model.layers.1."):
            check_weights(sent_prints(named), {n: v for n, v in held.items() if n not in layer1} | renamed, 0, 1)
        hit = "gpt_neox.layers.1.mlp.dense_h_to_4h.weight"
        _caught(generator, named, hit)
    finally:
        del generator
        gc.collect()


EXPORT_ONLY = {
    # vLLM 0.32 runs it on CPU through its transformers fallback, which decorates transformers'
    # class (see gpt_neox_class_restored): the export is checked without an engine in the process.
    "starcoder2": ("Starcoder2ForCausalLM", TINY),  # tied head, biases
}


@pytest.mark.parametrize("name", sorted(EXPORT_ONLY))
def test_the_export_of_a_family_synced_through_the_fallback_reloads_to_the_learners_logits(name, tokenizer,
                                                                                          tmp_path):
    model, folder = _model(EXPORT_ONLY, name, tokenizer, tmp_path / "start")
    named = _updated(model)
    assert model.config.tie_word_embeddings and not any(n.startswith("lm_head") for n in named)
    assert _same_logits_as(model, _exported(named, folder, tokenizer, tmp_path / "exported"), tokenizer) == 0.0


@pytest.mark.parametrize("name", sorted(MOE))
def test_moe_sync_stream_is_the_checkpoint_and_fused_experts_fingerprint_per_expert(name, tokenizer, tmp_path):
    """transformers 5 holds experts fused ([E, 2I, h] and [E, h, I]) and renames modules (Mixtral's
    block_sparse_moe): the sync stream is the checkpoint's tensors, names and values, as vLLM loads
    them; and vLLM's fused w13/w2 parameters fingerprint back to those per-expert names."""
    from safetensors.torch import load_file

    model, folder = _model(MOE, name, tokenizer, tmp_path)
    stream = dict(checkpoint_tensors(model, full_tensors(model)))
    saved = load_file(f"{folder}/model.safetensors")
    assert stream.keys() == saved.keys() and all(torch.equal(stream[k], saved[k]) for k in saved)
    shapes = {k: list(v.shape) for k, v in stream.items()}
    prefix = next(k for k in stream if ".experts.0." in k).split(".experts.0.")[0]  # ...layers.0.mlp
    names = expert_names(f"{prefix}.experts.routed_experts", "w13_weight", shapes, 4)
    assert names is not None and len(names) == 4 and all(len(row) == 2 for row in names)
    # vLLM's layout: w13[e] = [gate_e; up_e] stacked by rows, w2[e] = down_e.
    w13 = torch.stack([torch.cat([stream[gate], stream[up]]) for gate, up in names])
    held = {k: v for e in range(4) for k, v in split_rows(probe_rows(w13[e]), names[e], shapes).items()}
    prints = sent_prints(stream)
    assert check_weights({k: prints[k] for k in held}, held, 0, 1) == 8
    w13[1, 0, 0] += 1.0  # expert 1's gate projection changed: caught under its own name
    held = {k: v for e in range(4) for k, v in split_rows(probe_rows(w13[e]), names[e], shapes).items()}
    with pytest.raises(WeightSyncError, match=rf"{names[1][0]} "):
        check_weights({k: prints[k] for k in held}, held, 0, 1)
    down = expert_names(f"{prefix}.experts.routed_experts", "w2_weight", shapes, 4)
    assert down is not None and all(len(row) == 1 for row in down)


def test_a_fault_tensor_the_policy_lacks_is_refused_before_anything_starts(tokenizer, tmp_path):
    from rayppo.config.load import load_config
    from rayppo.config.schema import ConfigError
    from rayppo.plan.inputs import check_policy_for_generators

    _, dense = _model(FAMILIES, "opt", tokenizer, tmp_path / "opt")
    # The default fault tensor is a Llama name: OPT's MLP is fc1/fc2, so the fault would hit nothing.
    with pytest.raises(ConfigError, match=r"^checks.sync_fault_tensor: .* has no tensor "
                                          r"'model.layers.0.mlp.down_proj.weight'"):
        check_policy_for_generators(load_config(None, [f"model.policy={dense}", "checks.sync_fault=perturb_tensor"]),
                                    tmp_path / "opt")
    check_policy_for_generators(load_config(None, [f"model.policy={dense}", "checks.sync_fault=perturb_tensor",
                                                   "checks.sync_fault_tensor=model.decoder.layers.0.fc1.weight"]),
                                tmp_path / "opt")


# ------------------------------------------------------------------------------------------
# GPT-2 (issue 47, item 11): the family of many tutorials, TRL's included. transformers' GPT-2
# sends its projections as Conv1D weights [in, out]; vLLM holds them transposed, and on CPU inside
# a oneDNN kernel. The weight check read them in the sent layout and handed the kernel a probe of
# the wrong width: the process aborted in malloc right after the first weight load
# (actors/conv1d_weights.py). The policy (2 layers, 128 wide, head_dim 64, tied head)
# must sample with the learner's log-probs, have every synced tensor verified, and have a
# projection left a bf16 step behind or perturbed named.
# ------------------------------------------------------------------------------------------
def _gpt2(tokenizer, folder: Path) -> transformers.GPT2LMHeadModel:
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=len(tokenizer), n_layer=2, n_embd=128, n_head=2, n_positions=256,
                                     bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                                     pad_token_id=tokenizer.pad_token_id)
    transformers.GPT2LMHeadModel(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return transformers.GPT2LMHeadModel.from_pretrained(folder)


@pytest.mark.slow
def test_a_gpt2_policy_samples_the_learners_logprobs_and_its_synced_weights_are_verified(tokenizer, tmp_path,
                                                                                        monkeypatch):
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    model = _gpt2(tokenizer, tmp_path / "start")
    assert model.config.tie_word_embeddings and model.config.n_embd // model.config.n_head == 64
    generator = GeneratorEngine(str(tmp_path / "start"), SamplingSettings(max_new_tokens=8), backend="vllm",
                                actor=GeneratorActor(vllm=VLLMSettings(kv_cache_gib=1)))
    try:
        assert _mismatch(generator, str(tmp_path / "start"), tokenizer) < 1e-4
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
        assert _mismatch(generator, str(tmp_path / "updated"), tokenizer) < 1e-4  # it samples the new weights
        # A projection left one bf16 step of lr 1e-6 behind, or perturbed, is named (as for every family).
        for hit in ("transformer.h.1.mlp.c_fc.weight", "transformer.h.0.attn.c_proj.weight"):  # [128, 512], square
            _caught(generator, named, hit)
    finally:
        del generator
        gc.collect()
