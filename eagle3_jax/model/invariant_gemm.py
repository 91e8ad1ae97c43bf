"""Batch-invariant weight projections: a Pallas (Triton) GEMM computing every output row by the same
instructions in the same order whatever the rows beside it. XLA picks tiling, K split and library per
shape, so a token's row rounds differently in a decode, a verify and a prefill chunk, and one ulp can
flip a near-tie argmax. Here the K loop runs in order, in splits fixed by the weight (K, N) alone,
the parts added in order (as programs of their own where few rows leave SMs idle, else in turn by
one program: `splits_across_grid`); the M x N tile and the K columns a loop step loads (`Tiles`)
only say which program computes an output element and how it stages its loads, so they may follow
the row count as long as every tile lowers to the same MMA instruction.
Which tile serves which rows of which projection on a GPU kind is tuned there (gemm_tiles.json,
written by scripts/invariance_h200.py --phase attribution, which keeps only tiles whose every row
equals DEFAULT_TILES' bit for bit): BENCHMARKS.md, "Batch invariance: the cost".
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
from pathlib import Path

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

BLOCK_M = 64  # one Hopper warpgroup MMA tile of rows
BLOCK_N = 64  # the N tile `k_splits` counts programs by, whatever tile runs
BLOCK_K = 64
MIN_PROGRAMS = 128  # about one per SM of an H200 (132): fewer N tiles than this split K
MIN_SPLIT_K_ENV = "EAGLE3_JAX_GEMM_MIN_SPLIT_K"  # read at import, over the default below


def parse_min_split_k(text: str) -> int:
    """The shortest part of K a reduction is split into ("": 1,024). Any value keeps every row's sum
    fixed by the weight; shorter parts fill more SMs at few rows and write more partial sums at many."""
    if not text:
        return 1024
    if not text.isdigit() or int(text) < 16:
        raise ValueError(f"${MIN_SPLIT_K_ENV}: {text!r} is not a whole number of K columns >= 16")
    return int(text)


MIN_SPLIT_K = parse_min_split_k(os.environ.get(MIN_SPLIT_K_ENV, ""))


@dataclasses.dataclass(frozen=True)
class Tiles:
    """The output tile of one program and its launch: any of these gives each element the same sum."""

    block_m: int = BLOCK_M
    block_n: int = BLOCK_N
    num_warps: int = 4  # one warpgroup for a 64-row tile (wgmma)
    num_stages: int = 3  # three stages hide the K loop's loads
    # K columns a loop step loads. On the GPU Triton accumulates a step's MMAs into the loop's f32 tile
    # in K order, so the depth moves no sum (128 against 64: bit-equal on an H200 at Llama-3.1-8B's
    # shapes, BENCHMARKS.md, "Invariant GEMM tiles"; the tuner keeps a depth only where it is); the
    # interpreter's dot sums a step apart, so off the GPU a step is BLOCK_K deep whatever this says.
    block_k: int = BLOCK_K

    def __post_init__(self):
        for name in ("block_m", "block_n", "block_k"):
            size = getattr(self, name)
            if not (isinstance(size, int) and size >= 16 and size & (size - 1) == 0):
                raise ValueError(f"Tiles.{name}={size!r}: Triton's blocks are powers of two >= 16")


DEFAULT_TILES = Tiles()
# From this many rows a 128 x 256 tile of two warpgroups is the fastest measured on an H100 (up to
# 2.6x the default's at 2,048 rows; at 64 rows or fewer every tile is within a few percent):
# BENCHMARKS.md, "Invariant GEMM tiles".
WIDE_ROWS = 256
WIDE_TILES = Tiles(block_m=128, block_n=256, num_warps=8, num_stages=3)


TUNED_TILES_FILE = Path(__file__).with_name("gemm_tiles.json")
TUNED_TILES_ENV = "EAGLE3_JAX_GEMM_TILES"  # a file of the same form, read over the shipped one


@dataclasses.dataclass(frozen=True)
class TunedTile:
    """A tile measured fastest for up to `rows` rows of one projection (K, N, layout) on one GPU kind,
    and bit-equal there to `DEFAULT_TILES` (scripts/invariance_h200.py --phase attribution keeps no other)."""

    k: int
    n: int
    transposed: bool
    rows: int
    tiles: Tiles

    @classmethod
    def from_json(cls, entry: dict) -> TunedTile:
        return cls(int(entry["k"]), int(entry["n"]), bool(entry["transposed"]), int(entry["rows"]),
                   Tiles(*entry["tile"]))

    def to_json(self) -> dict:
        return dict(k=self.k, n=self.n, transposed=self.transposed, rows=self.rows,
                    tile=list(dataclasses.astuple(self.tiles)))


def read_tuned_tiles(path: Path) -> dict[str, list[TunedTile]]:
    """A tile table: {device kind: [TunedTile]} from its JSON ({kind: [{k, n, transposed, rows, tile}]})."""
    try:
        table = json.loads(path.read_text())
        return {kind: [TunedTile.from_json(e) for e in entries] for kind, entries in table.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"invariant GEMM tile table {path}: not a table of tuned tiles ({e})") from e


@functools.cache
def tuned_tiles(device_kind: str) -> dict[tuple[int, int, bool], list[TunedTile]]:
    """This GPU kind's tuned tiles by (K, N, transposed), fewest rows first: the shipped table's, then
    those of $EAGLE3_JAX_GEMM_TILES over them. Read once (`tuned_tiles.cache_clear()` reads again)."""
    entries = read_tuned_tiles(TUNED_TILES_FILE).get(device_kind, []) if TUNED_TILES_FILE.exists() else []
    if explicit := os.environ.get(TUNED_TILES_ENV):
        override = read_tuned_tiles(Path(explicit)).get(device_kind, [])
        shapes = {(e.k, e.n, e.transposed) for e in override}
        entries = [e for e in entries if (e.k, e.n, e.transposed) not in shapes] + override
    by_shape: dict[tuple[int, int, bool], list[TunedTile]] = {}
    for e in sorted(entries, key=lambda e: e.rows):
        by_shape.setdefault((e.k, e.n, e.transposed), []).append(e)
    return by_shape


def _device_kind() -> str | None:
    device = jax.devices()[0]
    return device.device_kind if device.platform == "gpu" else None


def tiles_for(m: int, k: int, n: int, transposed: bool = False) -> Tiles:
    """The tile for m rows of a K x N projection: the tuned one for the fewest tuned rows >= m on this
    GPU kind (`TunedTile`), else `untuned_tiles`. Every tile gives the same sums."""
    if (kind := _device_kind()) is not None:
        for tuned in tuned_tiles(kind).get((k, n, transposed), ()):
            if m <= tuned.rows:
                return tuned.tiles
    return untuned_tiles(m, n)


def untuned_tiles(m: int, n: int) -> Tiles:
    """The tile without a tuned one: wide from WIDE_ROWS where N divides it (padding the weight every
    call would cost more than the tile saves), else DEFAULT_TILES."""
    return WIDE_TILES if m >= WIDE_ROWS and n % WIDE_TILES.block_n == 0 else DEFAULT_TILES


def block_k(k: int, deepest: int = BLOCK_K) -> int:
    """`deepest`, or the largest power of two >= 16 (Triton's MMA depth) below it dividing K."""
    kb = deepest
    while kb > 16 and k % kb:
        kb //= 2
    return kb


def k_splits(k: int, n: int) -> int:
    """Parts of the K loop of a K x N weight, each a whole number of K blocks and >= MIN_SPLIT_K: the
    fewest that give the N tiles MIN_PROGRAMS programs, else as many as those bounds allow."""
    tiles, steps = -(-n // BLOCK_N), -(-k // block_k(k))
    allowed = [s for s in range(1, steps + 1) if steps % s == 0 and (s == 1 or k // s >= MIN_SPLIT_K)]
    return next((s for s in allowed if tiles * s >= MIN_PROGRAMS), allowed[-1])


# A program walking K's parts in turn holds two f32 tiles (a part's sum and the parts' total): at most
# this many registers a thread for both, of the 255 a thread can hold (the wide tile's would take 256).
MAX_WALK_REGISTERS = 128


def splits_across_grid(m: int, n: int, tiles: Tiles, splits: int) -> int:
    """How many of K's `splits` parts run as programs of their own: all where the M x N tiles alone
    would leave SMs idle (fewer than MIN_PROGRAMS) or a tile's two sums would not fit a thread's
    registers (MAX_WALK_REGISTERS), else none, one program walking its parts in turn: the same sums,
    with no partial sums written, read back and added by another kernel (1.7x a SmolLM2 forward at
    2,048 rows with K in 3 parts: BENCHMARKS.md, "Batch invariance: the cost")."""
    programs = -(-m // tiles.block_m) * -(-n // tiles.block_n)
    registers = 2 * tiles.block_m * tiles.block_n // (32 * tiles.num_warps)
    return splits if programs < MIN_PROGRAMS or registers > MAX_WALK_REGISTERS else 1


def _kernel(x_ref, w_ref, o_ref, *, kb: int, transposed: bool, block_m: int, parts: int):
    # x_ref [M, Ks] every row, this program's K range; w_ref [Ks, BN] ([BN, Ks] transposed); o_ref [M, BN].
    # The range holds `parts` parts of the K split (1 where the split runs across the grid): each summed
    # from zero, then added in order, the same f32 adds as `matmul`'s of parts written apart.
    # The program's block_m rows are read and written masked past M (no padded copy of x, no slice of
    # the output: two fewer launches a projection); masked rows are zeros and never stored.
    contract = (((1,), (1,)), ((), ())) if transposed else (((1,), (0,)), ((), ()))
    first = pl.program_id(1) * block_m
    rows = pl.ds(pl.multiple_of(first, block_m), block_m)
    valid = (first + jnp.arange(block_m) < x_ref.shape[0])[:, None]

    def step(i, acc):
        ks = pl.ds(pl.multiple_of(i * kb, kb), kb)
        w = w_ref[:, ks] if transposed else w_ref[ks, :]
        x = plgpu.load(x_ref.at[rows, ks], mask=valid, other=0.0)
        return acc + jax.lax.dot_general(x, w, contract, preferred_element_type=jnp.float32)

    steps = x_ref.shape[1] // kb // parts  # a part's
    zeros = jnp.zeros((block_m, o_ref.shape[1]), jnp.float32)

    def part(p):
        return jax.lax.fori_loop(p * steps, (p + 1) * steps, step, zeros)

    acc = part(0)  # not 0 + part(0): -0.0 stays -0.0, as the first part written apart does
    if parts > 1:
        acc = jax.lax.fori_loop(1, parts, lambda p, acc: acc + part(p), acc)
    plgpu.store(o_ref.at[rows, :], acc.astype(o_ref.dtype), mask=valid)


@functools.partial(jax.jit, static_argnames=("out_dtype", "transposed", "tiles"))
def matmul(x: jax.Array, w: jax.Array, out_dtype=None, transposed: bool = False,
           tiles: Tiles = DEFAULT_TILES) -> jax.Array:
    """x [M, K] @ w [K, N] (transposed: w [N, K]) -> [M, N], each row's arithmetic independent of M."""
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    m, k = x.shape
    n = w.shape[0] if transposed else w.shape[1]
    bm, bn = tiles.block_m, tiles.block_n
    kp, np_ = -(-k // 16) * 16, -(-n // bn) * bn
    # Zero padding adds exact zeros; real models' weights divide the tiles (test models' may not).
    if kp != k:
        x = jnp.pad(x, ((0, 0), (0, kp - k)))
    if (kp, np_) != (k, n):
        w = jnp.pad(w, ((0, np_ - n), (0, kp - k)) if transposed else ((0, kp - k), (0, np_ - n)))
    splits = k_splits(kp, n)
    kb = block_k(kp // splits, tiles.block_k if not _interpret() else BLOCK_K)  # a part's K in whole steps
    grid_splits = splits_across_grid(m, np_, tiles, splits)
    ks = kp // grid_splits
    w_spec = (pl.BlockSpec((bn, ks), lambda s, i, j: (j, s)) if transposed
              else pl.BlockSpec((ks, bn), lambda s, i, j: (s, j)))
    part_dtype = out_dtype if grid_splits == 1 else jnp.float32
    parts = pl.pallas_call(
        functools.partial(_kernel, kb=kb, transposed=transposed, block_m=bm, parts=splits // grid_splits),
        grid=(grid_splits, -(-m // bm), np_ // bn),
        in_specs=[pl.BlockSpec((m, ks), lambda s, i, j: (0, s)), w_spec],
        out_specs=pl.BlockSpec((None, m, bn), lambda s, i, j: (s, 0, j)),
        out_shape=jax.ShapeDtypeStruct((grid_splits, m, np_), part_dtype),
        interpret=_interpret(),
        compiler_params=_compiler_params(tiles),
        name="eagle3_invariant_gemm",
    )(x, w)
    out = parts[0]
    for s in range(1, grid_splits):  # in split order, whatever M is
        out = out + parts[s]
    return (out if np_ == n else out[:, :n]).astype(out_dtype)


def project(x: jax.Array, w: jax.Array, out_dtype=None, transposed: bool = False) -> jax.Array:
    """`layers.project`'s contract (transposed: w [N, K], a tied lm_head read as the embedding)."""
    lead, k = x.shape[:-1], x.shape[-1]
    out_shape = w.shape[:1] if transposed else w.shape[1:]
    w2 = w if transposed else w.reshape(k, math.prod(out_shape))
    rows = math.prod(lead)
    y = matmul(x.reshape(rows, k), w2, out_dtype=out_dtype, transposed=transposed,
               tiles=tiles_for(rows, k, math.prod(out_shape), transposed))
    return y.reshape(*lead, *out_shape)


def _compiler_params(tiles: Tiles):
    return plgpu.CompilerParams(num_warps=tiles.num_warps, num_stages=tiles.num_stages)


def _interpret() -> bool:
    return jax.default_backend() != "gpu"
