"""Bundled flax linen model families for tests, examples and benchmarks.

Each family module (`mlp`, `gpt`, `moe`, `convnet`, `wresnet`) has the same functions:
``make_batch(config, batch_size, *, seed)``, ``create_train_state(config, *, batch_size,
learning_rate, seed)``, ``make_train_step(grad_fn)``, a default ``train_step`` and
``param_count(config)``; `gpt` and `moe` add ``flops_per_token(config)``, `wresnet`
``flops_per_example(config)``. Call them through the module, e.g. ``gpt.make_batch(config, 8)``.
`gpt`, `moe` and `wresnet` carry Alpa's benchmark sizes (``GPTConfig.alpa("1.3B")``, ...), and
`abstract_train_inputs` gives any family's step with shape-only inputs, to plan it for a cluster
without allocating the model.

Example::

    from autopar.models import GPTConfig, gpt

    config = GPTConfig()
    state = gpt.create_train_state(config)
    state, metrics = jax.jit(gpt.train_step)(state, gpt.make_batch(config, batch_size=4))
"""

from autopar.models import convnet, gpt, mlp, moe, wresnet
from autopar.models.common import Batch, GradFn, Metrics, TrainStep, abstract_train_inputs
from autopar.models.convnet import ConvNet, ConvNetConfig
from autopar.models.gpt import ALPA_GPT_SIZES, GPT, GPTConfig
from autopar.models.mlp import MLP, MLPConfig
from autopar.models.moe import ALPA_MOE_SIZES, MoEConfig, MoETransformer
from autopar.models.vision import BatchNormTrainState
from autopar.models.wresnet import ALPA_WRESNET_SIZES, WResNet, WResNetConfig

__all__ = [
    "ALPA_GPT_SIZES",
    "ALPA_MOE_SIZES",
    "ALPA_WRESNET_SIZES",
    "GPT",
    "MLP",
    "Batch",
    "BatchNormTrainState",
    "ConvNet",
    "ConvNetConfig",
    "GPTConfig",
    "GradFn",
    "MLPConfig",
    "Metrics",
    "MoEConfig",
    "MoETransformer",
    "TrainStep",
    "WResNet",
    "WResNetConfig",
    "abstract_train_inputs",
    "convnet",
    "gpt",
    "mlp",
    "moe",
    "wresnet",
]
