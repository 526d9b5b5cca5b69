"""The embedded multi-turn model: a tiny Llama with a chat template, warmed up on the guessing game.

Like the embedded default model (``embedded.py``) it is built here, never downloaded, and cached
(``model.policy: embedded-guess``). Its tokenizer is word-level over the game's words, with role
markers and an end-of-turn token as special tokens, and a chat template that renders a
conversation as ``<bos><|user|>guess my digit<|end|><|assistant|>5<|end|><|user|>higher<|end|>...``;
the template is prefix-preserving, as multi-turn episodes need (``rayppo.models.chat_tokens``). The
warm-up trains the policy's turns of aimless legal games (``tasks.guess.aimless_game``), through
the same token rules the episodes use, so pi_ref plays the game's format from the start.
"""

from __future__ import annotations

import random
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

from rayppo.models.chat_tokens import observation_ids
from rayppo.models.embedded import tiny_llama_config
from rayppo.models.sft import SFTSettings, TokenExample, sft_train_ids
from rayppo.tasks import guess

ROLES = ("user", "assistant", "system", "tool")
SPECIAL_TOKENS = ["<pad>", "<unk>", "<bos>", "<|end|>", *(f"<|{role}|>" for role in ROLES)]
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")
"""Every message as role marker, content, end-of-turn; then the assistant's marker to answer."""


def build_chat_tokenizer(words: list[str]) -> PreTrainedTokenizerFast:
    """A word-level tokenizer over ``words`` with the role markers and ``<|end|>`` (its EOS) as
    special tokens and ``CHAT_TEMPLATE``."""
    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.train_from_iterator(words, trainers.WordLevelTrainer(special_tokens=SPECIAL_TOKENS, show_progress=False))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<|end|>", pad_token="<pad>",
                                        unk_token="<unk>")
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def game_example(tokenizer, game: list[tuple[str, str | None]]) -> TokenExample:
    """One warm-up game as (prompt ids, the episode's tokens, 1 on the policy's turns)."""
    history = guess.conversation()
    prompt = tokenizer(tokenizer.apply_chat_template(history, add_generation_prompt=True, tokenize=False),
                       add_special_tokens=False)["input_ids"]
    end_text = tokenizer.eos_token
    response: list[int] = []
    mask: list[int] = []
    for move, reply in game:
        turn = tokenizer(move, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        response, mask = response + turn, mask + [1] * len(turn)
        if reply is None:
            break
        message = {"role": "user", "content": reply}
        added = observation_ids(tokenizer, history, end_text, message)
        history = [*history, {"role": "assistant", "content": move}, message]
        response, mask = response + added, mask + [0] * len(added)
    return prompt, response, mask


def build_guess_model(out_dir: Path, seed: int = 0, progress: bool = True) -> Path:
    """Build the tokenizer and a random-init tiny Llama, warm it up on aimless games, save both."""
    torch.manual_seed(seed)
    tokenizer = build_chat_tokenizer([" ".join(guess.DIGITS), " ".join(guess.WORDS)])
    model = LlamaForCausalLM(tiny_llama_config(len(tokenizer), tokenizer))
    examples = [game_example(tokenizer, game) for game in guess.sft_games(seed=seed + 1)]
    random.Random(seed).shuffle(examples)
    sft_train_ids(model, tokenizer.pad_token_id, examples, SFTSettings(epochs=3, seed=seed, progress=progress))
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(str(out_dir))
    tokenizer.save_pretrained(str(out_dir))
    return out_dir
