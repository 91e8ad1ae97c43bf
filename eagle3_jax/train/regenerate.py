"""Self-distilled training data: the target's own replies to ShareGPT's prompts and to its own.

At inference the drafter reads the target's own text, and ShareGPT's ChatGPT replies are far from
what a small target writes; regenerating them with the target (as Medusa-2's self-distillation,
HASS and SpecForge's `regenerate` do) makes the training inputs match inference, while the labels
stay the target's next-token distribution (`objective.py`).

The prompts (`prompts.py`): ShareGPT user turns with the conversation before them (the first
`RegenerateSpec.turns`), and with `magpie` requests the target writes itself. `filters` drops
MT-bench overlaps, other scripts, short requests and duplicates; `shuffle_prompts` orders them by
a fixed permutation, so the held-out rows (the first) sample every source. Each prompt is answered
by the engine (target only) at the temperatures `temperature_plan` picks; the loss mask covers the
reply and its end-of-turn token. `RegenerateSpec.shard` splits the prompts over processes (shard i
of n answers i, i + n, ...); the Magpie requests come first, whole in a JSONL file, since every
shard needs all of them to deduplicate.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from eagle3_jax.sampling_params import SamplingParams
from eagle3_jax.train import data as D
from eagle3_jax.train import prompts as P

SEEDS_PER_DRAW = 10_000_000  # sampling seeds of one `RegenerateSpec.seed`
MIN_REPLY_TOKENS = 16  # shorter replies are dropped
PROMPT_ORDER_SEED = 0  # fixed: every draw keeps the same held-out prompts


@dataclasses.dataclass(frozen=True)
class RegenerateSpec:
    """Which prompts `regenerate_data` builds and how it asks the target for its replies."""

    max_prompt_tokens: int = 512
    max_new_tokens: int = 384
    temperatures: tuple[float, ...] = (0.0,)  # 0 = greedy
    replies_per_prompt: int | None = None  # temperatures each prompt is answered at; None: all of them
    turns: int | None = 1  # user turns per conversation taken as prompts (the first `turns`; None: all)
    magpie: int = 0  # requests the target is asked to write itself
    magpie_file: str | None = None  # JSONL of those requests: read when it exists, else written
    magpie_seed: int = 0
    magpie_temperature: float = 1.0
    magpie_top_p: float = 0.95
    magpie_max_tokens: int = 192  # a request without its end of turn within these is dropped
    # None: every prompt kept (the data of the shipped drafter's first two stages)
    filters: P.PromptFilters | None = dataclasses.field(default_factory=P.PromptFilters)
    shuffle_prompts: bool = True  # False: source order (the shipped drafter's first two stages)
    time_budget_s: float | None = None
    shard: tuple[int, int] = (0, 1)  # (i, n): answer prompts i, i + n, i + 2n, ...
    seed: int = 0  # another value draws other sampled replies (greedy ones stay the same)
    # Large buckets: the 135M target is launch-bound, so 256 rows cost little more than 16.
    batch_buckets: tuple[int, ...] = (16, 64, 256)
    prefill_buckets: tuple[int, ...] = (128, 512)

    def __post_init__(self):
        n = len(self.temperatures)
        if not n or any(t < 0 for t in self.temperatures):
            raise D.DataError(f"temperatures must be one or more numbers >= 0, got {self.temperatures}")
        if self.replies_per_prompt is not None and not 1 <= self.replies_per_prompt <= n:
            raise D.DataError(f"replies per prompt must be in 1..{n} (the number of temperatures), "
                              f"got {self.replies_per_prompt}")
        if self.turns is not None and self.turns < 1:
            raise D.DataError(f"turns must be at least 1 (or all), got {self.turns}")
        if self.magpie < 0 or self.magpie_max_tokens < 1 or not 0 < self.magpie_top_p <= 1:
            raise D.DataError(f"magpie: count {self.magpie} >= 0, max tokens {self.magpie_max_tokens} >= 1 and "
                              f"top_p {self.magpie_top_p} in (0, 1] needed")
        if self.magpie and self.filters is None:  # a sampled request may repeat another or an MT-bench question
            raise D.DataError("Magpie requests need the prompt filters (MT-bench overlaps, duplicates)")


# ----------------------------------------------------------------------------- pure parts

def temperature_plan(number: int, n_temperatures: int, per_prompt: int | None, seed: int) -> tuple[int, ...]:
    """The temperature indices prompt `number` is answered at: all, or `per_prompt` drawn from
    (seed, number) alone, so that the draw does not depend on the shard."""
    if per_prompt is None or per_prompt >= n_temperatures:
        return tuple(range(n_temperatures))
    pick = np.random.default_rng((seed, number)).permutation(n_temperatures)[:per_prompt]
    return tuple(sorted(int(k) for k in pick))


def sampling_seed(seed: int, number: int, n_temperatures: int, k: int) -> int:
    """One seed per (prompt, temperature); each `seed` owns a range of SEEDS_PER_DRAW."""
    return seed * SEEDS_PER_DRAW + number * n_temperatures + k


def reply_example(prompt_ids: Sequence[int], reply_ids: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """(ids [n] int32, loss mask [n] bool): the prompt unmasked, the reply masked in."""
    ids = np.asarray([*prompt_ids, *reply_ids], np.int32)
    mask = np.zeros(len(ids), bool)
    mask[len(prompt_ids):] = True
    return ids, mask


def encode_prompts(tokenizer, prompts: Sequence[list[dict]], max_tokens: int) -> list[list[int] | None]:
    """Chat-template token ids of each prompt (`LLM.encode`'s), None for one over `max_tokens`."""
    texts = [tokenizer.apply_chat_template(p, tokenize=False, add_generation_prompt=True) for p in prompts]
    encoded = D._encode_prefix(tokenizer, texts, max_tokens + 1)
    return [list(ids) if len(ids) <= max_tokens else None for ids, _ in encoded]


# ----------------------------------------------------------------------------- the target's replies

def answer(llm, prompt_ids: Sequence[Sequence[int]], plans: Sequence[tuple[int, ...]], temperatures: Sequence[float],
           *, numbers: Sequence[int], max_new_tokens: int, seed: int = 0, time_budget_s: float | None = None,
           progress: bool = True, log=print) -> tuple[dict[tuple[int, int], list[int]], list[dict]]:
    """The target's replies: prompt i at each temperature index of plans[i], through
    `LLM.generate_iter` -> ({(i, k): reply ids}, per temperature {"temperature", "asked",
    "replies", "tokens", "seconds"}). Requests go temperature by temperature, so a `time_budget_s`
    (no request started after it) cuts the later temperatures' replies."""
    start = time.perf_counter()
    order: list[tuple[int, int]] = []  # request number -> (prompt i, temperature k)
    stats = [{"temperature": t, "asked": sum(k in p for p in plans), "replies": 0, "tokens": 0,
              "first": None, "last": None} for k, t in enumerate(temperatures)]
    bar = tqdm(total=sum(len(p) for p in plans), desc="regenerate", unit="reply", disable=not progress)

    def requests():
        for k, t in enumerate(temperatures):
            for i, plan in enumerate(plans):
                if k not in plan:
                    continue
                if time_budget_s is not None and time.perf_counter() - start > time_budget_s:
                    log(f"regenerate: time budget reached at temperature {t} after {stats[k]['replies']} replies")
                    return
                order.append((i, k))
                if stats[k]["first"] is None:
                    stats[k]["first"] = time.perf_counter()
                params = SamplingParams(max_tokens=max_new_tokens, temperature=t,
                                        seed=sampling_seed(seed, numbers[i], len(temperatures), k))
                yield prompt_ids[i], params

    replies = {}
    for j, out in llm.generate_iter(requests()):
        if out.error is not None:
            raise RuntimeError(f"regenerate: a request failed: {out.error}")
        i, k = order[j]
        replies[i, k] = out.token_ids
        s = stats[k]
        s["replies"] += 1
        s["tokens"] += len(out.token_ids)
        s["last"] = time.perf_counter()
        bar.update(1)
    bar.close()
    for s in stats:
        first, last = s.pop("first"), s.pop("last")
        s["seconds"] = last - first if first is not None and last is not None else 0.0
        if s["replies"]:
            log(f"regenerate: temperature {s['temperature']}: {s['replies']:,} replies, {s['tokens']:,} tokens in "
                f"{s['seconds']:.0f} s ({s['tokens'] / max(s['seconds'], 1e-9):,.0f} tokens/s)")
    return replies, stats


def regenerate_examples(llm, prompts: Sequence[list[dict]], seq_len: int, *, max_prompt_tokens: int = 512,
                        max_new_tokens: int = 384, temperatures: Sequence[float] = (0.0,),
                        time_budget_s: float | None = None, min_reply_tokens: int = MIN_REPLY_TOKENS,
                        pad_id: int = 0, prompt_numbers: Sequence[int] | None = None, seed: int = 0,
                        progress: bool = True, log=print) -> D.Examples:
    """The target's replies to `prompts` (chat messages), one per prompt and temperature, as padded
    Examples [N, seq_len]; `llm` an `LLM` over the target alone (cheaper at large batch). Prompts
    over `max_prompt_tokens` and replies under `min_reply_tokens` are dropped. `prompt_numbers`
    [N]: the prompts' places in the whole list, for their sampling seeds."""
    _check_lengths(max_prompt_tokens, max_new_tokens, seq_len)
    start = time.perf_counter()
    numbers = range(len(prompts)) if prompt_numbers is None else prompt_numbers
    ids = [llm.encode(p) for p in prompts]
    keep = [i for i, p in enumerate(ids) if len(p) <= max_prompt_tokens]
    log(f"regenerate: {len(keep)} of {len(ids)} prompts have at most {max_prompt_tokens} tokens")
    every = tuple(range(len(temperatures)))
    replies, _ = answer(llm, [ids[i] for i in keep], [every] * len(keep), temperatures,
                        numbers=[numbers[i] for i in keep], max_new_tokens=max_new_tokens, seed=seed,
                        time_budget_s=time_budget_s, progress=progress, log=log)
    pairs = [reply_example(ids[keep[n]], replies[n, k]) for n, k in sorted(replies)
             if len(replies[n, k]) >= min_reply_tokens]
    _log_total(replies, start, len(pairs), log)
    return D.pad_examples(pairs, seq_len, pad_id)


def _check_lengths(max_prompt_tokens: int, max_new_tokens: int, seq_len: int) -> None:
    if max_prompt_tokens + max_new_tokens > seq_len:
        raise D.DataError(
            f"max_prompt_tokens {max_prompt_tokens} + max_new_tokens {max_new_tokens} exceed seq_len {seq_len}"
        )


def _log_total(replies: dict, start: float, examples: int, log) -> None:
    generated = sum(map(len, replies.values()))
    seconds = time.perf_counter() - start
    log(f"regenerate: {generated:,} tokens in {seconds:.0f} s ({generated / max(seconds, 1e-9):,.0f} tokens/s), "
        f"{examples} examples")


# ----------------------------------------------------------------------------- Magpie requests

def magpie_requests(llm, prefix_ids: Sequence[int], numbers: Sequence[int], *, seed: int = 0,
                    temperature: float = 1.0, top_p: float = 0.95, max_tokens: int = 192, progress: bool = True,
                    log=print) -> list[dict]:
    """Requests the target writes after its user header, one per number (its sampling seed) ->
    [{"n", "request" (text or None), "outcome" (prompts.MAGPIE_OUTCOMES), "tokens"}] by n."""
    start = time.perf_counter()
    numbers = list(numbers)
    tok = llm.tokenizer
    end_ids, special = llm.engine.eos_token_ids, set(tok.all_special_ids)
    requests = ((list(prefix_ids), SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                                                  seed=seed * SEEDS_PER_DRAW + n)) for n in numbers)
    out_of = {}
    for j, out in tqdm(llm.generate_iter(requests), total=len(numbers), desc="magpie", unit="request",
                       disable=not progress):
        if out.error is not None:
            raise RuntimeError(f"magpie: a request failed: {out.error}")
        text, outcome = P.parse_request(out.token_ids, end_ids, special, tok.decode)
        out_of[numbers[j]] = {"n": numbers[j], "request": text, "outcome": outcome, "tokens": len(out.token_ids)}
    records = [out_of[n] for n in sorted(out_of)]
    tokens, seconds = sum(r["tokens"] for r in records), time.perf_counter() - start
    outcomes = Counter(r["outcome"] for r in records)
    log(f"magpie: {len(records):,} requests written, {tokens:,} tokens in {seconds:.0f} s "
        f"({tokens / max(seconds, 1e-9):,.0f} tokens/s): "
        + ", ".join(f"{outcomes[o]:,} {o}" for o in P.MAGPIE_OUTCOMES))
    return records


