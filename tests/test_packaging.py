"""A wheel install works without the source tree: the shipped drafter is inside the wheel, and
converted models and downloads go to the user's cache (its environment variables honoured), never
into the installed package."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from eagle3_jax import assets

REPO = Path(__file__).resolve().parents[1]
DRAFTER = REPO / "checkpoints" / "smollm2-135m-eagle3"
# Prints where an installed package resolves its paths, under the environment it is given.
PATHS = ("import json, eagle3_jax, eagle3_jax.assets as a; print(json.dumps({'package': eagle3_jax.__file__, "
         "'draft': str(a.DEFAULT_DRAFT), 'target': str(a.DEFAULT_TARGET), 'cache': str(a.cache_dir())}))")
CACHE_VARIABLES = ("EAGLE3_JAX_CACHE", "EAGLE3_JAX_CHECKPOINTS", "XDG_CACHE_HOME")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """A wheel built from a copy of the sources (the drafters/ link kept a link, as git has it)."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    shutil.copytree(REPO / "eagle3_jax", src / "eagle3_jax", symlinks=True,
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(DRAFTER, src / "checkpoints" / DRAFTER.name)
    assert (src / "eagle3_jax" / "drafters" / DRAFTER.name).is_symlink()
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "--disable-pip-version-check", "-w", str(tmp / "dist"), str(src)], check=True)
    (built,) = (tmp / "dist").glob("eagle3_jax-*.whl")
    return built


def test_wheel_ships_the_drafter(wheel):
    with zipfile.ZipFile(wheel) as zf:
        sizes = {info.filename: info.file_size for info in zf.infolist()}
        config = json.loads(zf.read(f"eagle3_jax/drafters/{DRAFTER.name}/config.json"))
    for name in ("model.safetensors", "config.json", "MODEL_CARD.md"):
        assert sizes[f"eagle3_jax/drafters/{DRAFTER.name}/{name}"] == (DRAFTER / name).stat().st_size
    assert config == json.loads((DRAFTER / "config.json").read_text())
    assert not any(name.startswith("checkpoints/") for name in sizes)  # inside the package only


def _installed_paths(site: Path, cwd: Path, **env: str) -> dict:
    clean = {k: v for k, v in os.environ.items() if k not in CACHE_VARIABLES}
    out = subprocess.run([sys.executable, "-c", PATHS], cwd=cwd, capture_output=True, text=True, check=True,
                         env={**clean, "PYTHONPATH": str(site), **env})
    return {k: Path(v) for k, v in json.loads(out.stdout).items()}


def test_installed_wheel_reads_its_drafter_and_writes_to_the_cache(wheel, tmp_path):
    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as zf:  # what `pip install` lays out for a pure-Python wheel
        zf.extractall(site)
    home = tmp_path / "home"
    paths = _installed_paths(site, tmp_path, HOME=str(home))
    assert paths["package"].parent == site / "eagle3_jax"  # the wheel's copy, not the source tree
    assert paths["draft"] == site / "eagle3_jax" / "drafters" / DRAFTER.name
    assert (paths["draft"] / "model.safetensors").stat().st_size == (DRAFTER / "model.safetensors").stat().st_size
    assert paths["cache"] == home / ".cache" / "eagle3_jax"
    assert paths["target"] == home / ".cache" / "eagle3_jax" / "checkpoints" / "smollm2-135m-instruct"

    paths = _installed_paths(site, tmp_path, HOME=str(home), XDG_CACHE_HOME=str(tmp_path / "xdg"))
    assert paths["target"] == tmp_path / "xdg" / "eagle3_jax" / "checkpoints" / "smollm2-135m-instruct"
    paths = _installed_paths(site, tmp_path, XDG_CACHE_HOME=str(tmp_path / "xdg"),
                             EAGLE3_JAX_CACHE=str(tmp_path / "cache"), EAGLE3_JAX_CHECKPOINTS=str(tmp_path / "models"))
    assert paths["cache"] == tmp_path / "cache"
    assert paths["target"] == tmp_path / "models" / "smollm2-135m-instruct"
    assert site not in paths["target"].parents


def test_cache_dir_precedence(monkeypatch, tmp_path):
    for name in CACHE_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert assets.cache_dir() == tmp_path / "home" / ".cache" / "eagle3_jax"
    assert assets.checkpoints_dir() == tmp_path / "home" / ".cache" / "eagle3_jax" / "checkpoints"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert assets.cache_dir() == tmp_path / "xdg" / "eagle3_jax"
    monkeypatch.setenv("EAGLE3_JAX_CACHE", str(tmp_path / "mine"))
    assert assets.cache_dir() == tmp_path / "mine"
    assert assets.checkpoints_dir() == tmp_path / "mine" / "checkpoints"
    monkeypatch.setenv("EAGLE3_JAX_CHECKPOINTS", str(tmp_path / "models"))
    assert assets.checkpoints_dir() == tmp_path / "models"


def test_source_checkout_reads_the_committed_drafter():
    assert assets.DEFAULT_DRAFT.resolve() == DRAFTER.resolve()
    assert (assets.DEFAULT_DRAFT / "model.safetensors").is_file()
