"""Padding-free packing (``models/packing.py``): several sequences per row, positions restarted, no
attention between them; the same log-probs, entropies, values and gradients as the padded rows."""

from __future__ import annotations

import pytest
import torch

from rayppo.models.loading import Critic, load_causal_lm, prepare_for_training
from rayppo.models.packing import pack_sequences, unpack
from rayppo.models.sequences import critic_forward, pack, policy_forward
from rayppo.models.varlen_attention import use_varlen_attention

# fp64 on both paths: a wrong mask, position or gather shows as O(0.1) differences, while the
# packed and padded passes only sum the same terms in another order. Each output is a chain of
# dot products of at most K = 256 terms (hidden 128, MLP 256, attention over <= 64 keys) through 2
# layers and the head; reordering a K-term fp64 sum moves it by <= K u max|a b| (u = 1.1e-16), on
# values of magnitude <= ~50 here (logits, log-partitions): 256 x 1.1e-16 x 50 = 1.4e-12 per dot
# product, compounded over ~10 of them on the way: 1e-10.
BOUND = 1e-10

# A shared prompt's gradient is the sum of its rows' before it goes back through the prompt's layers,
# where each row's went back alone: the same sum in another order, except where the order meets a
# rounding. transformers 5.19's LlamaRMSNorm computes in fp32 whatever the model's dtype
# (``hidden_states.to(torch.float32)``), so each norm's backward rounds the summed gradient to fp32
# once instead of each row's: a relative 2^-24 per norm, 5 norms on the way (2 per layer x 2 + the
# last), compounded and summed over the tokens into a parameter: <= 1e-6 of its largest gradient.
SHARED_GRAD_BOUND = 1e-6


def ragged_batch(vocab: int, pad_id: int, lengths=((3, 1), (6, 9), (4, 2), (5, 12), (3, 0), (6, 7), (4, 4))):
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(4, vocab, (p,), generator=g).tolist() for p, _ in lengths]
    responses = [torch.randint(4, vocab, (r,), generator=g).tolist() for _, r in lengths]
    return pack(prompts, responses, pad_id)


def test_pack_sequences_lays_rows_end_to_end_and_unpack_restores_the_layout():
    from transformers.masking_utils import find_packed_sequence_indices

    batch = ragged_batch(50, 0)
    real = batch.attention_mask.bool()
    for mode in ("rows", "one_row", "varlen", "right_padded"):
        packing = pack_sequences(batch.input_ids, batch.attention_mask, mode)
        # sequences of 4, 15, 6, 17, 3, 13, 8 tokens: one row of all 66, or rows as wide as the longest
        # (17) filled first-fit longest first: 17 | 15 | 13 + 4 | 8 + 6 + 3 (7 sequences in 4 rows, not 7),
        # or each alone in a row of 17 (not 6 + 12 = 18 wide, the padded layout's longest prompt + response)
        assert packing.input_ids.shape == {"one_row": (1, 66), "varlen": (1, 66), "rows": (4, 17),
                                           "right_padded": (7, 17)}[mode]
        restored = unpack(packing.input_ids[..., None], packing)[..., 0]
        assert torch.equal(restored[real], batch.input_ids[real])  # every real token comes back in place
        assert torch.equal(unpack(packing.position_ids[..., None], packing)[..., 0][real], batch.position_ids[real])
        if mode == "right_padded":  # read as no packing at all (the test below)
            continue
        # transformers' reading of the position ids: each sequence one segment of its own
        segments = unpack(find_packed_sequence_indices(packing.position_ids)[..., None], packing)[..., 0]
        for row in range(len(batch.input_ids)):
            ids = segments[row][real[row]]
            assert (ids == ids[0]).all()
            same_row = packing.index[row, 0] // packing.input_ids.shape[1] == packing.index[:, 0] // packing.input_ids.shape[1]
            others = [int(segments[o][real[o]][0]) for o in range(len(batch.input_ids)) if o != row and same_row[o]]
            assert int(ids[0]) not in others


