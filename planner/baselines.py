"""Classic layouts priced by the intra-op ILP: data parallelism, ZeRO-2, ZeRO-3 and Megatron-LM.

A baseline fixes the storage spec of EVERY step input (`IntraOpConfig.pinned_inputs`) and lets
the ILP choose the strategies of the ops in between, so it is priced by the same cost model as
the ILP's own plan and is never worse than the layout's natural strategies. The unrestricted ILP
can store inputs in any of these specs, so (up to its solver gap and time limit) its plan is
never predicted slower than a baseline that fits the same memory budget.

Inputs play one of four roles (`input_roles`): the batch; parameters (the inputs that
`autopar.grad` differentiates); parameter state (optimizer state that mirrors a parameter: same
trailing dict-key path and shape, such as Adam's ``mu`` and ``nu``); and other state (step
counters). The layouts, for a mesh of n devices:

* DP: batch split on dim 0 over all axes; everything else replicated.
* Z2 (ZeRO-2): as DP, with parameter state split on its largest dim divisible by n (`split_spec`).
* Z3 (ZeRO-3 / FSDP): as Z2, with parameters split the same way.
* Megatron (tensor parallelism): on a 1D mesh over all devices with the batch replicated; on a
  2D (hosts x devices) mesh within a host (axis 1), with the batch split over hosts (axis 0),
  as Megatron-LM runs. Parameter state mirrors its parameter. Each parameter by its dict-key
  path (`megatron_spec`):

  - ``...['embedding']`` (an embedding table): split on dim 0, the vocabulary
    (VocabParallelEmbedding);
  - ``...['<layer>']['kernel']`` of 2 or more dims: column-parallel when ``<layer>`` is a name
    in `COLUMN_PARALLEL` (q/k/v projections, the first MLP layer, the LM head), row-parallel
    when it is in `ROW_PARALLEL` (attention output, the second MLP layer); other kernels
    alternate column, row, column, ... in the order the step first uses them, so that a
    column-parallel layer feeds a row-parallel one as in Megatron's MLP. Column-parallel splits
    the first output dim divisible by n (a ``(in, heads, head_dim)`` kernel: heads, else
    head_dim), row-parallel the first input dim divisible by n; convolution kernels (4 dims or
    more, ``(*window, in, out)``) split out- or in-channels. A kernel with no such dim falls
    back to the Z3 split (largest dim divisible by n), or stays replicated;
  - ``...['bias']`` of a column-parallel layer: split like its outputs (first dim divisible);
  - everything else (row-parallel biases, norm scales, position embeddings, scalars):
    replicated.
"""

from __future__ import annotations

import dataclasses
import enum
import re
from collections.abc import Sequence

from autopar.planner.cluster import ClusterSpec
from autopar.planner.errors import InfeasibleError
from autopar.planner.explicit import split_spec
from autopar.planner.gradients import param_inputs
from autopar.planner.intra import IntraOpConfig, ShardingProblem
from autopar.planner.plan import MeshPlan, Plan, Predicted, Spec, replicated
from autopar.planner.program import Program

# Plans within this relative difference of step time are "equal": the ILP's objective adds a
# storage tie-break and the solver stops within its default gap.
TOLERANCE = 1e-4


class Baseline(enum.Enum):
    """A classic storage layout (see the module docstring)."""

    DP = "DP"
    Z2 = "Z2"
    Z3 = "Z3"
    MEGATRON = "Megatron"


class InputRole(enum.Enum):
    """What a step input is, for choosing its baseline storage."""

    BATCH = "batch"
    PARAM = "param"
    PARAM_STATE = "param_state"  # optimizer state mirroring a parameter (Adam's mu, nu)
    OTHER = "other"  # other state: step and optimizer counters


COLUMN_PARALLEL = frozenset(
    {
        *("query", "key", "value", "qkv", "q_proj", "k_proj", "v_proj", "c_attn"),
        *("fc_in", "fc1", "c_fc", "wi", "wi_0", "wi_1", "w1", "w3", "up_proj", "gate_proj"),
        *("dense_h_to_4h", "lm_head"),
    }
)
"""Layer names whose kernels Megatron splits column-parallel (on their outputs)."""
ROW_PARALLEL = frozenset(
    {
        *("out", "o_proj", "out_proj", "c_proj", "attn_out"),
        *("fc_out", "fc2", "wo", "w2", "down_proj", "dense_4h_to_h"),
    }
)
"""Layer names whose kernels Megatron splits row-parallel (on their inputs)."""

