"""A GPT-style decoder (pre-LayerNorm, causal attention, untied LM head) and Alpa's benchmark sizes.

Attention keeps an explicit heads dimension, in the projection kernels ``(hidden, heads,
head_dim)`` and in the activations ``(batch, seq, heads, head_dim)``, so a sharding planner can
split heads (Megatron-style tensor parallelism) as well as batch and hidden.

Example::

    config = GPTConfig()
    state = create_train_state(config)
    state, metrics = jax.jit(train_step)(state, make_batch(config, batch_size=4))
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.training.train_state import TrainState

from autopar.markers import mark_pipeline_boundary
from autopar.models.common import Batch, GradFn, Metrics, TrainStep, dense_param_count

ALPA_GPT_SIZES: dict[str, tuple[int, int, int]] = {
    "125M": (768, 12, 12),
    "350M": (1024, 24, 16),
    "760M": (1536, 24, 16),
    "1.3B": (2048, 24, 32),
    "2.6B": (2560, 32, 32),
    "6.7B": (4096, 32, 32),
    "15B": (5120, 48, 40),
    "39B": (8192, 48, 64),
    "76B": (10240, 60, 80),
}
"""Alpa's GPT benchmark sizes (``benchmark/alpa/suite_manual_gpt.py``, ``gpt_specs``):
name -> (hidden, num_layers, num_heads), all with seq_len 1024 and vocab 51200."""


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    """Sizes of a GPT decoder; `dtype` is the compute dtype (parameters stay float32)."""

    vocab_size: int = 256
    seq_len: int = 32
    hidden: int = 64
    num_layers: int = 2
    num_heads: int = 4
    mlp_ratio: int = 4
    dtype: Any = jnp.float32
    pipeline_boundaries: bool = False  # mark a pipeline layer boundary between blocks
    scan_layers: bool = False  # the blocks as one `nn.scan` over stacked weights (MaxText's way)

    def __post_init__(self) -> None:
        if self.scan_layers and self.pipeline_boundaries:
            raise ValueError(
                "GPTConfig.pipeline_boundaries marks boundaries between blocks, which "
                "scan_layers=True runs as one scan: set one of them"
            )
        if self.hidden % self.num_heads:
            raise ValueError(
                f"GPTConfig.hidden ({self.hidden}) must be divisible by "
                f"num_heads ({self.num_heads})"
            )

    @property
    def head_dim(self) -> int:
        return self.hidden // self.num_heads

    @classmethod
    def alpa(cls, name: str, **overrides: Any) -> GPTConfig:
        """Alpa's benchmark GPT `name`, e.g. ``GPTConfig.alpa("1.3B", dtype=jnp.bfloat16)``."""
        if name not in ALPA_GPT_SIZES:
            raise ValueError(f"Unknown Alpa GPT size {name!r}; known: {list(ALPA_GPT_SIZES)}")
        hidden, num_layers, num_heads = ALPA_GPT_SIZES[name]
        sizes = dict(hidden=hidden, num_layers=num_layers, num_heads=num_heads)
        return cls(**{"vocab_size": 51200, "seq_len": 1024, **sizes, **overrides})


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention written with einsums over a visible heads axis."""

    config: GPTConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        c = self.config
        # No key bias: softmax is shift-invariant along keys, so its gradient is identically zero
        # and an optimizer like Adam would only amplify rounding noise in it.
        q, k, v = (
            nn.DenseGeneral(
                (c.num_heads, c.head_dim), use_bias=name != "key", dtype=c.dtype, name=name
            )(x)
            for name in ("query", "key", "value")
        )
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) / np.sqrt(c.head_dim)
        causal = jnp.tril(jnp.ones((x.shape[1], x.shape[1]), dtype=bool))
        scores = jnp.where(causal, scores, jnp.finfo(jnp.float32).min)
        probs = jax.nn.softmax(scores, axis=-1).astype(c.dtype)
        out = jnp.einsum("bhqk,bkhd->bqhd", probs, v)
        return nn.DenseGeneral(c.hidden, axis=(-2, -1), dtype=c.dtype, name="out")(out)


class Block(nn.Module):
    """Pre-LayerNorm transformer block: ``x + attn(ln(x))`` then ``x + mlp(ln(x))``."""

    config: GPTConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        c = self.config
        x = x + CausalSelfAttention(c, name="attn")(nn.LayerNorm(dtype=c.dtype, name="ln_1")(x))
        h = nn.LayerNorm(dtype=c.dtype, name="ln_2")(x)
        h = nn.gelu(nn.Dense(c.mlp_ratio * c.hidden, dtype=c.dtype, name="fc_in")(h))
        return x + nn.Dense(c.hidden, dtype=c.dtype, name="fc_out")(h)


class _ScannedBlock(nn.Module):
    """`Block` as the body of `nn.scan`: the hidden state is the carry, nothing is stacked out."""

    config: GPTConfig

    @nn.compact
    def __call__(self, x: jax.Array, _: None) -> tuple[jax.Array, None]:
        return Block(self.config, name="block")(x), None


def embed_tokens(module: nn.Module, config: GPTConfig, tokens: jax.Array) -> jax.Array:
    """Token + learned position embeddings, created as `module`'s ``wte`` and ``wpe``.

    Call it inside `module`'s compact ``__call__`` (decoders built on GPT's pieces share it).
    """
    c = config
    init = nn.initializers.normal(0.02)
    wte = nn.Embed(c.vocab_size, c.hidden, embedding_init=init, dtype=c.dtype, name="wte")
    pos = module.param("wpe", init, (c.seq_len, c.hidden))
    return wte(tokens) + pos[: tokens.shape[1]].astype(c.dtype)


def lm_logits(config: GPTConfig, x: jax.Array) -> jax.Array:
    """Final LayerNorm ``ln_f`` and the untied LM head ``lm_head``; inside a compact method."""
    x = nn.LayerNorm(dtype=config.dtype, name="ln_f")(x)
    return nn.Dense(config.vocab_size, use_bias=False, dtype=config.dtype, name="lm_head")(x)


class GPT(nn.Module):
    """Token + learned position embeddings, `num_layers` blocks, final LayerNorm, untied LM head."""

    config: GPTConfig

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        c = self.config
        x = embed_tokens(self, c, tokens)
        if c.scan_layers:
            blocks = nn.scan(
                _ScannedBlock,
                variable_axes={"params": 0},
                split_rngs={"params": True},
                length=c.num_layers,
            )
            x, _ = blocks(c, name="blocks")(x, None)
            return lm_logits(c, x)
        for i in range(c.num_layers):
            if c.pipeline_boundaries and i > 0:
                mark_pipeline_boundary()
            x = Block(c, name=f"block_{i}")(x)
        return lm_logits(c, x)


def make_batch(config: GPTConfig, batch_size: int, *, seed: int = 0) -> Batch:
    """Random token sequences; `targets` are `tokens` shifted left by one (next-token labels)."""
    rng = np.random.default_rng(seed)
    seq = rng.integers(0, config.vocab_size, (batch_size, config.seq_len + 1), dtype=np.int32)
    return {"tokens": seq[:, :-1].copy(), "targets": seq[:, 1:].copy()}


def create_train_state(
    config: GPTConfig, *, batch_size: int = 1, learning_rate: float = 1e-3, seed: int = 0
) -> TrainState:
    """Initialise parameters and AdamW, the optimizer Alpa's GPT benchmarks use."""
    model = GPT(config)
    tokens = jnp.zeros((batch_size, config.seq_len), jnp.int32)
    params = model.init(jax.random.key(seed), tokens)["params"]
    return TrainState.create(apply_fn=model.apply, params=params, tx=optax.adamw(learning_rate))