def magpie_params(spec: RegenerateSpec, prefix: str) -> dict:
    """What a Magpie file's requests depend on; a file with other values is not reused."""
    return {"count": spec.magpie, "seed": spec.magpie_seed, "temperature": spec.magpie_temperature,
            "top_p": spec.magpie_top_p, "max_tokens": spec.magpie_max_tokens, "prefix": prefix}


def write_magpie(path: str | Path, params: dict, records: Sequence[dict], shard: tuple[int, int] = (0, 1)) -> Path:
    """A JSONL file: a header line {"magpie": params, "shard": [i, n]}, then one record a line."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    with open(partial, "w", encoding="utf-8") as f:
        f.write(json.dumps({"magpie": params, "shard": list(shard)}) + "\n")
        f.writelines(json.dumps(r) + "\n" for r in records)
    partial.replace(path)
    return path


def _read_magpie_file(path: Path) -> tuple[dict, tuple[int, int], list[dict]]:
    try:
        with open(path, encoding="utf-8") as f:
            lines = [json.loads(line) for line in f if line.strip()]
        header, records = lines[0], lines[1:]
        return header["magpie"], tuple(header["shard"]), records
    except (json.JSONDecodeError, IndexError, KeyError, TypeError) as e:
        raise D.DataError(f"{path}: not a Magpie request file ({type(e).__name__}: {e})") from None


def read_magpie(path: str | Path, params: dict) -> list[dict]:
    """The records of a whole Magpie file written for `params`; DataError otherwise."""
    path = Path(path)
    got, shard, records = _read_magpie_file(path)
    if got != params:
        diff = sorted(k for k in params.keys() | got.keys() if got.get(k) != params.get(k))
        raise D.DataError(f"{path}: Magpie requests written with other settings ({', '.join(diff)}); "
                          "delete it or name another --magpie-file")
    if shard != (0, 1) or [r.get("n") for r in records] != list(range(params["count"])):
        raise D.DataError(f"{path}: holds {len(records)} of the {params['count']} Magpie requests; delete it")
    return records


def merge_magpie(parts: Sequence[str | Path], out: str | Path) -> Path:
    """Shard files of `magpie_requests` (one per process) -> one whole file, by request number."""
    read = [_read_magpie_file(Path(p)) for p in parts]
    params, n = read[0][0], len(parts)
    for p, (got, shard, _) in zip(parts, read):
        if got != params or shard[1] != n:
            raise D.DataError(f"{p}: written for other settings or another number of shards than {parts[0]}")
    if sorted(shard[0] for _, shard, _ in read) != list(range(n)):
        raise D.DataError(f"Magpie shard files {[str(p) for p in parts]} do not cover shards 0..{n - 1}")
    records = sorted((r for _, _, rs in read for r in rs), key=lambda r: r["n"])
    path = write_magpie(out, params, records)
    read_magpie(path, params)  # whole: every number once
    return path


def make_llm(target_dir: str | Path, spec: RegenerateSpec, progress: bool = True):
    """The target alone on an engine sized for `spec`'s prompts and replies."""
    from eagle3_jax.api import LLM
    from eagle3_jax.config import EngineConfig

    engine = EngineConfig(batch_buckets=spec.batch_buckets, prefill_buckets=spec.prefill_buckets,
                          num_speculative_tokens=0, max_model_len=spec.max_prompt_tokens + spec.max_new_tokens)
    return LLM(target_dir, draft=None, num_speculative_tokens=0, engine_config=engine, progress=progress)


