"""Speculators (`protocol.Speculator`): chain.py (EAGLE-3's chain of K; Chain(0) is the target
alone), dynamic_tree.py (EAGLE-2's tree, same head), ngram.py (prompt lookup, no drafter). An
engine may serve two ("auto": tree or chain per bucket) in slots with room for either. A stale
proposal of the verify's own kind is still verified: each was drawn as its rule requires.
"""

from __future__ import annotations

from collections.abc import Callable

from eagle3_jax.config import ConfigError, DraftConfig, TreeSpec
from eagle3_jax.runner.speculators import ngram
from eagle3_jax.runner.speculators.chain import Chain, DraftCarry
from eagle3_jax.runner.speculators.dynamic_tree import Tree
from eagle3_jax.runner.speculators.protocol import DraftContext, DraftStart, Speculator

__all__ = ["SPECULATORS", "Chain", "DraftCarry", "DraftContext", "DraftStart", "Speculator", "Tree",
           "eagle3_proposal", "speculators_for"]


def eagle3_proposal(spec: TreeSpec, measures_top1_chain: bool = False) -> Speculator:
    """The drafter's proposal of shape `spec`: TreeSpec(K, 1, K) is the chain of K."""
    return Chain(spec.steps) if spec.is_chain else Tree(spec, measures_top1_chain)


def eagle3_proposals(specs: tuple[TreeSpec, ...], draft: DraftConfig | None) -> tuple[Speculator, ...]:
    """Each proposal shape by the EAGLE-3 head (none without a drafter); a tree beside a chain measures it."""
    if draft is None:
        return ()
    both = any(s.is_chain for s in specs) and not all(s.is_chain for s in specs)
    return tuple(eagle3_proposal(spec, measures_top1_chain=both) for spec in specs)


# name -> (the proposals' shapes, the engine's first; the drafter or None) -> the speculators drafting them
SPECULATORS: dict[str, Callable[[tuple[TreeSpec, ...], DraftConfig | None], tuple[Speculator, ...]]] = {
    "eagle3": eagle3_proposals,
    "ngram": ngram.proposals,
}


def speculators_for(name: str, specs: tuple[TreeSpec, ...], draft: DraftConfig | None) -> tuple[Speculator, ...]:
    if name not in SPECULATORS:
        raise ConfigError(f"speculator must be one of {', '.join(SPECULATORS)}, got {name!r}")
    return SPECULATORS[name](specs, draft)
