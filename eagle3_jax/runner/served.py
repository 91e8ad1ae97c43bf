"""The engine configuration as served: `served_config` turns what the user asked for (an EngineConfig)
into a ServedConfig for the target, the drafter and the device, once per engine, before the runner
is built. Everything EngineConfig leaves open is settled here and nowhere else: the tree "auto"
chooses, the speculators drafting each proposal, the batch buckets and slots, the KV pool's pages
and the kernels the device runs. The engine, its scheduler and the runner read the one result.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
from jax.sharding import Mesh

from eagle3_jax.config import (
    ConfigError,
    DraftConfig,
    EngineConfig,
    KernelConfig,
    ModelConfig,
    ServedConfig,
    SpeculationConfig,
    check_max_num_seqs,
    check_proposal_fits,
    check_tree,
    default_batch_buckets,
    default_tree,
    drafted,
    proposal_specs,
)
from eagle3_jax.model import invariant_gemm
from eagle3_jax.parallel import sharding
from eagle3_jax.runner import kv_memory
from eagle3_jax.runner.speculators import speculators_for


@dataclasses.dataclass(frozen=True)
class DeviceFacts:
    """What settling a configuration needs of the devices an engine runs on."""

    backend: str  # jax.default_backend(): "cpu", "gpu", ...
    name: str  # the first device's kind, for messages
    hopper: bool  # an NVIDIA Hopper GPU (wgmma, TMA: the Mosaic GEMV's)
    tp: int | None  # the mesh's tensor-parallel degree (None: no mesh)
    free_bytes: int | None = None  # the least free over the devices once the weights are placed (None: not read)
    held_elsewhere: int | None = None  # bytes in use there beyond the engine's own weights then

    @classmethod
    def of(cls, mesh: Mesh | None, weights: Sequence | None = None) -> DeviceFacts:
        """The devices of `mesh` (None: the default one); with `weights`, every array the engine
        holds, their free memory too (`kv_memory.free_bytes`, `kv_memory.held_elsewhere`)."""
        first = jax.devices()[0]
        hopper = first.platform == "gpu" and str(getattr(first, "compute_capability", "")).startswith("9.")
        devices = jax.devices()[:1] if mesh is None else list(mesh.devices.flat)
        free = held = None
        if weights is not None:
            free, held = kv_memory.free_bytes(devices), kv_memory.held_elsewhere(devices, weights)
        tp = None if mesh is None else mesh.shape[sharding.TP]
        return cls(jax.default_backend(), first.device_kind, hopper, tp, free, held)


def served_config(cfg: EngineConfig, target: ModelConfig, draft: DraftConfig | None, device: DeviceFacts,
                  kv_dtype) -> ServedConfig:
    """`cfg` as served with `target`, `draft` (None: no drafter) on `device`, its KV pool in `kv_dtype`.
    ConfigError naming what cannot be served."""
    speculation = settled_speculation(cfg, draft, device.backend)
    kernels = KernelConfig(attention=attention_kind(cfg, device), gemv=gemv_kind(cfg, device), gemm=cfg.gemm,
                           batch_invariant=batch_invariant(cfg, target, device))
    buckets = cfg.batch_buckets or default_batch_buckets([f.spec for f in speculation.facts], cfg.batch_buckets_up_to)
    check_max_num_seqs(cfg.max_num_seqs, buckets[-1])
    seqs = cfg.max_num_seqs or buckets[-1]
    pool_draft = draft if any(f.uses_drafter for f in speculation.facts) else None
    tp = device.tp or 1
    pool = kv_memory.pool_config(cfg, seqs, speculation.tree,
                                 lambda: kv_memory.page_bytes(target, pool_draft, cfg.page_size, kv_dtype, tp),
                                 device.free_bytes, tp)
    return ServedConfig(max_model_len=cfg.max_model_len, max_num_seqs=seqs, batch_buckets=buckets,
                        prefill_buckets=cfg.prefill_buckets, prefill_batch_buckets=cfg.prefill_batch_buckets,
                        freeze_heap=cfg.freeze_heap, speculation=speculation, pool=pool, kernels=kernels,
                        structured_warmup=cfg.structured_warmup)


def settled_speculation(cfg: EngineConfig, draft: DraftConfig | None, backend: str) -> SpeculationConfig:
    """The tree chosen where "auto" ("`default_tree`"), a chain-shaped one as the chain of its steps,
    and the speculator named drafting each proposal (runner/speculators' SPECULATORS)."""
    tree = default_tree(cfg, draft is not None, backend) if cfg.tree == "auto" else cfg.tree
    if tree is not None:
        check_tree(tree, cfg.fused_iteration)
    tree, k = drafted(tree, cfg.num_speculative_tokens)
    proposals = speculators_for(cfg.speculator, proposal_specs(tree, k, cfg.speculation), draft)
    for proposal in proposals:
        if proposal.facts.uses_drafter:
            check_proposal_fits(proposal.facts.spec, draft)
    return SpeculationConfig(speculator=cfg.speculator, num_speculative_tokens=k, tree=tree, proposals=proposals,
                             mode=cfg.speculation, speculative_max_batch=cfg.speculative_max_batch,
                             step_costs=cfg.step_costs, fused_iteration=cfg.fused_iteration)


def untuned_tiles_line(kernels: KernelConfig, device: DeviceFacts) -> str | None:
    """The start-up warning for batch-invariant kernels on a GPU kind the GEMM tile table does not
    cover (None where it does, or where they do not run): its rule's tiles give the same bits, only
    slower where a tuned tile would win."""
    if not kernels.batch_invariant or device.backend != "gpu" or invariant_gemm.tuned_tiles(device.name):
        return None
    return (f"batch-invariant GEMM: no tuned tiles for {device.name!r} in {invariant_gemm.TUNED_TILES_FILE.name} "
            f"or ${invariant_gemm.TUNED_TILES_ENV}: every projection runs the untuned rule's tile (the same bits, "
            "maybe slower); scripts/invariance_h200.py --phase attribution writes a table for this GPU")


def attention_kind(cfg: EngineConfig, device: DeviceFacts) -> str:
    """EngineConfig.attention settled: "auto" is Pallas on one GPU (XLA does not partition a pallas_call)."""
    if cfg.attention == "pallas" and device.tp is not None:
        raise ConfigError("engine config: attention 'pallas' does not run under tensor parallelism "
                          "(use 'auto' or 'xla')")
    if cfg.attention != "auto":
        return cfg.attention
    return "pallas" if device.backend == "gpu" and device.tp is None else "xla"


def batch_invariant(cfg: EngineConfig, target: ModelConfig, device: DeviceFacts) -> bool:
    """EngineConfig.batch_invariant, checked: under tp each device must hold whole kv groups (`per_device`)."""
    tp = device.tp or 1
    if cfg.batch_invariant and not sharding.kv_heads_split(target.num_kv_heads, tp):
        raise ConfigError(f"engine config: batch_invariant under tensor parallelism needs the {target.num_kv_heads} "
                          f"kv heads split evenly over tp={tp} (use batch_invariant=False, or a tp dividing them)")
    return cfg.batch_invariant


def gemv_kind(cfg: EngineConfig, device: DeviceFacts) -> str:
    """EngineConfig.gemv, checked: the Mosaic kernel needs one Hopper GPU (wgmma, TMA; XLA won't partition it)."""
    if cfg.gemv == "mosaic" and (device.tp is not None or not device.hopper):
        where = " under tensor parallelism" if device.tp is not None else ""
        raise ConfigError(f"engine config: gemv 'mosaic' runs on one Hopper GPU only, not on "
                          f"{device.name}{where} (use 'xla')")
    return cfg.gemv
