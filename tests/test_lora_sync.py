"""LoRA adapter sync (``learner.lora_sync``, docs/lora.md): only the adapter travels, the
generators serve it on the base they loaded once, the weight check sees what they serve.

The engines here are real: vLLM's CPU engine with its LoRA support, transformers with peft, and
on a local Ray the whole distributed trainer."""

from __future__ import annotations

import gc
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import pytest
import torch

from rayppo.actors.generator import GeneratorActor, GeneratorEngine, SamplingSettings, VLLMSettings
from rayppo.config.derived import lora_sync
from rayppo.config.load import load_config
from rayppo.config.schema import ConfigError
from rayppo.data.prompts import PromptBatch
from rayppo.learner.adapter_weights import (
    adapter_config,
    adapter_tensors,
    engine_form,
    peft_param_name,
    scaling,
    unsupported,
    wrap_lora,
)
from rayppo.learner.broadcast_sender import SyncEndpoint, WeightSender, free_port
from rayppo.learner.guard import WeightSyncError, check_weights
from rayppo.learner.policy_sync import PolicySync
from rayppo.models.fingerprint import sent_print
from rayppo.models.loading import load_causal_lm
from rayppo.models.sequences import pack, policy_forward
from rayppo.models.weights import SyncFault, pack_weights

SAMPLING = SamplingSettings(max_new_tokens=6, temperature=0.9, ignore_eos=True)
RANK, ALPHA = 4, 32.0  # s = 8: the scaling vLLM folds into B is not 1, so the check must follow it


def test_lora_sync_picks_adapter_where_it_works_and_says_why_it_falls_back():
    """``auto``: adapter on the defaults (vLLM, object store), on the hf backend, over the
    broadcast and CUDA-IPC transports and to tensor-parallel generators; merged with a reason for
    a rank vLLM does not serve; ``adapter`` where it cannot work is refused at load, naming the
    field; no LoRA, no sync choice."""
    from rayppo.config.derived import weight_sync_backend

    def mode(*overrides: str) -> tuple[str, str]:
        return lora_sync(load_config(None, ["learner.lora_rank=4", *overrides]))

    assert mode()[0] == "adapter" and "only the LoRA adapter travels (r=4)" in mode()[1]
    assert mode("generators.backend=hf")[0] == "adapter"
    assert mode("learner.lora_sync=merged") == ("merged", "learner.lora_sync=merged")
    assert mode("learner.weight_sync=broadcast")[0] == "adapter"
    assert weight_sync_backend(load_config(None, ["learner.lora_rank=4", "learner.weight_sync=broadcast"])) == "gloo"
    assert mode("generators.gpus_per_worker=2", "generators.tensor_parallel_size=2", "learner.gpus_per_rank=1")[0] == "adapter"
    merged, why = mode("learner.lora_rank=1024")
    assert merged == "merged" and "rank 1024 (vLLM 0.32 serves ranks up to 512)" in why
    assert mode("learner.lora_rank=1024", "generators.backend=hf")[0] == "adapter"  # peft serves any rank
    with pytest.raises(ConfigError, match=r"checks.sync_fault: drop_adapter needs LoRA adapter sync"):
        mode("learner.lora_sync=merged", "checks.sync_fault=drop_adapter")
    with pytest.raises(ConfigError, match=r"learner.lora_sync: adapter sync cannot serve rank 1024"):
        mode("learner.lora_sync=adapter", "learner.lora_rank=1024")
    assert lora_sync(load_config(None, [])) == ("none", "")


@pytest.fixture(scope="module")
def adapted(embedded_dir):
    """The embedded policy with a LoRA adapter whose B is not zero (a trained adapter's): its
    log-probs differ from the base's by far more than the tolerances below."""
    model = wrap_lora(load_causal_lm(embedded_dir, "float32"), {"r": RANK, "lora_alpha": ALPHA,
                                                                "target_modules": "all-linear"})
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.05 * torch.randn(p.shape, generator=g))
    return model.eval()


def _payload(model, version: int):
    named = {name: t.clone() for name, t in adapter_tensors(model)}
    config = adapter_config(model)
    sent = {name: sent_print(engine_form(name, t, scaling(config))) for name, t in named.items()}
    return pack_weights(named, version, adapter=config), sent


