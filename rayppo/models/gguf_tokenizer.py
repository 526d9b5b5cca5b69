"""The tokenizer flags a GGUF file states, carried onto transformers' conversion of it and checked.

A GGUF file says how its tokenizer is used, under llama.cpp's keys: whether a BOS is prepended
(``tokenizer.ggml.add_bos_token``) and an EOS appended (``tokenizer.ggml.add_eos_token``), which
ids are BOS, EOS, padding and unknown, and the chat template (``tokenizer.chat_template``).
transformers 5.19 builds the tokenizer from the file's vocabulary
(``transformers/integrations/gguf/gguf_tokenizer_mapping.py``) but reads neither adding flag:
``GGUF_TOKENIZER_MAPPING`` has no key for them, so ``TokenizersBackend.__init__``
(``transformers/tokenization_utils_tokenizers.py``) takes its default ``add_bos_token=False`` and
``update_post_processor`` writes a post-processor that adds nothing. A Llama or Gemma file that
states ``add_bos_token = true`` converts to a tokenizer that encodes ``hi`` without its BOS, and
the model is then trained on prompts it was never meant to see.

In transformers 5 the adding lives in the backend's post-processor: ``tokenizer.json`` holds it, a
reload keeps it, and the ``add_bos_token`` attribute is neither saved nor read back beside a
``tokenizer.json``. So the check is on behaviour: a short text encoded with and without special
tokens differs by exactly the BOS and EOS the file asks for. A flag the file does not state is left
as transformers made it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from rayppo.errors import ModelFolderError

PROBE = "hi"
"""The text encoded to see which special tokens the tokenizer adds around it."""

SPECIAL_IDS = {"bos_token": "bos_token_id", "eos_token": "eos_token_id", "pad_token": "padding_token_id",
               "unk_token": "unknown_token_id"}
"""The tokenizer's special token (its attribute) -> the GGUF key (under ``tokenizer.ggml.``) of its id."""


@dataclass(frozen=True)
class GGUFTokenizerFlags:
    """What a GGUF file states about its tokenizer; ``None`` where it states nothing."""

    add_bos: bool | None
    """``tokenizer.ggml.add_bos_token``: prepend BOS to every encoded text."""
    add_eos: bool | None
    """``tokenizer.ggml.add_eos_token``: append EOS to every encoded text."""
    ids: dict[str, int]
    """Special token attribute (``bos_token``, ``eos_token``, ``pad_token``, ``unk_token``) -> the id
    the file gives it; only those the file gives."""
    chat_template: str | None
    """``tokenizer.chat_template``: the default chat template."""


def read_tokenizer_flags(path: Path) -> GGUFTokenizerFlags:
    """The tokenizer flags in a GGUF file's header (read with the ``gguf`` package)."""
    from gguf import GGUFReader

    fields = GGUFReader(str(path)).fields

    def value(key: str):
        field = fields.get(key)
        return None if field is None else field.contents()

    ids = {attr: value(f"tokenizer.ggml.{key}") for attr, key in SPECIAL_IDS.items()}
    ids = {attr: int(token_id) for attr, token_id in ids.items() if token_id is not None}
    add_bos, add_eos = value("tokenizer.ggml.add_bos_token"), value("tokenizer.ggml.add_eos_token")
    return GGUFTokenizerFlags(add_bos=None if add_bos is None else bool(add_bos),
                              add_eos=None if add_eos is None else bool(add_eos),
                              ids=ids, chat_template=value("tokenizer.chat_template"))


def carry_tokenizer_flags(tokenizer, flags: GGUFTokenizerFlags, path: Path) -> None:
    """Set on ``tokenizer`` (transformers' conversion of the file at ``path``) every flag the file
    states: the special tokens' ids, the chat template, and BOS/EOS adding (its post-processor)."""
    renamed = False
    for attr, token_id in flags.ids.items():
        if not 0 <= token_id < len(tokenizer):
            raise ModelFolderError(f"{path}: tokenizer.ggml.{SPECIAL_IDS[attr]} = {token_id} is outside the "
                                   f"file's vocabulary of {len(tokenizer)} tokens")
        if getattr(tokenizer, f"{attr}_id") != token_id:
            setattr(tokenizer, attr, tokenizer.convert_ids_to_tokens(token_id))
            renamed = True
    if flags.chat_template is not None and tokenizer.chat_template != flags.chat_template:
        tokenizer.chat_template = flags.chat_template
    prefix, _, suffix = added_around(tokenizer)
    add_bos = flags.add_bos if flags.add_bos is not None else bool(prefix)
    add_eos = flags.add_eos if flags.add_eos is not None else bool(suffix)
    wanted = ([tokenizer.bos_token_id] if add_bos else []), ([tokenizer.eos_token_id] if add_eos else [])
    if renamed or (prefix, suffix) != wanted:  # the post-processor names the BOS and EOS it adds: rebuild it
        tokenizer.add_bos_token = add_bos  # each setter rebuilds it from both flags (update_post_processor)
        tokenizer.add_eos_token = add_eos


def check_tokenizer_flags(tokenizer, flags: GGUFTokenizerFlags, path: Path, where: str = "") -> None:
    """A ``ModelFolderError`` naming the file and the flag where ``tokenizer`` does not do what the
    file states; ``where`` tells which tokenizer it is in the message (e.g. `` as saved in out/``)."""
    name = f"its tokenizer{where}"
    for attr, token_id in flags.ids.items():
        if getattr(tokenizer, f"{attr}_id") != token_id:
            raise ModelFolderError(f"{path}: the file states tokenizer.ggml.{SPECIAL_IDS[attr]} = {token_id}, but "
                                   f"{name} has {attr} id {getattr(tokenizer, f'{attr}_id')}")
    if flags.chat_template is not None and tokenizer.chat_template != flags.chat_template:
        raise ModelFolderError(f"{path}: {name} does not have the file's tokenizer.chat_template")
    prefix, plain, suffix = added_around(tokenizer)
    for key, stated, added, attr, end in (("add_bos_token", flags.add_bos, prefix, "bos_token", "first"),
                                          ("add_eos_token", flags.add_eos, suffix, "eos_token", "last")):
        token, token_id = getattr(tokenizer, attr), getattr(tokenizer, f"{attr}_id")
        if stated and token_id is None:
            raise ModelFolderError(f"{path}: the file states tokenizer.ggml.{key} = true but no "
                                   f"tokenizer.ggml.{SPECIAL_IDS[attr]}: there is no {attr} to add")
        if stated is not None and added != ([token_id] if stated else []):
            wrong = f"without {token!r} (id {token_id}) {end}" if stated else f"adding {added}"
            raise ModelFolderError(f"{path}: the file states tokenizer.ggml.{key} = {str(stated).lower()}, but "
                                   f"{name} encodes {PROBE!r} as {prefix + plain + suffix}, {wrong}")


def added_around(tokenizer) -> tuple[list[int], list[int], list[int]]:
    """``PROBE``'s ids when adding special tokens, in three parts: those before the text's own ids,
    the text's own (encoded without special tokens), those after."""
    plain = tokenizer(PROBE, add_special_tokens=False)["input_ids"]
    full = tokenizer(PROBE)["input_ids"]
    for start in range(len(full) - len(plain) + 1):
        if full[start:start + len(plain)] == plain:
            return full[:start], plain, full[start + len(plain):]
    return full, [], []  # the special tokens changed the text's own ids: all of it counts as added

