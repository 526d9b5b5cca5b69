"""Log-probs and entropy in chunks (``rayppo.models.vocab_head``): the same numbers and gradients
as the full-vocabulary logits, without holding them.

Tolerances come from the arithmetic. Two fp32 dot products of length H over the same operands
in different orders each differ from the exact value by at most gamma_H * sum|h||w| (gamma_H =
H u / (1 - H u), u = 2^-24), so two logits differ by at most twice that; a log-softmax is
1-Lipschitz in the max norm and so moves by at most twice the logits' difference, plus each
side's own rounding of the logsumexp over V terms ((V + 4) u relative). The entropy's gradient
with respect to the logits has an l1 norm of at most 2 log V.
"""

import math

import pytest
import torch

import rayppo.models.sequences as sequences
import rayppo.models.vocab_head as vocab_head
from rayppo.models.loading import load_causal_lm
from rayppo.models.sequences import _full_logits_forward, pack, policy_forward, policy_forward_at, top_forward
from rayppo.models.vocab_head import HeadPass, plain_weight, token_logprobs
from rayppo.plan.footprint import LOGIT_CHUNK_ELEMENTS

U32, U_BF16 = 2.0**-24, 2.0**-8


def _ragged(tokenizer, vocab: int, seed: int = 0):
    """Four rows of different prompt and response lengths (one response of a single token)."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (3, 6, 1, 4)]
    responses = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (5, 1, 7, 3)]
    return pack(prompts, responses, tokenizer.pad_token_id)


@pytest.fixture
def small_chunks(monkeypatch):
    """Three tokens per chunk, so every batch here spans several chunks and a ragged last one."""
    def use(vocab: int) -> None:
        monkeypatch.setattr(vocab_head, "CHUNK_ELEMENTS", 3 * vocab)
    return use


@pytest.mark.parametrize("bias", [False, True], ids=["fused", "checkpointed-module"])
@pytest.mark.parametrize("with_entropy,entropy_grad,logprob_weight",
                         [(False, True, 1.0), (True, True, 1.0), (True, False, 1.0), (True, True, 0.0)],
                         ids=["logprobs", "both", "entropy-statistic", "entropy-only"])
def test_gradients_are_exact(bias, with_entropy, entropy_grad, logprob_weight):
    """torch's numerical Jacobian in fp64 against the analytic backward of both paths (a biased
    head is not a plain weight: it goes through per-chunk checkpointing of the module)."""
    torch.manual_seed(0)
    n, h, v = 7, 5, 11
    head = torch.nn.Linear(h, v, bias=bias).double()
    hidden = torch.randn(n, h, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, v, (n,))
    assert (plain_weight(head) is None) == bias

    def f(hidden, *params):  # params: the head's weight (and bias), read by the head itself
        logprobs, entropy = token_logprobs(hidden, head, targets, HeadPass(0.7, with_entropy, entropy_grad, chunk=3))
        if logprob_weight == 0.0:  # only the entropy reaches the loss: no log-prob gradient at all
            return entropy
        return logprobs + (0.5 * entropy if with_entropy and entropy_grad else 0.0)

    assert torch.autograd.gradcheck(f, (hidden, *head.parameters()))
    if with_entropy and not entropy_grad:  # a statistic: no gradient flows through it
        _, entropy = token_logprobs(hidden, head, targets, HeadPass(0.7, True, False, chunk=3))
        assert not entropy.requires_grad


def test_chunk_size_does_not_change_the_result():
    """One token per chunk, a ragged last chunk and one chunk for all: the same fp64 numbers."""
    torch.manual_seed(1)
    head = torch.nn.Linear(8, 13, bias=False).double()
    hidden, targets = torch.randn(10, 8, dtype=torch.float64), torch.randint(0, 13, (10,))
    results = [token_logprobs(hidden, head, targets, HeadPass(1.3, True, chunk=c)) for c in (1, 4, 10)]
    z = torch.log_softmax(hidden @ head.weight.t() / 1.3, -1)
    for logprobs, entropy in results:
        torch.testing.assert_close(logprobs, z.gather(1, targets[:, None]).squeeze(1), rtol=0, atol=1e-12)
        torch.testing.assert_close(entropy, -(z.exp() * z).sum(-1), rtol=0, atol=1e-12)


def _bounds(model, batch, temperature: float, logit_rounding: float = 0.0) -> tuple[float, float]:
    """(log-prob bound, entropy bound) of two computations of the same log-softmax: fp32 dot
    products in different orders, plus ``logit_rounding`` x |z| where each side rounds its logits
    to a narrower dtype (bf16: u = 2^-8 per side)."""
    with torch.no_grad():
        captured = []
        handle = model.get_decoder().register_forward_hook(lambda _m, _a, out: captured.append(out.last_hidden_state))
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                       position_ids=batch.position_ids).logits.float() / temperature
        handle.remove()
    hidden, weight = captured[0].float(), model.get_output_embeddings().weight.float()
    width, vocab = weight.shape[1], weight.shape[0]
    gamma = width * U32 / (1 - width * U32)
    abs_dot = (hidden.abs().reshape(-1, width) @ weight.abs().t()).max().item() / temperature
    max_logit = logits.abs().max().item()
    dz = 2 * gamma * abs_dot + U32 * max_logit + 2 * logit_rounding * max_logit
    rounding = 2 * (vocab + 4) * U32 * (1 + max_logit)
    return 2 * dz + rounding, 2 * math.log(vocab) * dz + 2 * rounding


def test_policy_forward_equals_the_full_logits_fp32(embedded_dir, tokenizer, small_chunks):
    """The learner's, the reference's and the generator's log-prob pass on a ragged batch, in
    chunks of 3 tokens: equal to the full ``[B, T, V]`` path within fp32 rounding; padding 0."""
    model = load_causal_lm(embedded_dir).eval()
    small_chunks(model.config.vocab_size)
    batch = _ragged(tokenizer, model.config.vocab_size)
    with torch.no_grad():
        logprobs, entropy = policy_forward(model, batch, 0.7, with_entropy=True)
        full_logprobs, full_entropy, _ = _full_logits_forward(model, batch, None, 0.7, True, True)
    lp_bound, ent_bound = _bounds(model, batch, 0.7)
    assert (logprobs - full_logprobs).abs().max().item() <= lp_bound
    assert (entropy - full_entropy).abs().max().item() <= ent_bound
    assert (logprobs[batch.mask == 0] == 0).all() and (entropy[batch.mask == 0] == 0).all()


def test_policy_forward_equals_the_full_logits_bf16(embedded_dir, tokenizer, small_chunks):
    """In bf16 each side rounds its logits to bf16 once (u = 2^-8 of the logit), on top of the
    fp32 accumulation: the bound grows by 2 u max|z|."""
    model = load_causal_lm(embedded_dir, "bfloat16").eval()
    small_chunks(model.config.vocab_size)
    batch = _ragged(tokenizer, model.config.vocab_size)
    with torch.no_grad():
        logprobs, _ = policy_forward(model, batch, 1.0)
        full_logprobs, _, _ = _full_logits_forward(model, batch, None, 1.0, False, True)
    lp_bound, _ = _bounds(model, batch, 1.0, logit_rounding=U_BF16)
    assert (logprobs - full_logprobs).abs().max().item() <= lp_bound


def test_policy_gradients_equal_the_full_logits(embedded_dir, tokenizer, small_chunks):
    """Every parameter's gradient of sum(log pi) + 0.3 sum(H), in fp64 (rounding ~1e-15
    relative; a wrong or missing term is O(1)), on a ragged batch in chunks of 3 tokens."""
    model = load_causal_lm(embedded_dir).double().train()
    small_chunks(model.config.vocab_size)
    batch = _ragged(tokenizer, model.config.vocab_size, seed=2)
    grads = []
    for forward in (policy_forward, _reference_fp64_forward):
        model.zero_grad(set_to_none=True)
        logprobs, entropy = forward(model, batch, 0.8, True, True)
        (logprobs.sum() + 0.3 * entropy.sum()).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys()
    assert "lm_head.weight" in grads[0] or model.config.tie_word_embeddings
    for name, g in grads[1].items():
        torch.testing.assert_close(grads[0][name], g, rtol=1e-9, atol=1e-12 * (1 + g.abs().max().item()), msg=name)


def _reference_fp64_forward(model, batch, temperature, with_entropy, entropy_grad):
    """The full-logits path kept in fp64 (``_full_logits_forward`` casts logits to fp32)."""
    out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids)
    width = batch.response_ids.shape[1]
    z = torch.log_softmax(out.logits[:, batch.prompt_width - 1: batch.prompt_width - 1 + width] / temperature, -1)
    logprobs = z.gather(-1, batch.response_ids[..., None]).squeeze(-1) * batch.mask
    return logprobs, -(z.exp() * z).sum(-1) * batch.mask


def test_no_full_vocabulary_tensor_is_kept_for_backward(small_chunks):
    """What autograd saves for backward, on a model whose vocabulary dwarfs its width: the full
    path keeps [B, T, V] log-softmax outputs, the chunked one nothing larger than the head's
    weight or a layer's activations."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=4096, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64)
    model = LlamaForCausalLM(config).train()
    small_chunks(config.vocab_size)
    g = torch.Generator().manual_seed(0)
    batch = pack([torch.randint(1, 4096, (3 + i % 4,), generator=g).tolist() for i in range(16)],
                 [torch.randint(1, 4096, (16 - i % 5,), generator=g).tolist() for i in range(16)], 0)
    full_size = batch.mask.numel() * config.vocab_size
    largest = {}
    for forward in (policy_forward_at, _full_logits_forward):
        sizes: list[int] = []

        def record(t: torch.Tensor, sizes: list[int] = sizes) -> torch.Tensor:
            sizes.append(t.numel())
            return t

        with torch.autograd.graph.saved_tensors_hooks(record, lambda t: t):
            forward(model, batch, None, 1.0, True, True)
        largest[forward.__name__] = max(sizes)
    assert largest["_full_logits_forward"] >= full_size
    assert largest["policy_forward_at"] <= max(config.vocab_size * config.hidden_size,
                                            batch.input_ids.numel() * config.intermediate_size) < full_size


