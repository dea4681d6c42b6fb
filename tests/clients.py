"""Models written the way their libraries' users write them, for the client tests.

Each builder returns a `ClientStep`: the train step (gradients through `autopar.value_and_grad`,
plain jax outside autopar), its initial arguments and which argument holds the batch. Weights are
random from small configs: nothing is downloaded. `tx` is the optimizer: the tests pass
`optax.sgd` so that parameter updates compare gradients, and `optax.adamw` where a client's
usual optimizer is exercised.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.training import train_state

import autopar

SEQ = 8
VOCAB = 64


@dataclasses.dataclass(frozen=True)
class ClientStep:
    """A client's train step and the arguments of its first call."""

    name: str
    step: Callable[..., Any]
    args: tuple[Any, ...]
    # Micro-batches differ from slices of the full batch by design: dropout draws each one's
    # mask from the same key, batch norm normalises each by its own statistics.
    per_micro_batch: bool = False
    jit: Callable[[Callable], Callable] = jax.jit  # how its users compile it serially

    def params(self, args: tuple[Any, ...]) -> Any:
        """The trainable arrays of the state in `args` (what the tests compare)."""
        state = args[0]
        if hasattr(state, "params"):
            return state.params
        return jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, jax.Array))


class DropoutState(train_state.TrainState):
    """A TrainState that carries the dropout key (a typed key), split every step."""

    rng: jax.Array


def _hf_state(model: Any, tx: optax.GradientTransformation) -> DropoutState:
    return DropoutState.create(
        apply_fn=model.__call__, params=model.params, tx=tx, rng=jax.random.key(1)
    )


def _tokens(batch_size: int, seed: int = 0, seq: int = SEQ, vocab: int = VOCAB) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab, (batch_size, seq)).astype(np.int32)


def _hf_lm_step(model: Any, loss_of: Callable[..., Any]) -> Callable[..., Any]:
    """A transformers-style step: dropout key in the state, loss and accuracy metrics."""

    def train_step(state, batch):
        rng, dropout_rng = jax.random.split(state.rng)

        def loss_fn(params):
            return loss_of(model, params, batch, dropout_rng)

        loss, grads = autopar.value_and_grad(loss_fn)(state.params)
        metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads)}
        return state.apply_gradients(grads=grads, rng=rng), metrics

    return train_step


def _causal_lm_loss(model, params, batch, dropout_rng):
    logits = model(batch["input_ids"], params=params, dropout_rng=dropout_rng, train=True).logits
    labels = batch["input_ids"][:, 1:]
    return optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], labels).mean()


