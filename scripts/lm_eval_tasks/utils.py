"""The datasets of these tasks, built locally (lm-evaluation-harness calls `custom_dataset` in
place of loading from the hub): facts_mc.jsonl beside this file, and HumanEval from its pinned
PyPI package through eagle3_jax.assets."""

from __future__ import annotations

import json
from pathlib import Path

import datasets

HERE = Path(__file__).resolve().parent


def facts_mc(**_metadata) -> datasets.DatasetDict:
    """facts_mc.jsonl: {question, choices (4), answer (the right choice's index)} per line."""
    with open(HERE / "facts_mc.jsonl") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})


def humaneval_next_line(**_metadata) -> datasets.DatasetDict:
    """HumanEval's 164 problems: the prompt (signature and docstring) and, as the target, the first
    non-empty line of the canonical solution, stripped."""
    from eagle3_jax import assets

    rows = []
    for problem in assets.humaneval_problems():
        first = next(line for line in problem["canonical_solution"].splitlines() if line.strip())
        rows.append({"task_id": problem["task_id"], "prompt": problem["prompt"], "target": first.strip()})
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})
