"""The text a reward model r_φ reads for a (prompt, response): one rule for training it
(``rayppo reward-model``) and serving it (the reward actor), so it scores what it learned on.

With a chat template (the reward model folder's tokenizer): the prompt's conversation, a plain
prompt as one user turn, then the response as the assistant's turn, rendered by the template,
which writes its own special tokens. Without one: ``prompt + " " + response`` with the
tokenizer's special tokens added at encoding.
"""

from __future__ import annotations

from typing import Any

Message = dict[str, Any]


def templated(tokenizer: Any) -> bool:
    """Whether ``tokenizer`` renders reward texts with its chat template (then they carry their
    special tokens and are encoded with ``add_special_tokens=False``)."""
    return bool(getattr(tokenizer, "chat_template", None))


def reward_text(tokenizer: Any, prompt: str | list[Message], response: str) -> str:
    """The text r_φ scores for ``response`` to ``prompt`` (a string, or a list of ``{role,
    content}`` messages). A conversation needs a chat template (``ValueError``); the template's
    own failures propagate for the caller to name the row."""
    if not templated(tokenizer):
        if not isinstance(prompt, str):
            raise ValueError("the prompt is a conversation but the reward model's tokenizer has no chat template")
        return f"{prompt} {response}"
    turns = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    return tokenizer.apply_chat_template([*turns, {"role": "assistant", "content": response}], tokenize=False)
