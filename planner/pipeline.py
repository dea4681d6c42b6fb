"""Cut a layered train step into pipeline stages (Alpa's stage slicing) and build stage programs.

After `autopar.grad` differentiates a loss cut into L layers (`autopar.layering`), the step's
jaxpr holds, in order: the forward of layers 0..L-1 (forward markers ``layer=1..L`` between
them), the backward of layers L-1..0 (backward markers ``layer=L..1``), the gradient boundary and
the optimizer update. `split_step` gives every top-level eqn a part: the forward or backward of
one layer, or *apply* (the update, plus whatever the gradients do not depend on).

`place_stages` maps layer ranges to stages and places the apply eqns: an eqn that reads a
gradient (or a result derived from one) runs on the stage of the first such operand, so each
stage updates its own parameters; an eqn that reads no gradient (a step counter, a bias
correction) is recomputed on every stage that needs it instead of being shipped around.

`StageProgram` is one stage as a stand-alone ClosedJaxpr with the same variables as the step:
its forward eqns, its backward eqns, a gradient boundary over its own gradients and the
per-micro-batch values it sends to other stages, then its apply eqns. The intra-op ILP plans it
like any step (the boundary tells it what runs once per micro-batch) and the pipeline executor
runs its parts with that plan.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from jax.extend.core import (
    ClosedJaxpr,
    DebugInfo,
    Jaxpr,
    JaxprEqn,
    Literal,
    Var,
    new_jaxpr_eqn,
)

from autopar.planner.errors import PlanningError
from autopar.planner.fingerprint import jaxpr_fingerprint
from autopar.planner.graph import tensor_info
from autopar.planner.markers import grad_boundary_p, layer_boundary_p
from autopar.planner.micro_batches import ancestors, describe_eqn
from autopar.planner.program import Program, StepSignature


@dataclasses.dataclass(frozen=True)
class StepParts:
    """The step's top-level eqns (by index) per part; see the module docstring."""

    closed: ClosedJaxpr
    forward: tuple[tuple[int, ...], ...]  # per layer
    backward: tuple[tuple[int, ...], ...]  # per layer
    apply: tuple[int, ...]
    boundary: int  # the gradient boundary eqn

    @property
    def num_layers(self) -> int:
        return len(self.forward)


def split_step(closed: ClosedJaxpr, batch_inputs: Sequence[int]) -> StepParts:
    """Assign each top-level eqn of a layered step to a layer's forward or backward, or apply.

    `batch_inputs` (indices of the step's batch inputs) are split into micro-batches, so like
    the forward and backward results they may reach the apply part only through the boundary."""
    eqns = closed.jaxpr.eqns
    boundaries = [i for i, e in enumerate(eqns) if e.primitive is grad_boundary_p]
    if len(boundaries) != 1:
        raise PlanningError(
            "PipeshardParallel needs exactly one autopar.grad / autopar.value_and_grad call at the "
            f"top level of the train step (it marks where gradients are complete); found "
            f"{len(boundaries)}"
        )
    b = boundaries[0]
    forward_markers = [
        e.params["layer"]
        for e in eqns[:b]
        if e.primitive is layer_boundary_p and e.params["kind"] == "forward"
    ]
    if not forward_markers:
        raise PlanningError(
            "the train step has no layer boundaries: trace it with a layer option, and "
            "differentiate the loss with autopar.grad / autopar.value_and_grad"
        )
    num_layers = max(forward_markers)
    needed = ancestors(eqns[b].invars, eqns)
    live = ancestors(closed.jaxpr.outvars, eqns)  # the rest is dead code
    forward: list[list[int]] = [[] for _ in range(num_layers)]
    backward: list[list[int]] = [[] for _ in range(num_layers)]
    apply: list[int] = []
    part, layer = forward, 0
    for i, eqn in enumerate(eqns[:b]):
        if eqn.primitive is layer_boundary_p:
            k, kind = eqn.params["layer"], eqn.params["kind"]
            if kind == "forward" and k < num_layers:
                layer = k  # the marker opens layer k
            elif kind == "forward":  # the loss's marker closes the forward pass
                part[num_layers - 1].append(i)
                part, layer = backward, num_layers - 1
                continue
            elif kind == "backward" and k < num_layers:
                part[k].append(i)  # the cotangents leave layer k
                layer = k - 1
                continue
            elif kind != "backward":
                raise PlanningError(
                    f"{describe_eqn(eqn)}: a layer boundary of kind {kind!r} in the step; "
                    "forward-mode differentiation (jax.jvp) of a layered loss cannot be pipelined"
                )
        if i in needed or eqn.primitive is layer_boundary_p:
            part[layer].append(i)
        elif i in live:
            apply.append(i)  # the gradients do not need it: compute it once, with the update
    apply.extend(i for i in range(b + 1, len(eqns)) if i in live)
    parts = StepParts(
        closed, tuple(map(tuple, forward)), tuple(map(tuple, backward)), tuple(apply), b
    )
    _check_apply_reads(parts, batch_inputs)
    return parts


