"""Executable: a compiled plan, called with the user's pytrees, with its HLO and memory readable."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from typing import Any

import jax
from jax.sharding import NamedSharding

from autopar.planner.plan import Plan

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")


@dataclasses.dataclass(frozen=True)
class MemoryStats:
    """Per-device bytes from XLA's compiled memory analysis."""

    argument_bytes: int
    output_bytes: int
    alias_bytes: int
    temp_bytes: int

    @classmethod
    def of(cls, compiled: jax.stages.Compiled) -> MemoryStats:
        """XLA's compiled memory analysis of `compiled`."""
        m = compiled.memory_analysis()
        return cls(
            argument_bytes=int(m.argument_size_in_bytes),
            output_bytes=int(m.output_size_in_bytes),
            alias_bytes=int(m.alias_size_in_bytes),
            temp_bytes=int(m.temp_size_in_bytes),
        )

    @property
    def peak_bytes(self) -> int:
        """Arguments + outputs (minus donated aliases) + temporaries: XLA's peak estimate."""
        return self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes


def _placed(x: Any, sharding: NamedSharding, donated: bool) -> jax.Array:
    """`x` on `sharding`: as it is where it is there already (on the same devices in the same
    layout, however its sharding is spelled: a one-device mesh's or a single device's), else
    moved there. A donated jax array is copied first: device_put may alias its buffer, and
    donation must never consume an array the caller still holds."""
    if isinstance(x, jax.Array):
        if x.sharding.is_equivalent_to(sharding, x.ndim):
            return x
        if donated:
            x = x.copy()
    return jax.device_put(x, sharding)


class Executable:
    """A plan compiled for concrete devices. Call it like the original step."""

    def __init__(
        self,
        plan: Plan,
        compiled: jax.stages.Compiled,
        in_shardings: Sequence[NamedSharding],
        out_shardings: Sequence[NamedSharding],
        in_tree: Any,
        out_tree: Any,
        static_argnums: tuple[int, ...],
    ) -> None:
        self.plan = plan
        self._compiled = compiled
        self._flat_in_shardings = tuple(in_shardings)
        # For each input, the ids of its sharding and of the executable's output shardings equal
        # to it: the state a step returns carries those very objects (kept alive here), so
        # `call_flat` finds it in place by identity, where an isinstance and a sharding
        # comparison per buffer cost about 1 µs each.
        self._output_shardings = tuple(jax.tree.leaves(compiled.output_shardings))
        equal: dict[Any, set[int]] = {}
        for sharding in self._output_shardings:
            equal.setdefault(sharding, set()).add(id(sharding))
        self._in_place = tuple(
            frozenset({id(s), *equal.get(s, ())}) for s in self._flat_in_shardings
        )
        self._flat_out_shardings = tuple(out_shardings)
        self._in_tree = in_tree
        self._out_tree = out_tree
        self._static_argnums = static_argnums
        donated = set(plan.donated_inputs)
        self._donated = tuple(i in donated for i in range(len(self._flat_in_shardings)))

    def _dynamic(self, args: Sequence[Any]) -> tuple[Any, ...]:
        return tuple(a for i, a in enumerate(args) if i not in self._static_argnums)

    def __call__(self, *args: Any) -> Any:
        return self.call_flat(self._in_tree.flatten(self._dynamic(args)))

    def call_flat(self, flat: Sequence[Any]) -> Any:
        """Run on the flattened dynamic arguments; returns the outputs as a pytree."""
        placed = [
            x if id(getattr(x, "sharding", None)) in in_place else _placed(x, s, donated)
            for x, s, donated, in_place in zip(
                flat, self._flat_in_shardings, self._donated, self._in_place, strict=True
            )
        ]
        outs = self._compiled(*placed)
        return self._out_tree.unflatten(outs)

    def place_flat(self, flat: Sequence[Any]) -> list[Any]:
        """The flattened dynamic arguments, each moved to the sharding the plan reads it with."""
        return [jax.device_put(x, s) for x, s in zip(flat, self._flat_in_shardings, strict=True)]

    @property
    def flat_input_shardings(self) -> tuple[NamedSharding, ...]:
        """Sharding of each flattened dynamic argument, in order."""
        return self._flat_in_shardings

    @property
    def input_shardings(self) -> tuple[Any, ...]:
        """Shardings of the dynamic arguments, as pytrees shaped like them."""
        return self._in_tree.unflatten(self._flat_in_shardings, with_statics=False)

    @property
    def output_shardings(self) -> Any:
        """Shardings of the outputs, as a pytree shaped like them."""
        return self._out_tree.unflatten(self._flat_out_shardings, with_statics=False)

    def get_hlo_text(self) -> str:
        """The optimised, SPMD-partitioned HLO that runs on each device."""
        return self._compiled.as_text()

    def memory_stats(self) -> MemoryStats:
        """Per-device argument, output, temp and peak bytes from XLA's memory analysis."""
        return MemoryStats.of(self._compiled)

    def collectives(self) -> dict[str, list[int]]:
        """Per collective kind, the byte size of each such op in the HLO (output shape)."""
        return collective_bytes(self.get_hlo_text())

    def collective_bytes_per_step(self) -> dict[str, float]:
        """Per collective kind, the bytes a step moves per device: an op inside the micro-batch
        loop counts once per micro-batch (`Plan.predicted.communication_bytes` predicts it)."""
        return collective_bytes_per_step(self.get_hlo_text())


