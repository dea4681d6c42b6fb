"""A Wide-ResNet image classifier (bottleneck blocks, BatchNorm) and Alpa's benchmark sizes.

The network is ResNet v1 with bottleneck blocks (He et al. 2016) widened as in Alpa's benchmark
model (``alpa/model/wide_resnet.py``, after Zagoruyko & Komodakis 2016): the 3x3 convolution of a
block has `width_factor` times the block's filters. A 7x7 stride-2 stem and a 3x3 stride-2 max
pool come first, stage i has ``channels * 2**i`` filters and halves the resolution (except stage
0), and a global mean pool feeds a dense classifier. BatchNorm follows every convolution, so the
state carries ``batch_stats`` and the step is the image classifiers' shared one
(`autopar.models.vision`). Under micro-batching the batch statistics are per micro-batch.

Example::

    config = WResNetConfig()
    state = create_train_state(config)
    state, metrics = jax.jit(train_step)(state, make_batch(config, batch_size=8))
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from autopar.markers import mark_pipeline_boundary
from autopar.models import vision
from autopar.models.common import dense_param_count
from autopar.models.vision import BatchNormTrainState

ALPA_WRESNET_SIZES: dict[str, tuple[int, int, int]] = {
    "250M": (50, 160, 2),
    "500M": (50, 224, 2),
    "1B": (50, 320, 2),
    "2B": (50, 448, 2),
    "4B": (50, 640, 2),
    "6.8B": (50, 320, 16),
    "13B": (101, 320, 16),
}
"""Alpa's Wide-ResNet benchmark sizes (``benchmark/alpa/suite_wresnet.py``, ``wresnet_specs``):
name -> (depth, channels, width_factor), all with 224 px images and 1024 classes."""

BOTTLENECK_STAGE_SIZES: dict[int, tuple[int, ...]] = {
    50: (3, 4, 6, 3),
    101: (3, 4, 23, 3),
    152: (3, 8, 36, 3),
    200: (3, 24, 36, 3),
}
"""Blocks per stage of the standard bottleneck ResNets, by depth."""


@dataclasses.dataclass(frozen=True)
class WResNetConfig:
    """Sizes of a Wide-ResNet; `dtype` is the compute dtype (parameters stay float32).

    `stage_sizes` lists the bottleneck blocks per stage; `channels` is the first stage's filters.
    """

    image_size: int = 32
    channels: int = 8
    width_factor: int = 2
    stage_sizes: tuple[int, ...] = (1, 1)
    num_classes: int = 10
    in_channels: int = 3
    dtype: Any = jnp.float32
    pipeline_boundaries: bool = False  # mark a pipeline layer boundary between blocks

    def __post_init__(self) -> None:
        if not self.stage_sizes or min(self.stage_sizes) < 1:
            raise ValueError(
                "WResNetConfig.stage_sizes must list at least one stage of >= 1 blocks, "
                f"got {self.stage_sizes}"
            )
        for name in ("image_size", "channels", "width_factor", "num_classes", "in_channels"):
            if getattr(self, name) < 1:
                raise ValueError(f"WResNetConfig.{name} must be >= 1, got {getattr(self, name)}")

    @property
    def depth(self) -> int:
        """Weighted layers: the stem, three convolutions per block and the classifier."""
        return 3 * sum(self.stage_sizes) + 2

    @classmethod
    def alpa(cls, name: str, **overrides: Any) -> WResNetConfig:
        """Alpa's benchmark Wide-ResNet `name`, e.g. ``WResNetConfig.alpa("1B")``."""
        if name not in ALPA_WRESNET_SIZES:
            raise ValueError(
                f"Unknown Alpa Wide-ResNet size {name!r}; known: {list(ALPA_WRESNET_SIZES)}"
            )
        depth, channels, width_factor = ALPA_WRESNET_SIZES[name]
        sizes = dict(
            stage_sizes=BOTTLENECK_STAGE_SIZES[depth], channels=channels, width_factor=width_factor
        )
        return cls(**{"image_size": 224, "num_classes": 1024, **sizes, **overrides})


class Bottleneck(nn.Module):
    """1x1 (filters) -> 3x3 (width x filters, strided) -> 1x1 (4 x filters), BatchNorm + relu
    after each, plus the input, projected by a strided 1x1 convolution where shapes differ."""

    config: WResNetConfig
    filters: int
    strides: int
    train: bool

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        c = self.config
        conv = functools.partial(nn.Conv, use_bias=False, dtype=c.dtype)
        norm = functools.partial(
            nn.BatchNorm, use_running_average=not self.train, momentum=0.9, dtype=c.dtype
        )
        strides = (self.strides, self.strides)
        y = nn.relu(norm(name="bn_1")(conv(self.filters, (1, 1), name="conv_1")(x)))
        y = conv(c.width_factor * self.filters, (3, 3), strides, name="conv_2")(y)
        y = nn.relu(norm(name="bn_2")(y))
        y = conv(4 * self.filters, (1, 1), name="conv_3")(y)
        # Zero-initialised last scale: each block starts as the identity (Goyal et al. 2017).
        y = norm(scale_init=nn.initializers.zeros, name="bn_3")(y)
        if x.shape != y.shape:
            x = conv(4 * self.filters, (1, 1), strides, name="proj")(x)
            x = norm(name="bn_proj")(x)
        return nn.relu(x + y)


