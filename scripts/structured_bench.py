#!/usr/bin/env python3
"""Structured outputs (SamplingParams.structured_outputs) end to end: N JSON-schema requests through
`LLM`, with speculation on (the chain of K, the tree) and off, each with and without the grammar.

    python3 scripts/structured_bench.py [--target T] [--draft D|none] [--requests 32] [--batch 8]
        [--max-tokens 256] [--num-draft 4] [--proposals chain,tree,target] [--tree 6,8,31]
        [--batch-invariant] [--profile] [--out-dir DIR]

Four schemas (nested objects, enums, arrays, patterns), the requests cycling through them, each a
user turn through the chat template asking for that JSON, greedy. Per run: the share of replies
that parse as JSON and that validate against their schema (`jsonschema`, where installed), the mean
acceptance length, tok/s (after an untimed pass over the same requests, so no compile is timed) and
each reply's decode rate after its first token (a grammar's replies are shorter: whole-run tok/s
charges them more prefill per token).
The constrained replies must be token-identical with speculation on and off, each proposal's with the
target alone's (the grammar's masks apply inside the verify: EAGLE-3 stays lossless under them; in bf16 exactly so with
--batch-invariant, else up to near-ties, as without a grammar). The default target is SmolLM2 with the
shipped drafter; on the CPU keep --requests and --max-tokens small. Prints a table and writes
structured.json under --out-dir.

--profile: instead, one batch of --batch grammar requests (greedy, then seeded sampling) a run, and
where a step under a grammar spends its time (`EngineStats`), in ms a step: reading every result in
flight (of which blocked on the device: "wait"), reading the pending proposals and writing the
grammar's forced tokens in, computing the masks, dispatching, the rest of the step; beside it the
device's masked iteration alone on padding rows (its bucket, timed to completion). Writes
profile.json (the split and every reply's tokens) under --out-dir.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

SCHEMAS = {
    "person": {
        "type": "object", "additionalProperties": False, "required": ["name", "age", "role", "skills", "address"],
        "properties": {
            "name": {"type": "string", "maxLength": 40},
            "age": {"type": "integer", "minimum": 0, "maximum": 130},
            "role": {"enum": ["engineer", "scientist", "artist", "teacher"]},
            "skills": {"type": "array", "items": {"type": "string", "maxLength": 24}, "maxItems": 4},
            "address": {"type": "object", "additionalProperties": False, "required": ["city", "zip"],
                        "properties": {"city": {"type": "string", "maxLength": 30},
                                       "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}},
        },
    },
    "product": {
        "type": "object", "additionalProperties": False, "required": ["id", "title", "price", "in_stock", "tags"],
        "properties": {
            "id": {"type": "integer", "minimum": 1},
            "title": {"type": "string", "maxLength": 60},
            "price": {"type": "number", "minimum": 0},
            "in_stock": {"type": "boolean"},
            "tags": {"type": "array", "items": {"enum": ["new", "sale", "popular", "limited"]}, "maxItems": 3},
            "size": {"type": "object", "additionalProperties": False,
                     "properties": {"width_cm": {"type": "number"}, "height_cm": {"type": "number"}}},
        },
    },
    "event": {
        "type": "object", "additionalProperties": False, "required": ["title", "date", "attendees"],
        "properties": {
            "title": {"type": "string", "maxLength": 60},
            "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
            "attendees": {"type": "array", "maxItems": 3, "items": {
                "type": "object", "additionalProperties": False, "required": ["name", "rsvp"],
                "properties": {"name": {"type": "string", "maxLength": 30},
                               "rsvp": {"enum": ["yes", "no", "maybe"]}}}},
        },
    },
    "review": {
        "type": "object", "additionalProperties": False, "required": ["sentiment", "score", "reasons"],
        "properties": {
            "sentiment": {"enum": ["positive", "negative", "neutral"]},
            "score": {"type": "integer", "minimum": 1, "maximum": 5},
            "reasons": {"type": "array", "items": {"type": "string", "maxLength": 60}, "maxItems": 3},
        },
    },
}
TOPICS = {
    "person": ["a famous physicist", "a jazz musician", "a primary school teacher", "a software engineer"],
    "product": ["a coffee mug", "a laptop stand", "running shoes", "a desk lamp"],
    "event": ["a book club meeting", "a team offsite", "a birthday party", "a product launch"],
    "review": ["a pizza restaurant", "a science fiction film", "a hotel stay", "a pair of headphones"],
}


def requests(n: int) -> list[tuple[str, dict]]:
    """n (prompt, schema) pairs, cycling through the schemas and their topics."""
    names = list(SCHEMAS)
    out = []
    for i in range(n):
        name = names[i % len(names)]
        topic = TOPICS[name][(i // len(names)) % len(TOPICS[name])]
        prompt = (f"Describe {topic} as a JSON object with this schema, and reply with the JSON only:\n"
                  f"{json.dumps(SCHEMAS[name])}")
        out.append((prompt, SCHEMAS[name]))
    return out


def judge(text: str, schema: dict, validate) -> tuple[bool, bool]:
    """(parses as JSON, validates against `schema`; False when there is no validator)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return False, False
    if validate is None:
        return True, False
    try:
        validate(value, schema)
    except Exception:  # noqa: BLE001 - jsonschema's ValidationError and SchemaError alike: not valid
        return True, False
    return True, True


