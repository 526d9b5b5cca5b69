"""Token-in, token-out: an episode's tokens are the policy's sampled ids plus the observation ids.

The history is never decoded and re-tokenised (BPE does not round-trip, and the stored log-probs
would then belong to other tokens). Only an *observation* is tokenised, as exactly the tokens the
chat template adds for it, found by rendering and diffing the conversation as text:

    R1 = render(history + [assistant: the turn])                       (no generation prompt)
    R2 = render(history + [assistant: the turn, observation message])  (with the generation prompt)

R2 must start with R1 (a template that rewrites earlier turns, e.g. one that strips an earlier
turn's reasoning, would make the sequence trained on differ from the one sampled: refused). The
template's closing of the assistant turn after its end-of-turn token (Qwen's newline after
``<|im_end|>``, which the policy never samples) belongs to the observation, so no boundary token
is dropped: the observation's ids are ``tokenize(R1's tail after the end-of-turn token + R2[len(R1):])``.
"""

from __future__ import annotations

from typing import Any

from rayppo.errors import RayppoError

Message = dict[str, Any]


class TemplateError(RayppoError, ValueError):
    """The policy's chat template cannot carry a multi-turn episode token-in, token-out."""


PROBE = [{"role": "user", "content": "probe one"}]
"""A conversation the template check renders, with a turn and an observation appended."""


def render(tokenizer, messages: list[Message], generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=False)


def observation_ids(tokenizer, history: list[Message], turn_text: str, end_text: str,
                    observation: Message) -> list[int]:
    """The token ids that follow the policy's turn (``turn_text``, ended by the end-of-turn token
    whose text is ``end_text``) when ``observation`` is appended to ``history``, the generation
    prompt of the next turn included. ``TemplateError`` when the template does not render the
    conversation as a prefix-preserving token sequence."""
    before = render(tokenizer, history, True)
    with_turn = render(tokenizer, [*history, {"role": "assistant", "content": turn_text}], False)
    after = render(tokenizer, [*history, {"role": "assistant", "content": turn_text}, observation], True)
    if not with_turn.startswith(before) or not after.startswith(with_turn):
        raise TemplateError("the policy's chat template rewrites earlier turns when a message is added (the "
                            "conversation rendered with one more message does not start with it rendered "
                            "without): a multi-turn episode would train on tokens it never sampled")
    turn = with_turn[len(before):]
    if not turn.startswith(turn_text + end_text):
        raise TemplateError(f"the policy's chat template renders an assistant turn {turn_text!r} as {turn!r}, not as "
                            f"the turn followed by its end-of-turn token {end_text!r}: the sampled tokens would "
                            "not be the rendered ones")
    closing = turn[len(turn_text) + len(end_text):]
    return list(tokenizer(closing + after[len(with_turn):], add_special_tokens=False)["input_ids"])


def check_template(tokenizer, end_texts: list[str], role: str) -> list[str]:
    """Refuse, at load, a tokenizer whose template cannot run episodes: none at all, or one that is
    not prefix-preserving on a probe conversation (``observation_ids``' rules) with any of the
    end-of-turn tokens ``end_texts`` (the generator's stop tokens). Returns those that it renders
    a turn with (Qwen: ``<|im_end|>``, not ``<|endoftext|>``): only they end a turn."""
    if not getattr(tokenizer, "chat_template", None):
        raise TemplateError("rollout.environment needs a policy tokenizer with a chat template (observations are "
                            "messages the template renders)")
    error: TemplateError | None = None
    passed = []
    for end_text in end_texts:
        try:
            observation_ids(tokenizer, PROBE, "probe two", end_text, {"role": role, "content": "probe three"})
            passed.append(end_text)
        except TemplateError as exc:
            error = exc
        except Exception as exc:  # noqa: BLE001 - the template is the model folder's Jinja code: any failure
            raise TemplateError(f"the policy's chat template failed on a {role!r} message after an assistant turn "
                                f"(rollout.observation_role): {type(exc).__name__}: {exc}") from None
    if not passed:
        raise error or TemplateError("the policy has no end-of-turn token (no EOS id)")
    return passed