def make_train_step(grad_fn: GradFn = jax.value_and_grad) -> TrainStep:
    """Build the next-token cross-entropy train step around `grad_fn` (jax's or autopar's)."""

    def train_step(state: TrainState, batch: Batch) -> tuple[TrainState, Metrics]:
        def loss_fn(params):
            logits = state.apply_fn({"params": params}, batch["tokens"]).astype(jnp.float32)
            losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
            return losses.mean()

        loss, grads = grad_fn(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), {"loss": loss}

    return train_step


train_step = make_train_step()


def param_count(config: GPTConfig) -> int:
    """Number of parameters, from the sizes alone (embeddings, blocks, final LayerNorm, head)."""
    h, f = config.hidden, config.mlp_ratio * config.hidden
    # q, v and out projections have biases; the key projection has none (see CausalSelfAttention).
    block = (
        4 * dense_param_count(h, h) - h + dense_param_count(h, f) + dense_param_count(f, h) + 4 * h
    )
    embeddings = (config.vocab_size + config.seq_len) * h
    return embeddings + config.num_layers * block + 2 * h + h * config.vocab_size


def flops_per_token(config: GPTConfig) -> int:
    """Training FLOPs per token (forward + backward): ``6 * N + 12 * L * S * h``.

    ``N`` is the non-embedding parameter count (blocks, final LayerNorm, untied LM head): each
    weight costs 2 FLOPs forward and 4 backward per token. The attention term counts the two
    ``S x S`` einsums (scores, weighted values): ``4 * S * h`` FLOPs forward per layer and token,
    tripled for backward; causal masking is not discounted. This is PaLM's formula (Chowdhery et
    al. 2022, App. B) and, as ``N ~ 12 L h^2 + V h``, Alpa's ``compute_gpt_tflops`` without remat.
    """
    non_embedding = param_count(config) - (config.vocab_size + config.seq_len) * config.hidden
    attention = 12 * config.num_layers * config.seq_len * config.hidden
    return 6 * non_embedding + attention