def test_adapter_tensors_are_a_peft_checkpoints(adapted):
    """The tensors sent are ``get_peft_model_state_dict``'s, under its names, and every linear
    layer of the decoder has one; the config is peft's own; nothing makes it unservable."""
    from peft import get_peft_model_state_dict

    named = dict(adapter_tensors(adapted))
    expected = get_peft_model_state_dict(adapted)
    assert named.keys() == expected.keys()
    assert all(torch.equal(named[k], expected[k]) for k in named)
    assert all(peft_param_name(k) in dict(adapted.named_parameters()) for k in named)
    config = adapter_config(adapted)
    assert (config["r"], config["lora_alpha"], scaling(config)) == (RANK, ALPHA, ALPHA / RANK)
    assert {name.rsplit(".", 1)[-1] for name in config["target_modules"]} == {
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}  # peft resolves all-linear
    assert unsupported(config, list(named)) is None
    assert "DoRA" in unsupported({**config, "use_dora": True}, list(named))
    assert "modules_to_save" in unsupported({**config, "modules_to_save": ["lm_head"]}, list(named))
    assert "head" in unsupported(config, list(named) + ["base_model.model.lm_head.lora_A.weight"])
    assert "rank 1024" in unsupported({**config, "r": 1024}, list(named))


def _prompts(tokenizer) -> PromptBatch:
    texts = ["say 1 2 3", "count to four : 1 2", "w3 w4 w5 w6 w7", "the end is"]
    return PromptBatch(texts, [tokenizer(t)["input_ids"] for t in texts])


def _mismatch(rollout, model, pad_id: int) -> float:
    """Largest |generator log-prob - ``model``'s| over the rollout's tokens (fp32 both)."""
    batch = pack(rollout.prompt_ids, rollout.response_ids, pad_id)
    with torch.no_grad():
        logprobs, _ = policy_forward(model, batch, SAMPLING.temperature)
    return max((logprobs[i, : len(lp)] - torch.tensor(lp)).abs().max().item() for i, lp in enumerate(rollout.logprobs))


def _broadcast(engine: GeneratorEngine, model, version: int) -> tuple[dict, int]:
    """Send ``model``'s adapter to ``engine`` as learner rank 0 does over the broadcast transport
    (``PolicySync``: the layout once at join, then A and B, fingerprinted as the engine holds
    them), over a 2-rank gloo group. Returns the fingerprints sent and the bytes delivered."""
    stream = PolicySync(model, "adapter", None, rank=0)
    layout = stream.layout()
    endpoint = SyncEndpoint("gloo", "127.0.0.1", free_port(), 2, timeout_s=60)
    with ThreadPoolExecutor(1) as pool:
        opened = pool.submit(WeightSender, endpoint, layout.specs, torch.device("cpu"))
        engine.join_weight_sync(endpoint, rank_offset=1)
        sent = pool.submit(opened.result().send, stream.fingerprinted())
        assert engine.receive_weights(layout, version) == version
        return stream.sent, sent.result()


def _hand_over(engine: GeneratorEngine, model, version: int, monkeypatch) -> dict:
    """Hand ``model``'s adapter to ``engine`` as the colocated CUDA-IPC sync does: learner rank 0's
    one run (``PolicySync.ipc_runs``, ``ipc_chunk`` with the adapter's config), staged in the
    worker and registered when the update finishes. CUDA-IPC needs a GPU: here a handle names a
    tensor in a table of this process, and the worker opens it from there (on GPUs:
    ``open_ipc_handle``, vLLM 0.32's rebuild). Returns the fingerprints sent."""
    import rayppo.actors.vllm_adapters as vllm_adapters
    from rayppo.learner.broadcast_sender import ipc_chunk

    shared: dict[int, torch.Tensor] = {}

    def share(tensor: torch.Tensor) -> dict[str, tuple]:
        shared[id(tensor)] = tensor
        return {"table": (id(tensor),)}

    monkeypatch.setattr(vllm_adapters, "open_ipc_handle", lambda handle, device: shared[handle["table"][0]])
    stream = PolicySync(model, "adapter", None, rank=0)
    (run,) = list(stream.ipc_runs(zero_stage=2))
    chunk = ipc_chunk(run, export=share, adapter=stream.adapter_config())
    engine.start_ipc_update()
    engine.load_ipc(chunk)
    assert engine.finish_ipc_update(version) == version
    return stream.sent