def memory_floor(parts: StepParts, batch_inputs: Sequence[int]) -> tuple[float, float]:
    """(state, activations): bytes that every pipeline plan of the step holds at once, summed
    over its devices. The state is the step's inputs other than the batch (parameters,
    optimizer state); the activations are one micro-batch of what each layer's backward reads
    from its own forward and that depends on the batch (every stage keeps at least one
    micro-batch in flight). Spread evenly over N devices, (state + activations) / N bounds a
    plan's memory per device from below."""
    jaxpr = parts.closed.jaxpr
    batch = set(batch_inputs)
    state = sum(tensor_info(v.aval).nbytes for i, v in enumerate(jaxpr.invars) if i not in batch)
    from_batch = {v for i, v in enumerate(jaxpr.invars) if i in batch}
    for eqn in jaxpr.eqns:
        if any(isinstance(v, Var) and v in from_batch for v in eqn.invars):
            from_batch.update(eqn.outvars)
    activations = 0
    for forward, backward in zip(parts.forward, parts.backward, strict=True):
        made = {v for i in forward for v in jaxpr.eqns[i].outvars if v in from_batch}
        read = {v for i in backward for v in jaxpr.eqns[i].invars if isinstance(v, Var)}
        activations += sum(tensor_info(v.aval).nbytes for v in made & read)
    return float(state), float(activations)


def _check_apply_reads(parts: StepParts, batch_inputs: Sequence[int]) -> None:
    """Per-micro-batch values may reach the update and the outputs only through the boundary."""
    jaxpr = parts.closed.jaxpr
    eqns = jaxpr.eqns
    # what made each per-micro-batch value: an eqn, described only for the error
    made_by: dict[Var, JaxprEqn | None] = {
        v: eqns[i]
        for part in (*parts.forward, *parts.backward)
        for i in part
        for v in eqns[i].outvars
    }
    made_by.update((jaxpr.invars[i], None) for i in batch_inputs)
    readers: list[tuple[JaxprEqn | None, Sequence]] = [
        (eqns[i], eqns[i].invars) for i in parts.apply
    ]
    readers.append((None, jaxpr.outvars))
    for reader, invars in readers:
        for v in invars:
            if isinstance(v, Var) and v in made_by:
                who = "the step's outputs" if reader is None else describe_eqn(reader)
                what = "a batch input" if made_by[v] is None else describe_eqn(made_by[v])
                raise PlanningError(
                    f"{who} reads a value of a micro-batch ({what}) outside the "
                    "gradient computation; compute it in the loss function and return it as "
                    "aux (has_aux=True) so it is accumulated over micro-batches"
                )