_DTYPE_BYTES = {
    "f64": 8,
    "f32": 4,
    "f16": 2,
    "bf16": 2,
    "s64": 8,
    "s32": 4,
    "s16": 2,
    "s8": 1,
    "u64": 8,
    "u32": 4,
    "u16": 2,
    "u8": 1,
    "pred": 1,
}
_SHAPE = re.compile(r"(\w+)\[([\d,]*)\]")


def _shape_bytes(text: str) -> int:
    total = 0
    for dtype, dims in _SHAPE.findall(text):
        size = _DTYPE_BYTES.get(dtype, 4)
        for d in filter(None, dims.split(",")):
            size *= int(d)
        total += size
    return total


_COLLECTIVE = re.compile(r"=\s*(\(?[^=]*?\)?)\s+(" + "|".join(COLLECTIVES) + r")(-start)?\(")
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_CALLED = re.compile(
    r"(?:calls|to_apply|body|condition|branch_computations|true_computation|false_computation)"
    r"=\{?(%[\w.\-]+(?:,\s*%[\w.\-]+)*)"
)
_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')


def _collective(line: str) -> tuple[str, int] | None:
    """(kind, result bytes) of a collective op's HLO line (async pairs count at their start)."""
    match = _COLLECTIVE.search(re.sub(r"/\*.*?\*/", "", line))  # tuples carry /*index=5*/
    return (match.group(2), _shape_bytes(match.group(1))) if match else None


def collective_bytes(hlo_text: str) -> dict[str, list[int]]:
    """Parse HLO text: for each collective kind, the result bytes of each op (async starts once)."""
    found: dict[str, list[int]] = {kind: [] for kind in COLLECTIVES}
    for line in hlo_text.splitlines():
        if (op := _collective(line)) is not None:
            found[op[0]].append(op[1])
    return found


def collective_bytes_per_step(hlo_text: str) -> dict[str, float]:
    """Per collective kind, the bytes one run of the HLO moves: each op's result bytes times how
    often it runs, i.e. the known trip counts of the while loops around it (a gradient
    accumulation loop runs its body once per micro-batch)."""
    lines: dict[str, list[str]] = {}
    entry, current = None, None
    for line in hlo_text.splitlines():
        header = None if line.startswith(" ") else _COMPUTATION.match(line)
        if header:
            current = header.group(1)
            lines[current] = []
            entry = current if line.startswith("ENTRY") else entry
        elif current is not None:
            lines[current].append(line)
    runs: dict[str, float] = {}

    def visit(name: str, times: float) -> None:
        runs[name] = runs.get(name, 0.0) + times
        for line in lines.get(name, ()):
            trip = _TRIP_COUNT.search(line)
            for called in _CALLED.findall(line):
                for callee in called.split(","):
                    visit(callee.strip().lstrip("%"), times * (int(trip.group(1)) if trip else 1))

    if entry is not None:
        visit(entry, 1.0)
    found = dict.fromkeys(COLLECTIVES, 0.0)
    for name, times in runs.items():
        for line in lines.get(name, ()):
            if (op := _collective(line)) is not None:
                found[op[0]] += times * op[1]
    return found
