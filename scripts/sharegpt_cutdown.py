#!/usr/bin/env python3
"""A small copy of the ShareGPT file holding only what regeneration reads, for GPU machines that
take a limited upload (the PyPI package's file is 126 MB; this copy of it, for two turns, is 9.4 MB
as xz).

    python3 scripts/sharegpt_cutdown.py --turns 2 --out sharegpt_2turns.json.xz
    python3 scripts/sharegpt_cutdown.py --turns all --out sharegpt_all.json.xz

Every record is kept, so the whole-record count check still holds. Each conversation is cut before
its (turns + 1)-th user turn, and the reply after its last kept user turn is shortened (it is never
part of a prompt, but the reader keeps a conversation only up to its last reply). A record the
reader drops anyway (an unknown speaker) becomes a one-turn stub it still drops. The copy is then
read back and its prompts (`prompts.user_turns`, MT-bench overlaps removed) checked to equal the
full file's; the script fails otherwise. `.xz` and `.gz` outputs are compressed.
"""

from __future__ import annotations

import argparse
import gzip
import json
import lzma
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from eagle3_jax import assets
from eagle3_jax.train import data as D
from eagle3_jax.train import prompts as P


def prompts(records: list[dict], turns: int | None, mtbench) -> list[list[dict]]:
    convs = [m for m in map(D.to_messages, records) if m is not None]
    return P.user_turns(D.drop_mtbench(convs, mtbench)[0], turns)


def turns_arg(text: str) -> int | None:
    if text == "all":
        return None
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive number of turns or 'all', got {text!r}")
    return int(text)


def open_out(path: Path):
    if path.suffix == ".xz":
        return lzma.open(path, "wt", encoding="utf-8", preset=9)
    if path.suffix == ".gz":
        return gzip.open(path, "wt", encoding="utf-8")
    return open(path, "w", encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sharegpt", help="the ShareGPT json (default: the pinned PyPI asset)")
    ap.add_argument("--mtbench", help="MT-bench question.jsonl (default: the pinned PyPI asset)")
    ap.add_argument("--turns", type=turns_arg, default=2,
                    help="user turns per conversation the copy keeps: a number, or 'all'")
    ap.add_argument("--out", required=True, help="output .json, .json.gz or .json.xz")
    a = ap.parse_args(argv)
    source = Path(a.sharegpt) if a.sharegpt else assets.fetch(assets.SHAREGPT)
    records = D.load_sharegpt(source, expect=D.SHAREGPT_WHOLE_RECORDS)
    with open(a.mtbench or assets.fetch(assets.MTBENCH)) as f:
        mtbench = [json.loads(line) for line in f if line.strip()]
    cut = [D.cut_for_prompts(r, a.turns) for r in records]
    out = Path(a.out)
    with open_out(out) as f:
        json.dump(cut, f)
    back = D.load_sharegpt(out, expect=len(records))
    full, small = prompts(records, a.turns, mtbench), prompts(back, a.turns, mtbench)
    if full != small:
        raise SystemExit(f"{out}: its prompts differ from the full file's; not usable")
    which = "every user turn" if a.turns is None else f"first {a.turns} user turns"
    print(f"{out}: {len(back)} records, {len(small)} prompts ({which}) equal to the full file's; "
          f"{out.stat().st_size / 1e6:.1f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
