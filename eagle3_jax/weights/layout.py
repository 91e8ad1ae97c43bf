"""Our parameter fields <-> the public (Hugging Face) tensors, for the target and the drafter.

On disk each projection is a Linear weight [out, in]; in memory [in, out] (`x @ w`), with q/k/v
and gate/up fused (model/layers.py). A `Field` names a parameter, its public tensors and the two
conversions, all exact: save -> load gives identical tensors.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from eagle3_jax.weights.tensors import take

Shape = tuple[int, ...]


@dataclass(frozen=True)
class Field:
    """One parameter field built from one or more public tensors."""

    name: str  # our field
    public: tuple[str, ...]  # public tensor names (after a caller's prefix), in `join`'s order
    shapes: Callable[[Any], tuple[Shape, ...]]  # config -> their stored shapes
    join: Callable[..., np.ndarray]  # (config, *public arrays) -> our array
    part: Callable[[np.ndarray], tuple[np.ndarray, ...]]  # our array -> public arrays


def fuse_qkv(q: np.ndarray, k: np.ndarray, v: np.ndarray, kv_heads: int) -> np.ndarray:
    """Public q_proj [G*R*hd, D], k_proj, v_proj [G*hd, D] -> wqkv [D, G, R + 2, hd] (HF's q head
    j reads kv head j // R, so q's rows split as [G, R, hd])."""
    d, hd = q.shape[1], k.shape[0] // kv_heads

    def grouped(w):  # [n*hd, D] -> [D, G, n / G, hd]
        return w.T.reshape(d, kv_heads, -1, hd)

    return np.concatenate([grouped(q), grouped(k), grouped(v)], axis=2)


def split_qkv(wqkv: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """wqkv [D, G, R + 2, hd] -> public (q_proj [G*R*hd, D], k_proj [G*hd, D], v_proj [G*hd, D])."""
    d, r = wqkv.shape[0], wqkv.shape[2] - 2
    return tuple(w.reshape(d, -1).T for w in (wqkv[:, :, :r], wqkv[:, :, r], wqkv[:, :, r + 1]))


def fuse_gate_up(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """Public gate_proj, up_proj [I, D] -> w_gate_up [D, 2, I]."""
    return np.stack([gate.T, up.T], axis=1)


def split_gate_up(w_gate_up: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """w_gate_up [D, 2, I] -> public (gate_proj, up_proj) [I, D]."""
    return w_gate_up[:, 0].T, w_gate_up[:, 1].T


def stored(name: str, public: str, shape: Callable[[Any], Shape]) -> Field:
    """A tensor kept as it is stored (norms, embeddings)."""
    return Field(name, (public,), lambda c: (shape(c),), lambda c, x: x, lambda x: (x,))


def linear(name: str, public: str, shape: Callable[[Any], Shape]) -> Field:
    """A Linear weight, stored [out, in] (`shape`), ours [in, out]."""
    return Field(name, (public,), lambda c: (shape(c),), lambda c, w: w.T, lambda w: (w.T,))


def qkv(name: str, prefix: str, d_in: Callable[[Any], int]) -> Field:
    """wqkv from `{prefix}q_proj.weight`, `k_proj`, `v_proj` reading d_in(config) features."""
    return Field(name, tuple(f"{prefix}{p}_proj.weight" for p in "qkv"),
                 lambda c: ((c.q_size, d_in(c)), (c.kv_size, d_in(c)), (c.kv_size, d_in(c))),
                 lambda c, q, k, v: fuse_qkv(q, k, v, c.num_kv_heads), split_qkv)


def gate_up(name: str, prefix: str) -> Field:
    """w_gate_up from `{prefix}gate_proj.weight` and `{prefix}up_proj.weight` [I, hidden]."""
    return Field(name, (f"{prefix}gate_proj.weight", f"{prefix}up_proj.weight"),
                 lambda c: ((c.intermediate_size, c.hidden_size),) * 2,
                 lambda c, g, u: fuse_gate_up(g, u), split_gate_up)


def public_shapes(fields: Sequence[Field], cfg: Any, prefix: str = "") -> dict[str, Shape]:
    """Public name -> stored shape of every tensor the fields are made of."""
    return {prefix + n: s for f in fields for n, s in zip(f.public, f.shapes(cfg), strict=True)}


def read_fields(fields: Sequence[Field], tensors: Mapping[str, np.ndarray], cfg: Any, where: str,
                prefix: str = "") -> Iterator[tuple[str, np.ndarray]]:
    """(field, our host array) per field, each public tensor checked against its shape first.
    One field at a time, so a large checkpoint never sits whole in host memory."""
    for f in fields:
        parts = [np.asarray(take(tensors, prefix + n, s, where))
                 for n, s in zip(f.public, f.shapes(cfg), strict=True)]
        yield f.name, f.join(cfg, *parts)


def public_tensors(fields: Sequence[Field], params: Any, prefix: str = "",
                   convert: Callable[[Any], np.ndarray] = np.asarray) -> dict[str, np.ndarray]:
    """Public name -> tensor of each field of `params` (`convert` turns a field into numpy)."""
    return {prefix + n: x for f in fields
            for n, x in zip(f.public, f.part(convert(getattr(params, f.name))), strict=True)}
