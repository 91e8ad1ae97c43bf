"""Prompts for self-distillation: where they come from and which are kept. Pure Python.

Sources (`SOURCES`), each prompt a list of chat messages ending with a user turn:
  sharegpt-first  the first user turn of a ShareGPT conversation (`user_turns`)
  sharegpt-later  each later user turn, with the conversation before it (ShareGPT's own replies) as context
  magpie          requests the instruct target writes itself when given only its chat template's user
                  header (Magpie, arXiv 2406.08464): `magpie_prefix_ids` is what it is given,
                  `parse_request` reads what it wrote

`select_prompts` drops, in this order and counted per source (`FILTERS`):
  mtbench         a user message that equals, contains or is contained in an MT-bench turn (word-normalised),
                  or shares more than a small share of its word 8-grams with one (`MTBenchGuard`):
                  MT-bench is the evaluation set
  language        user text whose letters are mostly not ASCII (the target is an English model; a
                  script test, no language model)
  length          a last user message shorter than `PromptFilters.min_chars`
  duplicate       the same normalised prompt (every message) seen before
  near_duplicate  the same normalised context and the same first `PromptFilters.prefix_chars`
                  characters of the last user message seen before (templated prompts that differ at the end)
The first occurrence, in source order, is the one kept.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
import unicodedata
from collections import Counter
from collections.abc import Callable, Collection, Iterable, Sequence

SOURCES = ("sharegpt-first", "sharegpt-later", "magpie")
FILTERS = ("mtbench", "language", "length", "duplicate", "near_duplicate")
MAGPIE_OUTCOMES = ("parsed", "unfinished", "template_tokens", "empty")

Prompt = tuple[str, list[dict]]  # (source, chat messages ending with a user turn)


# ----------------------------------------------------------------------------- sources

def user_turns(conversations: Sequence[list[dict]], turns: int | None = 1) -> list[list[dict]]:
    """The prompts of each conversation, in order: its first `turns` user turns (None: all), each
    with the messages before it."""
    if turns is not None and turns < 1:
        raise ValueError(f"turns must be at least 1 (or None for all), got {turns}")
    out = []
    for messages in conversations:
        users = [i for i, m in enumerate(messages) if m["role"] == "user"][:turns]
        out.extend([dict(m) for m in messages[:i + 1]] for i in users)
    return out


def sharegpt_prompts(conversations: Sequence[list[dict]], turns: int | None = None) -> list[Prompt]:
    """`user_turns` tagged with their source: "sharegpt-first" or "sharegpt-later"."""
    return [("sharegpt-first" if sum(m["role"] == "user" for m in p) == 1 else "sharegpt-later", p)
            for p in user_turns(conversations, turns)]


def magpie_prefix(tokenizer) -> str:
    """The chat template's text before a user message's content: what the target continues."""
    mark = "\ue000"  # a private-use character no template writes
    text = tokenizer.apply_chat_template([{"role": "user", "content": mark}], tokenize=False)
    if text.count(mark) != 1:
        raise ValueError("the chat template does not render a user message's content once; no Magpie prefix")
    return text[:text.index(mark)]


def magpie_prefix_ids(tokenizer) -> list[int]:
    """Token ids of `magpie_prefix`, checked to begin a real user turn's (no token straddles it)."""
    prefix = magpie_prefix(tokenizer)
    ids = list(tokenizer(prefix, add_special_tokens=False)["input_ids"])
    sample = tokenizer.apply_chat_template([{"role": "user", "content": "Hello there."}], tokenize=True,
                                           return_dict=False)
    if list(sample[:len(ids)]) != ids:
        raise ValueError(f"the tokens of the user header {prefix!r} do not begin a rendered user turn's tokens")
    return ids


def parse_request(token_ids: Sequence[int], end_ids: Collection[int], special_ids: Collection[int],
                  decode: Callable[[list[int]], str]) -> tuple[str | None, str]:
    """A sampled Magpie request -> (its text, "parsed"), or (None, why not): it must end with an
    end-of-turn token ("unfinished"), hold no other special token ("template_tokens") and leave
    text after `clean_request` ("empty")."""
    ids = list(token_ids)
    end = next((i for i, t in enumerate(ids) if t in end_ids), None)
    if end is None:
        return None, "unfinished"
    if any(t in special_ids for t in ids[:end]):
        return None, "template_tokens"
    text = clean_request(decode(ids[:end]))
    return (text, "parsed") if text else (None, "empty")


def clean_request(text: str) -> str:
    """Unix newlines, no blank runs of more than one line, no surrounding whitespace."""
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    return re.sub(r"\n{3,}", "\n\n", text).strip()


# ----------------------------------------------------------------------------- normalising

def normalize(text: str) -> str:
    """Case- and width-folded text with whitespace runs made one space (the duplicate key)."""
    return re.sub(r"\s+", " ", unicodedata.normalize("NFKC", text).casefold()).strip()


def words(text: str) -> list[str]:
    """The word sequence of `normalize(text)`, punctuation dropped (MT-bench matching)."""
    return re.findall(r"\w+", unicodedata.normalize("NFKC", text).casefold())


_LETTER = re.compile(r"[^\W\d_]")  # a letter of any script
_ASCII_LETTER = re.compile(r"[A-Za-z]")


def _letter_counts(text: str) -> tuple[int, int]:
    """(ASCII letters, letters of any script) in `text`."""
    ascii_letters = len(_ASCII_LETTER.findall(text))
    return ascii_letters, ascii_letters if text.isascii() else len(_LETTER.findall(text))


