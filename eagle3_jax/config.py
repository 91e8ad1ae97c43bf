"""Static, hashable configurations.

Every config here is a frozen dataclass, so it can be a `static_argnames` argument of a jitted
function: two equal configs hit the same compiled executable.

Capture convention (stated once, used everywhere): `capture_layer_ids` are indices of target
layers whose INPUT residual stream is captured for the drafter, before that layer runs. The EAGLE
reference code and vLLM use this convention (default 2, L//2, L-3); TensorRT-LLM names the same
tensors as the OUTPUT of layers 1, L//2-1, L-4, and SGLang adds 1 to config-provided ids.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any


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
        raise ConfigError(f"{where}: field '{name}' must be {kind}, got {value!r}")
    return value


def _positive(value: int, name: str, where: str) -> int:
    if value <= 0:
        raise ConfigError(f"{where}: field '{name}' must be positive, got {value}")
    return value


def parse_rope(d: dict, where: str) -> tuple[float, Llama3RopeScaling | None]:
    """(rope_theta, llama3 scaling or None) from a transformers-4 or transformers-5 config."""
    # transformers 5 moved theta and scaling into `rope_parameters`; transformers 4 has
    # `rope_theta` plus an optional `rope_scaling` dict.
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
    """The decoder layer's fields a target's and a drafter's config.json share, as the configs'
    keyword arguments: widths, heads, norm epsilon, RoPE and its range."""
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
    """An EAGLE-3 draft head (one Llama decoder layer over [embedding, hidden]).

    `target_hidden_size` is the width of each captured target hidden state: the 70B drafters
    have hidden_size < target_hidden_size and ship their own embedding.
    """

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
        eagle = d.get("eagle_config") or {}
        aux = eagle.get("eagle_aux_hidden_state_layer_ids")
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
        """A drafter whose midlayer has the target's layer shapes (as the public 8B drafter has),
        reading the target's captures; `overrides` replace any field."""
        fields = dict(vocab_size=target.vocab_size, draft_vocab_size=min(draft_vocab_size, target.vocab_size),
                      hidden_size=target.hidden_size, intermediate_size=target.intermediate_size,
                      num_heads=target.num_heads, num_kv_heads=target.num_kv_heads, head_dim=target.head_dim,
                      rms_norm_eps=target.rms_norm_eps, rope_theta=target.rope_theta,
                      rope_scaling=target.rope_scaling, max_position_embeddings=target.max_position_embeddings,
                      target_hidden_size=target.hidden_size, num_captures=len(target.capture_layer_ids))
        return cls(**{**fields, **overrides})

    def to_hf(self, has_own_embedding: bool = False) -> dict:
        """The public EAGLE-3 config.json layout (loads in other EAGLE-3 engines).

        `has_own_embedding`: whether the drafter's file stores `embed_tokens.weight`. The EAGLE
        reference reads the mere presence of `target_hidden_size` as "this drafter brings its own
        embedding" (and then skips loading the target's), so the key is written only when it
        differs from `hidden_size` or an embedding is stored; `from_hf` defaults it to hidden_size.
        """
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
    """Raise ConfigError naming the mismatch when a drafter cannot serve this target."""
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
    """Raise ConfigError when a drafter cannot draft this proposal: each expanded node takes the
    top_k most likely tokens of the draft vocabulary, so it must hold at least top_k."""
    if spec.top_k > draft.draft_vocab_size:
        raise ConfigError(f"{spec.label}: top_k {spec.top_k} exceeds the drafter's draft vocabulary of "
                          f"{draft.draft_vocab_size} tokens")


def read_json(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"config not found: {path}")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON ({e})") from None


MAX_SPECULATIVE_TOKENS = 16
SPECULATION_MODES = ("auto", "always")  # EngineConfig.speculation
ATTENTION_KINDS = ("auto", "xla", "pallas")  # EngineConfig.attention
GEMV_KINDS = ("xla", "mosaic")  # EngineConfig.gemv
GEMM_KINDS = ("auto", "triton", "cublas")  # EngineConfig.gemm
PAGE_RESERVATIONS = ("on_demand", "whole")  # EngineConfig.page_reservation


