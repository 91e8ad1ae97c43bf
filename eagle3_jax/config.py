"""Static, hashable configurations: frozen dataclasses, so each can be a `static_argnames`
argument of a jitted function (equal configs share one compiled executable).

Capture convention: `capture_layer_ids` index the target layers whose INPUT residual stream is
captured for the drafter, as in the EAGLE reference and vLLM (default 2, L//2, L-3); TensorRT-LLM
names the same tensors as the OUTPUT of layers 1, L//2-1, L-4, and SGLang adds 1 to config ids.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple, Protocol


class ConfigError(ValueError):
    """A config.json that cannot describe a model we run; the message names the field."""


@dataclasses.dataclass(frozen=True)
class Llama3RopeScaling:
    """Llama-3.1/3.3 `rope_type: llama3` frequency scaling."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


def _field(d: dict, name: str, kind: type | tuple[type, ...], where: str, default: Any = ...) -> Any:
    if name not in d or d[name] is None:
        if default is ...:
            raise ConfigError(f"{where}: missing required field '{name}'")
        return default
    value = d[name]
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        raise ConfigError(f"{where}: field '{name}' must be {type_words(kind)}, got {value!r}")
    return value


_TYPE_WORDS = {int: "an integer", float: "a number", bool: "true or false", str: "a string", list: "a list",
               dict: "an object"}


def type_words(kind: type | tuple[type, ...]) -> str:
    """A type (or types) as a message says it: int -> "an integer", (int, str) -> "an integer or a string"."""
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join(_TYPE_WORDS.get(k, k.__name__) for k in kinds)


def _positive(value: int, name: str, where: str) -> int:
    if value <= 0:
        raise ConfigError(f"{where}: field '{name}' must be positive, got {value}")
    return value


def parse_rope(d: dict, where: str) -> tuple[float, Llama3RopeScaling | None]:
    """(rope_theta, llama3 scaling or None) from a transformers-4 or transformers-5 config."""
    # transformers 5: `rope_parameters`; transformers 4: `rope_theta` and an optional `rope_scaling`.
    params = d.get("rope_parameters") or {}
    scaling = d.get("rope_scaling") or {}
    if not isinstance(params, dict) or not isinstance(scaling, dict):
        raise ConfigError(f"{where}: 'rope_parameters'/'rope_scaling' must be objects")
    theta = params.get("rope_theta", d.get("rope_theta", 10000.0))
    if not isinstance(theta, (int, float)) or theta <= 0:
        raise ConfigError(f"{where}: field 'rope_theta' must be a positive number, got {theta!r}")
    merged = {**scaling, **params}
    rope_type = merged.get("rope_type", merged.get("type", "default"))
    if rope_type in (None, "default"):
        return float(theta), None
    if rope_type != "llama3":
        raise ConfigError(f"{where}: unsupported rope_type {rope_type!r} (supported: default, llama3)")
    fields = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    for f in fields:
        if f not in merged:
            raise ConfigError(f"{where}: llama3 rope scaling needs field '{f}'")
    scaling_cfg = Llama3RopeScaling(
        factor=float(merged["factor"]),
        low_freq_factor=float(merged["low_freq_factor"]),
        high_freq_factor=float(merged["high_freq_factor"]),
        original_max_position_embeddings=int(merged["original_max_position_embeddings"]),
    )
    if scaling_cfg.high_freq_factor <= scaling_cfg.low_freq_factor:
        raise ConfigError(f"{where}: llama3 rope scaling needs high_freq_factor > low_freq_factor")
    return float(theta), scaling_cfg