# The roles each ZeRO stage stores split (the Z3 split: largest dim divisible by n).
_SPLIT_ROLES = {
    Baseline.Z2: (InputRole.PARAM_STATE,),
    Baseline.Z3: (InputRole.PARAM_STATE, InputRole.PARAM),
}
_KEY_CHAIN = re.compile(r"(?:\['[^']*'\])+$")
_KEY = re.compile(r"\['([^']*)'\]")


def key_path(path: str) -> tuple[str, ...]:
    """The trailing dict keys of an input path: ``state.params['fc']['kernel']`` → (fc, kernel)."""
    found = _KEY_CHAIN.search(path)
    return tuple(_KEY.findall(found.group(0))) if found else ()


def input_roles(program: Program) -> tuple[InputRole, ...]:
    """The role of each step input (see the module docstring)."""
    sig = program.signature
    params = set(param_inputs(program.graph).values())
    param_keys = {
        (key_path(sig.input_paths[i]), tuple(sig.input_avals[i].shape))
        for i in params
        if key_path(sig.input_paths[i])
    }
    roles = []
    for i, (path, aval) in enumerate(zip(sig.input_paths, sig.input_avals, strict=True)):
        if i in sig.batch_inputs:
            roles.append(InputRole.BATCH)
        elif i in params:
            roles.append(InputRole.PARAM)
        elif key_path(path) and (key_path(path), tuple(aval.shape)) in param_keys:
            roles.append(InputRole.PARAM_STATE)
        else:
            roles.append(InputRole.OTHER)
    return tuple(roles)


def _split(ndim: int, dim: int, axes: tuple[str, ...]) -> Spec:
    return tuple(axes if d == dim else None for d in range(ndim))


def _first_divisible(shape: Sequence[int], dims: Sequence[int], n: int) -> int | None:
    return next((d for d in dims if shape[d] % n == 0 and shape[d] >= n), None)


def megatron_spec(
    keys: tuple[str, ...], shape: tuple[int, ...], column: bool, axes: tuple[str, ...], n: int
) -> Spec:
    """Megatron's storage of one parameter with dict-key path `keys` (see the module docstring).

    `column` says whether a kernel whose layer name is in neither `COLUMN_PARALLEL` nor
    `ROW_PARALLEL` is column-parallel (by the order of use); `n` devices over `axes`."""
    leaf = keys[-1] if keys else ""
    layer = keys[-2] if len(keys) > 1 else ""
    ndim = len(shape)
    if leaf == "embedding" and ndim >= 1 and shape[0] % n == 0:
        return _split(ndim, 0, axes)  # vocab-parallel embedding
    if leaf == "kernel" and ndim >= 2:
        if layer in COLUMN_PARALLEL or layer in ROW_PARALLEL:
            column = layer in COLUMN_PARALLEL
        if ndim >= 4:  # convolution (*window, in, out)
            dims = [ndim - 1] if column else [ndim - 2]
        else:
            dims = list(range(1, ndim)) if column else list(range(ndim - 1))
        dim = _first_divisible(shape, dims, n)
        return _split(ndim, dim, axes) if dim is not None else split_spec(shape, axes, n)
    if leaf == "bias" and column and ndim >= 1:
        dim = _first_divisible(shape, range(ndim), n)
        return _split(ndim, dim, axes) if dim is not None else replicated(ndim)
    return replicated(ndim)


def _first_uses(program: Program) -> dict[int, int]:
    """Input index → position of the first node reading it (program order)."""
    position = {node.id: k for k, node in enumerate(program.graph.nodes)}
    graph = program.graph
    return {
        i: min((position[n] for n, _ in graph.input_consumers(i)), default=len(position))
        for i in range(len(graph.inputs))
    }


def _megatron_params(program: Program, roles: Sequence[InputRole], axes, n) -> dict:
    """(key path, shape) → spec of every parameter under the Megatron layout."""
    sig = program.signature
    params = [i for i, role in enumerate(roles) if role is InputRole.PARAM]
    uses = _first_uses(program)
    # Kernels of unnamed layers alternate column/row in the order of first use; a layer's
    # bias follows its kernel.
    column_layers: dict[tuple[str, ...], bool] = {}
    unnamed = 0
    for i in sorted(params, key=lambda i: (uses[i], i)):
        keys = key_path(sig.input_paths[i])
        if keys and keys[-1] == "kernel" and len(sig.input_avals[i].shape) >= 2:
            layer = keys[-2] if len(keys) > 1 else ""
            if layer in COLUMN_PARALLEL or layer in ROW_PARALLEL:
                column_layers[keys[:-1]] = layer in COLUMN_PARALLEL
            else:
                column_layers[keys[:-1]] = unnamed % 2 == 0
                unnamed += 1
    specs = {}
    for i in params:
        keys, shape = key_path(sig.input_paths[i]), tuple(sig.input_avals[i].shape)
        column = column_layers.get(keys[:-1], False)
        specs[(keys, shape)] = megatron_spec(keys, shape, column, axes, n)
    return specs


