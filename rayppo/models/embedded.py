"""The embedded default model: a tiny Llama and tokenizer that rayppo builds itself.

Nothing is downloaded. The tokenizer is a word-level vocabulary trained with ``tokenizers`` on
the default task's words; the model is a randomly initialised 2-layer Llama (head_dim 64, which
vLLM's CPU attention needs), then warmed up on the task's format (the SFT stage) so that it
becomes a sensible pi_ref. The result is cached and reused; builds are atomic and locked, so
several processes asking at once build it once.
"""

from __future__ import annotations

import fcntl
import shutil
import tempfile
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from rayppo.models.paths import BUILD_VERSION, cache_root
from rayppo.tasks import digits

SPECIAL_TOKENS = ["<pad>", "<unk>", "<bos>", "<eos>"]


def build_tokenizer(words: list[str]) -> PreTrainedTokenizerFast:
    """A word-level tokenizer over ``words``; ``<bos>`` is prepended, spaces are restored on decode."""
    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.train_from_iterator(words, trainers.WordLevelTrainer(special_tokens=SPECIAL_TOKENS))
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
    from rayppo.models.sft import sft_train

    torch.manual_seed(seed)
    tokenizer = build_tokenizer(digits.corpus())
    model = LlamaForCausalLM(tiny_llama_config(len(tokenizer), tokenizer))
    if sft:
        sft_train(model, tokenizer, digits.sft_examples(), seed=seed, progress=progress)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(str(out_dir))
    tokenizer.save_pretrained(str(out_dir))
    return out_dir


def embedded_model_dir(cache_dir: str | None = None) -> Path:
    """The cached embedded model folder, built on first use."""
    root = cache_root(cache_dir)
    target = root / BUILD_VERSION  # rayppo.models.paths.embedded_path
    if (target / "config.json").is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f".{BUILD_VERSION}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be building it right now
        if not (target / "config.json").is_file():
            staging = Path(tempfile.mkdtemp(dir=root, prefix=f".{BUILD_VERSION}-"))
            build_embedded_model(staging)
            shutil.rmtree(target, ignore_errors=True)
            staging.rename(target)
    return target


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


def build_random_llama(out_dir: str | Path, vocab_size: int, seed: int = 0, **shape) -> Path:
    """A random-init Llama of any shape (benchmarks): the embedded tokenizer's words plus filler
    words ``w0, w1, ...`` up to ``vocab_size``, so every sampled id decodes to a word."""
    torch.manual_seed(seed)
    base = digits.corpus()
    fillers = max(0, vocab_size - len(SPECIAL_TOKENS) - sum(len(w.split()) for w in base))
    tokenizer = build_tokenizer(base + [" ".join(f"w{i}" for i in range(fillers))])
    model = LlamaForCausalLM(tiny_llama_config(len(tokenizer), tokenizer, **shape))
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(str(out_dir))
    tokenizer.save_pretrained(str(out_dir))
    return Path(out_dir)
