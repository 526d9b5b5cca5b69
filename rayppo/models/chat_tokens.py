"""Token-in, token-out: an episode's tokens are the policy's sampled ids plus the observation ids.

The history is never decoded and re-tokenised (BPE does not round-trip, and the stored log-probs
would then belong to other tokens). Only an *observation* is tokenised, as exactly the tokens the
chat template puts between the end of an assistant turn and the start of the next one. They are
read off a conversation in which every assistant turn is a fixed placeholder, never the sampled
text:

    R = render(history' + [assistant: PLACEHOLDER, observation])   (with the generation prompt)

where history' is the episode's history with each assistant turn's content replaced by the
placeholder. The observation's tokens are ``tokenize(R after its last "PLACEHOLDER" + end-of-turn
token)``: the template's closing of the turn (Qwen's newline after ``<|im_end|>``, which the policy
never samples), the observation message, the next generation prompt.

Sampled text never reaches the template, so templates that rewrite an assistant turn's text do not
change these tokens: Llama 3 trims each message, Qwen3 renders an empty ``<think>`` block into the
last turn and strips reasoning from turns before the latest user message. (An earlier version
rendered the sampled turn and required R with and without the observation to agree as prefixes:
the start-up probe passed, and an ordinary sample with a trailing space or a think block stopped
the run later.) A template that does not render an assistant turn as its text followed by the
end-of-turn token is refused at start.
"""

from __future__ import annotations

from typing import Any

from rayppo.errors import RayppoError

Message = dict[str, Any]


class TemplateError(RayppoError, ValueError):
    """The policy's chat template cannot carry a multi-turn episode token-in, token-out."""


PROBE = [{"role": "user", "content": "probe one"}]
"""A conversation the template check renders, with a turn and an observation appended."""
PLACEHOLDER = "rayppo-turn"
"""The content of every assistant turn in the conversations rendered here (no whitespace, no
reasoning markup: nothing a template trims or strips)."""


def render(tokenizer, messages: list[Message], generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=False)


def observation_ids(tokenizer, history: list[Message], end_text: str, observation: Message) -> list[int]:
    """The token ids that follow an assistant turn ended by the end-of-turn token whose text is
    ``end_text`` when ``observation`` is appended to ``history``, the generation prompt of the
    next turn included. ``TemplateError`` when the template does not render the turn as its text
    followed by that token."""
    placeholders = [{**m, "content": PLACEHOLDER} if m.get("role") == "assistant" else m for m in history]
    rendered = render(tokenizer, [*placeholders, {"role": "assistant", "content": PLACEHOLDER}, observation], True)
    turn = PLACEHOLDER + end_text
    at = rendered.rfind(turn)
    if at < 0:
        raise TemplateError(f"the policy's chat template does not render an assistant turn as its text followed by "
                            f"the end-of-turn token {end_text!r}: the sampled tokens would not be the rendered ones")
    return list(tokenizer(rendered[at + len(turn):], add_special_tokens=False)["input_ids"])


def check_template(tokenizer, end_texts: list[str], role: str) -> list[str]:
    """Refuse, at load, a tokenizer whose template cannot run episodes: none at all, or one that
    does not end an assistant turn of a probe conversation (``observation_ids``' rule) with any of the
    end-of-turn tokens ``end_texts`` (the generator's stop tokens). Returns those that it renders
    a turn with (Qwen: ``<|im_end|>``, not ``<|endoftext|>``): only they end a turn."""
    if not getattr(tokenizer, "chat_template", None):
        raise TemplateError("rollout.environment needs a policy tokenizer with a chat template (observations are "
                            "messages the template renders)")
    error: TemplateError | None = None
    passed = []
    for end_text in end_texts:
        try:
            observation_ids(tokenizer, PROBE, end_text, {"role": role, "content": "probe three"})
            passed.append(end_text)
        except TemplateError as exc:
            error = exc
        except Exception as exc:  # noqa: BLE001 - the template is the model folder's Jinja code: any failure
            raise TemplateError(f"the policy's chat template failed on a {role!r} message after an assistant turn "
                                f"(rollout.observation_role): {type(exc).__name__}: {exc}") from None
    if not passed:
        raise error or TemplateError("the policy has no end-of-turn token (no EOS id)")
    return passed