def gpt2(
    tx: optax.GradientTransformation,
    batch_size: int,
    *,
    seq: int = SEQ,
    vocab: int = VOCAB,
    hidden: int = 32,
) -> ClientStep:
    """transformers' FlaxGPT2LMHeadModel, causal-LM cross-entropy (sizes: tiny by default, the
    cost-model benchmark asks for larger ones)."""
    from transformers import FlaxGPT2LMHeadModel, GPT2Config

    config = GPT2Config(
        vocab_size=vocab,
        n_positions=seq,
        n_embd=hidden,
        n_layer=2,
        n_head=2,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    model = FlaxGPT2LMHeadModel(config, input_shape=(1, seq), seed=0)
    state = _hf_state(model, tx)
    batch = {"input_ids": _tokens(batch_size, seq=seq, vocab=vocab)}
    return ClientStep("gpt2", _hf_lm_step(model, _causal_lm_loss), (state, batch))


def llama(tx: optax.GradientTransformation, batch_size: int) -> ClientStep:
    """transformers' FlaxLlamaForCausalLM: its rotary sin/cos table is computed with numpy."""
    from transformers import FlaxLlamaForCausalLM, LlamaConfig

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    model = FlaxLlamaForCausalLM(config, input_shape=(1, SEQ), seed=0)
    state = _hf_state(model, tx)
    batch = {"input_ids": _tokens(batch_size)}
    return ClientStep("llama", _hf_lm_step(model, _causal_lm_loss), (state, batch))


def bert_mlm(tx: optax.GradientTransformation, batch_size: int) -> ClientStep:
    """transformers' FlaxBertForMaskedLM with a padded batch: the loss is a weighted mean over
    the masked tokens, returned as (sum, count) and divided once after the gradient, so that
    micro-batching gives the full-batch update (README: losses that are not plain means)."""
    from transformers import BertConfig, FlaxBertForMaskedLM

    config = BertConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=SEQ,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    model = FlaxBertForMaskedLM(config, input_shape=(1, SEQ), seed=0)
    state = _hf_state(model, tx)
    rng = np.random.default_rng(2)
    tokens = _tokens(batch_size, seed=3)
    lengths = rng.integers(2, SEQ + 1, batch_size)
    attention = (np.arange(SEQ)[None] < lengths[:, None]).astype(np.int32)
    masked = (rng.random((batch_size, SEQ)) < 0.3) & (attention == 1)
    batch = {
        "input_ids": np.where(masked, 1, tokens).astype(np.int32),
        "attention_mask": attention,
        "labels": np.where(masked, tokens, -100).astype(np.int32),
    }

    def train_step(state, batch):
        rng, dropout_rng = jax.random.split(state.rng)

        def loss_fn(params):
            logits = model(
                batch["input_ids"],
                batch["attention_mask"],
                params=params,
                dropout_rng=dropout_rng,
                train=True,
            ).logits
            weights = (batch["labels"] != -100).astype(jnp.float32)
            labels = jnp.where(batch["labels"] > 0, batch["labels"], 0)
            xent = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
            return (xent * weights).sum(), weights.sum()

        (loss_sum, count), grads = autopar.value_and_grad(loss_fn, has_aux=True)(state.params)
        grads = jax.tree.map(lambda g: g / count, grads)
        metrics = {"loss": loss_sum / count, "tokens": count}
        return state.apply_gradients(grads=grads, rng=rng), metrics

    return ClientStep("bert_mlm", train_step, (state, batch))


def vit(tx: optax.GradientTransformation, batch_size: int) -> ClientStep:
    """transformers' FlaxViTForImageClassification, dropout drawn from a typed key."""
    from transformers import FlaxViTForImageClassification, ViTConfig

    config = ViTConfig(
        image_size=8,
        patch_size=4,
        num_channels=3,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        num_labels=5,
        hidden_dropout_prob=0.1,
        attention_probs_dropout_prob=0.1,
    )
    model = FlaxViTForImageClassification(config, input_shape=(1, 8, 8, 3), seed=0)
    state = _hf_state(model, tx)
    rng = np.random.default_rng(4)
    batch = {
        "pixel_values": rng.standard_normal((batch_size, 3, 8, 8)).astype(np.float32),  # NCHW
        "labels": rng.integers(0, 5, batch_size).astype(np.int32),
    }

    def loss_of(model, params, batch, dropout_rng):
        logits = model(
            batch["pixel_values"], params=params, dropout_rng=dropout_rng, train=True
        ).logits
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"]).mean()

    return ClientStep("vit", _hf_lm_step(model, loss_of), (state, batch), per_micro_batch=True)


def equinox_transformer(tx: optax.GradientTransformation, batch_size: int) -> ClientStep:
    """An equinox transformer passed to the step as a Module (with an activation function
    leaf), its optimizer state beside it, as equinox users write steps."""
    import equinox as eqx

    class Block(eqx.Module):
        norm: eqx.nn.LayerNorm
        attention: eqx.nn.MultiheadAttention
        up: eqx.nn.Linear
        down: eqx.nn.Linear
        activation: Callable = eqx.field(static=False)

        def __init__(self, width: int, key: jax.Array):
            k1, k2, k3 = jax.random.split(key, 3)
            self.norm = eqx.nn.LayerNorm(width)
            self.attention = eqx.nn.MultiheadAttention(2, width, inference=True, key=k1)
            self.up = eqx.nn.Linear(width, 2 * width, key=k2)
            self.down = eqx.nn.Linear(2 * width, width, key=k3)
            self.activation = jax.nn.gelu

        def __call__(self, x):
            h = jax.vmap(self.norm)(x)
            x = x + self.attention(h, h, h)
            return x + jax.vmap(lambda t: self.down(self.activation(self.up(t))))(x)

    class Transformer(eqx.Module):
        embed: eqx.nn.Embedding
        blocks: list
        head: eqx.nn.Linear

        def __init__(self, key: jax.Array):
            keys = jax.random.split(key, 4)
            self.embed = eqx.nn.Embedding(VOCAB, 32, key=keys[0])
            self.blocks = [Block(32, k) for k in keys[1:3]]
            self.head = eqx.nn.Linear(32, VOCAB, key=keys[3])

        def __call__(self, tokens):
            x = jax.vmap(self.embed)(tokens)
            for block in self.blocks:
                x = block(x)
                autopar.mark_pipeline_boundary()
            return jax.vmap(self.head)(x)

    model = Transformer(jax.random.key(0))
    opt_state = tx.init(eqx.filter(model, eqx.is_inexact_array))
    batch = {"tokens": _tokens(batch_size)}

    def train_step(model, opt_state, batch):
        def loss_fn(model):
            logits = jax.vmap(model)(batch["tokens"])
            labels = batch["tokens"][:, 1:]
            return optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], labels).mean()

        loss, grads = autopar.value_and_grad(loss_fn)(model)
        updates, opt_state = tx.update(grads, opt_state, eqx.filter(model, eqx.is_inexact_array))
        return eqx.apply_updates(model, updates), opt_state, {"loss": loss}

    return ClientStep("equinox", train_step, (model, opt_state, batch), jit=eqx.filter_jit)