def magpie_shard(target_dir: str | Path, spec: RegenerateSpec, path: str | Path, progress: bool = True,
                 log=print) -> Path:
    """Write this process's shard (`spec.shard`) of the Magpie requests to `path`."""
    llm = make_llm(target_dir, spec, progress)
    shard, shards = spec.shard
    prefix = P.magpie_prefix(llm.tokenizer)
    records = magpie_requests(llm, P.magpie_prefix_ids(llm.tokenizer), range(shard, spec.magpie, shards),
                              seed=spec.magpie_seed, temperature=spec.magpie_temperature, top_p=spec.magpie_top_p,
                              max_tokens=spec.magpie_max_tokens, progress=progress, log=log)
    return write_magpie(path, magpie_params(spec, prefix), records, spec.shard)


def _magpie_records(llm, spec: RegenerateSpec, progress: bool, log) -> list[dict]:
    """All of `spec`'s Magpie requests: from `spec.magpie_file` when it exists, else written (and saved there)."""
    params = magpie_params(spec, P.magpie_prefix(llm.tokenizer))
    if spec.magpie_file and Path(spec.magpie_file).is_file():
        records = read_magpie(spec.magpie_file, params)
        log(f"magpie: {len(records):,} requests read from {spec.magpie_file}")
        return records
    records = magpie_requests(llm, P.magpie_prefix_ids(llm.tokenizer), range(spec.magpie), seed=spec.magpie_seed,
                              temperature=spec.magpie_temperature, top_p=spec.magpie_top_p,
                              max_tokens=spec.magpie_max_tokens, progress=progress, log=log)
    if spec.magpie_file:
        write_magpie(spec.magpie_file, params, records)
    return records