class WResNet(nn.Module):
    """Stem, bottleneck stages, global mean pool and a dense classifier."""

    config: WResNetConfig

    @nn.compact
    def __call__(self, images: jax.Array, *, train: bool) -> jax.Array:
        c = self.config
        x = nn.Conv(
            c.channels, (7, 7), (2, 2), padding=3, use_bias=False, dtype=c.dtype, name="stem"
        )(images)
        x = nn.BatchNorm(use_running_average=not train, momentum=0.9, dtype=c.dtype, name="bn")(x)
        x = nn.max_pool(nn.relu(x), (3, 3), strides=(2, 2), padding="SAME")
        for i, blocks in enumerate(c.stage_sizes):
            for j in range(blocks):
                if c.pipeline_boundaries and (i, j) != (0, 0):
                    mark_pipeline_boundary()
                strides = 2 if i > 0 and j == 0 else 1
                name = f"stage_{i}_block_{j}"
                x = Bottleneck(c, c.channels * 2**i, strides, train, name=name)(x)
        x = jnp.mean(x, axis=(1, 2))
        return nn.Dense(c.num_classes, dtype=c.dtype, name="head")(x)


def create_train_state(
    config: WResNetConfig, *, batch_size: int = 1, learning_rate: float = 1e-3, seed: int = 0
) -> BatchNormTrainState:
    """Initialise parameters, BatchNorm statistics (mean 0, variance 1) and AdamW."""
    return vision.create_train_state(
        WResNet(config), config, batch_size=batch_size, learning_rate=learning_rate, seed=seed
    )


# Batches and the step are the image classifiers' shared ones.
make_batch = vision.make_batch
make_train_step = vision.make_train_step
train_step = make_train_step()


def _blocks(config: WResNetConfig):
    """(filters, in_channels, input side, strides) of each bottleneck block, in order."""
    side = math.ceil(math.ceil(config.image_size / 2) / 2)  # stem and max pool, both stride 2
    in_channels = config.channels
    for i, blocks in enumerate(config.stage_sizes):
        filters = config.channels * 2**i
        for j in range(blocks):
            strides = 2 if i > 0 and j == 0 else 1
            yield filters, in_channels, side, strides
            in_channels, side = 4 * filters, math.ceil(side / strides)


def param_count(config: WResNetConfig) -> int:
    """Number of trainable parameters (BatchNorm scale and bias included, running stats not)."""
    c, w = config, config.width_factor
    total = 49 * c.in_channels * c.channels + 2 * c.channels  # stem conv and BatchNorm
    for filters, in_channels, _, _ in _blocks(c):
        total += in_channels * filters + 9 * filters * w * filters + w * filters * 4 * filters
        total += 2 * (filters + w * filters + 4 * filters)  # BatchNorm after each conv
        if in_channels != 4 * filters:  # the first block of a stage: projection and BatchNorm
            total += in_channels * 4 * filters + 2 * 4 * filters
    return total + dense_param_count(4 * c.channels * 2 ** (len(c.stage_sizes) - 1), c.num_classes)


def flops_per_example(config: WResNetConfig) -> int:
    """Training FLOPs per image (forward + backward): 3 x the forward convolutions and dense
    classifier, each ``2 * outputs * fan_in`` (a multiply and an add per weight use).

    BatchNorm, relu, pooling and the optimizer are not counted. Backward is twice forward
    (gradients of activations and of weights), except for the stem, whose input (the images)
    gets no gradient.
    """
    c, w = config, config.width_factor
    stem_side = math.ceil(c.image_size / 2)
    stem = 2 * stem_side**2 * 49 * c.in_channels * c.channels
    forward = stem
    for filters, in_channels, side, strides in _blocks(c):
        out_side = math.ceil(side / strides)
        forward += 2 * side**2 * in_channels * filters  # conv_1, before the stride
        forward += 2 * out_side**2 * 9 * filters * w * filters  # conv_2, strided
        forward += 2 * out_side**2 * w * filters * 4 * filters  # conv_3
        if in_channels != 4 * filters:
            forward += 2 * out_side**2 * in_channels * 4 * filters  # projection
    head_in = 4 * c.channels * 2 ** (len(c.stage_sizes) - 1)
    forward += 2 * head_in * c.num_classes
    return 3 * forward - stem
