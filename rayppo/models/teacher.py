"""The distillation teacher's folder and the check that it reads the student's token ids as the
student does: same vocabulary, same special tokens, same encoding of probe texts. Run before
any actor starts (the trainers' constructors), so a wrong teacher costs a second, not a run."""

from __future__ import annotations

from pathlib import Path

from rayppo.errors import ModelFolderError
from rayppo.models.loading import load_tokenizer, resolve_model_path
from rayppo.models.paths import saved_policy

PROBE_TEXTS = (
    "The answer is 42.",
    "  two spaces,\ttab and\nnewline  ",
    "12 + 7 = 19; 3.14159 * 2 = 6.28318",
    "Ünïcödé ✓ 日本語 — «quotes» 🙂",
    "def f(x):\n    return x ** 2  # code",
)
"""Texts both tokenizers encode; any difference in ids is a difference in how they read tokens."""

SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token")


def teacher_folder(name: str, cache_dir: str | None = None) -> Path:
    """``distill.teacher`` as a model folder: a rayppo run's folder means the ``policy/`` it saved;
    anything else resolves as a model does (a built-in name, a GGUF file, a folder)."""
    folder = saved_policy(name)
    if folder != Path(name).expanduser():
        return folder
    try:
        return resolve_model_path(name, cache_dir)
    except ModelFolderError as exc:
        raise ModelFolderError(f"distill.teacher: {exc} (a rayppo run's folder holds it as policy/)") from None


def tokenizer_difference(teacher: Path, policy: Path) -> str | None:
    """What differs between the two folders' tokenizers (the first thing found), or None."""
    mine, theirs = load_tokenizer(teacher), load_tokenizer(policy)
    vocab_t, vocab_p = mine.get_vocab(), theirs.get_vocab()
    if vocab_t != vocab_p:
        differ = sorted(set(vocab_t.items()) ^ set(vocab_p.items()))
        return (f"vocabulary of {len(vocab_t)} tokens against {len(vocab_p)}"
                + (f" (e.g. {differ[0][0]!r} -> {differ[0][1]})" if differ else ""))
    for name in SPECIAL_TOKENS:
        t, p = getattr(mine, name), getattr(theirs, name)
        if t != p:
            return f"{name} {t!r} against {p!r}"
    if sorted(mine.all_special_tokens) != sorted(theirs.all_special_tokens):
        return f"special tokens {sorted(mine.all_special_tokens)} against {sorted(theirs.all_special_tokens)}"
    for text in PROBE_TEXTS:
        for special in (False, True):
            a, b = mine.encode(text, add_special_tokens=special), theirs.encode(text, add_special_tokens=special)
            if a != b:
                return f"{text!r} encodes as {a} against {b}" + (" (with special tokens)" if special else "")
    return None


def check_teacher_tokenizer(teacher: Path, policy: Path) -> None:
    """Refuse a teacher whose tokenizer is not the policy's: it would score the student's ids as other words."""
    difference = tokenizer_difference(teacher, policy)
    if difference is not None:
        raise ModelFolderError(f"distill.teacher: the teacher's tokenizer differs from the policy's: {difference} "
                               f"(teacher {teacher}, policy {policy}); it would score the student's token ids as "
                               "other words, so distil from a teacher of the same tokenizer")


def checked_teacher(name: str, policy: str | Path, cache_dir: str | None = None, topk: int = 0) -> Path:
    """``distill.teacher``'s folder (``teacher_folder``), refused unless its tokenizer is ``policy``'s
    and its vocabulary holds the ``topk`` tokens it is to send per position."""
    folder = teacher_folder(name, cache_dir)
    check_teacher_tokenizer(folder, Path(policy))
    vocabulary = len(load_tokenizer(folder)) if topk else None  # only a top-k needs it
    if vocabulary is not None and topk >= vocabulary:
        raise ModelFolderError(f"distill.topk: {topk} is not below the teacher's vocabulary of {vocabulary} tokens "
                               f"({folder}); take at most {vocabulary - 1}, so that the rest remains one outcome")
    return folder