# ----------------------------------------------------------------------------- the whole data set

def regenerate_data(target_dir: str | Path, sharegpt: str | Path, seq_len: int, spec: RegenerateSpec, *,
                    mtbench, max_conversations: int | None, expect_records: int | None, progress: bool = True,
                    log=print) -> tuple[D.Examples, dict]:
    """This process's shard (`spec.shard`) of the self-distilled data -> (Examples, provenance)."""
    _check_lengths(spec.max_prompt_tokens, spec.max_new_tokens, seq_len)
    convs, read = D.sharegpt_counted(sharegpt, mtbench=mtbench, max_conversations=max_conversations,
                                     expect_records=expect_records, log=log)
    llm = make_llm(target_dir, spec, progress)
    return self_distill(llm, convs, read, seq_len, spec, mtbench=mtbench, progress=progress, log=log)


def self_distill(llm, conversations: Sequence[list[dict]], sharegpt_read: dict, seq_len: int, spec: RegenerateSpec,
                 *, mtbench, progress: bool = True, log=print) -> tuple[D.Examples, dict]:
    """`regenerate_data` on loaded conversations and an `LLM`."""
    start = time.perf_counter()
    candidates = P.sharegpt_prompts(conversations, spec.turns)
    magpie = None
    if spec.magpie:
        records = _magpie_records(llm, spec, progress, log)
        magpie = {"asked": len(records), **{o: sum(r["outcome"] == o for r in records) for o in P.MAGPIE_OUTCOMES}}
        candidates += [("magpie", [{"role": "user", "content": r["request"]}]) for r in records if r["request"]]
    f = spec.filters
    guard = P.MTBenchGuard(mtbench, n=f.mtbench_ngram, share=f.mtbench_share) if f and mtbench is not None else None
    kept, counts = P.select_prompts(candidates, f, guard)
    log(f"prompts: {len(kept):,} of {len(candidates):,} kept" + ("" if f else " (no filters)"))
    if spec.shuffle_prompts:
        kept = [kept[i] for i in np.random.default_rng(PROMPT_ORDER_SEED).permutation(len(kept))]
    shard, shards = spec.shard
    mine = kept[shard::shards]
    numbers = range(shard, len(kept), shards)  # their places in the whole list
    log(f"regenerate: shard {shard} of {shards}: {len(mine):,} prompts, temperatures {spec.temperatures}"
        + (f", {spec.replies_per_prompt} per prompt" if spec.replies_per_prompt else ""))

    ids = encode_prompts(llm.tokenizer, [m for _, m in mine], spec.max_prompt_tokens)
    keep = [i for i, x in enumerate(ids) if x is not None]
    log(f"regenerate: {len(keep):,} of {len(ids):,} prompts have at most {spec.max_prompt_tokens} tokens")
    plans = [temperature_plan(numbers[i], len(spec.temperatures), spec.replies_per_prompt, spec.seed) for i in keep]
    replies, per_temperature = answer(
        llm, [ids[i] for i in keep], plans, spec.temperatures, numbers=[numbers[i] for i in keep],
        max_new_tokens=spec.max_new_tokens, seed=spec.seed, time_budget_s=spec.time_budget_s, progress=progress,
        log=log)

    rows = {s: {"prompts": 0, "over_tokens": 0, "rows": 0, "prompt_tokens": 0, "reply_tokens": 0} for s in P.SOURCES}
    for (source, _), x in zip(mine, ids):
        rows[source]["prompts"] += 1
        rows[source]["over_tokens"] += x is None
    pairs = []
    for t in per_temperature:
        t["short"] = 0
    for n, k in sorted(replies):
        reply = replies[n, k]
        if len(reply) < MIN_REPLY_TOKENS:
            per_temperature[k]["short"] += 1
            continue
        r = rows[mine[keep[n]][0]]
        r["rows"] += 1
        r["prompt_tokens"] += len(ids[keep[n]])
        r["reply_tokens"] += len(reply)
        pairs.append(reply_example(ids[keep[n]], reply))
    _log_total(replies, start, len(pairs), log)
    provenance = {"shards": [shard], "of": shards, "sharegpt": sharegpt_read, "magpie": magpie, "prompts": counts,
                  "regenerated": rows, "temperatures": per_temperature, "spec": spec_record(spec)}
    ex = D.pad_examples(pairs, seq_len, D.pad_id(llm.tokenizer))
    D.describe(ex, "regenerated", log)
    for line in format_provenance(provenance).splitlines():
        log(line)
    return ex, provenance


