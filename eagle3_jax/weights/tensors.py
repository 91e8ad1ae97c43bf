"""Reading and writing safetensors checkpoints (one file or sharded with an index).

Errors name the file and the tensor. Tensors are read one at a time, so a checkpoint never sits
whole in host memory.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from pathlib import Path

import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded; the message names the file or tensor."""


class TensorFiles(Mapping[str, np.ndarray]):
    """A lazy name -> array mapping over a checkpoint directory's safetensors files."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        self._file_of: dict[str, Path] = {}
        index = self.directory / INDEX_NAME
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as e:
                raise CheckpointError(f"{index}: unreadable index ({e})") from None
            files = sorted({self.directory / f for f in weight_map.values()})
        else:
            files = sorted(self.directory.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"no safetensors files in {self.directory}")
        for f in files:
            if not f.is_file():
                raise CheckpointError(f"{f}: listed in {INDEX_NAME} but missing")
            for name in _open(f).keys():  # noqa: SIM118 (a safe_open handle is not iterable)
                self._file_of[name] = f

    def __getitem__(self, name: str) -> np.ndarray:
        path = self._file_of[name]
        try:
            with safe_open(path, framework="numpy") as f:
                return f.get_tensor(name)
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"{path}: cannot read tensor '{name}' (corrupt file?): {e}") from None

    def shape(self, name: str) -> tuple[int, ...]:
        with safe_open(self._file_of[name], framework="numpy") as f:
            return tuple(f.get_slice(name).get_shape())

    def __iter__(self) -> Iterator[str]:
        return iter(self._file_of)

    def __len__(self) -> int:
        return len(self._file_of)


def _open(path: Path):
    try:
        # safe_open validates the header and that the data section covers every tensor, so a
        # truncated file fails here rather than as garbage weights later.
        handle = safe_open(path, framework="numpy")
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(f"{path}: not a valid safetensors file (truncated or corrupt?): {e}") from None
    return handle


def check_names(found: set[str], expected: set[str], where: str) -> None:
    missing, extra = sorted(expected - found), sorted(found - expected)
    if missing:
        raise CheckpointError(f"{where}: missing tensor(s) {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    if extra:
        raise CheckpointError(f"{where}: unexpected tensor(s) {extra[:5]}{' ...' if len(extra) > 5 else ''}")


def take(tensors: Mapping[str, np.ndarray], name: str, shape: tuple[int, ...], where: str) -> np.ndarray:
    """tensors[name], checked against the expected shape."""
    found = tensors.shape(name) if isinstance(tensors, TensorFiles) else tensors[name].shape
    if tuple(found) != tuple(shape):
        raise CheckpointError(f"{where}: tensor '{name}' has shape {tuple(found)}, expected {tuple(shape)}")
    return tensors[name]


def write(tensors: Mapping[str, np.ndarray], path: str | Path, metadata: dict | None = None) -> None:
    """Write a safetensors file readable by everyone (0644): safetensors writes a private
    temporary file (0600) and renames it into place."""
    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(path),
              metadata=metadata or {"format": "pt"})
    Path(path).chmod(0o644)