def ascii_letter_share(text: str) -> float | None:
    """The share of the letters of `text` that are ASCII; None when it has no letter."""
    ascii_letters, letters = _letter_counts(text)
    return ascii_letters / letters if letters else None


def _digest(text: str) -> bytes:
    return hashlib.blake2b(text.encode("utf-8"), digest_size=16).digest()


# ----------------------------------------------------------------------------- MT-bench

class MTBenchGuard:
    """Whether a text's words (`words`) equal an MT-bench turn's, contain one, are contained in one
    with at least `min_words` words (so "continue" is not caught), or share more than `share` of
    the smaller n-gram set with one."""

    def __init__(self, questions: Iterable[dict], n: int = 8, share: float = 0.1, min_words: int = 4):
        self.turns = [" ".join(words(t)) for q in questions for t in q["turns"]]
        self.turns = [t for t in self.turns if t]
        if not self.turns:
            raise ValueError("no MT-bench turns to guard against")
        self.n, self.share, self.min_words = n, share, min_words
        self._padded = [f" {t} " for t in self.turns]
        self._padded_set = set(self._padded)
        self._short = [p for p, t in zip(self._padded, self.turns) if len(t.split()) < n]
        self._all = "\n".join(self._padded)  # one haystack for "contained in any turn"
        self._longest = max(map(len, self._padded))
        self._grams: dict[str, list[int]] = {}  # n-gram -> the turns that hold it
        self._sizes = []
        for k, t in enumerate(self.turns):
            grams = set(self._ngrams(t.split()))
            self._sizes.append(len(grams))
            for g in grams:
                self._grams.setdefault(g, []).append(k)

    def _ngrams(self, ws: list[str]) -> Iterable[str]:
        return (" ".join(ws[i:i + self.n]) for i in range(len(ws) - self.n + 1))

    def overlaps(self, text: str) -> bool:
        ws = words(text)
        if not ws:
            return False
        padded = f" {' '.join(ws)} "
        if padded in self._padded_set:
            return True
        if len(ws) >= self.min_words and len(padded) <= self._longest and padded in self._all:  # inside a turn
            return True
        if any(t in padded for t in self._short):  # holds a whole turn (longer ones: all their n-grams)
            return True
        grams = set(self._ngrams(ws))
        shared = Counter(k for g in grams for k in self._grams.get(g, ()))
        return any(c > self.share * min(len(grams), self._sizes[k]) for k, c in shared.items())


# ----------------------------------------------------------------------------- selection

@dataclasses.dataclass(frozen=True)
class PromptFilters:
    """Thresholds of `select_prompts` (see the module docstring)."""

    min_chars: int = 8  # of the last user message, after stripping
    min_ascii_letters: float = 0.9  # share of the user messages' letters
    prefix_chars: int = 100  # near duplicates: same context and same first characters of the last message
    mtbench_ngram: int = 8
    mtbench_share: float = 0.1  # of the smaller side's n-grams


def empty_counts() -> dict[str, dict[str, int]]:
    return {s: {"candidates": 0, **dict.fromkeys(FILTERS, 0), "kept": 0} for s in SOURCES}


def select_prompts(candidates: Iterable[Prompt], filters: PromptFilters | None,
                   mtbench: MTBenchGuard | None) -> tuple[list[Prompt], dict[str, dict[str, int]]]:
    """-> (the kept prompts in input order, {source: {"candidates", each of FILTERS, "kept": count}});
    `filters` None keeps every prompt, `mtbench` None skips that check."""
    counts = empty_counts()
    seen_exact: set[bytes] = set()
    seen_near: set[tuple[bytes, str]] = set()
    # Once per message, however many prompts repeat it as context.
    checks: dict[str, tuple[bool, int, int]] = {}  # user message -> (MT-bench hit, ASCII letters, letters)
    norms: dict[str, str] = {}  # message -> normalize(message)

    def check(content: str) -> tuple[bool, int, int]:
        if content not in checks:
            hit = mtbench is not None and mtbench.overlaps(content)
            checks[content] = (hit, *_letter_counts(content))
        return checks[content]

    def norm(content: str) -> str:
        if content not in norms:
            norms[content] = normalize(content)
        return norms[content]

    kept = []
    for source, messages in candidates:
        c = counts[source]
        c["candidates"] += 1
        if filters is not None:
            why = _drop_reason(messages, filters, check, norm, seen_exact, seen_near)
            if why is not None:
                c[why] += 1
                continue
        c["kept"] += 1
        kept.append((source, messages))
    return kept, counts


def _drop_reason(messages: list[dict], f: PromptFilters, check, norm, seen_exact: set,
                 seen_near: set) -> str | None:
    users = [check(m["content"]) for m in messages if m["role"] == "user"]
    if any(hit for hit, _, _ in users):
        return "mtbench"
    letters = sum(n for _, _, n in users)
    if not letters or sum(a for _, a, _ in users) < f.min_ascii_letters * letters:
        return "language"
    if len(messages[-1]["content"].strip()) < f.min_chars:
        return "length"
    context = _digest("\0".join(f"{m['role']}\0{norm(m['content'])}" for m in messages[:-1]))
    last = norm(messages[-1]["content"])
    exact = _digest(f"{context.hex()}\0{last}")
    if exact in seen_exact:
        return "duplicate"
    near = (context, last[:f.prefix_chars])
    if near in seen_near:
        return "near_duplicate"
    seen_exact.add(exact)
    seen_near.add(near)
    return None