def spec_record(spec: RegenerateSpec) -> dict:
    """The spec as provenance records it, less what does not change the data (shard, Magpie file)."""
    d = dataclasses.asdict(spec)
    d.pop("shard")
    d.pop("magpie_file")
    return json.loads(json.dumps(d))


# ----------------------------------------------------------------------------- provenance

def provenance_path(data_path: str | Path) -> Path:
    """The provenance file next to a data file: data_896.npz -> data_896.provenance.json."""
    return Path(data_path).with_suffix(".provenance.json")


def write_provenance(provenance: dict, data_path: str | Path) -> Path:
    path = provenance_path(data_path)
    path.write_text(json.dumps(provenance, indent=1) + "\n")
    return path


def read_provenance(data_paths: Sequence[str | Path]) -> dict | None:
    """The merged provenance of data files (`merge_provenance`); None when one has none."""
    paths = [provenance_path(p) for p in data_paths]
    if not paths or not all(p.is_file() for p in paths):
        return None
    try:
        return merge_provenance([json.loads(p.read_text()) for p in paths])
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise D.DataError(f"provenance files {[str(p) for p in paths]} unreadable ({type(e).__name__}: {e})") from None


def merge_provenance(parts: Sequence[dict]) -> dict:
    """Shards' provenance -> one: counts summed, a temperature's seconds the longest shard's."""
    first = parts[0]
    for p in parts[1:]:
        for key in ("of", "sharegpt", "magpie", "prompts", "spec"):
            if p[key] != first[key]:
                raise D.DataError(f"data shards built from different prompts or settings (their {key!r} differ)")
    shards = sorted(s for p in parts for s in p["shards"])
    if len(set(shards)) != len(shards):
        raise D.DataError(f"data shards given twice: {shards}")
    rows = {s: {k: sum(p["regenerated"][s][k] for p in parts) for k in first["regenerated"][s]}
            for s in first["regenerated"]}
    temps = []
    for k, t in enumerate(first["temperatures"]):
        merged = {key: sum(p["temperatures"][k][key] for p in parts) for key in ("asked", "replies", "tokens", "short")}
        temps.append({"temperature": t["temperature"], **merged,
                      "seconds": max(p["temperatures"][k]["seconds"] for p in parts)})
    return {**first, "shards": shards, "regenerated": rows, "temperatures": temps}