@dataclasses.dataclass(frozen=True)
class TreeSpec:
    """The static shape of an EAGLE-2 dynamic draft tree (runner/tree.py builds and verifies it).

    steps: draft forwards per tree, and its depth: the most proposals one iteration can accept.
    top_k: children per expanded node, and beams kept per level.
    tokens: nodes the target verifies besides the root (the row's last token), chosen as the
        best-scoring of the top_k + (steps - 1) top_k^2 candidates: the verify is tokens + 1 wide.
    A chain of K proposals is TreeSpec(K, 1, K) (`chain`)."""

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
        """TreeSpec(K, 1, K): served as the chain of K proposals."""
        return self.top_k == 1 and self.tokens == self.steps

    @property
    def label(self) -> str:
        """How tables and logs name the proposal: "chain K=4", "tree 5,4,15"."""
        return f"chain K={self.steps}" if self.is_chain else f"tree {self.steps},{self.top_k},{self.tokens}"

    @property
    def candidates(self) -> int:
        """N: level 1's k, then k^2 at each of the steps - 1 further levels."""
        return self.top_k + (self.steps - 1) * self.top_k ** 2

    @property
    def verify_width(self) -> int:
        """Tokens per row in the target's verify: the root and the nodes."""
        return self.tokens + 1

    @property
    def max_depth(self) -> int:
        """The deepest level's depth, and the most proposals a row can accept."""
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