@dataclasses.dataclass(frozen=True)
class StagePlacement:
    """Which stage runs each part: layer ranges, and the apply eqns of each stage."""

    layer_ranges: tuple[tuple[int, int], ...]
    apply: tuple[tuple[int, ...], ...]  # per stage, eqn indices (shared ones on several stages)
    boundary_operands: tuple[tuple[int, ...], ...]  # per stage: positions of boundary operands
    output_stage: tuple[int | None, ...]  # per step output: the stage that produces it

    @property
    def num_stages(self) -> int:
        return len(self.layer_ranges)


def place_stages(parts: StepParts, layer_ranges: Sequence[tuple[int, int]]) -> StagePlacement:
    """Stages for contiguous `layer_ranges` covering every layer; see the module docstring."""
    ranges = tuple((int(a), int(b)) for a, b in layer_ranges)
    flat = [k for a, b in ranges for k in range(a, b)]
    if flat != list(range(parts.num_layers)) or any(a >= b for a, b in ranges):
        raise PlanningError(
            f"stage layer ranges {ranges} must cover layers 0..{parts.num_layers - 1} in order, "
            "each stage at least one layer"
        )
    eqns = parts.closed.jaxpr.eqns
    last = len(ranges) - 1
    stage_of: dict[Var, int] = {}
    for s, (a, b) in enumerate(ranges):
        for k in range(a, b):
            for i in (*parts.forward[k], *parts.backward[k]):
                stage_of.update(dict.fromkeys(eqns[i].outvars, s))
    boundary = eqns[parts.boundary]
    operands: list[list[int]] = [[] for _ in ranges]
    for pos, (v, out) in enumerate(zip(boundary.invars, boundary.outvars, strict=True)):
        s = stage_of.get(v, last) if isinstance(v, Var) else last
        operands[s].append(pos)
        stage_of[out] = s
    # Apply eqns that read a gradient-derived value run where the first such operand lives;
    # the others ("shared") run on every stage that reads their results.
    shared: list[int] = []
    owned: dict[int, int] = {}
    for i in parts.apply:
        found = [stage_of[v] for v in eqns[i].invars if isinstance(v, Var) and v in stage_of]
        if found:
            owned[i] = found[0]
            stage_of.update(dict.fromkeys(eqns[i].outvars, found[0]))
        else:
            shared.append(i)
    readers: dict[Var, set[int]] = {}
    for part, s in _stage_parts(parts, ranges, owned):
        for i in part:
            for v in eqns[i].invars:
                if isinstance(v, Var):
                    readers.setdefault(v, set()).add(s)
    output_stage: list[int | None] = []
    shared_out = {v for i in shared for v in eqns[i].outvars}
    for v in parts.closed.jaxpr.outvars:
        if not isinstance(v, Var):  # a constant result: no stage makes it
            output_stage.append(None)
            continue
        if v in shared_out:
            readers.setdefault(v, set()).add(0)  # a result nobody else reads: stage 0 makes it
        output_stage.append(stage_of.get(v, 0 if v in shared_out else None))
    runs_on: dict[int, set[int]] = {}
    for i in reversed(shared):  # readers come later in program order
        stages = set().union(*(readers.get(v, set()) for v in eqns[i].outvars))
        runs_on[i] = stages
        for v in eqns[i].invars:
            if isinstance(v, Var):
                readers.setdefault(v, set()).update(stages)
    apply = [
        tuple(i for i in parts.apply if owned.get(i) == s or s in runs_on.get(i, ()))
        for s in range(len(ranges))
    ]
    return StagePlacement(ranges, tuple(apply), tuple(map(tuple, operands)), tuple(output_stage))


def _stage_parts(parts: StepParts, ranges, owned: dict[int, int]):
    """(eqn indices, stage) for the forward/backward parts and the owned apply eqns."""
    for s, (a, b) in enumerate(ranges):
        for k in range(a, b):
            yield parts.forward[k], s
            yield parts.backward[k], s
    for i, s in owned.items():
        yield (i,), s