@contextmanager
def _another_adapter(model, part: str):
    """Inside the block, another adapter: every A negated (``part="lora_A"``) or every B
    shifted by 0.01 (``"lora_B"``); the adapter as it was after."""
    def change(sign: float) -> None:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if part in name:
                    p.mul_(-1) if part == "lora_A" else p.add_(0.01 * sign)

    change(1.0)
    try:
        yield
    finally:
        change(-1.0)


@pytest.mark.parametrize("backend", ["vllm", "hf"])
def test_a_generator_serves_the_adapter_it_was_sent_and_its_fingerprints_prove_it(backend, embedded_dir, adapted,
                                                                                    tokenizer, monkeypatch):
    """The adapter loads into a real engine through the object store (version 1, then 2), over a
    gloo broadcast (version 3: A and B alone, ``sync/bytes`` their size) and, on vLLM, as the
    CUDA-IPC sync hands it over (version 4, its handles opened by a stand-in), and the engine
    then samples from base + adapter: its log-probs are the peft model's within fp32 evaluation
    error (1e-4 nats, as the merged sync's tests bound two fp32 evaluations of one network) and
    far from the base's; its fingerprints match what was sent, B with the scaling vLLM folds into
    it, and no longer match the version it replaced."""
    engine = GeneratorEngine(str(embedded_dir), SAMPLING, backend=backend,
                             actor=GeneratorActor(vllm=VLLMSettings(lora_rank=RANK, collective_sync=True)))
    try:
        payload, sent = _payload(adapted, version=1)
        assert engine.load_weights(payload) == 1
        assert check_weights(sent, engine.weight_fingerprints(), 0, 1) == len(sent)
        rollout = engine.generate(_prompts(tokenizer), seed=3)
        assert _mismatch(rollout, adapted, tokenizer.pad_token_id) < 1e-4
        with adapted.disable_adapter():
            assert _mismatch(rollout, adapted, tokenizer.pad_token_id) > 1e-2  # the adapter is what was served
        with _another_adapter(adapted, "lora_A"):
            second, sent2 = _payload(adapted, version=2)
            engine.load_weights(second)
            assert check_weights(sent2, engine.weight_fingerprints(), 0, 2) == len(sent2)
            with pytest.raises(WeightSyncError):  # the first version's prints no longer match
                check_weights(sent, engine.weight_fingerprints(), 0, 1)
            assert _mismatch(engine.generate(_prompts(tokenizer), seed=3), adapted, tokenizer.pad_token_id) < 1e-4
        sent3, delivered = _broadcast(engine, adapted, version=3)
        assert delivered == sum(t.numel() * t.element_size() for _, t in adapter_tensors(adapted))
        assert check_weights(sent3, engine.weight_fingerprints(), 0, 3) == len(sent3)
        with pytest.raises(WeightSyncError):
            check_weights(sent2, engine.weight_fingerprints(), 0, 2)
        assert _mismatch(engine.generate(_prompts(tokenizer), seed=4), adapted, tokenizer.pad_token_id) < 1e-4
        if backend == "vllm":
            with _another_adapter(adapted, "lora_B"):
                sent4 = _hand_over(engine, adapted, version=4, monkeypatch=monkeypatch)
                assert check_weights(sent4, engine.weight_fingerprints(), 0, 4) == len(sent4)
                with pytest.raises(WeightSyncError):
                    check_weights(sent3, engine.weight_fingerprints(), 0, 3)
                assert _mismatch(engine.generate(_prompts(tokenizer), seed=5), adapted, tokenizer.pad_token_id) < 1e-4
    finally:
        engine.close()


@pytest.mark.parametrize("fault", ["skip_all", "drop_adapter"])
def test_a_generator_that_keeps_its_old_adapter_or_serves_none_fails_the_weight_check(fault, embedded_dir, adapted):
    """veRL #7495's failure, on purpose: the generator says it took version 2 but keeps serving
    version 1's adapter (``skip_all``), or took it and serves requests with none
    (``drop_adapter``). The fingerprints of what its requests are served with do not match,
    whether the adapter came through the object store (version 2) or a broadcast (version 3)."""
    engine = GeneratorEngine(str(embedded_dir), SAMPLING, backend="vllm",
                             actor=GeneratorActor(vllm=VLLMSettings(lora_rank=RANK, collective_sync=True)))
    try:
        first, _ = _payload(adapted, version=1)
        engine.load_weights(first)
        engine.sync_fault = SyncFault(fault)
        with _another_adapter(adapted, "lora_B"):
            second, sent = _payload(adapted, version=2)
            assert engine.load_weights(second) == 2  # it reports the new version ...
            with pytest.raises(WeightSyncError, match=r"weight sync to policy version 2 .*generator 3"):
                check_weights(sent, engine.weight_fingerprints(), 3, 2)  # ... and the check sees it does not serve it
            with _another_adapter(adapted, "lora_A"):
                sent3, _ = _broadcast(engine, adapted, version=3)
                assert engine.policy_version == 3
                with pytest.raises(WeightSyncError, match=r"weight sync to policy version 3 .*generator 3"):
                    check_weights(sent3, engine.weight_fingerprints(), 3, 3)
    finally:
        engine.close()


