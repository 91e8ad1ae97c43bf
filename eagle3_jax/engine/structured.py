"""Structured outputs on the host: a request's grammar (`SamplingParams.structured_outputs`) as a
matcher that says, before each verify, which tokens the output may take at every position the
verify decides (along a chain's drafts; at each node of a tree, under its own path), so the
target's acceptance runs on masked logits (runner/sampling.py, `mask_logits`).

The grammar engine is llguidance: no dependencies (xgrammar needs torch and triton), one abi3 wheel
for every Python from 3.10, JSON schemas, regular expressions and Lark or GBNF grammars alike, a
matcher that rolls back, and masks along a row's draft path computed in one call across rows on
its own threads. On SmolLM2's 49,152-token vocabulary with a nested schema (a 2-core CPU), a mask
took 11 us at the median and 47 us on average (the first of a request 1.5 ms), the K + 1 = 5
masks along a chain of 4 drafts 30-35 us a row; xgrammar's adaptive masks took 2 us (median),
6 us (mean); outlines-core compiles regular expressions only (no grammars) into an index, 76 ms
for that schema. A GPU iteration of SmolLM2 takes about 1 ms, so llguidance's cost is small and
its dependency cost nil. A tree costs about what a chain does a node: 8 rows of a tree (6, 8, 31)
every node of which tests/test_structured.py's schema allowed, 256 masks, took 16 ms (62 us a
node) where 8 chains of 4 allowed drafts took 3.4 ms (85 us a position: another reply, other
positions than the figures above), and 1.1 ms with random tokens of the reply as nodes, most
refused (`tree_masks` computes no mask under a refused token).
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Sequence

import llguidance
import llguidance.hf
import llguidance.numpy
import numpy as np

from eagle3_jax.engine.scheduler import RequestError
from eagle3_jax.runner.sampling import allow_all
from eagle3_jax.sampling_params import StructuredOutputsParams

log = logging.getLogger(__name__)

# A compact JSON: no whitespace between tokens (StructuredOutputsParams' docstring says why).
_JSON_OPTIONS = {"whitespace_flexible": False}
_ANY_OBJECT = {"type": "object"}


class GrammarError(RequestError):
    """A request's structured output that does not compile; the message says why."""


def grammar_text(params: StructuredOutputsParams) -> str:
    """The llguidance grammar of `params` (not yet checked)."""
    kind = params.kind
    if kind in ("json", "json_object"):
        schema = _ANY_OBJECT if kind == "json_object" else params.json
        schema = json.loads(schema) if isinstance(schema, str) else schema
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=_JSON_OPTIONS)
    return llguidance.grammar_from(kind, list(params.choice) if kind == "choice" else getattr(params, kind))


