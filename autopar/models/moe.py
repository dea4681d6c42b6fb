"""A GShard-style mixture-of-experts decoder (GPT blocks, every other MLP a top-2 MoE) and Alpa's
MoE benchmark sizes.

Layers 0, 2, 4, ... replace GPT's MLP with `num_experts` expert MLPs. Tokens are routed in groups
of `expert_group_size` (GShard's S): a top-2 gate picks two experts per token, each expert takes
at most ``capacity = capacity_factor * 2 * S / num_experts`` tokens of a group (later tokens
overflow and skip the layer, keeping only the residual), and tokens move to and from the experts
by einsums with dispatch and combine tensors of shape (groups, S, experts, capacity) — Lepikhin et
al. 2021, "GShard", Algorithm 1. Expert weights have a leading experts dimension, e.g. ``wi`` is
(experts, hidden, ffn), so a sharding planner can split experts over devices; with the groups
split the other way that is where all-to-all appears. The load-balancing loss (GShard's
``l_aux``) is summed over MoE layers and added to the cross-entropy, weighted by
`aux_loss_weight`.

Example::

    config = MoEConfig()
    state = create_train_state(config)
    state, metrics = jax.jit(train_step)(state, make_batch(config, batch_size=4))
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax.training.train_state import TrainState

from autopar.markers import mark_pipeline_boundary
from autopar.models import gpt
from autopar.models.common import Batch, GradFn, Metrics, TrainStep, dense_param_count

ALPA_MOE_SIZES: dict[str, tuple[int, int, int]] = {
    "380M": (768, 8, 8),
    "690M": (768, 8, 16),
    "1.3B": (768, 16, 16),
    "2.4B": (1024, 16, 16),
    "7.1B": (1280, 16, 32),
    "10B": (1536, 16, 32),
    "27B": (2048, 16, 48),
    "70B": (2048, 32, 64),
}
"""Alpa's MoE benchmark sizes (the paper's MoE suite; ``moe_specs`` in
``benchmark/alpa/suite_manual_moe.py`` lists all but 7.1B): name -> (hidden, num_layers,
num_experts), all with seq_len 1024, vocab 32000, 16 heads, an FFN of 8 x hidden and expert groups
of 2048 tokens."""


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """Sizes of an MoE decoder; `dtype` is the compute dtype (parameters and routing stay fp32).

    `expert_group_size` is how many tokens are routed together (None: one sequence); a batch
    with fewer tokens routes them all as one group.
    """

    vocab_size: int = 256
    seq_len: int = 32
    hidden: int = 64
    num_layers: int = 2
    num_heads: int = 4
    mlp_ratio: int = 8  # Alpa's MoE benchmark: FFN of 8 x hidden, dense and expert MLPs alike
    num_experts: int = 4
    expert_group_size: int | None = None
    capacity_factor: float = 1.0
    aux_loss_weight: float = 0.01
    dtype: Any = jnp.float32
    pipeline_boundaries: bool = False  # mark a pipeline layer boundary between blocks

    def __post_init__(self) -> None:
        _ = self.dense  # GPTConfig checks the sizes the two share (hidden vs heads)
        if self.num_experts < 2:
            raise ValueError(
                f"MoEConfig.num_experts must be >= 2 for top-2 gating, got {self.num_experts}"
            )
        if self.expert_group_size is not None and self.expert_group_size < 1:
            raise ValueError(
                f"MoEConfig.expert_group_size must be >= 1 or None, got {self.expert_group_size}"
            )
        if not self.capacity_factor > 0:
            raise ValueError(f"MoEConfig.capacity_factor must be > 0, got {self.capacity_factor}")

    @property
    def dense(self) -> gpt.GPTConfig:
        """The GPT decoder of the same sizes: its attention and dense blocks are this model's."""
        return gpt.GPTConfig(
            vocab_size=self.vocab_size,
            seq_len=self.seq_len,
            hidden=self.hidden,
            num_layers=self.num_layers,
            num_heads=self.num_heads,
            mlp_ratio=self.mlp_ratio,
            dtype=self.dtype,
        )

    @property
    def num_moe_layers(self) -> int:
        """Layers 0, 2, 4, ... are MoE layers."""
        return (self.num_layers + 1) // 2

    @classmethod
    def alpa(cls, name: str, **overrides: Any) -> MoEConfig:
        """Alpa's benchmark MoE `name`, e.g. ``MoEConfig.alpa("1.3B", dtype=jnp.bfloat16)``."""
        if name not in ALPA_MOE_SIZES:
            raise ValueError(f"Unknown Alpa MoE size {name!r}; known: {list(ALPA_MOE_SIZES)}")
        hidden, num_layers, num_experts = ALPA_MOE_SIZES[name]
        sizes = dict(hidden=hidden, num_layers=num_layers, num_experts=num_experts)
        alpa = dict(vocab_size=32000, seq_len=1024, num_heads=16, expert_group_size=2048)
        return cls(**{**alpa, **sizes, **overrides})


