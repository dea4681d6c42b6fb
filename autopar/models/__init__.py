"""Bundled flax linen model families for tests, examples and benchmarks.

Each family module (`mlp`, `gpt`, `convnet`) has the same functions: ``make_batch(config,
batch_size, *, seed)``, ``create_train_state(config, *, batch_size, learning_rate, seed)``,
``make_train_step(grad_fn)``, a default ``train_step`` and ``param_count(config)``; `gpt` adds
``flops_per_token(config)``. Call them through the module, e.g. ``gpt.make_batch(config, 8)``.

Example::

    from autopar.models import GPTConfig, gpt

    config = GPTConfig()
    state = gpt.create_train_state(config)
    state, metrics = jax.jit(gpt.train_step)(state, gpt.make_batch(config, batch_size=4))
"""

from autopar.models import convnet, gpt, mlp
from autopar.models.common import Batch, GradFn, Metrics, TrainStep
from autopar.models.convnet import ConvNet, ConvNetConfig, ConvNetTrainState
from autopar.models.gpt import ALPA_GPT_SIZES, GPT, GPTConfig
from autopar.models.mlp import MLP, MLPConfig

__all__ = [
    "ALPA_GPT_SIZES",
    "GPT",
    "MLP",
    "Batch",
    "ConvNet",
    "ConvNetConfig",
    "ConvNetTrainState",
    "GPTConfig",
    "GradFn",
    "MLPConfig",
    "Metrics",
    "TrainStep",
    "convnet",
    "gpt",
    "mlp",
]