class Grammars:
    """An engine's grammars: the tokenizer llguidance reads (built on first use, about 0.4 s for a
    49k vocabulary), compiling, and the masks of a batch's rows. `tokenizer`: a transformers fast
    tokenizer (None: structured requests are refused); vocab_size: the target's (the masks' width);
    eos_token_ids: the tokens a grammar allows once its output may end; forced_drafts: the engine
    puts the tokens a grammar forces in place of a row's first drafts (`forced`)."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: Sequence[int], forced_drafts: bool = True):
        self._hf, self.vocab_size, self.eos_token_ids = tokenizer, vocab_size, sorted(eos_token_ids)
        self.forced_drafts = forced_drafts
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._executor: llguidance.LLExecutor | None = None
        self._lock = threading.Lock()  # the server checks requests on another thread than the engine's

    def tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._tokenizer is None:
                if self._hf is None:
                    raise GrammarError("structured_outputs needs the target's tokenizer; this target has none")
                try:
                    self._tokenizer = llguidance.hf.from_tokenizer(self._hf, n_vocab=self.vocab_size,
                                                                   eos_token=self.eos_token_ids or None)
                except ValueError as e:
                    raise GrammarError(f"structured_outputs: the target's tokenizer cannot drive a grammar: {e}") \
                        from None
                self._executor = llguidance.LLExecutor()
            return self._tokenizer

    def compile(self, params: StructuredOutputsParams) -> str:
        """The grammar of `params`, checked against the tokenizer; GrammarError naming what fails."""
        grammar = self._text(params)
        if error := llguidance.LLMatcher.validate_grammar(grammar, self.tokenizer()):
            raise GrammarError(f"structured_outputs {params.kind} does not compile: {error.strip()}")
        return grammar

    def matcher(self, params: StructuredOutputsParams) -> Matcher:
        """A fresh matcher of `params`' grammar at the output's start (GrammarError if it does not compile)."""
        matcher = llguidance.LLMatcher(self.tokenizer(), self._text(params), log_level=0)
        if matcher.is_error():
            raise GrammarError(f"structured_outputs {params.kind} does not compile: {matcher.get_error().strip()}")
        return Matcher(matcher)

    @staticmethod
    def _text(params: StructuredOutputsParams) -> str:
        try:
            return grammar_text(params)
        except ValueError as e:
            raise GrammarError(f"structured_outputs {params.kind}: {e}") from None

    def masks(self, rows: Sequence[tuple[int, Matcher, Sequence[int]]], batch: int, width: int) -> np.ndarray:
        """Packed token masks [batch, width, mask_words] of a verify: for each (row, matcher, drafts
        d1..dk), masks[row, 0] the tokens allowed next and masks[row, i] those allowed after d1..di,
        as far as the grammar takes the drafts; every other row and position allows every token
        (past a draft the grammar refuses, or past its end, no emitted token is chosen). The
        matchers end where they started."""
        return self.tree_masks([(row, m, drafts[:width - 1], range(len(drafts[:width - 1])))
                                for row, m, drafts in rows], batch, width)

    def tree_masks(self, rows: Sequence[tuple[int, Matcher, Sequence[int], Sequence[int]]], batch: int,
                   width: int) -> np.ndarray:
        """Packed token masks [batch, width, mask_words] of a tree's verify (runner/tree.py's layout):
        for each (row, matcher, tokens, parents) of nodes 1..n (node i drafts tokens[i - 1] after
        node parents[i - 1] < i; node 0 is the root, the row's last emitted token), masks[row, i]
        the tokens allowed after the path root..node i, which decide node i's children and its
        bonus token; masks[row, 0] those allowed next. Under a token the grammar refuses (or past
        its end) a node allows every token: it is never accepted, as its parent's mask refuses it.
        A chain is the tree whose node i's parent is i - 1 (`masks`).

        The tree goes as paths (`_paths`), depth first, and every path of every row in one
        llguidance call, across them on its threads, each along its path's drafts from a matcher
        of its own at the path's start: the row's matcher for the path from the root, a copy
        (`deep_copy`) of a walker for each other. The walker, a copy of the row's matcher, goes
        from path to path rolling back only to where the next path branches off and consuming the
        tokens from there to its start. So each node's mask is computed once, a path's shared
        ancestors are consumed once, and the whole tree's masks wait on one call, not one a path.
        The row's matcher computes the masks along the root path (its lexer keeps what they
        teach it; a copy's is dropped) and ends where it started."""
        # Row b's j-th node in path order is scratch[b * width + j], node order[b, j] (unconstrained
        # rows: allow all, in node order).
        scratch = allow_all((batch * width,), self.vocab_size)
        order = np.tile(np.arange(width), (batch, 1))
        jobs = []  # (matcher at a path's start, the path's first place in scratch, the path's tokens past its start)
        for row, m, drafts, parents in rows:
            n = min(len(drafts), width - 1)
            parent = [-1, *(int(p) if 0 <= p < i else 0 for i, p in enumerate(parents[:n], 1))]
            token = [0, *(int(t) for t in drafts[:n])]
            paths = _paths(parent)
            order[row, :n + 1] = [node for path in paths for node in path]
            place = row * width
            jobs.append((m.llg, place, [token[node] for node in paths[0][1:]]))
            place += len(paths[0])
            walker, at = m.llg.deep_copy() if len(paths) > 1 else None, []  # the nodes below the root it took
            for k, path in enumerate(paths[1:], 1):
                down = _ancestry(parent, path[0])  # the nodes from the root's child to the path's start
                shared = next((i for i, (a, b) in enumerate(zip(at, down)) if a != b), min(len(at), len(down)))
                if len(at) > shared:
                    walker.rollback(len(at) - shared)
                    del at[shared:]
                took = walker.try_consume_tokens([token[node] for node in down[shared:]])
                at.extend(down[shared:shared + took])
                if len(at) == len(down):  # else a token on the way was refused: the path allows all
                    # The last path takes the walker itself: nothing comes after it.
                    jobs.append((walker if k == len(paths) - 1 else walker.deep_copy(), place,
                                 [token[node] for node in path[1:]]))
                place += len(path)
        _fill(self._executor, jobs, scratch)
        masks = np.empty((batch, width, scratch.shape[1]), np.int32)
        masks[np.arange(batch)[:, None], order] = scratch.reshape(batch, width, -1)
        return masks

    def forced(self, rows: Sequence[tuple[Matcher, bool]], limit: int) -> list[list[int]]:
        """The tokens each (matcher, sole) row's grammar forces from the matcher's place, at most
        `limit`: llguidance's fast-forward tokens, the bytes every continuation starts with as the
        tokenizer splits them. Another split of those bytes may be allowed too (a BPE vocabulary's
        `{"` and `{`); with `sole`, only the leading tokens that are the only one the grammar
        allows at their position (the rows whose verify reads the drafter's q need that). The
        matchers end where they started."""
        forced = [m.llg.compute_ff_tokens()[:limit] if limit else [] for m, _ in rows]
        checked = [(row, m, tokens) for row, ((m, sole), tokens) in enumerate(zip(rows, forced)) if sole and tokens]
        if checked:  # masks[row, i]: the tokens allowed at forced token i's position
            masks = self.masks(checked, len(rows), limit + 1)
            counts = np.unpackbits(masks.view(np.uint8), axis=-1).sum(axis=-1)  # [rows, limit + 1]
            for row, _, tokens in checked:
                alone = counts[row, :len(tokens)] == 1
                forced[row] = tokens[:int(np.argmin(alone)) if not alone.all() else len(tokens)]
        return forced


def _paths(parent: Sequence[int]) -> list[list[int]]:
    """A tree's nodes (node i's parent parent[i] < i, the root's -1) as paths down it, each from the
    root or from a child of an earlier path's node, on through first children to a leaf; depth first
    (the next path branches off the previous one as deep as it can)."""
    children = [[] for _ in parent]
    for node, up in enumerate(parent[1:], 1):
        children[up].append(node)
    paths, starts = [], [0]
    while starts:
        node = starts.pop()
        path = [node]
        while children[node]:
            starts.extend(reversed(children[node][1:]))
            node = children[node][0]
            path.append(node)
        paths.append(path)
    return paths


def _ancestry(parent: Sequence[int], node: int) -> list[int]:
    """The nodes from the root's child down to `node` (none for the root)."""
    line = []
    while node > 0:
        line.append(node)
        node = parent[node]
    return line[::-1]


def _fill(executor: llguidance.LLExecutor, jobs: list[tuple[llguidance.LLMatcher, int, list[int]]],
          flat: np.ndarray) -> None:
    """llguidance's masks of (matcher, place, drafts d1..dk) jobs, across them on its threads: at
    flat[place] the tokens allowed next, at flat[place + i] those allowed after d1..di."""
    if alone := [job[:2] for job in jobs if not job[2]]:  # llguidance takes no empty draft list
        llguidance.numpy.fill_next_token_bitmask_par(executor, alone, flat)
    if drafted := [job for job in jobs if job[2]]:
        llguidance.numpy.fill_next_token_bitmask_par_with_draft_tokens(executor, drafted, flat)


class Matcher:
    """One request's place in its grammar: advanced by each token the request emits."""

    def __init__(self, matcher: llguidance.LLMatcher):
        self.llg = matcher

    def advance(self, token: int) -> bool:
        """Take the next emitted token -> whether the output must end here: the grammar is complete
        (nothing may follow) or, which the masks prevent, refused it."""
        if not self.llg.consume_token(token):
            log.warning("structured output: the grammar refused an emitted token (%s); ending the request",
                        self.llg.get_error())
            return True
        return self.llg.is_stopped()

