"""Self-distilled training data: the target's own replies to the ShareGPT prompts.

At inference the drafter reads the target's own text, not ChatGPT's. ShareGPT's replies were
written by ChatGPT; for a 135M target they are far from what it would write, so a drafter trained
on them learns to follow a distribution it will never see. Regenerating the replies with the
target itself (as Medusa-2's self-distillation and HASS do; the EAGLE-3 authors' SpecForge has a
`regenerate` step for the same reason) makes the training inputs match inference, while the
labels stay the target's next-token distribution (`objective.py`).

Each example is one user turn in the chat template, with everything before it (its system message,
if any; for a later turn, the earlier turns and ShareGPT's replies to them), plus the target's reply,
decoded through our own engine (target-only). `RegenerateSpec.turns` says how many user turns of
each conversation become prompts: 1 (the default) takes the first only; more turns give more, and
longer, prompts from the same conversations. Each prompt is answered once
per temperature of `RegenerateSpec.temperatures`: greedy, as the evaluation decodes, and, for
variety, sampled (more contexts the drafter sees, still labelled with the target's own
distribution). The loss mask covers the reply and its end-of-turn token.

`RegenerateSpec.shard` splits the prompts over processes (one per GPU): shard i of n answers
prompts i, i + n, ...; the training run concatenates the shards' data files.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from eagle3_jax.sampling_params import SamplingParams
from eagle3_jax.train import data as D

SEEDS_PER_DRAW = 10_000_000  # sampling seeds of one `RegenerateSpec.seed`


@dataclasses.dataclass(frozen=True)
class RegenerateSpec:
    """How `regenerate_sharegpt` asks the target for its replies."""

    max_prompt_tokens: int = 512
    max_new_tokens: int = 384
    temperatures: tuple[float, ...] = (0.0,)  # one reply per prompt and temperature; 0 = greedy
    turns: int = 1  # user turns per conversation taken as prompts (the first `turns`)
    time_budget_s: float | None = None
    shard: tuple[int, int] = (0, 1)  # (i, n): answer prompts i, i + n, i + 2n, ...
    seed: int = 0  # another value draws other sampled replies (greedy ones stay the same)
    # Large buckets: the 135M target is launch-bound, so 256 rows cost little more than 16.
    batch_buckets: tuple[int, ...] = (16, 64, 256)
    prefill_buckets: tuple[int, ...] = (128, 512)


def user_turns(conversations: Sequence[list[dict]], turns: int = 1) -> list[list[dict]]:
    """The prompts to regenerate: for each conversation, its first `turns` user turns, each as the
    messages up to and including it (an optional system message, earlier turns and their replies),
    conversation by conversation in order."""
    if turns < 1:
        raise ValueError(f"turns must be at least 1, got {turns}")
    out = []
    for messages in conversations:
        users = [i for i, m in enumerate(messages) if m["role"] == "user"][:turns]
        out.extend([dict(m) for m in messages[:i + 1]] for i in users)
    return out


def reply_example(prompt_ids: Sequence[int], reply_ids: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """(ids [n] int32, loss mask [n] bool): the prompt unmasked, the reply masked in."""
    ids = np.asarray([*prompt_ids, *reply_ids], np.int32)
    mask = np.zeros(len(ids), bool)
    mask[len(prompt_ids):] = True
    return ids, mask


def regenerate_examples(llm, prompts: Sequence[list[dict]], seq_len: int, *, max_prompt_tokens: int = 512,
                        max_new_tokens: int = 384, temperatures: Sequence[float] = (0.0,),
                        time_budget_s: float | None = None, min_reply_tokens: int = 16, pad_id: int = 0,
                        prompt_numbers: Sequence[int] | None = None, seed: int = 0, progress: bool = True,
                        log=print) -> D.Examples:
    """The target's replies to `prompts` (chat messages), one per prompt and temperature, as padded
    Examples [N, seq_len] (each prompt's replies in the order of `temperatures`).

    `llm` is an `eagle3_jax.api.LLM` over the target (best without a drafter: any drafter is
    lossless, but target-only is cheaper at large batch). Requests stream through the engine
    (`LLM.generate_iter`): a finished row takes the next request at once. Prompts longer than
    `max_prompt_tokens` are skipped, as are replies shorter than `min_reply_tokens`. Requests go
    temperature by temperature; with `time_budget_s`, none is started after the budget is spent
    (the admitted ones finish and are kept), so the budget cuts the later temperatures' replies.
    `prompt_numbers` [N] number the prompts for their sampling seeds (default 0..N-1; a
    shard passes the prompts' places in the whole list, so its replies do not depend on how many
    shards there are); `seed` offsets every sampling seed, for another draw of the same prompts.
    """
    if max_prompt_tokens + max_new_tokens > seq_len:
        raise ValueError(
            f"max_prompt_tokens {max_prompt_tokens} + max_new_tokens {max_new_tokens} exceed seq_len {seq_len}"
        )
    start = time.perf_counter()
    numbers = range(len(prompts)) if prompt_numbers is None else prompt_numbers
    ids = [llm.encode(p) for p in prompts]
    keep = [i for i, p in enumerate(ids) if len(p) <= max_prompt_tokens]
    log(f"regenerate: {len(keep)} of {len(ids)} prompts have at most {max_prompt_tokens} tokens")
    bar = tqdm(total=len(keep) * len(temperatures), desc="regenerate", unit="reply", disable=not progress)

    def requests():
        # Temperature-major: every prompt's first reply (greedy, as evaluated) before any second
        # one, so a time budget cuts the extra samples first.
        for k, t in enumerate(temperatures):
            for n, i in enumerate(keep):
                if time_budget_s is not None and time.perf_counter() - start > time_budget_s:
                    log(f"regenerate: time budget reached at temperature {t} after {n} prompts")
                    return
                # One seed per (prompt, temperature): sampled replies are reproducible and independent.
                # Each `seed` owns a range of SEEDS_PER_DRAW, far above any prompt count times temperatures.
                yield (
                    ids[i],
                    SamplingParams(
                        max_tokens=max_new_tokens,
                        temperature=t,
                        seed=seed * SEEDS_PER_DRAW + numbers[i] * len(temperatures) + k,
                    ),
                )

    replies, generated = {}, 0  # (prompt n, temperature k) -> reply ids
    for j, out in llm.generate_iter(requests()):
        if out.error is not None:
            raise RuntimeError(f"regenerate: a request failed: {out.error}")
        generated += len(out.token_ids)
        replies[divmod(j, len(keep))[::-1]] = out.token_ids
        bar.update(1)
    bar.close()
    pairs = [
        reply_example(ids[keep[n]], replies[n, k]) for n, k in sorted(replies) if len(replies[n, k]) >= min_reply_tokens
    ]
    seconds = time.perf_counter() - start
    log(
        f"regenerate: {generated:,} tokens in {seconds:.0f} s ({generated / max(seconds, 1e-9):,.0f} tokens/s), "
        f"{len(pairs)} examples"
    )
    return D.pad_examples(pairs, seq_len, pad_id)


def regenerate_sharegpt(
    target_dir: str | Path,
    sharegpt: str | Path,
    seq_len: int,
    spec: RegenerateSpec,
    *,
    mtbench,
    max_conversations: int | None,
    expect_records: int | None,
    progress: bool = True,
    log=print,
) -> D.Examples:
    """ShareGPT user turns (`spec.turns` per conversation, MT-bench overlaps removed) answered by the
    target in `target_dir`,
    this process's shard of them (`spec.shard`). `expect_records` checks the file's whole records
    (`data.sharegpt_conversations`)."""
    from eagle3_jax.api import LLM
    from eagle3_jax.config import EngineConfig

    convs = D.sharegpt_conversations(
        sharegpt, mtbench=mtbench, max_conversations=max_conversations, expect_records=expect_records, log=log
    )
    engine = EngineConfig(
        batch_buckets=spec.batch_buckets,
        prefill_buckets=spec.prefill_buckets,
        num_speculative_tokens=0,
        max_model_len=spec.max_prompt_tokens + spec.max_new_tokens,
    )
    shard, shards = spec.shard
    prompts = user_turns(convs, spec.turns)[shard::shards]
    numbers = range(shard, shard + shards * len(prompts), shards)  # their places in the whole list
    log(f"regenerate: shard {shard} of {shards}: {len(prompts)} prompts, temperatures {spec.temperatures}")
    llm = LLM(target_dir, draft=None, num_speculative_tokens=0, engine_config=engine, progress=progress)
    ex = regenerate_examples(
        llm,
        prompts,
        seq_len,
        max_prompt_tokens=spec.max_prompt_tokens,
        max_new_tokens=spec.max_new_tokens,
        temperatures=spec.temperatures,
        time_budget_s=spec.time_budget_s,
        pad_id=D.pad_id(llm.tokenizer),
        prompt_numbers=numbers,
        seed=spec.seed,
        progress=progress,
        log=log,
    )
    D.describe(ex, "regenerated", log)
    return ex


def add_arguments(ap) -> None:
    """The regeneration flags of `eagle3-jax train-draft` and scripts/train_smollm2_drafter.py."""
    g = ap.add_argument_group("self-distillation: train on the target's own replies to the ShareGPT prompts")
    g.add_argument(
        "--regenerate",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="answer the ShareGPT user turns with the target and train on those replies",
    )
    g.add_argument("--regen-max-prompt-tokens", type=int, default=RegenerateSpec.max_prompt_tokens)
    g.add_argument("--regen-max-new-tokens", type=int, default=RegenerateSpec.max_new_tokens)
    g.add_argument(
        "--regen-temperatures",
        type=_floats,
        default=RegenerateSpec.temperatures,
        help="answer each prompt once per temperature, comma-separated (0 = greedy; default 0)",
    )
    g.add_argument(
        "--regen-turns",
        type=int,
        default=RegenerateSpec.turns,
        help="user turns of each conversation taken as prompts, each with the turns before it (default 1)",
    )
    g.add_argument("--regen-time-budget-s", type=float, help="stop asking for replies after this long")
    g.add_argument(
        "--regen-seed",
        type=int,
        default=RegenerateSpec.seed,
        help="another value draws other sampled replies, e.g. to continue training (--init) on new data",
    )
    g.add_argument(
        "--regen-shard",
        type=_shard,
        default=RegenerateSpec.shard,
        metavar="I/N",
        help="answer only shard I of N of the prompts (one process per GPU); default 0/1",
    )


def _floats(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    if any(v < 0 for v in values):
        raise argparse.ArgumentTypeError(f"temperatures must be >= 0, got {text!r}")
    return values


def _shard(text: str) -> tuple[int, int]:
    try:
        i, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected I/N such as 0/4, got {text!r}") from None
    if not 0 <= i < n:
        raise argparse.ArgumentTypeError(f"shard {i}/{n}: need 0 <= I < N")
    return i, n


def spec_from_args(a) -> RegenerateSpec | None:
    if not a.regenerate:
        return None
    return RegenerateSpec(
        max_prompt_tokens=a.regen_max_prompt_tokens,
        max_new_tokens=a.regen_max_new_tokens,
        temperatures=a.regen_temperatures,
        time_budget_s=a.regen_time_budget_s,
        shard=a.regen_shard,
        turns=a.regen_turns,
        seed=a.regen_seed,
    )