def group_size(config: MoEConfig, num_tokens: int) -> int:
    """Tokens per routing group for a batch of `num_tokens` tokens; it must divide them."""
    size = min(config.expert_group_size or config.seq_len, num_tokens)
    if num_tokens % size:
        raise ValueError(
            f"MoEConfig.expert_group_size ({size}) must divide the tokens of a batch "
            f"({num_tokens}); pick a group size that divides the (micro-)batch's tokens"
        )
    return size


def expert_capacity(config: MoEConfig, group: int) -> int:
    """Slots per expert and group: ``capacity_factor * 2 * group / num_experts`` (top-2)."""
    return max(1, math.ceil(config.capacity_factor * 2 * group / config.num_experts))


def top2_gating(gate_logits: jax.Array, capacity: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """GShard's top-2 gating (Algorithm 1) on router logits of shape (groups, S, experts).

    Returns the combine weights and the dispatch mask, both (groups, S, experts, capacity) and
    float32, and the load-balancing loss ``E^2 * mean_{g,e}(f_ge * p_ge)``: ``f`` the fraction
    of a group's tokens whose first choice is expert e, ``p`` the mean gate probability of e.
    Each token goes to its best expert and, with its renormalised weight, its second best; the
    first choices of a group fill each expert's `capacity` slots in token order, then the second
    choices, and a token that finds no slot is dropped from that expert. The second expert is
    always the second best (GShard samples it at random in proportion to its weight).
    """
    num_experts = gate_logits.shape[-1]
    gates = jax.nn.softmax(gate_logits.astype(jnp.float32), axis=-1)
    mask_1 = jax.nn.one_hot(jnp.argmax(gates, axis=-1), num_experts)
    without_first = gates * (1.0 - mask_1)
    mask_2 = jax.nn.one_hot(jnp.argmax(without_first, axis=-1), num_experts)
    gate_1 = jnp.sum(gates * mask_1, axis=-1)
    gate_2 = jnp.sum(without_first * mask_2, axis=-1)
    aux_loss = jnp.mean(jnp.mean(mask_1, axis=1) * jnp.mean(gates, axis=1)) * num_experts**2

    denominator = gate_1 + gate_2  # > 0: softmax probabilities are positive
    gate_1, gate_2 = gate_1 / denominator, gate_2 / denominator

    # Slot of each token in its expert's buffer: first choices first, in token order.
    position_1 = jnp.cumsum(mask_1, axis=1) - mask_1
    mask_1 = mask_1 * (position_1 < capacity)
    position_2 = jnp.cumsum(mask_2, axis=1) - mask_2 + jnp.sum(mask_1, axis=1, keepdims=True)
    mask_2 = mask_2 * (position_2 < capacity)

    # The two experts of a token differ, so one (G, S, E) tensor holds both choices. Experts a
    # token does not reach get slot `capacity`, out of range, whose one-hot row is all zeros.
    routed = mask_1 + mask_2
    slot = position_1 * mask_1 + position_2 * mask_2 + capacity * (1.0 - routed)
    dispatch = jax.nn.one_hot(slot.astype(jnp.int32), capacity)
    weights = gate_1[..., None] * mask_1 + gate_2[..., None] * mask_2
    return weights[..., None] * dispatch, dispatch, aux_loss


class MoEMLP(nn.Module):
    """Top-2 routed expert MLPs: (batch, seq, hidden) -> same shape, and the balancing loss."""

    config: MoEConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        c = self.config
        experts, ffn = c.num_experts, c.mlp_ratio * c.hidden
        group = group_size(c, x.shape[0] * x.shape[1])
        # Fan-in per expert: the experts dim is a batch dim of the initializer.
        expert_init = nn.initializers.lecun_normal(batch_axis=(0,))
        router = self.param("router", nn.initializers.lecun_normal(), (c.hidden, experts))
        wi = self.param("wi", expert_init, (experts, c.hidden, ffn))
        wo = self.param("wo", expert_init, (experts, ffn, c.hidden))

        tokens = x.reshape(-1, group, c.hidden)  # (G, S, M)
        logits = jnp.einsum("gsm,me->gse", tokens.astype(jnp.float32), router)
        combine, dispatch, aux_loss = top2_gating(logits, expert_capacity(c, group))
        expert_in = jnp.einsum("gsec,gsm->egcm", dispatch.astype(c.dtype), tokens)
        h = nn.gelu(jnp.einsum("egcm,emh->egch", expert_in, wi.astype(c.dtype)))
        expert_out = jnp.einsum("egch,ehm->gecm", h, wo.astype(c.dtype))
        out = jnp.einsum("gsec,gecm->gsm", combine.astype(c.dtype), expert_out)
        return out.reshape(x.shape), aux_loss


class MoEBlock(nn.Module):
    """GPT's pre-LayerNorm block with `MoEMLP` in place of the MLP; returns the balancing loss."""

    config: MoEConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        c = self.config
        x = x + gpt.CausalSelfAttention(c.dense, name="attn")(
            nn.LayerNorm(dtype=c.dtype, name="ln_1")(x)
        )
        y, aux_loss = MoEMLP(c, name="moe")(nn.LayerNorm(dtype=c.dtype, name="ln_2")(x))
        return x + y, aux_loss


class MoETransformer(nn.Module):
    """GPT's embeddings and head around alternating MoE (even layers) and dense GPT blocks.

    Returns the logits and the load-balancing loss summed over the MoE layers and weighted by
    `aux_loss_weight`: the term to add to the training objective.
    """

    config: MoEConfig

    @nn.compact
    def __call__(self, tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
        c, dense = self.config, self.config.dense
        x = gpt.embed_tokens(self, dense, tokens)
        aux_loss = jnp.zeros((), jnp.float32)
        for i in range(c.num_layers):
            if c.pipeline_boundaries and i > 0:
                mark_pipeline_boundary()
            if i % 2 == 0:
                x, layer_aux = MoEBlock(c, name=f"block_{i}")(x)
                aux_loss = aux_loss + layer_aux
            else:
                x = gpt.Block(dense, name=f"block_{i}")(x)
        return gpt.lm_logits(dense, x), c.aux_loss_weight * aux_loss


# Token batches are GPT's: the same vocabulary and sequence fields.
make_batch = gpt.make_batch


def create_train_state(
    config: MoEConfig, *, batch_size: int = 1, learning_rate: float = 1e-3, seed: int = 0
) -> TrainState:
    """Initialise parameters and AdamW."""
    model = MoETransformer(config)
    tokens = jnp.zeros((batch_size, config.seq_len), jnp.int32)
    params = model.init(jax.random.key(seed), tokens)["params"]
    return TrainState.create(apply_fn=model.apply, params=params, tx=optax.adamw(learning_rate))


def make_train_step(grad_fn: GradFn = jax.value_and_grad) -> TrainStep:
    """Build the train step around `grad_fn` (jax's or autopar's): next-token cross-entropy plus
    the weighted load-balancing loss, which the metrics also report alone as ``aux_loss``."""

    def train_step(state: TrainState, batch: Batch) -> tuple[TrainState, Metrics]:
        def loss_fn(params):
            logits, aux_loss = state.apply_fn({"params": params}, batch["tokens"])
            losses = optax.softmax_cross_entropy_with_integer_labels(
                logits.astype(jnp.float32), batch["targets"]
            )
            return losses.mean() + aux_loss, aux_loss

        (loss, aux_loss), grads = grad_fn(loss_fn, has_aux=True)(state.params)
        return state.apply_gradients(grads=grads), {"loss": loss, "aux_loss": aux_loss}

    return train_step


train_step = make_train_step()


def _dense_mlp_params(config: MoEConfig) -> int:
    h, f = config.hidden, config.mlp_ratio * config.hidden
    return dense_param_count(h, f) + dense_param_count(f, h)


def param_count(config: MoEConfig) -> int:
    """Number of parameters: the GPT of the same sizes with each MoE layer's MLP replaced by the
    router (hidden x experts) and the expert MLPs (no biases)."""
    h, f, e = config.hidden, config.mlp_ratio * config.hidden, config.num_experts
    moe_mlp = h * e + 2 * e * h * f
    return gpt.param_count(config.dense) + config.num_moe_layers * (
        moe_mlp - _dense_mlp_params(config)
    )


def flops_per_token(config: MoEConfig) -> int:
    """Training FLOPs per token (forward + backward), GPT's formula with each MoE layer's MLP
    replaced by what the layer computes (times 3 for forward and backward), per token:

    * router: ``2 h E``;
    * experts: every one of the ``E * C`` slots of a group runs an expert MLP, filled or not,
      so ``(E C / S) * 4 h f`` with ``E C / S ~ 2 * capacity_factor``;
    * dispatch and combine einsums: ``2 * 2 h E C`` (Alpa's ``compute_moe_tflops`` counts them).

    Softmax, top-2 selection and the balancing loss are not counted. `S` is the configured group
    size, as in a batch of at least that many tokens.
    """
    h, f, e = config.hidden, config.mlp_ratio * config.hidden, config.num_experts
    group = config.expert_group_size or config.seq_len
    slots = e * expert_capacity(config, group)
    moe_mlp = 2 * h * e + slots * 4 * h * f // group + 4 * h * slots
    dense_mlp = 2 * _dense_mlp_params(config)
    return gpt.flops_per_token(config.dense) + 3 * config.num_moe_layers * (moe_mlp - dense_mlp)