def test_right_padded_rows_start_at_column_zero_and_read_as_unpacked():
    """One sequence per row, its filler continuing its positions: transformers finds no packing,
    so the model runs without any attention mask (SDPA's causal kernel)."""
    from transformers.masking_utils import find_packed_sequence_indices

    batch = ragged_batch(50, 0)
    packing = pack_sequences(batch.input_ids, batch.attention_mask, "right_padded")
    width = packing.input_ids.shape[1]
    assert torch.equal(packing.position_ids, torch.arange(width).expand(len(batch.input_ids), width))
    assert find_packed_sequence_indices(packing.position_ids) is None
    for row, n in enumerate(batch.attention_mask.sum(dim=1).tolist()):
        assert torch.equal(packing.input_ids[row, :n], batch.input_ids[row][batch.attention_mask[row].bool()])
    with pytest.raises(ValueError, match="pack mode must be rows, one_row, varlen or right_padded, got 'columns'"):
        pack_sequences(batch.input_ids, batch.attention_mask, "columns")


def grouped_batch(vocab: int, pad_id: int):
    """GRPO's rows: 3 prompts (5, 3, 7 tokens) of 3, 1 and 2 samples, a group's rows not all
    adjacent, responses of 0-9 tokens."""
    g = torch.Generator().manual_seed(12)
    prompts = [torch.randint(4, vocab, (p,), generator=g).tolist() for p in (5, 3, 7)]
    rows = [(0, 4), (0, 9), (1, 3), (2, 6), (0, 0), (2, 2)]
    responses = [torch.randint(4, vocab, (r,), generator=g).tolist() for _, r in rows]
    return pack([prompts[p] for p, _ in rows], responses, pad_id)


@pytest.mark.parametrize("mode", ["rows", "one_row", "varlen", "varlen checkpointed", "right_padded", "varlen shared"],
                         ids=["rows of the longest", "one row (flash varlen)", "one row, SDPA per sequence",
                              "the same under activation checkpointing", "one sequence per row, no mask",
                              "one row, a group's prompt once"])
def test_packed_forward_equals_the_padded_one_with_gradients(embedded_dir, tokenizer, mode):
    torch.manual_seed(0)
    shared = mode.endswith(" shared")
    checkpointed = mode.endswith(" checkpointed")  # the layers' recompute must get the segments again
    mode = mode.split()[0]
    policy = prepare_for_training(load_causal_lm(embedded_dir).double(), gradient_checkpointing=checkpointed)
    critic = prepare_for_training(Critic.from_pretrained(embedded_dir).double(), gradient_checkpointing=checkpointed)
    if mode == "varlen":  # the padded pass below then runs through it too, as SDPA (its fallback)
        use_varlen_attention(policy)
        use_varlen_attention(critic)
    batch = (grouped_batch if shared else ragged_batch)(len(tokenizer), tokenizer.pad_token_id)
    packed = batch.packed(mode)
    if shared:  # each prompt's 5 / 3 / 7 tokens once, then the 24 response tokens
        assert packed.packing.processed_tokens == 15 + 24  # not 3 x 5 + 3 + 2 x 7 + 24 = 56
    weights = torch.randn(batch.mask.shape, dtype=torch.float64)
    outputs, grads = [], []
    for b in (batch, packed):
        policy.zero_grad()
        critic.zero_grad()
        logprobs, entropy = policy_forward(policy, b, 0.8, with_entropy=True)
        values, last = critic_forward(critic, b)
        (((logprobs + entropy + values) * weights).sum() + last.sum()).backward()
        outputs.append((logprobs, entropy, values, last))
        grads.append({n: p.grad.clone() for n, p in [*policy.named_parameters(), *critic.named_parameters()]
                      if p.grad is not None})
    for padded_out, packed_out in zip(*outputs):
        assert (padded_out - packed_out).abs().max().item() <= BOUND
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) > 10
    for name, g in grads[0].items():
        bound = SHARED_GRAD_BOUND if shared else BOUND
        assert (g - grads[1][name]).abs().max().item() <= bound * (1 + g.abs().max().item()), name
    # and the packed pass really is another computation: fewer tokens than the padded rectangle
    assert packed.packing.processed_tokens < batch.input_ids.numel()