QKV0 = "model.layers.0.self_attn.qkv_proj"
"""vLLM's LoRA layer of the first decoder layer's q/k/v (three packed modules, one slot each)."""


def _change_registered_copy(worker, version: int) -> None:
    """Add 1 to every B of ``QKV0`` in vLLM's registered ``LoRAModel`` of ``version``, not in its slot."""
    from rayppo.actors.vllm_adapters import adapter_id

    for b in worker.model_runner.lora_manager._adapter_manager.get_adapter(adapter_id(version)).loras[QKV0].lora_b:
        b.add_(1.0)


def _clear_slot(worker, version: int) -> None:
    """vLLM's own ``reset_lora`` on ``QKV0``'s slot of ``version``: what the kernels read where an
    adapter is registered but not applied (activation resets a layer it has no weights for)."""
    from rayppo.actors.vllm_adapters import adapter_id

    manager = worker.model_runner.lora_manager._adapter_manager
    manager.modules[QKV0].reset_lora(manager.lora_index_to_id.index(adapter_id(version)))


def test_the_weight_check_reads_the_slot_the_kernels_read(embedded_dir, adapted, tokenizer):
    """The fingerprints come from the adapter's slot of the LoRA layers' stacked buffers, which
    the kernels read, not from vLLM's registered copy: B of q/k/v changed in the registered copy
    alone leaves the served log-probs (within the 1e-4 of two fp32 evaluations) and the check as
    they were; the slot cleared as vLLM clears an unapplied layer's fails the check, naming the
    first tensor of that layer. An adapter with a module no LoRA layer takes (the router
    ``mlp.gate`` that peft finds in transformers' MoE models, here added by hand) is refused at
    registration, naming the module, instead of being registered and never applied."""
    engine = GeneratorEngine(str(embedded_dir), SAMPLING, backend="vllm",
                             actor=GeneratorActor(vllm=VLLMSettings(lora_rank=RANK)))
    try:
        payload, sent = _payload(adapted, version=1)
        engine.load_weights(payload)
        engine.backend.llm.collective_rpc(_change_registered_copy, args=(1,))
        assert check_weights(sent, engine.weight_fingerprints(), 0, 1) == len(sent)
        assert _mismatch(engine.generate(_prompts(tokenizer), seed=3), adapted, tokenizer.pad_token_id) < 1e-4
        engine.backend.llm.collective_rpc(_clear_slot, args=(1,))
        with pytest.raises(WeightSyncError, match=r"generator 0 does not hold the weights the learner sent: "
                                                  r"base_model\.model\.model\.layers\.0\.self_attn\.q_proj\.lora_A"):
            check_weights(sent, engine.weight_fingerprints(), 0, 1)
        gate = "base_model.model.model.layers.1.mlp.gate"  # a router of 4 experts on the 128-wide stream
        named = {**dict(adapter_tensors(adapted)), f"{gate}.lora_A.weight": torch.zeros(RANK, 128),
                 f"{gate}.lora_B.weight": torch.zeros(4, RANK)}
        modules = len({name.rsplit(".", 2)[0] for name in named})
        with pytest.raises(ValueError, match=rf"adapter sync: 1 of the adapter's {modules} LoRA modules would not be "
                                             r"applied .*: no linear LoRA layer of vLLM's model takes "
                                             r"model\.layers\.\*\.mlp\.gate$"):
            engine.load_weights(pack_weights(named, 2, adapter=adapter_config(adapted)))
    finally:
        del engine  # vLLM's in-process engine gives back its parallel groups when it is collected
        gc.collect()