def format_provenance(p: dict) -> str:
    """The provenance as a few lines of text (printed by the training script, cited by model cards)."""
    lines = [f"data provenance ({len(p['shards'])} of {p['of']} shards):"]
    s = p["sharegpt"]
    lines.append(f"  sharegpt: {s['records']:,} records, {s['usable']:,} usable, {s['mtbench_exact']:,} dropped for "
                 f"an MT-bench question, {s['conversations']:,} conversations used")
    if p["magpie"]:
        m = p["magpie"]
        lines.append(f"  magpie: {m['asked']:,} requests asked, {m['parsed']:,} parsed ("
                     + ", ".join(f"{m[o]:,} {o.replace('_', ' ')}" for o in P.MAGPIE_OUTCOMES[1:]) + ")")
    cols = ["candidates", *P.FILTERS, "kept"]
    heads = ["candidates", "mtbench", "language", "length", "dup", "near-dup", "kept",
             "over-tok", "rows", "prompt tok", "reply tok"]
    lines.append(f"  {'source':<15}" + "".join(f"{h:>11}" for h in heads))
    total = Counter()
    for src in P.SOURCES:
        c, r = p["prompts"][src], p["regenerated"][src]
        values = [c[k] for k in cols] + [r["over_tokens"], r["rows"], r["prompt_tokens"], r["reply_tokens"]]
        if not c["candidates"]:
            continue
        total.update(dict(enumerate(values)))
        lines.append(f"  {src:<15}" + "".join(f"{v:>11,}" for v in values))
    lines.append(f"  {'total':<15}" + "".join(f"{total[i]:>11,}" for i in range(len(heads))))
    for t in p["temperatures"]:
        rate = t["tokens"] / t["seconds"] if t["seconds"] else 0.0
        lines.append(f"  temperature {t['temperature']}: {t['replies']:,} of {t['asked']:,} replies asked "
                     f"({t['short']:,} under {MIN_REPLY_TOKENS} tokens dropped), {t['tokens']:,} tokens generated in "
                     f"{t['seconds']:.0f} s ({rate:,.0f} tokens/s)")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- flags