@pytest.mark.parametrize("mode", ["one_row", "varlen"])
def test_a_sequence_in_a_packed_row_does_not_see_its_neighbours(embedded_dir, tokenizer, mode):
    """The same sequence packed after different neighbours gives the same log-probs (a leak of
    attention across sequences would change them). It is the row's last sequence: the first one
    has nothing before it to leak from, so a test of it passes without any block mask."""
    policy = load_causal_lm(embedded_dir).double().eval()
    if mode == "varlen":
        use_varlen_attention(policy)
    g = torch.Generator().manual_seed(3)
    rows = [torch.randint(4, len(tokenizer), (n,), generator=g).tolist() for n in (5, 12, 3, 4, 2, 2, 6, 1, 4, 3)]
    pad = tokenizer.pad_token_id
    # The tested sequence (rows 4 + 5: 4 tokens) is the shortest, so the longest-first packing puts
    # it after its neighbours (17 and 7 tokens, then 7 and 7) in the one packed row.
    first = pack([rows[0], rows[2], rows[4]], [rows[1], rows[3], rows[5]], pad)
    second = pack([rows[6], rows[8], rows[4]], [rows[7], rows[9], rows[5]], pad)
    with torch.no_grad():
        a, _ = policy_forward(policy, first.packed(mode))
        b, _ = policy_forward(policy, second.packed(mode))
    assert first.packed(mode).packing.position_ids[0, -4:].tolist() == [0, 1, 2, 3]  # it is last in the row
    assert (a[2, :2] - b[2, :2]).abs().max().item() <= BOUND  # row 2: the same 2 response tokens in both batches


def test_pack_mode_follows_the_setting_the_family_and_the_attention_kernel():
    from types import SimpleNamespace

    from rayppo.models.packing import pack_mode

    # auto: one packed row where attention runs per sequence without a mask (flash-attention's varlen
    # kernel, or SDPA per sequence), one sequence per row for the other known families, else padded
    flash = SimpleNamespace(model_type="llama", _attn_implementation="flash_attention_2")
    sdpa = SimpleNamespace(model_type="llama", _attn_implementation="sdpa")
    assert pack_mode("auto", flash) == "one_row" and pack_mode("padded", flash) == ""
    assert pack_mode("auto", sdpa) == "varlen" and pack_mode("packed", sdpa) == "varlen"
    assert pack_mode("right_padded", flash) == "right_padded" and pack_mode("padded", sdpa) == ""
    # Gemma 2 soft-caps its attention scores (not plain SDPA): a block mask only when asked to pack
    capped = SimpleNamespace(model_type="gemma2", _attn_implementation="sdpa")
    assert pack_mode("auto", capped) == "right_padded" and pack_mode("packed", capped) == "rows"
    # any sliding window: transformers masks the whole packed row with it, however long the positions
    windowed = SimpleNamespace(model_type="mistral", _attn_implementation="sdpa", sliding_window=4096,
                               max_position_embeddings=4096)
    unwindowed = SimpleNamespace(model_type="mistral", _attn_implementation="sdpa", sliding_window=None)
    assert pack_mode("auto", windowed) == "right_padded" and pack_mode("auto", unwindowed) == "varlen"
    off = SimpleNamespace(model_type="qwen2_moe", _attn_implementation="sdpa", sliding_window=0)
    assert pack_mode("auto", off) == "right_padded"  # builds its sliding mask regardless
    eager = SimpleNamespace(model_type="llama", _attn_implementation="eager")
    assert pack_mode("auto", eager) == "right_padded"
    unknown = SimpleNamespace(model_type="some_remote_family", _attn_implementation="flash_attention_2")
    assert pack_mode("auto", unknown) == "" and pack_mode("packed", unknown) == "one_row"


def test_learner_packing_values_are_checked_at_load():
    from rayppo.config.load import load_config
    from rayppo.config.schema import ConfigError

    assert load_config(None, ["learner.packing=padded"]).learner.packing == "padded"
    with pytest.raises(ConfigError, match="learner.packing"):
        load_config(None, ["learner.packing=sometimes"])