def test_an_adapter_module_vllm_would_not_apply_is_refused_when_the_generator_starts(tokenizer, tmp_path):
    """peft's ``all-linear`` on transformers' Mixtral puts LoRA on the router (``mlp.gate``) and
    the 3D experts (``mlp.experts``, its ``base_layer`` the gate/up half); vLLM 0.32's Mixtral
    calls that block ``block_sparse_moe`` and has no LoRA layer under those names, so those
    modules would be registered and never applied. The generator refuses to start, naming them
    (and only them: the attention's are applied), before any sync."""
    from test_model_families import MOE, _model

    gc.collect()  # the engines of earlier tests: vLLM sets up a MoE model's expert-parallel group only in a fresh process state
    _, folder = _model(MOE, "mixtral", tokenizer, tmp_path / "mixtral")
    with pytest.raises(ConfigError, match=r"^learner\.lora_sync: 6 of the adapter's 14 modules \(model\.layers\.\*\.mlp\."
                                          r"experts, model\.layers\.\*\.mlp\.experts\.base_layer, model\.layers\.\*\.mlp\."
                                          r"gate\) are taken by no linear LoRA layer of vLLM's MixtralForCausalLM"):
        GeneratorEngine(folder, SAMPLING, backend="vllm", actor=GeneratorActor(vllm=VLLMSettings(lora_rank=RANK)))


def test_the_base_with_its_adapter_off_is_the_reference(embedded_dir, adapted, tokenizer):
    """A LoRA policy's log pi_ref comes from its own forward with the adapter switched off: the
    same log-probs a separate reference engine on the base checkpoint gives (fp32, the same
    network evaluated twice: 1e-5 nats), and not the adapted policy's."""
    from rayppo.actors.reference import ReferenceEngine
    from rayppo.learner.collective import LocalCollective
    from rayppo.learner.rollout_tensors import RolloutTensors, padded
    from rayppo.learner.step import LearnerModels, LearnSettings, base_logprobs

    cfg = load_config(None, ["learner.lora_rank=4", "ppo.kl_coef=0.1", f"rollout.temperature={SAMPLING.temperature}"])
    settings = LearnSettings.of(cfg)
    assert settings.reference_from_base
    engine = GeneratorEngine(str(embedded_dir), SAMPLING, backend="hf")
    rollout = engine.generate(_prompts(tokenizer), seed=5)
    tensors = RolloutTensors.of(rollout, tokenizer.pad_token_id)
    models = LearnerModels(adapted, None, None, LocalCollective(), "cpu", tokenizer.pad_token_id)  # type: ignore[arg-type]
    base = base_logprobs(models, tensors, settings) * tensors.batch.mask
    reference = ReferenceEngine(str(embedded_dir), temperature=SAMPLING.temperature).ref_logprobs(rollout)
    assert (base - padded(reference)).abs().max() < 1e-5
    with torch.no_grad():
        adapted_logprobs, _ = policy_forward(adapted, tensors.batch, SAMPLING.temperature)
    assert ((adapted_logprobs - base) * tensors.batch.mask).abs().max() > 1e-2  # the adapter was off