def add_arguments(ap) -> None:
    """The regeneration flags of `eagle3-jax train-draft` and scripts/train_smollm2_drafter.py."""
    g = ap.add_argument_group("self-distillation: train on the target's own replies to ShareGPT's and its own prompts")
    g.add_argument("--regenerate", action=argparse.BooleanOptionalAction, default=False,
                   help="answer the prompts with the target and train on those replies")
    g.add_argument("--regen-max-prompt-tokens", type=positive_int, default=RegenerateSpec.max_prompt_tokens)
    g.add_argument("--regen-max-new-tokens", type=positive_int, default=RegenerateSpec.max_new_tokens)
    g.add_argument("--regen-temperatures", type=_floats, default=RegenerateSpec.temperatures,
                   help="temperatures the prompts are answered at, comma-separated (0 = greedy; default 0)")
    g.add_argument("--regen-replies-per-prompt", type=positive_int,
                   help="answer each prompt at this many of the temperatures, picked from its number and "
                   "--regen-seed (default: at every one)")
    g.add_argument("--regen-turns", type=_turns, default=RegenerateSpec.turns,
                   help="user turns of each ShareGPT conversation taken as prompts, each with the turns before it: "
                   "a number (the first ones; default 1) or 'all'")
    g.add_argument("--regen-time-budget-s", type=float, help="stop asking for replies after this long")
    g.add_argument("--regen-seed", type=int, default=RegenerateSpec.seed,
                   help="another value draws other sampled replies and other Magpie requests (unless --magpie-seed "
                   "or an existing --magpie-file says otherwise), e.g. to continue training (--init) on new data")
    g.add_argument("--regen-shard", type=_shard, default=RegenerateSpec.shard, metavar="I/N",
                   help="answer only shard I of N of the prompts (one process per GPU); default 0/1")
    g.add_argument("--magpie", type=count_int, default=RegenerateSpec.magpie, metavar="N",
                   help="also ask the target to write N requests of its own (Magpie: its chat template's user "
                   "header alone, sampled) and answer those; default 0")
    g.add_argument("--magpie-file", help="JSONL of the Magpie requests: read when it exists, else written")
    g.add_argument("--magpie-seed", type=int,
                   help="sampling seed of the Magpie requests (default: --regen-seed; the same seed writes the "
                   "same requests, and greedy replies to them are then the same text)")
    g.add_argument("--magpie-temperature", type=float, default=RegenerateSpec.magpie_temperature)
    g.add_argument("--magpie-top-p", type=float, default=RegenerateSpec.magpie_top_p)
    g.add_argument("--magpie-max-tokens", type=positive_int, default=RegenerateSpec.magpie_max_tokens,
                   help="a request that has not ended within these tokens is dropped")
    f = P.PromptFilters()
    g.add_argument("--prompt-filters", action=argparse.BooleanOptionalAction, default=True,
                   help="drop MT-bench overlaps (containment, 8-grams), non-Latin scripts, short requests and "
                   "(near) duplicates; --no-prompt-filters keeps every prompt (the shipped drafter's first two "
                   "stages: only conversations with an exact MT-bench question are dropped)")
    g.add_argument("--min-prompt-chars", type=count_int, default=f.min_chars,
                   help="drop prompts whose last user message is shorter")
    g.add_argument("--min-ascii-letters", type=_share, default=f.min_ascii_letters,
                   help="drop prompts whose user messages' letters are less than this share ASCII")
    g.add_argument("--dedupe-prefix-chars", type=positive_int, default=f.prefix_chars,
                   help="near duplicates: the same context and the same first N characters of the last message")
    g.add_argument("--shuffle-prompts", action=argparse.BooleanOptionalAction, default=RegenerateSpec.shuffle_prompts,
                   help="order the prompts by a fixed permutation (the held-out rows then sample every source); "
                   "--no-shuffle-prompts keeps source order (the shipped drafter's first two stages)")