def default_batch_buckets(proposals: Sequence[TreeSpec]) -> tuple[int, ...]:
    """The batch buckets of an engine given none (EngineConfig.batch_buckets None), by what it
    drafts: from 2 rows up when chains only, from 1 row up for a tree or the target alone. On the
    H200 a lone SmolLM2 request's chain iteration cost more at one row than padded to two (1.15
    against 1.09 ms on the device), its tree iteration less (1.22 against 1.30) and its decode
    less (0.95 against 1.00; BENCHMARKS.md, "Host overhead")."""
    chains_only = bool(proposals) and all(p.is_chain for p in proposals)
    return (() if chains_only else (1,)) + BATCH_BUCKETS


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Shapes of the compiled step functions and of the KV pool.

    batch_buckets: decode batch sizes compiled; a running set of n requests runs in the smallest
        bucket >= n, its padded rows pointing at the dummy slot 0. None: the engine takes
        `default_batch_buckets` for what it drafts, up to 64 rows: from 2 for chains only (one
        request runs padded to two rows, where the chain's iteration is the cheaper), from 1 for a
        tree or the target alone.
    max_num_seqs: the most requests running at once (the slots), at most the largest batch
        bucket; None: the largest batch bucket.
    prefill_buckets: prompt chunk lengths compiled; longer prompts are prefilled in chunks of the
        largest bucket.
    prefill_batch_buckets: prompts per prefill call compiled (each with every chunk bucket). The
        requests admitted in one step are prefilled together, those whose last chunk falls in the
        same chunk bucket sharing a call, up to the largest bucket per call; a call of fewer pads
        to the smallest bucket that holds them. With (1,) every prompt is a call of its own: on the
        H200 a burst of 32 SmolLM2 requests then waited 86 ms for its first tokens, against 49 ms
        in 5 calls with (1, 8) (BENCHMARKS.md, "Serving with arrivals").
    num_speculative_tokens: K, the proposals of the chain (0 = the target alone).
    speculator: what drafts the proposals. "eagle3": the EAGLE-3 drafter (a chain of K, or the
        tree below); "ngram": prompt lookup, K tokens copied from what followed the latest earlier
        occurrence of the row's last 1 to 4 tokens, no drafter (runner/speculators/ngram.py).
    tree: None drafts the chain of K. A TreeSpec(steps, top_k, tokens) drafts EAGLE-2's dynamic
        tree: the target verifies `tokens` nodes in one forward and a row accepts up to `steps` of
        them. It is the engine's proposal ("always" runs it at every bucket), and "auto" chooses
        per bucket among the tree, the chain of K (when K > 0) and the target alone
        (`speculative_proposals`). TreeSpec(K, 1, K) is the chain of K: it stands for
        num_speculative_tokens K and runs the chain's programs (the `resolved` config says so).
        Trees run as fused iterations only (fused_iteration True).
    speculation: "auto" chooses per bucket, and per iteration, what emits tokens fastest there:
        the target alone or one of `speculative_proposals`, from the measured cost of each
        iteration at the bucket (timed in warm-up, or `step_costs`) and each proposal's
        acceptance length measured while serving (engine/policy.py has the rule); warm-up then
        compiles every candidate at every bucket, so switching never compiles. "always" runs the
        engine's proposal (the tree, else the chain) at every bucket (up to
        `speculative_max_batch`): for measuring a drafter. A seeded request gives the same tokens
        either way (SamplingParams.draft_acceptance "coupled", its default).
    speculative_max_batch: batch buckets larger than this run the target alone, in either mode:
        a manual cap. None caps nothing.
    step_costs: (bucket, target-only seconds, then seconds of each speculative proposal in the
        order of `speculative_proposals`) per batch bucket, e.g. from `eagle3-jax bench`, for
        "auto"; buckets it lacks are timed in warm-up, entries for other batch sizes are
        ignored. None times every bucket. Kept as tuples, so the config stays hashable.
    fused_iteration: one program per iteration (True), or the driver dispatching the verify and
        each draft step as programs of their own, threading the draft's hidden state (False; a
        chain only).
    page_size, num_pages: the paged KV pool (page 0 is scratch; num_pages - 1 are allocatable),
        for the target's and the drafter's KV. num_pages None sizes it from memory: after the
        weights are placed, `kv_memory_fraction` of the device's free memory (per device under
        tensor parallelism); on a device that reports none (the CPU), every slot at
        min(max_model_len, 1024) tokens plus one request at max_model_len (`resolved`).
        Requests that do not fit wait; only one the whole pool cannot hold is refused.
    kv_memory_fraction: the share of the free device memory the pool takes when num_pages is
        None; the rest is the programs' working memory. Sized before warm-up, since every
        program is compiled for the pool's shape.
    page_reservation: "on_demand": a running request holds the pages its tokens fill and those
        the iterations in flight can write, taken before each iteration; when the pool runs short
        the most recently admitted request is preempted (its pages given back, itself queued
        first, and readmitted it prefills what the prefix cache lacks of its tokens). "whole":
        every page a request can need (prompt + max_tokens) is taken at admission, so nothing
        is preempted and far fewer requests run at once.
    prefix_caching: full pages stay cached by content (engine/pages.py) when their requests let
        them go, and a request admitted later reuses the longest cached prefix of its tokens,
        prefilling only the rest; least recently used ones are evicted when no page is free.
    max_model_len: longest prompt + output a request may have.
    attention: paged attention of decode, verify and draft steps. "pallas": one Pallas kernel per
        layer that reads only the pages a row has filled (model/pallas_attention.py; interpreted,
        and slow, off the GPU), and the target's residual adds each fused with the RMSNorm after
        it (model/pallas_norm.py), and a tree level's top-k with its logsumexp in two kernels
        (model/pallas_top_k.py); "xla": the XLA forms, attention over the whole block table;
        "auto": pallas on a GPU without tensor parallelism, else xla. Prefill chunks of more than
        a few tokens use the XLA attention either way.
    gemv: the weight projections of decode, verify and draft steps of up to 64 rows. "xla": XLA's
        dots. "mosaic": a Pallas Mosaic GPU kernel per projection (model/mosaic_gemv.py), on one
        Hopper GPU; on the H200 it made every Llama-3.1-8B step 4-5% slower than XLA's dots
        (BENCHMARKS.md, "Tried and rejected"), so it is not the default: it is the start of
        projections that take in the kernels around them. Prefills and larger steps use XLA's dots
        either way.
    gemm: how XLA builds the matrix products of a fused iteration program on a GPU. "triton": its
        Triton GEMM fusions (XLA's default), which at SmolLM2's width split K and add a reduction
        kernel after each projection, three a layer. "cublas": cuBLAS's GEMMs (the program compiled
        with xla_gpu_enable_triton_gemm off). "auto": cuBLAS for a program whose verify holds
        `steps.CUBLAS_MIN_ROWS` to `steps.CUBLAS_MAX_ROWS` rows (bucket x tokens verified a row) of a
        target no wider than `steps.CUBLAS_MAX_HIDDEN`, Triton elsewhere. On the H200, SmolLM2's
        (576 wide) iterations and verifies of 64 to 512 rows ran up to 17% faster on cuBLAS, those
        of fewer up to 28% slower and those of 2,048 up to 20% slower; Llama-3.1-8B's (4096) moved
        within 3.5% either way at 64 to 512 rows and lost up to 31% below (BENCHMARKS.md, "GEMMs:
        Triton or cuBLAS"); widths between are unmeasured. Prefills and the per-step path
        (fused_iteration False) compile as XLA does by default; other backends ignore the option.
    batch_invariant: the target's every op computes a token's row in an order that does not
        depend on the rows beside it, the batch bucket, the program (prefill chunk, decode, chain
        or tree verify) or the tokens per row: matrix products in one fixed tile schedule
        (model/invariant_gemm.py), attention walking each token's keys in fixed position blocks
        (model/invariant_attention.py), the residual add and norm a program per row. A token's
        logits are then the same bit for bit in a decode, a verify and a prefill, alone or in a
        batch, so greedy speculation is token-identical to the target alone in bf16 too; without it
        a bf16 near-tie can round differently in another batch shape. Checked on the CPU, where the
        kernels run in Pallas' interpreter over the same fixed blocks (tests/test_batch_invariant.py);
        on a GPU they compile to Triton, and `scripts/invariance_h200.py` checks the equality and
        times the cost there, not yet run. The drafter keeps `attention` and `gemv` (its numerics
        change only what is accepted). Under tensor parallelism the target runs per device, its
        row-parallel sums added in rank order (tests/test_parallel.py, on 8 CPU devices).
    freeze_heap: after warm-up, collect Python's garbage once and freeze the heap (`gc.freeze`,
        engine.freeze_heap), so that no full pass of the cyclic collector over the loaded
        engine's objects stalls serving. False leaves the collector alone (a test suite
        that builds many engines skips the pass, 0.4 s or more each on a CPU machine).

    Every field keeps the value it is given; what follows from them is a property, or is filled in
    by `resolved()`, the copy the engine serves.
    """

    batch_buckets: tuple[int, ...] | None = None
    max_num_seqs: int | None = None
    prefill_buckets: tuple[int, ...] = (32, 128, 512)
    prefill_batch_buckets: tuple[int, ...] = (1, 8)
    num_speculative_tokens: int = 3
    speculator: str = "eagle3"
    tree: TreeSpec | None = None
    speculation: str = "auto"
    speculative_max_batch: int | None = None
    step_costs: tuple[tuple[float, ...], ...] | None = None
    fused_iteration: bool = True
    page_size: int = 16
    num_pages: int | None = None
    max_model_len: int = 2048
    attention: str = "auto"
    gemv: str = "xla"
    gemm: str = "auto"
    freeze_heap: bool = True
    batch_invariant: bool = False
    kv_memory_fraction: float = 0.9
    page_reservation: str = "on_demand"
    prefix_caching: bool = True

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
            if name == "batch_buckets" and buckets is None:  # the engine's default, by what it drafts
                continue
            if not buckets or sorted(set(buckets)) != list(buckets) or buckets[0] < 1:
                raise ConfigError(f"{where}: {name} must be increasing positive sizes, got {buckets}")
        if self.tree is not None:
            if not isinstance(self.tree, TreeSpec):
                raise ConfigError(f"{where}: tree must be a TreeSpec(steps, top_k, tokens) or None, got "
                                  f"{self.tree!r}")
            if self.tree.steps > MAX_SPECULATIVE_TOKENS:
                raise ConfigError(f"{where}: tree.steps must be in 1..{MAX_SPECULATIVE_TOKENS}, got "
                                  f"{self.tree.steps}")
            if not self.fused_iteration and not self.tree.is_chain:
                raise ConfigError(f"{where}: fused_iteration=False does not run a tree ({self.tree} runs as "
                                  "fused iterations only): use fused_iteration=True, or a chain")
        if not 0 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise ConfigError(f"{where}: num_speculative_tokens must be in 0..16, got "
                              f"{self.num_speculative_tokens}")
        for name in ("page_size", "max_model_len"):
            _positive(getattr(self, name), name, where)
        if self.speculation not in SPECULATION_MODES:
            raise ConfigError(f"{where}: speculation must be one of {', '.join(SPECULATION_MODES)}, got "
                              f"{self.speculation!r}")
        if self.step_costs is not None:
            # A tuple of tuples, so the config stays hashable whatever sequence it was given as.
            width = 2 + len(self.speculative_proposals)
            costs = tuple(tuple(c) for c in self.step_costs)
            if wrong := [c for c in costs if len(c) != width]:
                names = ", ".join(p.label for p in self.speculative_proposals)
                raise ConfigError(f"{where}: step_costs entries are (bucket, target-only seconds, then seconds of "
                                  f"{names}): {width} numbers, got {wrong[0]}")
            bad = [c for c in costs if not all(t > 0 for t in c[1:])]
            if bad:
                raise ConfigError(f"{where}: step_costs must be positive seconds, got {bad[0]}")
            if len({c[0] for c in costs}) != len(costs):
                raise ConfigError(f"{where}: step_costs lists a bucket twice: {costs}")
            object.__setattr__(self, "step_costs", costs)
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
        largest = (self.batch_buckets or BATCH_BUCKETS)[-1]
        if self.max_num_seqs is not None and not 1 <= self.max_num_seqs <= largest:
            raise ConfigError(f"{where}: max_num_seqs must be in 1..{largest} (the largest batch bucket runs them "
                              f"all), got {self.max_num_seqs}; add a larger bucket to batch_buckets for more")

    def resolved(self) -> EngineConfig:
        """The config as the engine serves it (the engine makes it once): a chain-shaped tree as
        the chain of its steps (tree None, num_speculative_tokens its steps), max_num_seqs and
        num_pages filled in. A resolved config resolves to itself."""
        tree, k = self._drafted
        seqs = self.max_num_seqs or (self.batch_buckets or BATCH_BUCKETS)[-1]
        served = dataclasses.replace(self, tree=tree, num_speculative_tokens=k, max_num_seqs=seqs)
        if served.num_pages is not None:
            return served
        typical = -(-min(self.max_model_len, 1024) // self.page_size)
        return dataclasses.replace(served, num_pages=seqs * typical + served.max_blocks_per_seq + 1)

    @property
    def _drafted(self) -> tuple[TreeSpec | None, int]:
        """(the tree drafted, the chain's K): a chain-shaped tree is the chain of its steps."""
        if self.tree is not None and self.tree.is_chain:
            return None, self.tree.steps
        return self.tree, self.num_speculative_tokens

    @property
    def speculative_proposals(self) -> tuple[TreeSpec, ...]:
        """What a bucket may draft with a drafter, the engine's proposal first (a chain as
        TreeSpec.chain(K)): the tree, and in "auto" the chain of K beside it; else the chain of K
        (none when K is 0). "auto" also has the target alone."""
        tree, k = self._drafted
        chain = (TreeSpec.chain(k),) if k else ()
        if tree is None:
            return chain
        return (tree, *chain) if self.speculation == "auto" else (tree,)

    @property
    def max_proposals(self) -> int:
        """The most proposals one iteration can accept, over `speculative_proposals` (0: none)."""
        return max((p.steps for p in self.speculative_proposals), default=0)

    @property
    def max_blocks_per_seq(self) -> int:
        # Room for the committed tokens plus two iterations in flight (overlap) of up to K + 1
        # each, for the largest K, so the pool's size does not depend on K (a tree may write
        # further: TreeSpec.positions_per_iteration); a multiple of 4 pages, so the attention
        # kernel reads the table 4 pages at a time without running past it.
        tree = self._drafted[0]
        per_iteration = max(MAX_SPECULATIVE_TOKENS + 1, tree.positions_per_iteration if tree else 0)
        pages = -(-(self.max_model_len + 2 * per_iteration) // self.page_size)
        return -(-pages // 4) * 4


# The tree an engine on a GPU drafts beside its chain unless told otherwise (`default_tree`): the
# fastest proposal at batch 1 on the H200, 1.20-1.43x the best chain end to end, and 1.21x at 8
# rows; at 64 the chain is the faster, and "auto" runs it there (BENCHMARKS.md, "Trees end to
# end"). Its programs add about a third to a GPU engine's warm-up ("Start-up").
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
    """The tree an engine drafts when its user names none (`LLM(tree="auto")`, `generate --tree
    auto`): engine_config's own tree if it has one; else DEFAULT_TREE where it can only help,
    that is when a drafter is loaded with K > 0 under speculation "auto" (which runs the tree only
    at the buckets where it is the fastest, measured) on an accelerator; else none. Not on the CPU
    ("cpu" backend), which compiles each program on first use and where a tree's programs cost
    the most to compile; not under "always" (the user asked for the chain of K everywhere); not
    with a `step_costs` table (its entries name the engine's proposals, the tree not among them)."""
    if engine_config.tree is not None:
        return engine_config.tree
    wanted = (drafting and engine_config.num_speculative_tokens > 0 and engine_config.speculation == "auto"
              and engine_config.step_costs is None and backend != "cpu")
    return DEFAULT_TREE if wanted else None
