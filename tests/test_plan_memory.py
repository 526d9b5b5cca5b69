"""``rayppo plan``'s memory figures against the truth: the learner's saved activations against what
its forward saves, tensor by tensor, and every role's peak against what ``rayppo bench`` measured
on the real model (``benchmarks/results``)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

from rayppo.models.shape import shape_from_config
from rayppo.plan.activations import Pass, layer_saved_bytes
from rayppo.plan.footprint import estimate_roles

ROOT = Path(__file__).resolve().parents[1]
REAL_MODEL_RESULTS = [path for path in sorted((ROOT / "benchmarks" / "results").glob("smollm2-grpo*.json"))
                      if "peak_memory_bytes" in json.loads(path.read_text())]
SMOLLM2 = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 576,
           "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
           "vocab_size": 49152, "max_position_embeddings": 8192, "tie_word_embeddings": True}
"""SmolLM2-135M-Instruct's shape (docs/real-model.md): all the plan reads of the bench's models."""
BENCH_PROMPT_TOKENS = 47
"""The longest prompt of the bench's runs, which ``bench.plan_estimate`` plans for: the arithmetic
prompts are 44-50 tokens in SmolLM2's chat template, and these runs' longest was 47, the one P at
which the recorded estimates of the roles the learner's fix left alone come out to the byte (the
reward model's forward, 1.8 x 64 rows x (47 + 32) tokens x 11712 elements x p, plus its weights)."""


def _bench():
    spec = importlib.util.spec_from_file_location("rayppo_benchmarks_plan", ROOT / "benchmarks" / "bench.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("result", REAL_MODEL_RESULTS, ids=[path.stem for path in REAL_MODEL_RESULTS])
def test_every_roles_plan_is_within_a_quarter_of_the_peak_the_real_model_bench_measured(result, tmp_path):
    """The plan of the config each recorded run had (its workload's, through ``bench.workload_config``,
    the models' ``config.json`` only) against each role's measured peak RSS. ±25% is what the plan
    promises; the same workload (bf16) measured its learner at 5.08 and 5.49 GiB in two runs, an 8%
    spread, which leaves the estimate itself about 17%. Before the learner counted a group's prompt
    once and its weight copies as a phase of their own, it planned 1.55x the fp32 learner's peak."""
    recorded = json.loads(result.read_text())
    bench = _bench()
    policy, reward = tmp_path / "policy", tmp_path / "reward_model"
    for folder, config in ((policy, SMOLLM2), (reward, SMOLLM2 | {
            "architectures": ["LlamaForSequenceClassification"], "id2label": {"0": "LABEL_0"}})):
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(config))
    workload = bench.load_workloads()[recorded["workload"]]
    cfg = bench.workload_config(workload, policy, reward, recorded.get("overrides") or [])
    planned = estimate_roles(cfg, prompt_tokens=BENCH_PROMPT_TOKENS)
    ratios = {role: planned[role].rss / peak for role, peak in recorded["peak_memory_bytes"].items()}
    assert set(ratios) == {"generators", "reward", "learner"}  # kl_coef=0: no reference actor to measure
    assert all(0.75 <= ratio <= 1.25 for ratio in ratios.values()), ratios


def _saved_by_layer(model: torch.nn.Module, batch) -> list[int]:
    """Bytes of the tensors the learner's policy forward saves for backward, by the decoder layer
    that saved them first (a tensor several layers save, RoPE's cos and sin, counts in the first);
    parameters excluded."""
    from rayppo.models.sequences import policy_forward

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: set[int] = set()
    by_layer = [0] * len(model.model.layers)
    current = [-1]

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if current[0] >= 0 and ptr not in params and ptr not in seen:
            seen.add(ptr)
            by_layer[current[0]] += t.untyped_storage().nbytes()
        return t

    hooks = [layer.register_forward_pre_hook(lambda _m, _a, i=i: current.__setitem__(0, i))
             for i, layer in enumerate(model.model.layers)]
    hooks += [layer.register_forward_hook(lambda *_: current.__setitem__(0, -1)) for layer in model.model.layers]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        policy_forward(model, batch)
    for hook in hooks:
        hook.remove()
    return by_layer


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32, fused attention", "bf16, plain matmuls"])
def test_the_learners_saved_activations_are_counted_to_the_byte(dtype):
    """What a decoder layer saves for backward in the learner's forward (``varlen`` packing, a
    GRPO batch of 3 prompts x 4 samples, each prompt once; grouped-query attention) is what
    ``plan/activations.py`` counts: in fp32 (the fused attention kernel) and in bf16 on CPU
    (attention as plain matmuls, the norms' fp32 inputs)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from rayppo.models.loading import prepare_for_training
    from rayppo.models.sequences import pack
    from rayppo.models.varlen_attention import use_varlen_attention

    config = LlamaConfig(vocab_size=300, hidden_size=96, intermediate_size=160, num_hidden_layers=3,
                         num_attention_heads=6, num_key_value_heads=2, head_dim=16)
    torch.manual_seed(0)
    model = prepare_for_training(LlamaForCausalLM(config).to(dtype), gradient_checkpointing=False)
    use_varlen_attention(model)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(4, 300, (7,), generator=g).tolist() for _ in range(3)]
    responses = [torch.randint(4, 300, (5,), generator=g).tolist() for _ in range(12)]
    batch = pack([prompts[i // 4] for i in range(12)], responses, 0).packed("varlen")
    saved = _saved_by_layer(model, batch)
    step = Pass(rows=12, length=7 + 5, positions=3 * 7 + 12 * 5)  # each prompt's 7 positions once
    expected = layer_saved_bytes(shape_from_config(config.to_dict()), step, dtype.itemsize, dtype == torch.bfloat16)
    assert saved[1:] == [expected] * 2  # layer 0 also saved what every layer shares (cos, sin, the packing's indices)

