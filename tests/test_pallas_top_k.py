"""model/pallas_top_k.py: the top k of vocabulary-sized rows and their logsumexp.

Pallas' interpreter runs the kernels here, against lax.top_k and jax.nn.logsumexp; the shapes a
draft tree level gives them are lowered for CUDA (Triton) from this CPU machine.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eagle3_jax.model import pallas_top_k
from eagle3_jax.runner import tree as T


def _rows(rng, shape):
    """Values on a coarse grid (many ties), some -inf; and rows with fewer finite entries than k."""
    x = np.round(rng.standard_normal(shape) * 4).astype(np.float32) / 4
    x[..., ::7] = -np.inf
    few = np.full(shape, -np.inf, np.float32)
    few[..., -1], few[..., 3] = 0.5, 0.5  # a tie across the first and the last chunk
    return x, few


# Several chunks a row (16,384 = 8 x CHUNK; 5,000 ends in a part chunk); rows of one part chunk
# (the merge skipped), k not a power of two, k = the whole row.
@pytest.mark.parametrize("shape, k", [((2, 4, 16384), 4), ((3, 5000), 10), ((2, 300), 3), ((2, 6), 6)])
def test_top_k_is_lax_top_k(shape, k):
    """The same values and indices as lax.top_k, ties to the lower index and -inf entries after
    every finite one; the logsumexp of each row within f32 rounding."""
    rng = np.random.default_rng(k)
    for x in _rows(rng, shape):
        values, indices, lse = pallas_top_k.top_k(jnp.asarray(x), k)
        want_values, want_indices = jax.lax.top_k(jnp.asarray(x), k)
        np.testing.assert_array_equal(np.asarray(indices), np.asarray(want_indices))
        np.testing.assert_array_equal(np.asarray(values), np.asarray(want_values))
        np.testing.assert_allclose(np.asarray(lse), np.asarray(jax.nn.logsumexp(jnp.asarray(x), axis=-1)),
                                   rtol=1e-6, atol=1e-6)


def test_top_children_kernel_matches_the_xla_form():
    """A tree level's children from logits: the kernel's (top k, log-probs as value - logsumexp)
    against XLA's (log_softmax, then the two-stage top k): the same draft ids, log-probs within
    f32 rounding; and from given log-probs (a sampling program's) the same values exactly."""
    rng = np.random.default_rng(1)
    logits = jnp.asarray(3 * rng.standard_normal((2, 4, 16384)), jnp.float32)
    for normalize in (True, False):
        got = T.top_children(logits, 4, normalize=normalize, kernel=True)
        want = T.top_children(logits, 4, normalize=normalize, kernel=False)
        np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
        np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want[0]), rtol=0 if not normalize else 1e-6,
                                   atol=0 if not normalize else 1e-5)


def test_bad_k_is_refused():
    with pytest.raises(ValueError, match=r"k = 9 outside 1\.\.8"):
        pallas_top_k.top_k(jnp.zeros((2, 8)), 9)


@pytest.mark.parametrize("rows, vocab, k, kernels", [(8, 16384, 4, 2), (4, 32000, 4, 2), (16, 16384, 8, 2),
                                                     (2, 128256, 10, 2), (2, 16, 4, 1)])
def test_lowers_for_cuda(monkeypatch, rows, vocab, k, kernels):
    """The draft tree's shapes (SmolLM2's 16,384-token draft vocabulary at 2 x 4 and 2 x 8 beams,
    the 8B drafter's 32,000 at one row of 4 beams, a whole Llama-3 vocabulary at k = 10) lower to
    the two Triton kernels; a level's 4 x 4 scores, one chunk, to one."""
    monkeypatch.setattr(pallas_top_k, "_interpret", lambda: False)
    text = (jax.jit(lambda x: pallas_top_k.top_k(x, k)).trace(jax.ShapeDtypeStruct((rows, vocab), jnp.float32))
            .lower(lowering_platforms=("cuda",)).as_text())
    assert text.count("xla.gpu.triton") == kernels