def test_footprint_knows_the_chunk_size():
    """``rayppo plan`` (no torch) sizes the log-prob passes with the same chunk."""
    assert LOGIT_CHUNK_ELEMENTS == vocab_head.CHUNK_ELEMENTS


ZERO3_CHILD = """
import json, sys
import torch
from deepspeed.utils import safe_get_full_grad
from rayppo.config.load import load_config
from rayppo.cluster.learner_group import LearnerGroup
from rayppo.models.sequences import _full_logits_forward, pack, policy_forward
from rayppo.models.vocab_head import plain_weight

batch = pack(*json.loads(sys.argv[1]), int(sys.argv[2]))
learner = LearnerGroup(load_config(None, ["learner.num_ranks=1", "learner.zero_stage=3"]), placement=None)
engine = learner.ranks.actors[0].policy
lm_head = engine.module.get_output_embeddings()
logprobs, _ = policy_forward(engine, batch, 0.7)
with torch.no_grad():
    full, _, _ = _full_logits_forward(engine, batch, None, 0.7, False, True)
engine.backward(-(logprobs * batch.mask).sum())
print(json.dumps({"plain": plain_weight(lm_head) is not None, "gap": (logprobs.detach() - full).abs().max().item(),
                  "head_grad": safe_get_full_grad(lm_head.weight).abs().sum().item()}))
"""