class _NNXModel:
    """Builds the Flax NNX MLP-mixer-like model used by both NNX styles."""

    @staticmethod
    def make():
        from flax import nnx

        class Block(nnx.Module):
            def __init__(self, width: int, rngs: nnx.Rngs):
                self.norm = nnx.LayerNorm(width, rngs=rngs)
                self.up = nnx.Linear(width, 2 * width, rngs=rngs)
                self.down = nnx.Linear(2 * width, width, rngs=rngs)

            def __call__(self, x):
                return x + self.down(nnx.relu(self.up(self.norm(x))))

        class Model(nnx.Module):
            def __init__(self, rngs: nnx.Rngs):
                self.inp = nnx.Linear(16, 32, rngs=rngs)
                self.blocks = nnx.List([Block(32, rngs) for _ in range(2)])
                self.out = nnx.Linear(32, 4, rngs=rngs)

            def __call__(self, x):
                x = self.inp(x)
                for block in self.blocks:
                    x = block(x)
                    autopar.mark_pipeline_boundary()
                return self.out(x)

        return Model(nnx.Rngs(0))


def _regression_batch(batch_size: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(5)
    return {
        "x": rng.standard_normal((batch_size, 16)).astype(np.float32),
        "y": rng.standard_normal((batch_size, 4)).astype(np.float32),
    }


def nnx_functional(tx: optax.GradientTransformation, batch_size: int) -> ClientStep:
    """Flax NNX in the functional style: `nnx.split` outside, `nnx.merge` inside the step."""
    from flax import nnx

    graphdef, params = nnx.split(_NNXModel.make(), nnx.Param)
    opt_state = tx.init(params)

    def train_step(params, opt_state, batch):
        def loss_fn(params):
            model = nnx.merge(graphdef, params)
            return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)

        loss, grads = autopar.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, {"loss": loss}

    args = (params, opt_state, _regression_batch(batch_size))
    return ClientStep("nnx_functional", train_step, args)


def nnx_state_pytree(tx: optax.GradientTransformation, batch_size: int) -> ClientStep:
    """Flax NNX with its state passed as a pytree of plain arrays (`nnx.State.to_pure_dict`),
    rebuilt with `nnx.replace_by_pure_dict` inside the step."""
    from flax import nnx

    model = _NNXModel.make()
    graphdef, state = nnx.split(model)
    pure = nnx.to_pure_dict(state)
    opt_state = tx.init(pure)

    def train_step(pure, opt_state, batch):
        def loss_fn(pure):
            s = nnx.State(jax.tree.map(lambda x: x, state))
            nnx.replace_by_pure_dict(s, pure)
            model = nnx.merge(graphdef, s)
            return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)

        loss, grads = autopar.value_and_grad(loss_fn)(pure)
        updates, opt_state = tx.update(grads, opt_state, pure)
        return optax.apply_updates(pure, updates), opt_state, {"loss": loss}

    return ClientStep("nnx_pytree", train_step, (pure, opt_state, _regression_batch(batch_size)))