@dataclasses.dataclass(frozen=True)
class StageProgram:
    """One stage as a ClosedJaxpr over the step's variables (see the module docstring).

    Eqns ``[0, num_forward)`` are the forward part, the next ``num_backward`` the backward part,
    then the gradient boundary, then the apply part. Invars are the step inputs the stage reads
    (in step order) followed by values it receives from other stages; outvars are the values it
    sends and the step outputs it produces.
    """

    index: int
    layers: tuple[int, int]
    closed: ClosedJaxpr
    program: Program
    num_forward: int
    num_backward: int
    grads: tuple[Var, ...]  # boundary operands this stage accumulates over micro-batches
    means: tuple[Var, ...]  # the matching boundary results (the accumulated averages)
    per_micro_batch_inputs: frozenset[Var]  # invars that differ per micro-batch

    @property
    def boundary_index(self) -> int:
        return self.num_forward + self.num_backward

    def part(self, kind: str) -> list[tuple[str, JaxprEqn]]:
        """(node id, eqn) of the "forward", "backward" or "apply" part."""
        bounds = {
            "forward": (0, self.num_forward),
            "backward": (self.num_forward, self.boundary_index),
            "apply": (self.boundary_index + 1, len(self.closed.jaxpr.eqns)),
        }[kind]
        return [(str(i), self.closed.jaxpr.eqns[i]) for i in range(*bounds)]


# markers' parameters that say which parameter or layer they touch, not what is computed
_UNSTRUCTURAL_PARAMS = ("index", "layer", "grad_of")


def structural_fingerprint(closed: ClosedJaxpr) -> str:
    """Equal for programs that differ only in which parameters and layers they touch, so
    repeated layers are planned and costed once."""
    return jaxpr_fingerprint(closed, _UNSTRUCTURAL_PARAMS)


