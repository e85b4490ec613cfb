"""The routers' load-balancing loss of a mixture of experts (transformers' ``load_balancing_loss_func``),
carried through a staged forward as per-expert sums.

transformers concatenates the router logits of every sparse layer over the unmasked tokens
(rows = sparse layers x tokens), takes f[e] = the share of rows whose top k holds expert e (summed
over the k choices) and P[e] = the mean router probability of e, and returns E * sum_e f[e] P[e].
Both means have the rows' count as denominator, so with C[e] the rows' top-k count of e and S[e]
their summed probabilities, aux = E * sum_e C[e] S[e] / rows^2. Each sparse layer adds its C, S and
rows to ``RouterStats`` carried from stage to stage beside the activations (a few KiB), and the
last stage reads the totals: C is a count (no gradient), so d aux / d S[e] = E C[e] / rows^2 needs
every layer's counts before any layer's backward, which the staged step has (its forwards all run
first). Over several devices each holds its rows' sums (a leading axis of one, sharded like the
rows): the totals of C and rows are summed over the devices and each device's loss is its share,
linear in its own S (``load_balancing_loss``), so the shares add up to the loss of the whole
micro-batch, whatever the device count.

The softmax here is float32 (the routing's own); transformers' load_balancing_loss_func takes it
in the logits' dtype, so a bf16 run's value differs from its by bf16 rounding (fp32: equal).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class RouterStats(NamedTuple):
    """Sums over the sparse layers so far and the unmasked tokens, float32, per device."""
    counts_1xE: jax.Array  # rows whose top k chose each expert (no gradient)
    probs_1xE: jax.Array  # router probabilities of each expert, summed (differentiable)
    rows_1: jax.Array  # rows counted: sparse layers x unmasked tokens


def add_stats(a: RouterStats, b: RouterStats) -> RouterStats:
    return RouterStats(*(x + y for x, y in zip(a, b)))


def no_stats(n_experts: int) -> RouterStats:
    """What the first stage carries: nothing counted yet."""
    return RouterStats(jnp.zeros((1, n_experts), jnp.float32), jnp.zeros((1, n_experts), jnp.float32),
                       jnp.zeros((1,), jnp.float32))


def layer_stats(logits_NxE: jax.Array, k: int, mask_N: jax.Array) -> RouterStats:
    """One sparse layer's sums over the tokens where ``mask_N`` (transformers' attention mask):
    softmax of the logits in float32 (the routing's own), its top k, counted and summed."""
    probs_NxE = jax.nn.softmax(logits_NxE.astype(jnp.float32), axis=-1)
    _, chosen_NxK = jax.lax.top_k(probs_NxE, k)
    mask_N = mask_N.astype(jnp.float32)
    # (a scatter of the N x k choices: one-hot [N, k, E] would be a large temporary at 128 experts)
    counts_E = jnp.zeros(logits_NxE.shape[-1:], jnp.float32).at[chosen_NxK.reshape(-1)].add(
        jnp.repeat(mask_N, k))
    probs_E = mask_N @ probs_NxE
    return RouterStats(jax.lax.stop_gradient(counts_E)[None], probs_E[None], jnp.sum(mask_N)[None])


def load_balancing_loss(stats: RouterStats, counts_E: jax.Array, rows: jax.Array) -> jax.Array:
    """E * sum_e C[e] S[e] / rows^2 with the totals ``counts_E`` and ``rows`` (over every device's
    rows, no gradient) and this device's ``stats.probs_1xE``: its share of the micro-batch's loss
    (the whole loss with one device). No rows: 0."""
    counts_E, rows = jax.lax.stop_gradient(counts_E), jax.lax.stop_gradient(rows)
    E = stats.probs_1xE.shape[-1]
    return E * jnp.sum(counts_E * jnp.sum(stats.probs_1xE, axis=0)) / jnp.maximum(rows, 1.0) ** 2
