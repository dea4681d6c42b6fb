"""Plans on disk: plan files a user runs without planning, and the cache of plans already made.

Both hold `Plan.to_json()` text, never pickle. A plan records how its step was traced
(`Plan.tracing`), so a plan file traces the same program again; a plan is only used for a program
whose fingerprint it carries. The cache is keyed by the program's fingerprint, the cluster, the
method's options, the mesh and the autopar version; an entry that does not parse or does not
match its key is ignored with a warning and planned afresh.

The cache lives in ``$AUTOPAR_PLAN_CACHE`` (default ``~/.cache/autopar/plans``; ``off`` turns it
off).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import pathlib
from collections.abc import Sequence
from typing import Any

from autopar.options import AutoLayerOption, LayerOption, ManualLayerOption
from autopar.planner.cluster import ClusterSpec
from autopar.planner.errors import InvalidArgumentError
from autopar.planner.plan import PLAN_FORMAT_VERSION, Plan, TracingRecord

logger = logging.getLogger(__name__)

CACHE_ENV = "AUTOPAR_PLAN_CACHE"
_LAYER_OPTIONS = {"manual": ManualLayerOption, "auto": AutoLayerOption}


def tracing_record(regather_params: bool, layer_option: LayerOption | None) -> TracingRecord:
    """What `Plan.tracing` keeps: enough to trace the same program again."""
    layers = None
    if layer_option is not None:
        kind = "manual" if isinstance(layer_option, ManualLayerOption) else "auto"
        layers = {"kind": kind, **dataclasses.asdict(layer_option)}
    return TracingRecord(regather_params, layers)


def layer_option_of(plan: Plan) -> LayerOption | None:
    """The layer option a plan's step was traced with (None: not pipelined)."""
    return layer_option_in(plan.tracing)


def layer_option_in(tracing: TracingRecord | None) -> LayerOption | None:
    """The layer option a tracing record holds (None: the loss is not cut into layers)."""
    record = dict(tracing.layer_option or {}) if tracing else {}
    if not record:
        return None
    return _LAYER_OPTIONS[record.pop("kind")](**record)


def read_plan_file(path: str | os.PathLike) -> Plan:
    """A plan from a JSON plan file, or an InvalidArgumentError naming the file and the problem."""
    try:
        text = pathlib.Path(path).read_text()
    except OSError as e:
        raise InvalidArgumentError(f"cannot read plan file {str(path)!r}: {e.strerror}") from e
    try:
        plan = Plan.from_json(text)
    except (ValueError, KeyError, TypeError) as e:
        raise InvalidArgumentError(f"{str(path)!r} is not an autopar plan file: {e}") from e
    if plan.tracing is None:
        raise InvalidArgumentError(
            f"plan file {str(path)!r} does not record how its step was traced (plan.tracing); "
            "save plans made by autopar.plan or train_step.get_plan"
        )
    return plan


def check_plan_fits(
    plan: Plan, fingerprint: str, input_paths: Sequence[str], num_devices: int, source: str
) -> None:
    """Refuse a plan made for another program or for more devices than there are."""
    if plan.fingerprint != fingerprint:
        ours, theirs = tuple(input_paths), plan.input_paths
        pairs = enumerate(zip(ours, theirs, strict=False))
        differ = next((i for i, (a, b) in pairs if a != b), None)
        if differ is not None:
            why = f"input {differ} is {ours[differ]!r} here but {theirs[differ]!r} in the plan"
        elif len(ours) != len(theirs):
            why = f"the step has {len(ours)} inputs, the plan {len(theirs)}"
        else:
            why = "the inputs are named alike, so their shapes, dtypes or the computation differ"
        raise InvalidArgumentError(
            f"{source} was made for program {plan.fingerprint}, but this step traces to program "
            f"{fingerprint}: {why}"
        )
    needed = 1 + max(i for s in plan.stages for i in s.mesh.device_indices)
    if needed > num_devices:
        raise InvalidArgumentError(
            f"{source} needs {needed} devices, but the runtime has {num_devices}"
        )


class PlanCache:
    """Plans already made, one JSON file per key under `directory`."""

    def __init__(self, directory: str | os.PathLike) -> None:
        self.directory = pathlib.Path(directory).expanduser()

    @classmethod
    def from_env(cls) -> PlanCache | None:
        """The cache ``$AUTOPAR_PLAN_CACHE`` names (None when it is ``off``)."""
        where = os.environ.get(CACHE_ENV, "~/.cache/autopar/plans")
        return None if where.strip().lower() in ("off", "") else cls(where)

    @staticmethod
    def key(fingerprint: str, cluster: ClusterSpec, method: Any, mesh: Any) -> dict[str, str]:
        from autopar import __version__

        return {
            "fingerprint": fingerprint,
            "cluster": json.dumps(cluster.to_dict(), sort_keys=True),
            "method": repr(method),
            "mesh": repr(mesh),
            "autopar": __version__,
            # A new format comes with a new cost model: plans priced by an older one are stale.
            "plan_format": str(PLAN_FORMAT_VERSION),
        }

    def _path(self, key: dict[str, str]) -> pathlib.Path:
        digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]
        return self.directory / f"{digest}.json"

    def load(self, key: dict[str, str]) -> Plan | None:
        """The cached plan for `key`; None (with a warning for a bad entry) when there is none."""
        path = self._path(key)
        if not path.exists():
            return None
        try:
            entry = json.loads(path.read_text())
            if entry.get("key") != key:
                raise ValueError("its key does not match (a stale or colliding entry)")
            plan = Plan.from_json(json.dumps(entry["plan"]))
            if plan.fingerprint != key["fingerprint"]:
                raise ValueError("its plan is for another program")
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            logger.warning("ignoring plan cache entry %s: %s", path, e)
            return None
        logger.info("plan cache hit: %s", path)
        return plan

    def store(self, key: dict[str, str], plan: Plan) -> None:
        """Write the entry atomically (a reader never sees half a file); failures only warn."""
        path = self._path(key)
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            partial = path.with_suffix(f".{os.getpid()}.tmp")
            entry = {"key": key, "plan": json.loads(plan.to_json())}
            partial.write_text(json.dumps(entry, indent=1))
            partial.replace(path)
        except OSError as e:
            logger.warning("cannot write plan cache entry %s: %s", path, e)
