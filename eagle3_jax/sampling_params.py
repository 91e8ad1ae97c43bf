"""Per-request sampling parameters, validated on the host; `runner.sampling` holds the device side."""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
from collections.abc import Mapping

DRAFT_ACCEPTANCE_MODES = ("auto", "draft_q", "one_hot", "coupled")
MAX_LOGPROBS = 20  # the most likely tokens a request may ask for beside each (OpenAI's top_logprobs limit)


@dataclasses.dataclass(frozen=True)
class StructuredOutputsParams:
    """What a request's output must match, vLLM's fields; exactly one is set. json: a JSON schema
    (a dict, or its JSON text, kept parsed); json_object: any JSON object; regex: a regular expression (Rust's
    regex syntax); choice: one of these strings; grammar: a context-free grammar, Lark or GBNF
    (llguidance's dialects). JSON is written compact, no whitespace between its tokens (a small
    model left free to add whitespace can add it forever). Only the form is checked here: the
    engine compiles the grammar for its tokenizer and refuses one that does not compile."""

    json: str | dict | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def __post_init__(self) -> None:
        given = [name for name in self.KINDS if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            listed = ", ".join(self.KINDS)
            raise ValueError(f"structured_outputs takes exactly one of {listed}; got "
                             f"{', '.join(given) if given else 'none'}")
        if self.json is not None:
            schema = self.json
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except json.JSONDecodeError as e:
                    raise ValueError(f"structured_outputs json is not valid JSON: {e}") from None
            if not isinstance(schema, (Mapping, bool)):
                raise ValueError(f"structured_outputs json must be a JSON schema (an object), got "
                                 f"{type(schema).__name__}")
            object.__setattr__(self, "json", schema)  # one form, whichever was given: equal, equal hashes
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs {name} must be a non-empty string, got {value!r}")
        if self.choice is not None:
            choice = self.choice
            if isinstance(choice, str) or not all(isinstance(c, str) for c in choice) or not choice:
                raise ValueError(f"structured_outputs choice must be a non-empty list of strings, got {choice!r}")
            object.__setattr__(self, "choice", tuple(choice))
        if self.json_object not in (None, True, False):
            raise ValueError(f"structured_outputs json_object must be true, got {self.json_object!r}")

    KINDS = ("json", "regex", "choice", "grammar", "json_object")

    @property
    def kind(self) -> str:
        """Which one is set: "json", "regex", "choice", "grammar" or "json_object"."""
        return next(name for name in self.KINDS if getattr(self, name) not in (None, False))

    def __hash__(self) -> int:  # a schema dict is unhashable: hash its canonical text
        value = getattr(self, self.kind)
        return hash((self.kind, json.dumps(value, sort_keys=True) if self.kind == "json" else value))

    @classmethod
    def of(cls, value: StructuredOutputsParams | Mapping) -> StructuredOutputsParams:
        """A StructuredOutputsParams, or one from a dict of its fields (a request payload)."""
        if isinstance(value, cls):
            return value
        if not isinstance(value, Mapping):
            raise ValueError(f"structured_outputs must be a StructuredOutputsParams or a dict of its fields "
                             f"({', '.join(cls.KINDS)}), got {type(value).__name__}")
        if unknown := sorted(set(value) - set(cls.KINDS)):
            raise ValueError(f"structured_outputs has no field {unknown[0]!r}; its fields: {', '.join(cls.KINDS)}")
        return cls(**value)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to decode one request, vLLM's fields: max_tokens (> 0; 0: a prefill only, for prompt
    scoring with prompt_logprobs); temperature (0: greedy, argmax); top_k (0: off), top_p in (0, 1]
    (1: off), min_p in [0, 1] (0: off); seed (None: the engine draws one); stop_token_ids (besides
    EOS), stop strings, ignore_eos; n independent samples (`samples` splits them, the i-th seeded
    seed + i); structured_outputs: what the output must match (`StructuredOutputsParams`, or a dict
    of its fields), None: anything.

    logprobs: for each generated token its log-probability under the target, its rank and the
    `logprobs` likeliest tokens' (0..MAX_LOGPROBS; None: none). prompt_logprobs: the same for each
    prompt token after the first, given the ones before it. Both are the target's raw
    log-softmax, before temperature, top-k, top-p and min-p, as vLLM's default; the request's
    outputs carry them (api.py, `CompletionOutput.logprobs`, `RequestOutput.prompt_logprobs`).
    Under structured_outputs too they are the target's, before the grammar's mask.

    draft_acceptance: how a sampled row accepts proposals, every rule lossless. "draft_q":
    rejection sampling with the draft's q; "one_hot": q taken as one-hot (vLLM's, SGLang's);
    "coupled": Gumbel coupling keyed by (seed, position), so the tokens depend on the prompt and
    seed alone, whatever the batch or speculation; "auto": `acceptance_rule` (BENCHMARKS.md,
    "Sampled acceptance").
    """

    max_tokens: int = 256
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    draft_acceptance: str = "auto"
    n: int = 1
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        def _set(name, value):
            object.__setattr__(self, name, value)

        def _is_int(v) -> bool:
            return isinstance(v, numbers.Integral) and not isinstance(v, bool)

        def _is_real(v) -> bool:
            return isinstance(v, numbers.Real) and not isinstance(v, bool)

        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or not 0 <= value <= MAX_LOGPROBS):
                raise ValueError(f"{name} must be an int in 0..{MAX_LOGPROBS} (the likeliest tokens listed "
                                 f"beside each) or None, got {value!r}")
            _set(name, None if value is None else int(value))

        if not _is_int(self.max_tokens) or self.max_tokens < 0:
            raise ValueError(f"max_tokens must be a positive int, got {self.max_tokens!r}")
        if self.max_tokens == 0 and self.prompt_logprobs is None:
            raise ValueError("max_tokens must be a positive int; 0 (a prefill only) needs prompt_logprobs, "
                             "as nothing else comes back")
        _set("max_tokens", int(self.max_tokens))

        if not _is_real(self.temperature) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(
                f"temperature must be a finite float >= 0 (0 = greedy), got {self.temperature!r}"
            )
        _set("temperature", float(self.temperature))

        if not _is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k must be an int >= 0 (0 = off), got {self.top_k!r}")
        _set("top_k", int(self.top_k))

        # NaN fails the comparison
        if not _is_real(self.top_p) or not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        _set("top_p", float(self.top_p))

        if not _is_real(self.min_p) or not (0.0 <= self.min_p <= 1.0):
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        _set("min_p", float(self.min_p))

        if self.seed is not None:
            if not _is_int(self.seed) or self.seed < 0:
                raise ValueError(f"seed must be a non-negative int or None, got {self.seed!r}")
            _set("seed", int(self.seed))

        if isinstance(self.stop_token_ids, (str, bytes)) or _is_int(self.stop_token_ids):
            raise ValueError(
                f"stop_token_ids must be a sequence of ints, got {self.stop_token_ids!r}"
            )
        ids = tuple(self.stop_token_ids)
        for t in ids:
            if not _is_int(t) or t < 0:
                raise ValueError(
                    f"stop_token_ids must contain non-negative ints, got {self.stop_token_ids!r}"
                )
        _set("stop_token_ids", tuple(int(t) for t in ids))

        # a bare string is one stop string
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        for s in stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop must contain non-empty strings, got {self.stop!r}")
        _set("stop", stop)

        _set("ignore_eos", bool(self.ignore_eos))

        if self.draft_acceptance not in DRAFT_ACCEPTANCE_MODES:
            raise ValueError(
                f"draft_acceptance must be one of {DRAFT_ACCEPTANCE_MODES}, "
                f"got {self.draft_acceptance!r}"
            )

        if not _is_int(self.n) or self.n < 1:
            raise ValueError(f"n must be a positive int, got {self.n!r}")
        _set("n", int(self.n))

        if self.structured_outputs is not None:
            _set("structured_outputs", StructuredOutputsParams.of(self.structured_outputs))

    def samples(self) -> list[SamplingParams]:
        """One single-sample SamplingParams per sample; the i-th seeded seed + i, so seeded samples
        differ from each other and each reproduces."""
        if self.n == 1:
            return [self]
        return [dataclasses.replace(self, n=1, seed=None if self.seed is None else self.seed + i)
                for i in range(self.n)]

    def acceptance_rule(self, point_mass: bool = False) -> str:
        """draft_acceptance resolved: "auto" is "coupled" for a seeded request (a seed must reproduce
        its tokens) and where the proposals are point masses (a tree, prompt lookup: it accepts the
        most there), else "draft_q" (a drafter's sampled chain)."""
        if self.draft_acceptance != "auto":
            return self.draft_acceptance
        return "coupled" if self.seed is not None or point_mass else "draft_q"

    @property
    def greedy(self) -> bool:
        """True iff decoding is greedy (temperature == 0)."""
        return self.temperature == 0.0
