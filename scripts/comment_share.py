#!/usr/bin/env python3
"""The share of a package's non-blank lines that hold a comment or a docstring, per directory.

    python3 scripts/comment_share.py [eagle3_jax]

A line counts if it holds a comment token, or is part of a string that stands as a statement of
its own (a docstring, or a bare string used as one). Files at the package's top level are listed
by name, those deeper by their first directory.
"""

from __future__ import annotations

import collections
import io
import sys
import tokenize
from pathlib import Path

# Tokens after which a STRING starts a statement (rather than being part of an expression).
_STATEMENT_START = (tokenize.INDENT, tokenize.DEDENT, tokenize.NEWLINE, None)


def comment_lines(source: str) -> tuple[set[int], set[int]]:
    """(lines holding a comment or docstring, non-blank lines), 1-based."""
    commented: set[int] = set()
    prev = None
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            commented.add(tok.start[0])
        elif tok.type == tokenize.STRING and prev in _STATEMENT_START:
            commented.update(range(tok.start[0], tok.end[0] + 1))
        if tok.type not in (tokenize.NL, tokenize.COMMENT):
            prev = tok.type
    non_blank = {i for i, line in enumerate(source.splitlines(), 1) if line.strip()}
    return commented & non_blank, non_blank


def main(argv: list[str]) -> None:
    root = Path(argv[0] if argv else "eagle3_jax")
    total: collections.Counter[str] = collections.Counter()
    commented: collections.Counter[str] = collections.Counter()
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        key = rel.parts[0] if len(rel.parts) > 1 else rel.name
        c, n = comment_lines(path.read_text())
        commented[key] += len(c)
        total[key] += len(n)
    for key in sorted(total, key=lambda k: -commented[k]):
        print(f"{key:22s} {commented[key]:5d}/{total[key]:5d} = {commented[key] / total[key]:5.1%}")
    c, n = sum(commented.values()), sum(total.values())
    print(f"comment share of {root}/: {c}/{n} = {c / n:.1%}")


if __name__ == "__main__":
    main(sys.argv[1:])
