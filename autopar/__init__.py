"""autopar: automatic parallelization of JAX train steps, in the style of Alpa, on stock jax.

@autopar.parallelize(method=autopar.Zero3Parallel())
def train_step(state, batch):
    grads = autopar.grad(loss_fn)(state.params, batch)
    return state.apply_gradients(grads=grads)
"""

from autopar.api import ParallelizedFunc, explain, parallelize, plan
from autopar.checkpoint import restore_checkpoint, save_checkpoint
from autopar.context import init, shutdown, simulate_cpu_devices
from autopar.create_state import CreateStateParallel
from autopar.data import prefetch_batches
from autopar.markers import grad, mark_pipeline_boundary, value_and_grad
from autopar.methods import (
    DataParallel,
    FollowParallel,
    PipeshardParallel,
    PlanFile,
    ShardParallel,
    Zero2Parallel,
    Zero3Parallel,
)
from autopar.options import (
    AutoLayerOption,
    AutoShardingOption,
    AutoStageOption,
    ManualLayerOption,
    ManualStageOption,
    UniformStageOption,
)
from autopar.planner.cluster import ClusterSpec
from autopar.planner.errors import (
    AutoparError,
    InvalidArgumentError,
    MemoryBudgetError,
    PlanningError,
    TracingError,
)
from autopar.planner.plan import Plan
from autopar.runtime.cluster_profile import profile_cluster
from autopar.runtime.executable import Executable, MemoryStats
from autopar.runtime.local import PipelineExecutable
from autopar.runtime.ray import (
    RayExecutable,
    RemoteArray,
    RemoteError,
    StageFailedError,
    StepTimeoutError,
)

__version__ = "0.1.0"

__all__ = [
    "AutoLayerOption",
    "AutoShardingOption",
    "AutoStageOption",
    "AutoparError",
    "ClusterSpec",
    "CreateStateParallel",
    "DataParallel",
    "Executable",
    "FollowParallel",
    "InvalidArgumentError",
    "ManualLayerOption",
    "ManualStageOption",
    "MemoryBudgetError",
    "MemoryStats",
    "ParallelizedFunc",
    "PipelineExecutable",
    "PipeshardParallel",
    "Plan",
    "PlanFile",
    "PlanningError",
    "RayExecutable",
    "RemoteArray",
    "RemoteError",
    "ShardParallel",
    "StageFailedError",
    "StepTimeoutError",
    "TracingError",
    "UniformStageOption",
    "Zero2Parallel",
    "Zero3Parallel",
    "explain",
    "grad",
    "init",
    "mark_pipeline_boundary",
    "parallelize",
    "plan",
    "prefetch_batches",
    "profile_cluster",
    "restore_checkpoint",
    "save_checkpoint",
    "shutdown",
    "simulate_cpu_devices",
    "value_and_grad",
]
