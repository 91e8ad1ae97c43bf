"""The command lines' shared parts: one-line usage errors, argument types that reject a bad value
while parsing (before anything loads), and the checks of model directories. `eagle3-jax` (cli.py),
`eagle3-jax bench` (bench/) and `eagle3-jax train-draft` (train/) all take them from here, so none of
them imports another's command line."""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Callable
from pathlib import Path

from eagle3_jax.config import MAX_SPECULATIVE_TOKENS, ConfigError, TreeSpec, parse_tree, parse_tree_spec

PROG = "eagle3-jax"
# transformers advises on every import that PyTorch is missing; torch is optional here.
QUIET_ENV = {"TRANSFORMERS_NO_ADVISORY_WARNINGS": "1"}
MTBENCH_QUESTIONS = 80


class UsageError(Exception):
    """A mistake in what the user asked for; the message names it and what to do."""


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every flag's help ends with its default, unless the help already says it in words."""

    def _get_help_string(self, action):
        if "(default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


class ArgumentParser(argparse.ArgumentParser):
    """argparse with one-line errors (no usage block): the problem, and where to read more."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


# ---- argument types: each rejects a bad value while parsing, before anything loads ------------
def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None


def _float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return value


def _checked(value, ok: bool, problem: str):
    """`value` when `ok`, else the argument's error `problem` (one line, no traceback)."""
    if not ok:
        raise argparse.ArgumentTypeError(problem)
    return value


def positive_int(text: str) -> int:
    value = _int(text)
    return _checked(value, value >= 1, f"{value} must be at least 1")


def nonnegative_int(text: str) -> int:
    value = _int(text)
    return _checked(value, value >= 0, f"{value} must be 0 or more")


def num_draft(text: str) -> int:
    value = _int(text)
    return _checked(value, 0 <= value <= MAX_SPECULATIVE_TOKENS,
                    f"K = {value} is outside 0..{MAX_SPECULATIVE_TOKENS} (0 runs the target alone)")


def tree_spec(text: str) -> TreeSpec:
    """"4,4,8" -> TreeSpec(steps=4, top_k=4, tokens=8) (`config.parse_tree_spec`)."""
    try:
        return parse_tree_spec(text)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def tree_choice(text: str) -> TreeSpec | str | None:
    """--tree: "auto" (LLM's default tree choice), "none" (no tree) or STEPS,TOPK,TOKENS, as
    `LLM(tree=...)` takes them (`config.parse_tree`)."""
    try:
        return parse_tree(text)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def temperature(text: str) -> float:
    value = _float(text)
    return _checked(value, value >= 0, f"{value} is negative; use 0 (greedy) or more")


def fraction(text: str, hint: str = "") -> float:
    value = _float(text)
    return _checked(value, 0 < value <= 1, f"{value} is outside (0, 1]{hint}")


def memory_fraction(text: str) -> float:
    value = _float(text)
    return _checked(value, 0 < value < 1, f"{value} is outside (0, 1)")


def top_p(text: str) -> float:
    return fraction(text, "; 1 turns nucleus sampling off")


def nonnegative_float(text: str) -> float:
    value = _float(text)
    return _checked(value, value >= 0, f"{value} must be 0 or more")


def positive_float(text: str) -> float:
    value = _float(text)
    return _checked(value, value > 0, f"{value} must be positive")


def port(text: str) -> int:
    value = _int(text)
    return _checked(value, 1 <= value <= 65535, f"{value} is outside 1..65535")


def mtbench_count(text: str) -> int:
    value = _int(text)
    return _checked(value, 1 <= value <= MTBENCH_QUESTIONS,
                    f"{value} is outside 1..{MTBENCH_QUESTIONS} (MT-bench has {MTBENCH_QUESTIONS} questions)")


def sizes(text: str) -> tuple[int, ...]:
    """"8,2,4" -> (2, 4, 8): batch sizes, each at least 1, sorted, each once."""
    try:
        values = {positive_int(part.strip()) for part in text.split(",") if part.strip()}
    except argparse.ArgumentTypeError as e:
        raise argparse.ArgumentTypeError(f"{text!r}: {e}") from None
    if not values:
        raise argparse.ArgumentTypeError(f"{text!r} lists no sizes; give e.g. 2,4,8")
    return tuple(sorted(values))


def prompt_text(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError("the prompt is empty")
    return text


# ---- checks before anything loads ----------------------------------------------------------
def _has_weights(directory: Path) -> bool:
    return any(directory.glob("*.safetensors")) or (directory / "pytorch_model.bin").is_file()


def check_target_dir(target: Path, flag: str = "--target", default: str = "leave --target out for the default "
                     "SmolLM2-135M-Instruct") -> None:
    """A target directory exists and holds config.json and safetensors (cheap: no tensor is read)."""
    what = "a target directory is a Hugging Face Llama checkpoint: config.json and model.safetensors"
    if not target.is_dir():
        raise UsageError(f"{flag} {target}: no such directory ({what}; {default})")
    if not (target / "config.json").is_file():
        raise UsageError(f"{flag} {target}: no config.json in it ({what})")
    if not any(target.glob("*.safetensors")):
        raise UsageError(f"{flag} {target}: no model.safetensors in it ({what})")


def check_drafter_dir(draft: Path, flag: str = "--draft", instead: str = "--draft none runs the target alone") -> None:
    """A drafter directory exists and holds config.json and weights (cheap: no tensor is read)."""
    what = f"a drafter directory holds config.json and model.safetensors (or pytorch_model.bin); {instead}"
    if not draft.is_dir():
        raise UsageError(f"{flag} {draft}: no such directory ({what})")
    if not (draft / "config.json").is_file():
        raise UsageError(f"{flag} {draft}: no config.json in it ({what})")
    if not _has_weights(draft):
        raise UsageError(f"{flag} {draft}: no model.safetensors or pytorch_model.bin in it ({what})")


def one_line(e: BaseException) -> str:
    return " ".join(str(e).split())


def run_command(prog: str, command: Callable[[], int]) -> int:
    """`command()`'s exit status, a UsageError reported in one line on stderr (status 2) and Ctrl-C
    as status 130: how every command of `eagle3-jax` ends."""
    for key, value in QUIET_ENV.items():
        os.environ.setdefault(key, value)
    try:
        return command()
    except UsageError as e:
        print(f"{prog}: error: {one_line(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