def test_cpu_lora_products_per_adapter_equal_vllms_per_token_products():
    """rayppo's grouped CPU LoRA products (``actors/cpu_lora.py``) against vLLM 0.32's own torch
    ops, loaded fresh from its file: shrink, expand and expand-slice over tokens of three slots,
    a negative slot among them, to within fp32 summation order (n u sum |x_i w_i| per output,
    Higham eq. 3.5: the two sum the same products in another order)."""
    import importlib.util

    from vllm.lora.ops.torch_ops import lora_ops

    from rayppo.actors import cpu_lora

    spec = importlib.util.spec_from_file_location("vllm_lora_ops_unpatched", lora_ops.__file__)
    vllm_ops = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(vllm_ops)
    g = torch.Generator().manual_seed(0)
    tokens, hidden, rank, out, slots = 37, 48, 8, 40, 3
    indices = torch.tensor([i % slots for i in range(tokens)]) - (torch.arange(tokens) % 5 == 0).long()  # -1 too
    x = torch.randn(tokens, hidden, generator=g)
    a = torch.randn(slots, 1, rank, hidden, generator=g)
    b = torch.randn(slots, 1, out, rank, generator=g)
    u = torch.finfo(torch.float32).eps / 2

    def bound(inputs: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return inputs.shape[1] * u * torch.einsum("bi,boi->bo", inputs.abs(), weights.squeeze(1)[indices].abs())

    shrunk = {}
    for name, ops in (("vllm", vllm_ops), ("rayppo", cpu_lora)):
        y = torch.zeros(tokens, rank)
        ops.bgmv_shrink(x, a, y, indices, 0.5)
        shrunk[name] = y
    assert ((shrunk["vllm"] - shrunk["rayppo"]).abs() <= 0.5 * bound(x, a)).all()
    h = shrunk["vllm"]
    for add in (False, True):
        expanded, sliced = {}, {}
        for name, ops in (("vllm", vllm_ops), ("rayppo", cpu_lora)):
            y = torch.ones(tokens, out + 8)
            ops.bgmv_expand(h, b, y, indices, add)
            expanded[name] = y
            z = torch.ones(tokens, out + 8)
            ops.bgmv_expand_slice(h, b, z, indices, 4, out, add)
            sliced[name] = z
        assert ((expanded["vllm"] - expanded["rayppo"])[:, :out].abs() <= bound(h, b)).all()
        assert torch.equal(expanded["vllm"][:, out:], expanded["rayppo"][:, out:])  # untouched columns
        assert ((sliced["vllm"] - sliced["rayppo"])[:, 4:4 + out].abs() <= bound(h, b)).all()
    cpu_lora.patch()
    assert lora_ops.bgmv_expand is cpu_lora.bgmv_expand


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_slot_lora_linear_equals_vllms_per_slice_products(dtype):
    """rayppo's product for a packed layer whose tokens all use one adapter slot
    (``cpu_lora.one_slot_lora_linear``: one shrink for all slices) against vLLM 0.32's own ops in
    ``PunicaWrapperCPU.add_lora_linear``'s order (per slice: an fp32 shrink into a zeroed buffer,
    an expand in the output's dtype added to it), three slices of unequal width, slot 1 of 3.
    Both sum the same fp32 products in another order (n u_32 sum|.|, Higham eq. 3.5), then round
    h, the expand's product and its sum with y to ``dtype``: at most one unit in the last place of
    each apart, 4 u |h| |B| + 2 u |y|."""
    import importlib.util

    from vllm.lora.ops.torch_ops import lora_ops

    from rayppo.actors.cpu_lora import PackedLoRA, one_slot_lora_linear, single_slot

    spec = importlib.util.spec_from_file_location("vllm_lora_ops_unpatched", lora_ops.__file__)
    vllm_ops = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(vllm_ops)
    g = torch.Generator().manual_seed(0)
    tokens, hidden, rank, slots, widths = 19, 48, 8, 3, (40, 16, 16)
    a = tuple(torch.randn(slots, 1, rank, hidden, generator=g).to(dtype) for _ in widths)
    b = tuple(torch.randn(slots, 1, n, rank, generator=g).to(dtype) for n in widths)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    y = torch.randn(tokens, sum(widths), generator=g).to(dtype)
    indices = torch.full((tokens,), 1)
    assert single_slot(indices) == 1
    assert single_slot(torch.tensor([1, 1, 2])) is None and single_slot(torch.tensor([-1, -1])) is None
    ours = y.clone()
    one_slot_lora_linear(ours, x, PackedLoRA(a, b, 0.5, widths), slot=1)
    theirs, offset, shrunk, expanded = y.clone(), 0, [], []
    for a_i, b_i, n in zip(a, b, widths):
        h = torch.zeros(tokens, rank, dtype=torch.float32)
        vllm_ops.bgmv_shrink(x, a_i, h, indices, 0.5)
        vllm_ops.bgmv_expand_slice(h, b_i, theirs, indices, offset, n, True)
        b_abs = b_i[1, 0].float().abs().T
        shrunk.append((0.5 * x.float().abs() @ a_i[1, 0].float().abs().T) @ b_abs)  # |s x A^T| |B^T|
        expanded.append(h.abs() @ b_abs)  # |h| |B^T|
        offset += n
    u32, u = torch.finfo(torch.float32).eps / 2, torch.finfo(dtype).eps / 2
    # the shrink's fp32 order, carried through B; h rounded to dtype (one ulp apart at most), the
    # expand's order and its rounding; the sum's rounding
    bound = (hidden * u32 * torch.cat(shrunk, dim=1) + (rank * u32 + 4 * u) * torch.cat(expanded, dim=1)
             + 2 * u * theirs.float().abs())
    assert ((ours.float() - theirs.float()).abs() <= bound).all()
    assert not torch.equal(ours, y)  # the adapter added something
