"""Rematerialisation chosen by the planner: where no ShardParallel plan fits the memory budget,
recompute activations in the backward pass instead of keeping them.

The loss is cut into n FLOP-balanced layers (`AutoLayerOption`, as pipelines cut it), each run
under `jax.checkpoint`, so the backward pass keeps only each layer's inputs and recomputes the
rest one layer at a time. Every n recomputes the same forward pass once; a finer cut keeps more
layer inputs but a smaller working set. The search is outside the ILP: each candidate is traced
and planned by the ILP with its recomputation priced by the cost model, and the first n (2, 4,
8, ...) whose plan fits is used. Recomputing layers regathers FSDP-stored parameters in the
backward pass by itself, so these traces need no whole-loss checkpoint.

Only GPU clusters (`ClusterSpec.platform == "gpu"`, the presets) recompute: XLA's CPU scheduler
runs the recomputation early, so on simulated CPU devices a recomputed GPT-4-layer step saved
14% of its temporaries where the memory model (and a GPU) would save 57%.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

from autopar.options import AutoLayerOption
from autopar.plan_store import tracing_record
from autopar.planner.cluster import ClusterSpec
from autopar.planner.errors import InvalidArgumentError, MemoryBudgetError
from autopar.planner.graph import is_checkpoint
from autopar.planner.intra import IntraOpConfig, plan_shard_parallel
from autopar.planner.plan import MeshPlan, Plan
from autopar.planner.summary import format_bytes
from autopar.tracing import TracedStep

logger = logging.getLogger(__name__)

LAYER_COUNTS = (2, 4, 8, 16, 32)  # layers to recompute separately, tried in order

RematTrace = Callable[[AutoLayerOption], TracedStep]  # the step traced with a layer option


def recomputes_on(cluster: ClusterSpec) -> bool:
    """Whether the planner recomputes activations by itself on `cluster` (GPU clusters only:
    see the module docstring)."""
    return cluster.platform == "gpu"


def remat_layers(num_layers: int) -> AutoLayerOption:
    """The layer option of a step recomputed in `num_layers` layers."""
    return AutoLayerOption(layer_num=num_layers, remat_mode="coarse_grained")


def plan_with_remat(
    trace: RematTrace,
    mesh: MeshPlan,
    cluster: ClusterSpec,
    config: IntraOpConfig,
    num_micro_batches: int,
    without: MemoryBudgetError,
) -> tuple[TracedStep, Plan]:
    """The step traced with recomputed layers and its plan, for the fewest layers that fit;
    a MemoryBudgetError saying what to change when none does. `without` is the error of the
    plan without recomputation."""
    least, tried = without.least, 0
    for n in LAYER_COUNTS if recomputes_on(cluster) else ():
        option = remat_layers(n)
        try:
            traced = trace(option)
        except InvalidArgumentError:  # the loss has too few heavy ops for n layers
            break
        if not any(map(is_checkpoint, traced.closed_jaxpr.jaxpr.eqns)):
            break  # no loss to cut: the step differentiates with jax.grad, not autopar.grad
        tried = n
        try:
            plan = plan_shard_parallel(traced.program, mesh, cluster, config, num_micro_batches)
        except MemoryBudgetError as e:
            least = min(least, e.least)
            continue
        logger.info("no plan fits without recomputation; recomputing %d layers fits", n)
        note = f"activations recomputed in the backward pass, the loss cut into {n} layers"
        plan = dataclasses.replace(
            plan, tracing=tracing_record(False, option), notes=(*plan.notes, note)
        )
        return traced, plan
    if tried:
        recomputed = f", nor recomputing activations in up to {tried} layers"
    elif not recomputes_on(cluster):
        recomputed = (
            f" (recomputation is not tried on the {cluster.platform} backend: its scheduler "
            "runs the recomputation early and keeps most of what it was meant to free)"
        )
    else:
        recomputed = (
            " (recomputing activations needs the loss differentiated with autopar.grad or "
            "autopar.value_and_grad)"
        )
    raise MemoryBudgetError(
        f"no sharding plan fits the memory budget of {format_bytes(without.budget)} per "
        f"device as the step is{recomputed}: the least memory per device any plan needs is "
        f"about {format_bytes(least)}. To fit, accumulate gradients over more micro-batches "
        f"(num_micro_batches={2 * num_micro_batches}), cut the model into pipeline stages "
        "(PipeshardParallel), use more devices, or raise "
        "AutoShardingOption(memory_budget_per_device=...)",
        without.budget,
        least,
    )