def stage_program(
    parts: StepParts, placement: StagePlacement, stage: int, signature: StepSignature
) -> StageProgram:
    """Stage `stage` of `placement` as a `StageProgram`."""
    jaxpr = parts.closed.jaxpr
    eqns = jaxpr.eqns
    a, b = placement.layer_ranges[stage]
    fwd = sorted(i for k in range(a, b) for i in parts.forward[k])
    bwd = sorted(i for k in range(a, b) for i in parts.backward[k])
    apply = list(placement.apply[stage])
    mine = set(fwd) | set(bwd) | set(apply)
    per_micro_batch_defs = {
        v: s
        for s in range(placement.num_stages)
        for i in _stage_fb(parts, placement, s)
        for v in eqns[i].outvars
    }
    boundary = eqns[parts.boundary]
    positions = placement.boundary_operands[stage]
    grads = tuple(boundary.invars[p] for p in positions)
    means = tuple(boundary.outvars[p] for p in positions)

    defined = {v for i in mine for v in eqns[i].outvars} | set(means)
    read_elsewhere = _read_by_other_stages(parts, placement, stage, defined)
    sends = [v for i in (*fwd, *bwd) for v in eqns[i].outvars if v in read_elsewhere]
    sub_boundary = new_jaxpr_eqn(
        [*grads, *sends],
        [*means, *(Var(v.aval) for v in sends)],
        grad_boundary_p,
        {"grad_of": (*(boundary.params["grad_of"][p] for p in positions), *(-1,) * len(sends))},
        boundary.effects,
    )
    body = [eqns[i] for i in (*fwd, *bwd)] + [sub_boundary] + [eqns[i] for i in apply]

    step_inputs = {v: k for k, v in enumerate(jaxpr.invars)}
    consts = dict(zip(jaxpr.constvars, parts.closed.consts, strict=True))
    inner = {v for e in body for v in e.outvars}
    reads = dict.fromkeys(
        v for e in body for v in e.invars if isinstance(v, Var) and v not in inner
    )
    invars = sorted((v for v in reads if v in step_inputs), key=step_inputs.get)
    invars += [v for v in reads if v not in step_inputs and v not in consts]
    constvars = [v for v in reads if v in consts]
    out_index = {v: j for j, v in enumerate(jaxpr.outvars) if placement.output_stage[j] == stage}
    ordered = [v for e in body for v in e.outvars]
    outvars = list(dict.fromkeys([*sends, *(v for v in ordered if v in read_elsewhere)]))
    outvars += [v for v in out_index if v not in outvars and isinstance(v, Var) and v in inner]
    names = (
        *(
            signature.input_paths[step_inputs[v]] if v in step_inputs else f"in{p}"
            for p, v in enumerate(invars)
        ),
    )
    debug = DebugInfo(f"autopar stage {stage}", None, names, None)
    closed = ClosedJaxpr(
        Jaxpr(constvars, invars, outvars, body, effects=jaxpr.effects, debug_info=debug),
        [consts[v] for v in constvars],
    )

    per_micro_batch = frozenset(
        v
        for v in invars
        if (v in step_inputs and step_inputs[v] in signature.batch_inputs)
        or v in per_micro_batch_defs
    )
    position = {v: p for p, v in enumerate(invars)}
    output_to_input = tuple(
        _updated_input(signature, out_index.get(v), jaxpr.invars, position) for v in outvars
    )
    stage_signature = StepSignature(
        input_paths=tuple(
            signature.input_paths[step_inputs[v]] if v in step_inputs else f"stage{stage}.in{p}"
            for p, v in enumerate(invars)
        ),
        output_paths=tuple(
            signature.output_paths[out_index[v]] if v in out_index else f"stage{stage}.out{j}"
            for j, v in enumerate(outvars)
        ),
        input_avals=tuple(tensor_info(v.aval) for v in invars),
        output_avals=tuple(tensor_info(v.aval) for v in outvars),
        batch_inputs=tuple(p for p, v in enumerate(invars) if v in per_micro_batch),
        donated_inputs=tuple(
            p
            for p, v in enumerate(invars)
            if v in step_inputs and step_inputs[v] in signature.donated_inputs
        ),
        output_to_input=output_to_input,
    )
    program = Program(closed, stage_signature, structural_fingerprint(closed))
    return StageProgram(
        index=stage,
        layers=(a, b),
        closed=closed,
        program=program,
        num_forward=len(fwd),
        num_backward=len(bwd),
        grads=grads,
        means=means,
        per_micro_batch_inputs=per_micro_batch,
    )


def _updated_input(
    signature: StepSignature, output: int | None, step_invars, position: dict[Var, int]
) -> int | None:
    """The stage input that step output `output` is the new value of, if the stage reads it."""
    if output is None or signature.output_to_input[output] is None:
        return None
    return position.get(step_invars[signature.output_to_input[output]])


def _stage_fb(parts: StepParts, placement: StagePlacement, stage: int) -> list[int]:
    a, b = placement.layer_ranges[stage]
    return [i for k in range(a, b) for i in (*parts.forward[k], *parts.backward[k])]


def _read_by_other_stages(
    parts: StepParts, placement: StagePlacement, stage: int, defined: set[Var]
) -> set[Var]:
    """Values `stage` defines that another stage reads without computing them itself."""
    eqns = parts.closed.jaxpr.eqns
    boundary = eqns[parts.boundary]
    found: set[Var] = set()
    for s in range(placement.num_stages):
        if s == stage:
            continue
        own = [*_stage_fb(parts, placement, s), *placement.apply[s]]
        computes = {v for i in own for v in eqns[i].outvars}
        reads = [v for i in own for v in eqns[i].invars]
        reads += [boundary.invars[p] for p in placement.boundary_operands[s]]
        found.update(
            v
            for v in reads
            if isinstance(v, Var)
            and not isinstance(v, Literal)
            and v in defined
            and v not in computes
        )
    return found
