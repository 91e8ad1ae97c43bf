"""Every program that donates the device state (the KV pool, updated in place) is built by
`steps.state_jit`, which turns XLA:GPU's rematerialization off: its memory estimate counts the
donated pool more than once, and on the default pool it rewrote the greedy target-alone iteration
into one that gave other tokens (BENCHMARKS.md, "Batch invariance end to end"). The pass runs on
the GPU only, so this checks the construction; the GPU run is the behaviour."""

import ast
from pathlib import Path

import jax

from eagle3_jax.runner import steps

RUNNER = Path(steps.__file__).parent
# The donations that are not the state: a verdict or first-token buffer, the pinned slots and tables.
SMALL_BUFFERS = {"'buffer'", "old"}


def _donated(call: ast.Call) -> set[str]:
    """The names a jax.jit call donates (`donate_argnums` read as the wrapped lambda's or function's)."""
    kw = {k.arg: k.value for k in call.keywords}
    if "donate_argnames" in kw:
        value = kw["donate_argnames"]
        names = value.elts if isinstance(value, ast.Tuple) else [value]
        return {ast.unparse(n) for n in names}
    if "donate_argnums" in kw:
        fun = call.args[0]
        return {fun.args.args[0].arg if isinstance(fun, ast.Lambda) else ast.unparse(fun)}
    return set()


def test_only_small_buffers_are_donated_outside_state_jit():
    seen = 0
    for path in sorted(RUNNER.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and ast.unparse(node.func) == "jax.jit" and _donated(node):
                seen += 1
                assert _donated(node) <= SMALL_BUFFERS, (
                    f"{path.name}:{node.lineno} jits a program donating {_donated(node)} with jax.jit; "
                    "a program that donates the device state is built with steps.state_jit")
    assert seen >= 3  # read_verdicts, read_first_token, the pinned overwrite: the scan sees them


def test_state_jit_turns_rematerialization_off_and_keeps_other_options(monkeypatch):
    calls, real = [], jax.jit

    def spy(fun, **kwargs):
        calls.append(kwargs["compiler_options"])
        return real(fun, **kwargs)

    monkeypatch.setattr(jax, "jit", spy)
    steps.state_jit(lambda state: state, donate_argnums=0)
    per_gemm = steps.jit_per_gemm(lambda state: state, donate_argnums=0)
    assert len(calls) == 1 + len(per_gemm)
    assert all(options.items() >= steps.NO_REMAT.items() for options in calls)
    assert calls[-1]["xla_gpu_enable_triton_gemm"] is False  # cuBLAS's option kept beside it