class _ConvBN(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool):
        x = nn.Conv(8, (3, 3))(x)
        x = nn.BatchNorm(use_running_average=not train)(x)
        x = nn.relu(x)
        autopar.mark_pipeline_boundary()
        x = nn.Conv(8, (3, 3))(x)
        x = nn.BatchNorm(use_running_average=not train)(x)
        x = nn.relu(x).mean(axis=(1, 2))
        return nn.Dense(5)(x)


class BatchNormState(train_state.TrainState):
    batch_stats: Any


def linen_batchnorm(tx: optax.GradientTransformation, batch_size: int) -> ClientStep:
    """A Flax linen CNN with BatchNorm (`mutable=["batch_stats"]`)."""
    model = _ConvBN()
    rng = np.random.default_rng(6)
    images = rng.standard_normal((batch_size, 8, 8, 3)).astype(np.float32)
    variables = model.init(jax.random.key(0), images[:2], train=False)
    state = BatchNormState.create(
        apply_fn=model.apply,
        params=variables["params"],
        tx=tx,
        batch_stats=variables["batch_stats"],
    )
    batch = {"image": images, "label": rng.integers(0, 5, batch_size).astype(np.int32)}

    def train_step(state, batch):
        def loss_fn(params):
            logits, updates = state.apply_fn(
                {"params": params, "batch_stats": state.batch_stats},
                batch["image"],
                train=True,
                mutable=["batch_stats"],
            )
            loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()
            return loss, updates["batch_stats"]

        (loss, stats), grads = autopar.value_and_grad(loss_fn, has_aux=True)(state.params)
        state = state.apply_gradients(grads=grads, batch_stats=stats)
        return state, {"loss": loss}

    return ClientStep("linen_bn", train_step, (state, batch), per_micro_batch=True)


class _Classifier(nn.Module):
    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(VOCAB, 32)(tokens)
        x = nn.Dense(32)(x)
        x = nn.gelu(x)
        autopar.mark_pipeline_boundary()
        x = nn.LayerNorm()(nn.Dense(32)(x))
        return nn.Dense(VOCAB)(x)


def batch_outside_loss(tx: optax.GradientTransformation, batch_size: int) -> ClientStep:
    """Flax's example-trainer pattern: token weights computed from the batch before the loss,
    accuracy computed from the batch and the logits after the gradient."""
    model = _Classifier()
    tokens = _tokens(batch_size, seed=7)
    tokens[:, SEQ // 2 :][np.random.default_rng(8).random((batch_size, SEQ // 2)) < 0.5] = 0
    params = model.init(jax.random.key(0), tokens[:2])["params"]
    state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)
    batch = {"inputs": tokens, "targets": np.roll(tokens, -1, axis=1)}

    def train_step(state, batch):
        weights = jnp.where(batch["targets"] > 0, 1.0, 0.0)

        def loss_fn(params):
            logits = state.apply_fn({"params": params}, batch["inputs"])
            xent = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
            return (xent * weights).mean(), logits

        (loss, logits), grads = autopar.value_and_grad(loss_fn, has_aux=True)(state.params)
        correct = (jnp.argmax(logits, -1) == batch["targets"]) * weights
        metrics = {"loss": loss, "accuracy": correct.sum() / weights.sum()}
        return state.apply_gradients(grads=grads), metrics

    return ClientStep("batch_outside_loss", train_step, (state, batch))


CLIENTS: dict[str, Callable[..., ClientStep]] = {
    "gpt2": gpt2,
    "llama": llama,
    "bert_mlm": bert_mlm,
    "vit": vit,
    "equinox": equinox_transformer,
    "nnx_functional": nnx_functional,
    "nnx_pytree": nnx_state_pytree,
    "linen_bn": linen_batchnorm,
    "batch_outside_loss": batch_outside_loss,
}