def _floats(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    if any(not v >= 0 for v in values):
        raise argparse.ArgumentTypeError(f"temperatures must be >= 0, got {text!r}")
    return values


def _int(text: str, least: int, what: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < least:
        raise argparse.ArgumentTypeError(f"expected {what}, got {value}")
    return value


def positive_int(text: str) -> int:
    return _int(text, 1, "a positive integer")


def count_int(text: str) -> int:
    return _int(text, 0, "an integer >= 0")


def _share(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1], got {text!r}") from None
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1], got {value}")
    return value


def _turns(text: str) -> int | None:
    return None if text == "all" else _int(text, 1, "a positive number of turns or 'all'")


def _shard(text: str) -> tuple[int, int]:
    try:
        i, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected I/N such as 0/4, got {text!r}") from None
    if not 0 <= i < n:
        raise argparse.ArgumentTypeError(f"shard {i}/{n}: need 0 <= I < N")
    return i, n


def spec_from_args(a) -> RegenerateSpec | None:
    """The spec the flags ask for (None without --regenerate); DataError naming a bad combination."""
    if not a.regenerate:
        return None
    filters = P.PromptFilters(min_chars=a.min_prompt_chars, min_ascii_letters=a.min_ascii_letters,
                              prefix_chars=a.dedupe_prefix_chars) if a.prompt_filters else None
    return RegenerateSpec(
        max_prompt_tokens=a.regen_max_prompt_tokens,
        max_new_tokens=a.regen_max_new_tokens,
        temperatures=a.regen_temperatures,
        replies_per_prompt=a.regen_replies_per_prompt,
        turns=a.regen_turns,
        magpie=a.magpie,
        magpie_file=a.magpie_file,
        magpie_seed=a.regen_seed if a.magpie_seed is None else a.magpie_seed,
        magpie_temperature=a.magpie_temperature,
        magpie_top_p=a.magpie_top_p,
        magpie_max_tokens=a.magpie_max_tokens,
        filters=filters,
        shuffle_prompts=a.shuffle_prompts,
        time_budget_s=a.regen_time_budget_s,
        shard=a.regen_shard,
        seed=a.regen_seed,
    )