def baseline_pins(
    program: Program, baseline: Baseline, mesh: MeshPlan
) -> tuple[tuple[str, Spec], ...]:
    """The storage spec of every step input under `baseline` on `mesh`."""
    sig = program.signature
    roles = input_roles(program)
    all_axes, n = tuple(mesh.axis_names), mesh.num_devices
    megatron = baseline is Baseline.MEGATRON
    if megatron and len(mesh.shape) == 2:  # tensor parallel in a host, batch split over hosts
        tp_axes, tp = (mesh.axis_names[1],), mesh.shape[1]
        batch_axes, batch_n = (mesh.axis_names[0],), mesh.shape[0]
    else:
        tp_axes, tp = all_axes, n
        batch_axes, batch_n = ((), 1) if megatron else (all_axes, n)
    layout = _megatron_params(program, roles, tp_axes, tp) if megatron else {}
    pins = []
    for path, aval, role in zip(sig.input_paths, sig.input_avals, roles, strict=True):
        shape = tuple(aval.shape)
        if role is InputRole.BATCH:
            spec = replicated(len(shape))
            if batch_n > 1:
                if shape[0] % batch_n:
                    raise ValueError(
                        f"batch input {path} of shape {shape} does not split over {batch_n} devices"
                    )
                spec = _split(len(shape), 0, batch_axes)
        elif megatron and role in (InputRole.PARAM, InputRole.PARAM_STATE):
            spec = layout[(key_path(path), shape)]
        elif role in _SPLIT_ROLES.get(baseline, ()):
            spec = split_spec(shape, all_axes, n)
        else:
            spec = replicated(len(shape))
        pins.append((path, spec))
    return tuple(pins)


class LayoutStatus(enum.Enum):
    """How pricing a layout ended."""

    OK = "ok"  # planned within the memory budget
    OOM = "oom"  # plans exist, but none within the memory budget
    INFEASIBLE = "infeasible"  # no plan at all with these pins (none in the ILP's menus)
    UNAVAILABLE = "n/a"  # the layout does not apply (e.g. the batch does not split), see message


@dataclasses.dataclass(frozen=True)
class LayoutResult:
    """A layout priced by the ILP: its plan and prediction if it fits, else what it needs.

    `least_memory_bytes` is the least peak memory per device any plan of the layout needs
    (set when it does not fit)."""

    name: str
    status: LayoutStatus
    predicted: Predicted | None = None
    least_memory_bytes: float | None = None
    message: str = ""
    plan: Plan | None = dataclasses.field(default=None, compare=False, repr=False)

    @property
    def fits(self) -> bool:
        return self.status is LayoutStatus.OK

    @property
    def step_time_s(self) -> float | None:
        return None if self.predicted is None else self.predicted.step_time_s

    @property
    def memory_per_device_bytes(self) -> float | None:
        """Predicted peak per device if it fits; else the least it would need (or None)."""
        return (
            self.least_memory_bytes
            if self.predicted is None
            else (self.predicted.memory_per_device_bytes)
        )


def price_layout(
    program: Program,
    mesh: MeshPlan,
    cluster: ClusterSpec,
    config: IntraOpConfig,
    num_micro_batches: int,
    name: str = "ILP",
) -> LayoutResult:
    """Plan `program` with the ILP under `config` (its pins, its memory budget) and say how it
    went. A `PlanningError` other than "over budget" or "no plan at all" propagates."""
    problem = ShardingProblem(program, mesh, cluster, config, num_micro_batches)
    budget = config.budget(cluster)
    try:
        plan = problem.solve(budget)
        if plan is not None:
            return LayoutResult(name, LayoutStatus.OK, plan.predicted, plan=plan)
        least = problem.least_memory()
    except InfeasibleError as e:
        return LayoutResult(name, LayoutStatus.INFEASIBLE, message=str(e))
    message = str(problem.over_budget(budget, least))
    return LayoutResult(name, LayoutStatus.OOM, least_memory_bytes=least, message=message)


def price_baseline(
    program: Program,
    baseline: Baseline,
    mesh: MeshPlan,
    cluster: ClusterSpec,
    config: IntraOpConfig,
    num_micro_batches: int,
) -> LayoutResult:
    """`baseline`'s layout of `program` on `mesh`, priced by the ILP (other pins in `config`
    are replaced)."""
    pins = baseline_pins(program, baseline, mesh)
    pinned = dataclasses.replace(config, pinned_inputs=pins)
    return price_layout(program, mesh, cluster, pinned, num_micro_batches, baseline.value)