def decode_rate(outs) -> float:
    """Mean over the replies of tokens per second after the first (prefill left out: a grammar's
    replies are shorter, so whole-run tok/s charges them more prefill per token)."""
    rates = [(len(o.token_ids) - 1) / (o.metrics.last_token_time - o.metrics.first_token_time) for o in outs
             if len(o.token_ids) > 1 and o.metrics.last_token_time > o.metrics.first_token_time]
    return sum(rates) / len(rates) if rates else float("nan")


def run(llm, work: list[tuple[str, dict]], max_tokens: int, grammar: bool, batch: int) -> tuple[list, float]:
    """-> (outputs, seconds) of `work` at up to `batch` requests at once, after an untimed pass."""
    from eagle3_jax import SamplingParams

    def params(schema):
        return SamplingParams(max_tokens=max_tokens, structured_outputs={"json": schema} if grammar else None)

    chats = [[{"role": "user", "content": prompt}] for prompt, _ in work]
    groups = [range(i, min(i + batch, len(work))) for i in range(0, len(work), batch)]
    for group in groups[:1]:  # compiles the shapes the timed pass runs
        llm.chat([chats[i] for i in group], [params(work[i][1]) for i in group])
    start, outs = time.perf_counter(), []
    for group in groups:
        outs += llm.chat([chats[i] for i in group], [params(work[i][1]) for i in group])
    return outs, time.perf_counter() - start


