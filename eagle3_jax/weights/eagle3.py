"""EAGLE-3 drafter checkpoints in the public layout <-> DraftParams.

Layout (docs/EAGLE3.md, "Drafter checkpoints"): `config.json` plus `pytorch_model.bin` or
`model.safetensors` with `fc.weight`, `midlayer.*`, `norm.weight`, `lm_head.weight`, `d2t`, `t2d`
and, in the 70B layout, `embed_tokens.weight`. Other loaders' spellings (`layers.0.`,
`draft_id_to_target_id`) load too; we write the public names, fp16.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from eagle3_jax.config import DraftConfig, ModelConfig, check_draft_fits
from eagle3_jax.model.eagle3 import DraftParams
from eagle3_jax.weights import layout
from eagle3_jax.weights.tensors import CheckpointError, TensorFiles, check_names, take, write

# The public tensors, [out, in] as stored; q/k/v and gate/up fused on load (layout.py).
_FIELDS: tuple[layout.Field, ...] = (
    layout.linear("fc", "fc.weight", lambda c: (c.hidden_size, c.num_captures * c.target_hidden_size)),
    layout.stored("hidden_norm", "midlayer.hidden_norm.weight", lambda c: (c.hidden_size,)),
    layout.stored("input_norm", "midlayer.input_layernorm.weight", lambda c: (c.hidden_size,)),
    layout.qkv("wqkv", "midlayer.self_attn.", lambda c: 2 * c.hidden_size),
    layout.linear("wo", "midlayer.self_attn.o_proj.weight", lambda c: (c.hidden_size, c.q_size)),
    layout.stored("mlp_norm", "midlayer.post_attention_layernorm.weight", lambda c: (c.hidden_size,)),
    layout.gate_up("w_gate_up", "midlayer.mlp."),
    layout.linear("w_down", "midlayer.mlp.down_proj.weight", lambda c: (c.hidden_size, c.intermediate_size)),
    layout.stored("norm", "norm.weight", lambda c: (c.hidden_size,)),
    layout.linear("lm_head", "lm_head.weight", lambda c: (c.draft_vocab_size, c.hidden_size)),
)
EMBED = "embed_tokens.weight"
D2T, T2D = "d2t", "t2d"
_ALIASES = {"layers.0.": "midlayer.", "model.layers.0.": "midlayer.", "draft_id_to_target_id": D2T,
            "model.embed_tokens.weight": EMBED}


def canonical_name(name: str) -> str:
    for alias, public in _ALIASES.items():
        if name == alias or (alias.endswith(".") and name.startswith(alias)):
            return public + name[len(alias):]
    return name


class _PublicNames(Mapping[str, np.ndarray]):
    """A safetensors checkpoint under the public names, read lazily."""

    def __init__(self, files: TensorFiles):
        self._files = files
        self._stored = {canonical_name(k): k for k in files}

    def __getitem__(self, name: str) -> np.ndarray:
        return self._files[self._stored[name]]

    def __iter__(self):
        return iter(self._stored)

    def __len__(self) -> int:
        return len(self._stored)


def _import_torch(bin_path: Path, hint: str):
    try:
        import torch
    except ImportError:
        raise CheckpointError(f"{bin_path} is a PyTorch pickle; reading it needs torch: pip install torch "
                              f"(a CPU build is enough){hint}") from None
    return torch


def read_drafter_tensors(directory: Path) -> Mapping[str, np.ndarray]:
    """Tensors of a drafter directory, .safetensors preferred, else pytorch_model.bin (needs torch)."""
    if any(directory.glob("*.safetensors")):
        return _PublicNames(TensorFiles(directory))
    bin_path = directory / "pytorch_model.bin"
    if not bin_path.is_file():
        raise CheckpointError(f"{directory}: no model.safetensors or pytorch_model.bin")
    torch = _import_torch(bin_path, ", or convert it once with `eagle3-jax convert-draft` on a machine that has torch")
    try:
        state = torch.load(bin_path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 (unpickling raises errors of any kind on a damaged file)
        raise CheckpointError(f"{bin_path}: unreadable PyTorch checkpoint ({e})") from None
    return {canonical_name(k): v.float().numpy() if v.is_floating_point() else v.numpy()
            for k, v in state.items()}


def draft_params_from_tensors(tensors: Mapping[str, np.ndarray], cfg: DraftConfig, dtype=jnp.bfloat16,
                              where: str = "drafter") -> DraftParams:
    found = set(tensors) - {T2D}  # t2d is only used in training
    expected = set(layout.public_shapes(_FIELDS, cfg)) | {D2T}
    has_embed = EMBED in found
    check_names(found - {EMBED}, expected, where)
    fields = {name: jnp.asarray(x.astype(dtype)) for name, x in layout.read_fields(_FIELDS, tensors, cfg, where)}
    d2t = np.asarray(take(tensors, D2T, (cfg.draft_vocab_size,), where)).astype(np.int64)
    target_ids = np.arange(cfg.draft_vocab_size) + d2t
    bad = np.flatnonzero((target_ids < 0) | (target_ids >= cfg.vocab_size))
    if bad.size:
        raise CheckpointError(f"{where}: d2t maps draft id {bad[0]} to target id {target_ids[bad[0]]}, "
                              f"outside the vocabulary 0..{cfg.vocab_size - 1}")
    embed = None
    if has_embed:
        embed = jnp.asarray(np.asarray(take(tensors, EMBED, (cfg.vocab_size, cfg.hidden_size), where)).astype(dtype))
    return DraftParams(**fields, d2t=jnp.asarray(d2t, jnp.int32), embed=embed)


def load_drafter(directory: str | Path, target: ModelConfig | None = None,
                 dtype=jnp.bfloat16) -> tuple[DraftConfig, DraftParams]:
    """(config, params) of a drafter directory; with `target`, also check that it fits."""
    directory = Path(directory)
    cfg = DraftConfig.from_json(directory / "config.json")
    tensors = read_drafter_tensors(directory)
    if target is not None:  # the config's sizes first: they name the field, a tensor's shape would not
        check_draft_fits(target, cfg, has_own_embedding=EMBED in tensors)
    return cfg, draft_params_from_tensors(tensors, cfg, dtype, where=str(directory))


def drafter_tensors(params: DraftParams, cfg: DraftConfig, dtype=np.float16) -> dict[str, np.ndarray]:
    """The public tensor names and dtypes (fp16 weights, int64 d2t, bool t2d)."""
    out = layout.public_tensors(_FIELDS, params, convert=lambda x: np.asarray(x, np.float32).astype(dtype))
    d2t = np.asarray(params.d2t, np.int64)
    out[D2T] = d2t
    t2d = np.zeros(cfg.vocab_size, bool)
    t2d[np.arange(cfg.draft_vocab_size) + d2t] = True
    out[T2D] = t2d
    if params.embed is not None:
        out[EMBED] = np.asarray(params.embed, np.float32).astype(dtype)
    return out


def public_shapes(cfg: DraftConfig, own_embedding: bool = False) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor of the public layout, for `cfg` (t2d excluded: training only)."""
    shapes = layout.public_shapes(_FIELDS, cfg)
    shapes[D2T] = (cfg.draft_vocab_size,)
    if own_embedding:
        shapes[EMBED] = (cfg.vocab_size, cfg.hidden_size)
    return shapes


def save_drafter(params: DraftParams, cfg: DraftConfig, directory: str | Path) -> Path:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    write(drafter_tensors(params, cfg), directory / "model.safetensors")
    config = cfg.to_hf(has_own_embedding=params.embed is not None)
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return directory


def convert_bin_to_safetensors(directory: str | Path, out: str | Path | None = None) -> Path:
    """pytorch_model.bin -> model.safetensors with the same public names (needs torch)."""
    directory = Path(directory)
    out = Path(out) if out else directory
    bin_path = directory / "pytorch_model.bin"
    if not bin_path.is_file():
        raise CheckpointError(f"{directory}: no pytorch_model.bin to convert")
    if not (directory / "config.json").is_file():
        raise CheckpointError(f"{directory}: no config.json beside pytorch_model.bin")
    _import_torch(bin_path, "")  # before reading anything: the error would otherwise name this command
    tensors = read_drafter_tensors(directory)
    out.mkdir(parents=True, exist_ok=True)
    stored = {k: (v.astype(np.float16) if np.issubdtype(v.dtype, np.floating) else v) for k, v in tensors.items()}
    write(stored, out / "model.safetensors")
    if out != directory:
        (out / "config.json").write_text((directory / "config.json").read_text())
    return out