def _layer_fields(d: dict, where: str) -> dict[str, Any]:
    """The decoder-layer fields a target's and a drafter's config.json share, as keyword arguments."""
    hidden = _field(d, "hidden_size", int, where)
    heads = _field(d, "num_attention_heads", int, where)
    _positive(heads, "num_attention_heads", where)
    theta, scaling = parse_rope(d, where)
    return dict(
        hidden_size=hidden,
        intermediate_size=_field(d, "intermediate_size", int, where),
        num_heads=heads,
        num_kv_heads=_field(d, "num_key_value_heads", int, where, heads),
        head_dim=_field(d, "head_dim", int, where, hidden // heads),
        rms_norm_eps=_field(d, "rms_norm_eps", float, where, 1e-6),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=_field(d, "max_position_embeddings", int, where, 2048),
    )


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """A Llama-3 family target (LlamaForCausalLM)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: Llama3RopeScaling | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    eos_token_ids: tuple[int, ...] = ()
    # Input of these layers is captured for EAGLE-3 (see module docstring).
    capture_layer_ids: tuple[int, ...] = ()

    def __post_init__(self):
        where = "target config"
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            _positive(getattr(self, name), name, where)
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"{where}: num_attention_heads {self.num_heads} is not a multiple of "
                              f"num_key_value_heads {self.num_kv_heads}")
        if self.head_dim % 2:
            raise ConfigError(f"{where}: head_dim {self.head_dim} must be even for RoPE")
        if not self.capture_layer_ids:
            object.__setattr__(self, "capture_layer_ids", default_capture_layers(self.num_layers))
        for i in self.capture_layer_ids:
            if not 0 <= i < self.num_layers:
                raise ConfigError(f"{where}: capture layer id {i} outside 0..{self.num_layers - 1}")

    @classmethod
    def from_hf(cls, d: dict, where: str = "config.json") -> ModelConfig:
        model_type = d.get("model_type", "llama")
        if model_type != "llama":
            raise ConfigError(f"{where}: field 'model_type' is {model_type!r}; only 'llama' is supported")
        if d.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"{where}: field 'hidden_act' must be 'silu', got {d['hidden_act']!r}")
        for flag in ("attention_bias", "mlp_bias"):
            if d.get(flag):
                raise ConfigError(f"{where}: field '{flag}' is true; biases are not supported")
        layer = _layer_fields(d, where)
        eos = d.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        return cls(
            vocab_size=_field(d, "vocab_size", int, where),
            num_layers=_field(d, "num_hidden_layers", int, where),
            tie_word_embeddings=_field(d, "tie_word_embeddings", bool, where, False),
            eos_token_ids=eos_ids,
            **layer,
        )

    @classmethod
    def from_json(cls, path: str | Path) -> ModelConfig:
        return cls.from_hf(read_json(path), where=str(path))

    def with_capture_layers(self, ids: tuple[int, ...]) -> ModelConfig:
        return dataclasses.replace(self, capture_layer_ids=tuple(ids))

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


def default_capture_layers(num_layers: int) -> tuple[int, ...]:
    """EAGLE-3's default: the input of layers 2, L//2 and L-3 (low, mid, high)."""
    return (min(2, num_layers - 1), num_layers // 2, max(num_layers - 3, 0))


@dataclasses.dataclass(frozen=True)
class DraftConfig:
    """An EAGLE-3 draft head: one Llama decoder layer over [embedding, hidden]. target_hidden_size
    is each captured state's width (the 70B drafters: above hidden_size, with their own embedding)."""

    vocab_size: int  # target vocabulary (embedding rows)
    draft_vocab_size: int  # lm_head rows
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: Llama3RopeScaling | None
    max_position_embeddings: int
    target_hidden_size: int
    num_captures: int = 3
    # Target layers whose input feeds fc, if the drafter says (eagle_config); else the target's.
    capture_layer_ids: tuple[int, ...] | None = None

    def __post_init__(self):
        where = "draft config"
        for name in ("vocab_size", "draft_vocab_size", "hidden_size", "intermediate_size",
                     "num_heads", "num_kv_heads", "head_dim", "target_hidden_size", "num_captures"):
            _positive(getattr(self, name), name, where)
        if self.draft_vocab_size > self.vocab_size:
            raise ConfigError(f"{where}: draft_vocab_size {self.draft_vocab_size} exceeds vocab_size "
                              f"{self.vocab_size}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"{where}: num_attention_heads {self.num_heads} is not a multiple of "
                              f"num_key_value_heads {self.num_kv_heads}")

    @classmethod
    def from_hf(cls, d: dict, where: str = "draft config.json") -> DraftConfig:
        layers = d.get("num_hidden_layers", 1)
        if layers != 1:
            raise ConfigError(f"{where}: field 'num_hidden_layers' is {layers}; an EAGLE-3 drafter has 1")
        # No rope_theta in the public 8B drafter: the EAGLE reference falls back to 10000 (parse_rope's default).
        layer = _layer_fields(d, where)
        vocab = _field(d, "vocab_size", int, where)
        eagle = _field(d, "eagle_config", dict, where, {})
        aux = _field(eagle, "eagle_aux_hidden_state_layer_ids", list, f"{where}: eagle_config", None)
        return cls(
            vocab_size=vocab,
            draft_vocab_size=_field(d, "draft_vocab_size", int, where, vocab),
            target_hidden_size=_field(d, "target_hidden_size", int, where, layer["hidden_size"]),
            num_captures=len(aux) if aux else 3,
            capture_layer_ids=tuple(int(i) for i in aux) if aux else None,
            **layer,
        )

    @classmethod
    def from_json(cls, path: str | Path) -> DraftConfig:
        return cls.from_hf(read_json(path), where=str(path))

    @classmethod
    def like_target(cls, target: ModelConfig, draft_vocab_size: int, **overrides) -> DraftConfig:
        """A drafter with the target's layer shapes (as the public 8B drafter), `overrides` replacing any field."""
        fields = dict(vocab_size=target.vocab_size, draft_vocab_size=min(draft_vocab_size, target.vocab_size),
                      hidden_size=target.hidden_size, intermediate_size=target.intermediate_size,
                      num_heads=target.num_heads, num_kv_heads=target.num_kv_heads, head_dim=target.head_dim,
                      rms_norm_eps=target.rms_norm_eps, rope_theta=target.rope_theta,
                      rope_scaling=target.rope_scaling, max_position_embeddings=target.max_position_embeddings,
                      target_hidden_size=target.hidden_size, num_captures=len(target.capture_layer_ids))
        return cls(**{**fields, **overrides})

    def to_hf(self, has_own_embedding: bool = False) -> dict:
        """The public EAGLE-3 config.json layout. The EAGLE reference reads any `target_hidden_size`
        as "brings its own embedding", so it is written only when it differs from hidden_size or
        `has_own_embedding` (the file stores `embed_tokens.weight`)."""
        d: dict[str, Any] = {
            "architectures": ["LlamaForCausalLMEagle3"],
            "model_type": "llama",
            "hidden_act": "silu",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "num_hidden_layers": 1,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_position_embeddings,
            "vocab_size": self.vocab_size,
            "draft_vocab_size": self.draft_vocab_size,
            "tie_word_embeddings": False,
            "torch_dtype": "float16",
        }
        if has_own_embedding or self.target_hidden_size != self.hidden_size:
            d["target_hidden_size"] = self.target_hidden_size
        if self.rope_scaling is not None:
            d["rope_scaling"] = {"rope_type": "llama3", **dataclasses.asdict(self.rope_scaling)}
        if self.capture_layer_ids is not None:
            d["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(self.capture_layer_ids)}
        return d

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


def check_draft_fits(target: ModelConfig, draft: DraftConfig, has_own_embedding: bool) -> None:
    if draft.vocab_size != target.vocab_size:
        raise ConfigError(f"drafter vocab_size {draft.vocab_size} does not match the target's "
                          f"{target.vocab_size}")
    if draft.target_hidden_size != target.hidden_size:
        if draft.target_hidden_size == draft.hidden_size:  # no target_hidden_size of its own
            raise ConfigError(f"drafter hidden_size {draft.hidden_size} does not match the target's "
                              f"hidden_size {target.hidden_size}: the drafter was made for another target")
        raise ConfigError(f"drafter target_hidden_size {draft.target_hidden_size} does not match the "
                          f"target's hidden_size {target.hidden_size}: the drafter was made for another target")
    if not has_own_embedding and draft.hidden_size != target.hidden_size:
        raise ConfigError(f"drafter hidden_size {draft.hidden_size} differs from the target's "
                          f"{target.hidden_size} and the drafter has no embed_tokens of its own")
    layers = draft.capture_layer_ids or target.capture_layer_ids
    if len(layers) != draft.num_captures:
        raise ConfigError(f"drafter expects {draft.num_captures} captures, target provides {len(layers)}")
    for i in layers:
        if not 0 <= i < target.num_layers:
            raise ConfigError(f"drafter capture layer {i} outside the target's 0..{target.num_layers - 1}")


def check_proposal_fits(spec: TreeSpec, draft: DraftConfig) -> None:
    """ConfigError unless the draft vocabulary holds the top_k tokens each expanded node takes."""
    if spec.top_k > draft.draft_vocab_size:
        raise ConfigError(f"{spec.label}: top_k {spec.top_k} exceeds the drafter's draft vocabulary of "
                          f"{draft.draft_vocab_size} tokens")


def read_json(path: str | Path) -> dict:
    """A config.json's object; ConfigError naming the file when it is not UTF-8 JSON holding one."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"config not found: {path}")
    try:
        d = json.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text (byte {e.start}: {e.reason}); a config.json is JSON") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(d, dict):
        raise ConfigError(f"{path}: holds {json_kind(d)}, not the JSON object {{...}} of a model's fields")
    return d


def json_kind(value: Any) -> str:
    """A JSON value's kind in words: "an array", "null", "a number"."""
    kinds = ((bool, "a boolean"), (int, "a number"), (float, "a number"), (str, "a string"),
             (list, "an array"), (dict, "an object"))
    return "null" if value is None else next((kind for t, kind in kinds if isinstance(value, t)), type(value).__name__)


MAX_SPECULATIVE_TOKENS = 16
SPECULATION_MODES = ("auto", "always")
ATTENTION_KINDS = ("auto", "xla", "pallas")
GEMV_KINDS = ("xla", "mosaic")
GEMM_KINDS = ("auto", "triton", "cublas")
PAGE_RESERVATIONS = ("on_demand", "whole")


@dataclasses.dataclass(frozen=True)
class TreeSpec:
    """The static shape of an EAGLE-2 dynamic draft tree (runner/tree.py builds and verifies it).

    steps: draft forwards per tree, its depth: the most proposals one iteration can accept.
    top_k: children per expanded node, and beams kept per level.
    tokens: nodes verified besides the root (the row's last token), the best of `candidates`.
    A chain of K proposals is TreeSpec(K, 1, K)."""

    steps: int
    top_k: int
    tokens: int

    def __post_init__(self):
        for name in ("steps", "top_k", "tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{name} must be a positive int, got {value!r}")
        if self.tokens > self.candidates:
            raise ConfigError(f"tokens must be at most the {self.candidates} candidates of steps={self.steps}, "
                              f"top_k={self.top_k}, got {self.tokens}")

    @classmethod
    def chain(cls, k: int) -> TreeSpec:
        return cls(k, 1, k)

    @property
    def is_chain(self) -> bool:
        return self.top_k == 1 and self.tokens == self.steps

    @property
    def label(self) -> str:
        """The name in tables and logs: "chain K=4", "tree 5,4,15"."""
        return f"chain K={self.steps}" if self.is_chain else f"tree {self.steps},{self.top_k},{self.tokens}"

    @property
    def candidates(self) -> int:
        """N: level 1's k, then k^2 at each of the steps - 1 further levels."""
        return self.top_k + (self.steps - 1) * self.top_k ** 2

    @property
    def verify_width(self) -> int:
        return self.tokens + 1

    @property
    def max_depth(self) -> int:
        return self.steps

    @property
    def draft_slots(self) -> int:
        """W: draft KV positions one tree writes after the verified position (k per beam level)."""
        return (self.steps - 1) * self.top_k

    @property
    def positions_per_iteration(self) -> int:
        """KV positions past a row's length one iteration writes: the target's verify at
        length..length+tokens, the draft's extend and tree up to length + n + draft_slots, n <= steps."""
        if self.is_chain:  # the chain's own reservation (its later draft steps past it hit scratch)
            return self.steps + 1
        return max(self.tokens + 1, self.steps + 1 + self.draft_slots)


class SlotLayout(NamedTuple):
    """What a speculator keeps per slot (runner/state.py's `Slots`): proposals = Slots.drafts columns,
    q_rows = Slots.draft_probs rows, emitted = Slots.emitted columns; parents, history: whether kept."""

    proposals: int
    q_rows: int
    parents: bool
    emitted: int
    history: bool = False

    @staticmethod
    def union(layouts) -> SlotLayout:
        layouts = list(layouts)
        return SlotLayout(proposals=max(x.proposals for x in layouts), q_rows=max(x.q_rows for x in layouts),
                          parents=any(x.parents for x in layouts), emitted=max(x.emitted for x in layouts),
                          history=any(x.history for x in layouts))


@dataclasses.dataclass(frozen=True)
class SpeculatorFacts:
    """What the host knows of a speculator (runner/speculators/): fixed by its configuration, read by
    the engine, the scheduler and the policy to plan around it, and by the runner to size the
    programs and state it runs on. The speculator's methods are the device work."""

    label: str  # the name in tables and logs: "chain K=4", "tree 5,4,15", "ngram K=4"
    spec: TreeSpec | None  # its shape (None: the target alone)
    kind: int  # tags its proposals in Slots.drafted_by: a verify treats another kind's as none
    uses_drafter: bool  # drafts with the EAGLE-3 head
    point_mass: bool  # proposals are a function of the context: no q kept, one-hot or coupled rules
    top1_chain: int  # it is the drafter's top-1 chain of this length (0: not), which a tree's verify can measure
    measures_top1_chain: bool  # its verify reports what the drafter's top-1 chain would have accepted
    num_draft_steps: int
    max_accepted: int  # the most proposals one iteration accepts
    verify_width: int  # W: tokens per row the target verifies
    positions_per_iteration: int  # KV positions written past the row's length (the scheduler's footprint)
    slot_layout: SlotLayout

    @property
    def verifies_chain(self) -> bool:
        """Its verify checks one line of tokens (a chain, prompt lookup, the target alone), along
        which the host follows a grammar; a tree's it follows down every branch (engine/structured.py)."""
        return self.spec is None or self.spec.is_chain


class Proposal(Protocol):
    """A speculator as the host sees it: its facts (runner/speculators/ adds the device methods)."""

    @property
    def facts(self) -> SpeculatorFacts: ...


# Row 0 of the per-slot state is the dummy slot padded batch rows read and write; page 0 of the
# KV pool is the scratch page unused block-table entries point at. Neither belongs to a request.
DUMMY_SLOT = 0
SCRATCH_PAGE = 0


def smallest_bucket(buckets: tuple[int, ...], n: int) -> int:
    """The smallest of the increasing `buckets` that holds `n` (a batch, a chunk, rows of a call)."""
    for bucket in buckets:
        if bucket >= n:
            return bucket
    raise ValueError(f"{n} exceeds the largest bucket of {buckets}")


BATCH_BUCKETS = (2, 4, 8, 16, 32, 64)


def default_batch_buckets(proposals: Sequence[TreeSpec], up_to: int | None = None) -> tuple[int, ...]:
    """Powers of two from 2 rows for chains only (a lone chain iteration is cheaper padded to two
    rows), else from 1 (BENCHMARKS.md, "Host overhead"), up to the smallest holding `up_to` rows
    (None: BATCH_BUCKETS' largest)."""
    chains_only = bool(proposals) and all(p.is_chain for p in proposals)
    start = 2 if chains_only else 1
    top = BATCH_BUCKETS[-1] if up_to is None else max(start, 1 << (up_to - 1).bit_length())
    return tuple(1 << i for i in range(start.bit_length() - 1, top.bit_length()))


def drafted(tree: TreeSpec | None, num_speculative_tokens: int) -> tuple[TreeSpec | None, int]:
    """(the tree drafted, the chain's K): a chain-shaped tree is the chain of its steps."""
    if tree is not None and tree.is_chain:
        return None, tree.steps
    return tree, num_speculative_tokens


def proposal_specs(tree: TreeSpec | None, num_speculative_tokens: int, speculation: str) -> tuple[TreeSpec, ...]:
    """What a bucket may draft, the engine's proposal first: the tree (and under "auto" the chain
    of K beside it), else the chain of K (none when K is 0)."""
    tree, k = drafted(tree, num_speculative_tokens)
    chain = (TreeSpec.chain(k),) if k else ()
    if tree is None:
        return chain
    return (tree, *chain) if speculation == "auto" else (tree,)


def blocks_per_seq(max_model_len: int, page_size: int, tree: TreeSpec | None) -> int:
    """A block table's pages: the committed tokens plus two iterations in flight at the largest K
    (so the pool does not depend on K) or the tree's; a multiple of 4 pages, the attention
    kernel's table read."""
    tree = drafted(tree, 0)[0]
    per_iteration = max(MAX_SPECULATIVE_TOKENS + 1, tree.positions_per_iteration if tree else 0)
    pages = -(-(max_model_len + 2 * per_iteration) // page_size)
    return -(-pages // 4) * 4


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """What the user asks of an engine: shapes of the compiled step functions and of the KV pool,
    and how it serves. What a field leaves open ("auto", None) is settled once per engine, for the
    target, the drafter and the device, by runner/served.py's `served_config` into a ServedConfig,
    which everything downstream reads.

    Serving:
    max_model_len: longest prompt + output a request may have.
    max_num_seqs: the most requests running at once, at most the largest batch bucket (None: it).
    batch_buckets: decode batch sizes compiled; n running requests run in the smallest bucket >= n,
        padded rows pointing at the dummy slot. None: `default_batch_buckets` for what it drafts.
    batch_buckets_up_to: with batch_buckets None, the default buckets end at the smallest holding
        this many rows (None: at 64): a run that knows its largest batch compiles no larger one.
    prefill_buckets: prompt chunk lengths compiled; longer prompts prefill in chunks of the largest.
    prefill_batch_buckets: prompts per prefill call compiled; prompts admitted in one step whose last
        chunks share a chunk bucket share a call (BENCHMARKS.md, "Serving with arrivals").
    freeze_heap: after warm-up, collect garbage once and `gc.freeze` the heap, so that no full pass
        of the cyclic collector stalls serving (False: a test suite building many engines).
    structured_warmup: warm-up also compiles the programs that apply a grammar's token masks
        (`SamplingParams.structured_outputs`: each bucket's choices, tree, chain and target alone,
        and the prefills), so a structured request never waits for a compile; off (the default), they
        compile on a structured request's first use of each shape, and warm-up takes no longer.

    Speculation:
    speculator: "eagle3": the EAGLE-3 drafter (a chain of K, or the tree); "ngram": prompt lookup,
        the K tokens after an earlier match of the row's last 1-4, no drafter (runner/speculators/ngram.py).
    num_speculative_tokens: K, the proposals of the chain (0: the target alone).
    tree: None drafts the chain of K; a TreeSpec(steps, top_k, tokens) drafts EAGLE-2's dynamic
        tree, in fused iterations only. TreeSpec(K, 1, K) is the chain of K (`drafted`). "auto":
        `default_tree`'s, once the drafter and the device are known (LLM's default).
    speculation: "auto" runs per bucket and iteration the fastest of the target alone and
        `speculative_proposals` (engine/policy.py), warm-up compiling them all so switching never
        compiles; "always" runs the engine's proposal at every bucket, for measuring a drafter. A
        seeded request gives the same tokens either way (draft_acceptance "coupled").
    speculative_max_batch: batch buckets larger than this run the target alone (None: no cap).
    step_costs: per bucket (bucket, target-only seconds, then those of `speculative_proposals`),
        e.g. from `eagle3-jax bench`, for "auto"; buckets it lacks are timed in warm-up.
    fused_iteration: one program per iteration (True), or the verify and each draft step
        dispatched as programs of their own (False; a chain only).

    The KV pool:
    page_size, num_pages: the paged KV pool of target and drafter (page 0 is scratch). num_pages
        None: `kv_memory_fraction` of the free device memory after the weights; on a device that
        reports none (the CPU), every slot at min(max_model_len, 1024) tokens plus one request at
        max_model_len, within a quarter of the host's available memory (runner/kv_memory.py,
        `host_pool`). Only a request the pool cannot hold is refused.
    kv_memory_fraction: the share of free memory the pool takes; the rest is the programs' working
        memory (sized before warm-up, since every program is compiled for the pool's shape).
    page_reservation: "on_demand": pages taken as a request's tokens and iterations in flight need
        them, the latest admitted request preempted when short; "whole": prompt + max_tokens taken
        at admission, nothing preempted, far fewer requests running at once.
    prefix_caching: full pages stay cached by content (engine/pages.py) for later requests to reuse
        as a prefix; the least recently used are evicted when no page is free.

    Kernels (how the step functions compute, not what):
    attention: paged attention of decode, verify, draft and prefill steps. "pallas": kernels reading
        only a row's filled pages (a prefill chunk's query tiles, the keys each can see;
        model/pallas_attention.py), fused residual-norm and tree top-k; "xla": over the whole block
        table; "auto": pallas on a GPU without tensor parallelism, else xla.
    gemv: projections of steps up to 64 rows. "xla": XLA's dots; "mosaic": a Pallas Mosaic GPU
        kernel per projection (model/mosaic_gemv.py), slower (BENCHMARKS.md, "Tried and rejected").
    gemm: matrix products of a fused iteration on a GPU. "triton": XLA's default; "cublas": cuBLAS;
        "auto": cuBLAS for verifies of `steps.CUBLAS_MIN_ROWS` to `CUBLAS_MAX_ROWS` rows of a target
        up to `CUBLAS_MAX_HIDDEN` wide, where it was faster (BENCHMARKS.md, "GEMMs: Triton or cuBLAS").
    batch_invariant: the target computes each token's row in a fixed order whatever the batch,
        program or tokens per row (model/invariant_gemm.py, invariant_attention.py), so greedy
        speculation is token-identical to the target alone in bf16 too; under tensor parallelism
        the target runs per device, sums added in rank order. The drafter is unaffected.

    Every field keeps the value given; what follows from them alone is a property, what follows
    from them and the models and device is the ServedConfig.
    """

    # serving
    max_model_len: int = 2048
    max_num_seqs: int | None = None
    batch_buckets: tuple[int, ...] | None = None
    batch_buckets_up_to: int | None = None
    prefill_buckets: tuple[int, ...] = (32, 128, 512)
    prefill_batch_buckets: tuple[int, ...] = (1, 8)
    freeze_heap: bool = True
    structured_warmup: bool = False

    # speculation
    speculator: str = "eagle3"
    num_speculative_tokens: int = 3
    tree: TreeSpec | str | None = None
    speculation: str = "auto"
    speculative_max_batch: int | None = None
    step_costs: tuple[tuple[float, ...], ...] | None = None
    fused_iteration: bool = True

    # the KV pool
    page_size: int = 16
    num_pages: int | None = None
    kv_memory_fraction: float = 0.9
    page_reservation: str = "on_demand"
    prefix_caching: bool = True

    # kernels
    attention: str = "auto"
    gemv: str = "xla"
    gemm: str = "auto"
    batch_invariant: bool = False

    def __post_init__(self):
        where = "engine config"
        if self.attention not in ATTENTION_KINDS:
            raise ConfigError(f"{where}: attention must be one of {', '.join(ATTENTION_KINDS)}, got "
                              f"{self.attention!r}")
        if self.gemv not in GEMV_KINDS:
            raise ConfigError(f"{where}: gemv must be one of {', '.join(GEMV_KINDS)}, got {self.gemv!r}")
        if self.gemm not in GEMM_KINDS:
            raise ConfigError(f"{where}: gemm must be one of {', '.join(GEMM_KINDS)}, got {self.gemm!r}")
        if not isinstance(self.speculator, str):
            raise ConfigError(f"{where}: speculator must be a name (\"eagle3\", \"ngram\"), got {self.speculator!r}")
        if not isinstance(self.batch_invariant, bool):
            raise ConfigError(f"{where}: batch_invariant must be True or False, got {self.batch_invariant!r}")
        for name in ("batch_buckets", "prefill_buckets", "prefill_batch_buckets"):
            buckets = getattr(self, name)
            if name == "batch_buckets" and buckets is None:
                continue
            if not buckets or sorted(set(buckets)) != list(buckets) or buckets[0] < 1:
                raise ConfigError(f"{where}: {name} must be increasing positive sizes, got {buckets}")
        if self.tree not in (None, "auto"):
            if not isinstance(self.tree, TreeSpec):
                raise ConfigError(f'{where}: tree must be a TreeSpec(steps, top_k, tokens), "auto" or None, got '
                                  f"{self.tree!r}")
            check_tree(self.tree, self.fused_iteration)
        if not 0 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise ConfigError(f"{where}: num_speculative_tokens must be in 0..16, got "
                              f"{self.num_speculative_tokens}")
        for name in ("page_size", "max_model_len"):
            _positive(getattr(self, name), name, where)
        if self.speculation not in SPECULATION_MODES:
            raise ConfigError(f"{where}: speculation must be one of {', '.join(SPECULATION_MODES)}, got "
                              f"{self.speculation!r}")
        if self.step_costs is not None:
            # A tuple of tuples, so the config stays hashable whatever sequence it was given as. With
            # step_costs, "auto" drafts no tree (`default_tree`).
            specs = proposal_specs(None if self.tree == "auto" else self.tree, self.num_speculative_tokens,
                                   self.speculation)
            object.__setattr__(self, "step_costs", checked_step_costs(self.step_costs, specs))
        fraction = self.kv_memory_fraction
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction < 1:
            raise ConfigError(f"{where}: kv_memory_fraction must be in (0, 1), got {self.kv_memory_fraction!r}")
        if self.page_reservation not in PAGE_RESERVATIONS:
            raise ConfigError(f"{where}: page_reservation must be one of {', '.join(PAGE_RESERVATIONS)}, got "
                              f"{self.page_reservation!r}")
        if not isinstance(self.prefix_caching, bool):
            raise ConfigError(f"{where}: prefix_caching must be True or False, got {self.prefix_caching!r}")
        if self.num_pages is not None and self.num_pages < 2:
            raise ConfigError(f"{where}: num_pages must be >= 2 (page 0 is scratch), got {self.num_pages}")
        if self.batch_buckets_up_to is not None:
            _positive(self.batch_buckets_up_to, "batch_buckets_up_to", where)
        # Default buckets end where `served_config` finds (a tree's may end one row below a chain's):
        # the chain's bound here, the exact one there.
        largest = (self.batch_buckets or default_batch_buckets((TreeSpec.chain(1),), self.batch_buckets_up_to))[-1]
        check_max_num_seqs(self.max_num_seqs, largest)

    def _given_tree(self) -> TreeSpec | None:
        if self.tree == "auto":
            raise ConfigError('engine config: tree "auto" is settled once the drafter and the device are known: '
                              "read it from the served config (runner/served.py)")
        return self.tree

    @property
    def speculative_proposals(self) -> tuple[TreeSpec, ...]:
        """What a bucket may draft, the engine's proposal first (`proposal_specs`)."""
        return proposal_specs(self._given_tree(), self.num_speculative_tokens, self.speculation)

    @property
    def max_proposals(self) -> int:
        return max((p.steps for p in self.speculative_proposals), default=0)

    @property
    def max_blocks_per_seq(self) -> int:
        return blocks_per_seq(self.max_model_len, self.page_size, self._given_tree())


def check_tree(tree: TreeSpec, fused_iteration: bool) -> None:
    """ConfigError unless `tree` can be drafted: at most MAX_SPECULATIVE_TOKENS deep, in fused iterations."""
    where = "engine config"
    if tree.steps > MAX_SPECULATIVE_TOKENS:
        raise ConfigError(f"{where}: tree.steps must be in 1..{MAX_SPECULATIVE_TOKENS}, got {tree.steps}")
    if not fused_iteration and not tree.is_chain:
        raise ConfigError(f"{where}: fused_iteration=False does not run a tree ({tree} runs as fused iterations "
                          "only): use fused_iteration=True, or a chain")


def checked_step_costs(step_costs, specs: tuple[TreeSpec, ...]) -> tuple[tuple[float, ...], ...]:
    """`step_costs` as a tuple of tuples, checked against the proposals they time."""
    where = "engine config"
    width = 2 + len(specs)
    costs = tuple(tuple(c) for c in step_costs)
    if wrong := [c for c in costs if len(c) != width]:
        names = ", ".join(p.label for p in specs)
        raise ConfigError(f"{where}: step_costs entries are (bucket, target-only seconds, then seconds of "
                          f"{names}): {width} numbers, got {wrong[0]}")
    bad = [c for c in costs if not all(t > 0 for t in c[1:])]
    if bad:
        raise ConfigError(f"{where}: step_costs must be positive seconds, got {bad[0]}")
    if len({c[0] for c in costs}) != len(costs):
        raise ConfigError(f"{where}: step_costs lists a bucket twice: {costs}")
    return costs


def check_max_num_seqs(max_num_seqs: int | None, largest: int) -> None:
    """ConfigError unless the largest batch bucket runs `max_num_seqs` (None: it) requests at once."""
    if max_num_seqs is not None and not 1 <= max_num_seqs <= largest:
        raise ConfigError(f"engine config: max_num_seqs must be in 1..{largest} (the largest batch bucket runs them "
                          f"all), got {max_num_seqs}; add a larger bucket to batch_buckets for more")


# A GPU engine's tree beside its chain unless told otherwise (`default_tree`): the fastest proposal
# at small batches (BENCHMARKS.md, "Trees end to end"), for about a third more warm-up ("Start-up").
DEFAULT_TREE = TreeSpec(6, 8, 31)


def parse_tree_spec(text: str) -> TreeSpec:
    """"6,8,31" -> TreeSpec(steps=6, top_k=8, tokens=31); ConfigError naming what is wrong."""
    try:
        steps, top_k, tokens = (int(part) for part in text.split(","))
    except ValueError:
        raise ConfigError(f"{text!r} is not STEPS,TOPK,TOKENS (three integers, e.g. 6,8,31)") from None
    if not 1 <= steps <= MAX_SPECULATIVE_TOKENS:
        raise ConfigError(f"steps {steps} is outside 1..{MAX_SPECULATIVE_TOKENS}")
    return TreeSpec(steps, top_k, tokens)


def parse_tree(value: TreeSpec | str | None) -> TreeSpec | str | None:
    """A tree as `LLM(tree=...)` and `--tree` take it: a TreeSpec or "STEPS,TOPK,TOKENS" (that
    tree), "auto" (returned as is: `default_tree` decides once the drafter is known), None or
    "none" (None: no tree, the chain only). ConfigError for anything else."""
    if value is None or isinstance(value, TreeSpec):
        return value
    if not isinstance(value, str) or ("," not in value and value.strip() not in ("auto", "none")):
        raise ConfigError(f'tree must be a TreeSpec, "STEPS,TOPK,TOKENS" (e.g. "6,8,31"), "auto", "none" or None, '
                          f"got {value!r}")
    text = value.strip()
    if text in ("auto", "none"):
        return None if text == "none" else text
    return parse_tree_spec(text)


def default_tree(engine_config: EngineConfig, drafting: bool, backend: str) -> TreeSpec | None:
    """The tree for `tree="auto"`: engine_config's own, else DEFAULT_TREE where it can only help: a
    drafter with K > 0 under "auto" (which runs the tree only where it is faster) on an accelerator.
    Not on the CPU (a tree's programs compile slowest there), under "always" (the chain everywhere)
    or with `step_costs` (whose entries do not name the tree)."""
    if isinstance(engine_config.tree, TreeSpec):
        return engine_config.tree
    wanted = (drafting and engine_config.num_speculative_tokens > 0 and engine_config.speculation == "auto"
              and engine_config.step_costs is None and backend != "cpu")
    return DEFAULT_TREE if wanted else None


# ---- the engine configuration as served ---------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class SpeculationConfig:
    """What iterations draft, settled: EngineConfig's speculation fields with "auto" trees chosen,
    a chain-shaped tree as the chain of its steps, and the speculators built."""

    speculator: str  # the name in runner/speculators' SPECULATORS
    num_speculative_tokens: int  # K, the chain's proposals
    tree: TreeSpec | None  # the tree drafted beside (or instead of) the chain
    proposals: tuple[Proposal, ...]  # what an iteration may draft, the engine's own first (none: the target alone)
    mode: str  # EngineConfig.speculation: "auto" or "always"
    speculative_max_batch: int | None
    step_costs: tuple[tuple[float, ...], ...] | None
    fused_iteration: bool

    @property
    def facts(self) -> tuple[SpeculatorFacts, ...]:
        return tuple(p.facts for p in self.proposals)

    @property
    def max_accepted(self) -> int:
        """The most proposals one iteration accepts, over the proposals."""
        return max((f.max_accepted for f in self.facts), default=0)

    @property
    def positions_per_iteration(self) -> int:
        """KV positions past a row's length the widest iteration writes (the target alone: 1)."""
        return max((f.positions_per_iteration for f in self.facts), default=1)


@dataclasses.dataclass(frozen=True)
class PoolConfig:
    """The paged KV pool of target and drafter, sized (page 0 is scratch)."""

    page_size: int
    num_pages: int
    max_blocks_per_seq: int  # a block table's pages (`blocks_per_seq`)
    page_reservation: str
    prefix_caching: bool
    kv_memory_fraction: float


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """How the step functions compute, settled for the device: attention "pallas" or "xla"."""

    attention: str
    gemv: str
    gemm: str
    batch_invariant: bool


@dataclasses.dataclass(frozen=True)
class ServedConfig:
    """The engine configuration as served: an EngineConfig with everything it leaves open settled
    for the target, the drafter and the device (runner/served.py's `served_config`, once per engine,
    before the runner is built). The engine, its scheduler and speculation bookkeeping, the runner
    and its step configs all read this one object; hashable."""

    max_model_len: int
    max_num_seqs: int
    batch_buckets: tuple[int, ...]
    prefill_buckets: tuple[int, ...]
    prefill_batch_buckets: tuple[int, ...]
    freeze_heap: bool
    speculation: SpeculationConfig
    pool: PoolConfig
    kernels: KernelConfig
    structured_warmup: bool = False
