"""The embedded default model: a tiny Llama and tokenizer that rayppo builds itself.

Nothing is downloaded. The tokenizer is a word-level vocabulary trained with ``tokenizers`` on
the default task's words; the model is a randomly initialised 2-layer Llama (head_dim 64, which
vLLM's CPU attention needs), then warmed up on the task's format (the SFT stage) so that it
becomes a sensible pi_ref. The result is cached and reused (``paths.py``: ``BUILTIN_MODELS``,
``built_dir``).
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from rayppo.tasks import digits

SPECIAL_TOKENS = ["<pad>", "<unk>", "<bos>", "<eos>"]


def build_tokenizer(words: list[str]) -> PreTrainedTokenizerFast:
    """A word-level tokenizer over ``words``; ``<bos>`` is prepended, spaces are restored on decode."""
    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    # show_progress off: its bars reach a terminal even from the first-use build (4 per build, the next line glued on)
    tok.train_from_iterator(words, trainers.WordLevelTrainer(special_tokens=SPECIAL_TOKENS, show_progress=False))
    bos = tok.token_to_id("<bos>")
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", bos)])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", unk_token="<unk>"
    )


def tiny_llama_config(vocab_size: int, tokenizer: PreTrainedTokenizerFast, **overrides) -> LlamaConfig:
    """A 2-layer, 128-wide Llama with head_dim 64 (the smallest vLLM's CPU attention accepts)."""
    params = dict(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    params.update(overrides)
    return LlamaConfig(**params)


def build_embedded_model(out_dir: Path, seed: int = 0, sft: bool = True, progress: bool = True) -> Path:
    """Build tokenizer + random-init Llama, warm it up on the task format, save to ``out_dir``."""
    from rayppo.models.sft import SFTSettings, sft_train

    torch.manual_seed(seed)
    tokenizer = build_tokenizer(digits.corpus())
    model = LlamaForCausalLM(tiny_llama_config(len(tokenizer), tokenizer))
    if sft:
        sft_train(model, tokenizer, digits.sft_examples(), SFTSettings(seed=seed, progress=progress))
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(str(out_dir))
    tokenizer.save_pretrained(str(out_dir))
    return out_dir


def build_tiny_reward_model(out_dir: str | Path, seed: int = 0) -> Path:
    """A random-init one-label Llama reward model with its *own* tokenizer (other token ids
    than the policy's), for exercising the reward-model path without a download."""
    from transformers import LlamaForSequenceClassification

    torch.manual_seed(seed)
    # Extra frequent words shift every id, so the two vocabularies really differ.
    words = ["answer is good bad"] * 3 + digits.corpus()
    tokenizer = build_tokenizer(words)
    config = tiny_llama_config(len(tokenizer), tokenizer, num_labels=1)
    model = LlamaForSequenceClassification(config)
    model.save_pretrained(str(out_dir))
    tokenizer.save_pretrained(str(out_dir))
    return Path(out_dir)


def build_random_llama(out_dir: str | Path, vocab_size: int, seed: int = 0, eos_mean_length: float | None = None,
                       eos_length_cap: int = 128, **shape) -> Path:
    """A random-init Llama of any shape (benchmarks): the embedded tokenizer's words plus filler
    words ``w0, w1, ...`` up to ``vocab_size``, so every sampled id decodes to a word.

    ``eos_mean_length``: EOS follows "stop words" (``add_stop_words``) so that responses of
    at most ``eos_length_cap`` tokens sampled at temperature 1 are that long on average, with a long tail:
    the lengths are the model's, so every system sampling from it (rayppo, TRL) sees the same
    distribution."""
    torch.manual_seed(seed)
    base = digits.corpus()
    fillers = max(0, vocab_size - len(SPECIAL_TOKENS) - sum(len(w.split()) for w in base))
    tokenizer = build_tokenizer(base + [" ".join(f"w{i}" for i in range(fillers))])
    model = LlamaForCausalLM(tiny_llama_config(len(tokenizer), tokenizer, **shape))
    if eos_mean_length is not None:
        add_stop_words(model, tokenizer, eos_mean_length, eos_length_cap, seed=seed)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(str(out_dir))
    tokenizer.save_pretrained(str(out_dir))
    return Path(out_dir)


STOP_LOGIT = 40.0
"""The EOS logit after a stop word: e^40 / (e^40 + V) rounds to 1 for any vocabulary here."""


def expected_lengths(stop_mass: torch.Tensor) -> torch.Tensor:
    """Expected response length per row when EOS follows the first stop word.

    stop_mass: [B, T] along B responses sampled with EOS masked out (T = the length cap), the
    probability the stop words hold at each step. A response is longer than j tokens when none of
    its first j - 1 tokens was a stop word: P(L > j) = prod_{u < j-1} (1 - m_u) (1 for j < 2), and
    E[L] = sum_{j < T} P(L > j).
    """
    survival = torch.cumprod(1 - stop_mass[:, :-2], dim=1)
    return 2 + survival.sum(dim=1)


def add_stop_words(model: LlamaForCausalLM, tokenizer, mean_length: float, max_new_tokens: int,
                   seed: int = 0, rows: int = 64) -> int:
    """Make a random-init model end its responses after "stop words", so that responses sampled at
    temperature 1 (no top-k/top-p) from the default task's prompts are ``mean_length`` tokens long
    on average, capped at ``max_new_tokens``. Returns the number of stop words.

    A random-init model's logits are nearly flat (p_eos ~ 1/V): its responses would never end, and
    merely scaling its EOS row gives each response a rate of its own (attention averages the whole
    context), so most end at once and the rest run to the cap. Here one hidden channel k is freed
    (no layer reads or writes it), the stop words' embeddings carry 1 in it and the others 0, and
    the LM head's EOS row reads only it: after a stop word EOS follows (``STOP_LOGIT``), elsewhere
    its logit is 0. Each step samples a stop word with about the same probability, so lengths are
    about geometric: p50 ~ 0.7 x the mean, p90 ~ 2.3 x, a tail up to the cap, as in reasoning
    rollouts. The number of stop words (filler words, in a seeded order; never in a prompt) is found
    by bisection on the exact expected length (``expected_lengths``) of ``rows`` responses sampled
    once with EOS masked; channel k takes no part in them, so they hold for every choice.
    """
    if model.config.tie_word_embeddings:
        raise ValueError("add_stop_words: the LM head is tied to the embeddings; the EOS row would change the inputs")
    k, eos, inner = model.config.hidden_size - 1, tokenizer.eos_token_id, model.model
    with torch.no_grad():
        for layer in inner.layers:
            for read in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj,
                         layer.mlp.gate_proj, layer.mlp.up_proj):
                read.weight[:, k] = 0
            layer.self_attn.o_proj.weight[k] = 0
            layer.mlp.down_proj.weight[k] = 0
        inner.embed_tokens.weight[:, k] = 0
        model.lm_head.weight[eos] = 0
        torch.manual_seed(seed)
        prompts = tokenizer(digits.prompts(rows, seed), return_tensors="pt", padding=True, padding_side="left")
        paths = model.generate(**prompts, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                               max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, suppress_tokens=[eos],
                               pad_token_id=tokenizer.pad_token_id)
        width = prompts["input_ids"].shape[1]
        mask = torch.cat([prompts["attention_mask"], torch.ones_like(paths[:, width:])], dim=1)
        probs = model(input_ids=paths, attention_mask=mask).logits[:, width - 1 : -1].double().softmax(-1)
        words = set(tokenizer.convert_tokens_to_ids([w for w in tokenizer.get_vocab() if w.lstrip("▁").startswith("w")]))
        words -= set(prompts["input_ids"].flatten().tolist())
        order = sorted(words)
        order = [order[i] for i in torch.randperm(len(order), generator=torch.Generator().manual_seed(seed))]
        low, high = 1, len(order)  # the mean length falls as stop words are added
        if not expected_lengths(probs[..., order].sum(-1)).mean() < mean_length:
            raise ValueError(f"add_stop_words: a mean length of {mean_length} needs more stop words than the vocabulary has")
        while low < high:
            middle = (low + high) // 2
            low, high = (middle + 1, high) if expected_lengths(probs[..., order[:middle]].sum(-1)).mean() > mean_length \
                else (low, middle)
        inner.embed_tokens.weight[order[:low], k] = 1.0
        # h_k = x_k / rms(x) after the final norm; the channel dominates rms where it is 1.
        hidden = inner(input_ids=torch.tensor([order[:64]]).T).last_hidden_state[:, 0, k]
        model.lm_head.weight[eos, k] = STOP_LOGIT / float(hidden.min())
    return low