def profile(llm, work: list[tuple[str, dict]], max_tokens: int, batch: int) -> list[dict]:
    """The split of the steps of one batch of `work[:batch]` under its grammars, greedy and seeded
    sampling, after an untimed pass (`--profile`)."""
    import dataclasses

    import numpy as np

    from eagle3_jax import SamplingParams

    engine, work = llm.engine, work[:batch]
    chats = [[{"role": "user", "content": prompt}] for prompt, _ in work]
    rows = []
    for sampled in (False, True):
        params = [SamplingParams(max_tokens=max_tokens, structured_outputs={"json": schema},
                                 **({"temperature": 0.8, "seed": i} if sampled else {}))
                  for i, (_, schema) in enumerate(work)]
        for _ in range(2):  # compiles what the timed pass runs (the second: its prefills past cached prefixes)
            llm.chat(chats, params)
        engine.reset_stats()
        start = time.perf_counter()
        outs = llm.chat(chats, params)
        wall = time.perf_counter() - start
        s = engine.stats
        per_step = {name: 1e3 * seconds / max(s.constrained_steps, 1) for name, seconds in (
            ("step", s.host_s + s.device_wait_s), ("read", s.constrained_read_s), ("wait", s.device_wait_s),
            ("forced", s.forced_s), ("masks", s.mask_s), ("dispatch", s.dispatch_s))}
        per_step["other"] = per_step["step"] - sum(per_step[k] for k in ("read", "forced", "masks", "dispatch"))
        rows.append({"sampled": sampled, "steps": s.steps, "constrained_steps": s.constrained_steps,
                     "prefill_calls": s.prefill_calls, "wall_s": wall, "tokens": sum(len(o.token_ids) for o in outs),
                     "ms_per_constrained_step": per_step, "token_ids": [o.token_ids for o in outs]})
    # The device's masked iteration alone, on padding rows of the batch's bucket.
    cfg = dataclasses.replace(engine.iterate_config(batch), masked=True)
    slots, tables = engine.runner.padding_rows(batch)
    mask = engine.runner.allow_all(cfg, batch)
    for _ in range(2):
        engine.runner.iterate(slots, tables, cfg, lambda: mask).block_until_ready()
    samples = []
    for _ in range(10):
        start = time.perf_counter()
        engine.runner.iterate(slots, tables, cfg, lambda: mask).block_until_ready()
        samples.append(time.perf_counter() - start)
    for row in rows:
        row["device_step_ms"] = 1e3 * float(np.median(samples))
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default=None, help="a converted Llama target (default: SmolLM2-135M-Instruct)")
    p.add_argument("--draft", default="default", help="its drafter, 'default' (the shipped one) or 'none'")
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--batch", type=int, default=8, help="requests served at once")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--num-draft", type=int, default=4, help="K of the chain")
    p.add_argument("--proposals", default="chain,target",
                   help="the engines, in order: chain, tree, target (the target alone: always compared with)")
    p.add_argument("--tree", default="6,8,31", help="the tree's TreeSpec (steps, top-k, nodes)")
    p.add_argument("--batch-invariant", action="store_true",
                   help="batch-invariant kernels: token identity exact in bf16 too, near-ties included")
    p.add_argument("--profile", action="store_true", help="where a grammar batch's steps spend their time")
    p.add_argument("--out-dir", type=Path, default=None)
    args = p.parse_args()

    from eagle3_jax.api import LLM
    from eagle3_jax.config import EngineConfig, TreeSpec

    try:
        import jsonschema

        validate = jsonschema.validate
    except ImportError:
        validate = None
    work = requests(args.requests)
    rows, replies = [], {}
    proposals = list(dict.fromkeys([*args.proposals.split(","), "target"]))  # the target alone: the reference
    for proposal in proposals:
        speculative = proposal != "target"
        draft = None if not speculative or args.draft == "none" else args.draft
        tree = TreeSpec(*map(int, args.tree.split(","))) if proposal == "tree" else None
        cfg = EngineConfig(speculation="always", max_model_len=2048, batch_buckets_up_to=args.batch,
                           max_num_seqs=args.batch, structured_warmup=True)
        llm = LLM(target=args.target, draft=draft, num_speculative_tokens=args.num_draft if speculative else 0,
                  tree=tree, engine_config=cfg, progress=False, batch_invariant=args.batch_invariant)
        name = {"chain": f"chain K={args.num_draft}", "tree": f"tree ({args.tree})", "target": "target alone"}[proposal]
        if args.profile:
            rows += [{"run": name + (", sampled" if r["sampled"] else ", greedy"), **r}
                     for r in profile(llm, work, args.max_tokens, args.batch)]
            llm.close()
            continue
        for grammar in (True, False):
            outs, seconds = run(llm, work, args.max_tokens, grammar, args.batch)
            judged = [judge(o.text, schema, validate) for o, (_, schema) in zip(outs, work)]
            tokens = sum(len(o.token_ids) for o in outs)
            rows.append({"run": name + (", grammar" if grammar else ", free text"), "speculative": speculative,
                         "grammar": grammar, "requests": len(outs),
                         "parsed": sum(j[0] for j in judged) / len(outs),
                         "validated": sum(j[1] for j in judged) / len(outs) if validate else None,
                         "acceptance_length": sum(o.metrics.acceptance_length for o in outs) / len(outs),
                         "tokens": tokens, "seconds": seconds, "tok_s": tokens / seconds,
                         "decode_tok_s": decode_rate(outs),
                         "finish_reasons": {r: sum(o.finish_reason == r for o in outs)
                                            for r in sorted({o.finish_reason for o in outs})}})
            replies[(proposal, grammar)] = [o.token_ids for o in outs]
        llm.close()
    if args.profile:
        print_profile(rows, args.out_dir)
        return
    identical = {f"{proposal}, {'grammar' if g else 'free text'}": replies[(proposal, g)] == replies[("target", g)]
                 for proposal in proposals if proposal != "target" for g in (True, False)}
    print(f"{'run':34} {'parsed':>7} {'valid':>7} {'accept':>7} {'tok/s':>9} {'decode':>9}  finish")
    for r in rows:
        valid = "n/a" if r["validated"] is None else f"{r['validated']:.0%}"
        print(f"{r['run']:34} {r['parsed']:7.0%} {valid:>7} {r['acceptance_length']:7.2f} {r['tok_s']:9.1f} "
              f"{r['decode_tok_s']:9.1f}  {r['finish_reasons']}")
    print("token-identical with speculation on and off:", identical)
    if args.out_dir is not None:
        args.out_dir.mkdir(parents=True, exist_ok=True)
        (args.out_dir / "structured.json").write_text(json.dumps(
            {"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows, "identical": identical}, indent=1))


def print_profile(rows: list[dict], out_dir: Path | None) -> None:
    """`--profile`'s table (ms a step under a grammar), its greedy replies compared across the runs."""
    parts = ("read", "wait", "forced", "masks", "dispatch", "other")
    print(f"{'run':28} {'steps':>5} {'tok/s':>7} {'step':>7} " + " ".join(f"{p:>8}" for p in parts)
          + f" {'device':>7}")
    for r in rows:
        ms = r["ms_per_constrained_step"]
        print(f"{r['run']:28} {r['constrained_steps']:5d} {r['tokens'] / r['wall_s']:7.1f} {ms['step']:7.2f} "
              + " ".join(f"{ms[p]:8.2f}" for p in parts) + f" {r['device_step_ms']:7.2f}")
    print("ms per step under a grammar; read includes wait (blocked on the device); device: the masked "
          "iteration alone")
    greedy = [r for r in rows if not r["sampled"]]
    print("greedy replies token-identical across the runs:", all(r["token_ids"] == greedy[-1]["token_ids"]
                                                                  for r in greedy))
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "profile.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