def test_zero3_engine_takes_the_module_path_with_the_same_numbers(embedded_dir, tokenizer):
    """Under ZeRO-3 the head's weight is a partition: the pass goes through the head module
    (DeepSpeed gathers it in its hooks). A real DeepSpeed ZeRO-3 engine: the same log-probs as
    its own full-logits forward, and a backward through it that reaches the head. In a fresh
    process: DeepSpeed keeps torch.distributed groups per process, which an earlier in-process
    engine of the test session (vLLM's, DeepSpeed's) may have torn down."""
    import json
    import subprocess
    import sys

    batch = _ragged(tokenizer, len(tokenizer))
    rows = [[row[m.bool()].tolist() for row, m in zip(ids, mask)] for ids, mask in
            ((batch.input_ids[:, :batch.prompt_width], batch.attention_mask[:, :batch.prompt_width]),
             (batch.response_ids, batch.mask))]
    out = subprocess.run([sys.executable, "-c", ZERO3_CHILD, json.dumps(rows), str(tokenizer.pad_token_id)],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    lp_bound, _ = _bounds(load_causal_lm(embedded_dir).eval(), batch, 0.7)
    assert not result["plain"] and result["gap"] <= lp_bound and result["head_grad"] > 0


@pytest.mark.parametrize("bias", [False, True], ids=["fused", "checkpointed-module"])
@pytest.mark.parametrize("with_entropy", [False, True], ids=["logprobs", "with-entropy"])
def test_gradients_at_several_ids_per_token_are_exact(bias, with_entropy):
    """Targets ``[N, m]`` (the sampled token and a teacher's top ids, one repeated, as the sampled
    token often is among the top ones): torch's numerical Jacobian in fp64 against both paths' backward."""
    torch.manual_seed(2)
    n, h, v, m = 7, 5, 11, 4
    head = torch.nn.Linear(h, v, bias=bias).double()
    hidden = torch.randn(n, h, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, v, (n, m))
    targets[:, 2] = targets[:, 0]  # a repeated id: its gradient is counted twice

    def f(hidden, *params):
        logprobs, entropy = token_logprobs(hidden, head, targets, HeadPass(0.7, with_entropy, chunk=3))
        weights = torch.linspace(0.5, 2.0, m, dtype=torch.float64)  # each id's own weight: no cancellation
        return (logprobs * weights).sum(-1) + (0.5 * entropy if with_entropy else 0.0)

    assert torch.autograd.gradcheck(f, (hidden, *head.parameters()))
    logprobs, _ = token_logprobs(hidden, head, targets, HeadPass(0.7, chunk=3))
    z = torch.log_softmax(head(hidden) / 0.7, -1)
    torch.testing.assert_close(logprobs, z.gather(1, targets), rtol=0, atol=1e-12)


@pytest.mark.parametrize("bias", [False, True], ids=["fused", "module"])
def test_top_logprobs_are_the_full_softmax_top_k(bias):
    """``top_logprobs``: the k largest entries of log_softmax(z / T) and their ids, most likely first,
    and the targets' entries, in any chunk size (fp64: the same operations on the same numbers up to
    the logsumexp's order)."""
    torch.manual_seed(3)
    head = torch.nn.Linear(6, 17, bias=bias).double()
    hidden = torch.randn(9, 6, dtype=torch.float64)
    full = torch.log_softmax(head(hidden) / 0.8, -1)
    want, want_ids = full.topk(5, dim=-1)
    targets = torch.randint(0, 17, (9,))
    for chunk in (1, 4, 9):
        chosen, top, ids = vocab_head.top_logprobs(hidden, head, 5, targets, 0.8, chunk=chunk)
        assert torch.equal(ids, want_ids)
        torch.testing.assert_close(top, want, rtol=0, atol=1e-12)
        torch.testing.assert_close(chosen, full.gather(1, targets[:, None]).squeeze(1), rtol=0, atol=1e-12)
    chosen, top, ids = vocab_head.top_logprobs(hidden[:0], head, 5, targets[:0])
    assert chosen.shape == (0,) and top.shape == ids.shape == (0, 5)


def test_policy_and_teacher_passes_at_top_ids_equal_the_full_logits(embedded_dir, tokenizer, small_chunks,
                                                                     monkeypatch):
    """The teacher's pass (``top_forward``: the sampled tokens' log-probs and the top k) and the learner's
    (``policy_forward_at``: log pi at given ids, from the same head pass as the sampled tokens') on a
    ragged batch in chunks of 3 tokens, against the full ``[B, T, V]`` log-softmax: within the fp32
    bound of ``_bounds``; padding 0. The full-logits path of both passes gives the same."""
    model = load_causal_lm(embedded_dir).eval()
    small_chunks(model.config.vocab_size)
    batch = _ragged(tokenizer, model.config.vocab_size)
    with torch.no_grad():
        out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids)
        width = batch.response_ids.shape[1]
        full = torch.log_softmax(out.logits[:, batch.prompt_width - 1:batch.prompt_width - 1 + width].float() / 0.7, -1)
        sampled, top, ids = top_forward(model, batch, 6, 0.7)
        at = policy_forward_at(model, batch, ids, 0.7)
    lp_bound, _ = _bounds(model, batch, 0.7)
    valid = batch.mask.bool()
    want_top, _ = full.topk(6, dim=-1)
    assert (top[valid] - want_top[valid]).abs().max().item() <= lp_bound  # the k largest values
    assert (full.gather(-1, ids)[valid] - top[valid]).abs().max().item() <= lp_bound  # at the ids given
    assert (at.at_ids[valid] - top[valid]).abs().max().item() <= lp_bound  # the learner reads them back
    full_sampled = full.gather(-1, batch.response_ids.long().unsqueeze(-1)).squeeze(-1)
    assert (sampled[valid] - full_sampled[valid]).abs().max().item() <= lp_bound
    assert (at.logprobs[valid] - sampled[valid]).abs().max().item() <= lp_bound
    assert not top[~valid].any() and not ids[~valid].any() and not at.at_ids[~valid].any()
    # A model type whose logits the chunked path does not trust takes the full-logits path: the same numbers.
    monkeypatch.setattr(sequences, "PLAIN_HEAD_MODELS", frozenset())
    with torch.no_grad():
        full_sampled_path, full_top, full_ids = top_forward(model, batch, 6, 0.7)
        full_at = policy_forward_at(model, batch, ids, 0.7)
    assert torch.equal(full_ids[valid], ids[valid])
    for mine, theirs in ((full_top, top), (full_at.at_ids, at.at_ids), (full_sampled_path, sampled)):
        assert (mine[valid] - theirs[valid]).abs().max().item() <= lp_bound
