"""autopar: automatic parallelization of JAX train steps, in the style of Alpa, on stock jax.

@autopar.parallelize(method=autopar.Zero3Parallel())
def train_step(state, batch):
    grads = autopar.grad(loss_fn)(state.params, batch)
    return state.apply_gradients(grads=grads)
"""

from autopar.api import ParallelizedFunc, parallelize, plan
from autopar.context import init, shutdown, simulate_cpu_devices
from autopar.markers import grad, value_and_grad
from autopar.methods import DataParallel, ShardParallel, Zero2Parallel, Zero3Parallel
from autopar.options import AutoShardingOption
from autopar.planner.cluster import ClusterSpec
from autopar.planner.errors import (
    AutoparError,
    InvalidArgumentError,
    PlanningError,
    TracingError,
)
from autopar.planner.plan import Plan
from autopar.runtime.executable import Executable, MemoryStats

__version__ = "0.1.0"

__all__ = [
    "AutoShardingOption",
    "AutoparError",
    "ClusterSpec",
    "DataParallel",
    "Executable",
    "InvalidArgumentError",
    "MemoryStats",
    "ParallelizedFunc",
    "Plan",
    "PlanningError",
    "ShardParallel",
    "TracingError",
    "Zero2Parallel",
    "Zero3Parallel",
    "grad",
    "init",
    "parallelize",
    "plan",
    "shutdown",
    "simulate_cpu_devices",
    "value_and_grad",
]
