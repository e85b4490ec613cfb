"""The batch pytree: packed rows' side inputs, the checks before a step, and packing's exactness:
a packed row gives every model family the losses and gradients of its examples run alone."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pstar_models.gpt import StagedGPT, preset
from pstar_models.llama import LinearRopeScaling, Llama3RopeScaling, LlamaConfig, StagedLlama
from pstar_jax.data.batch import Batch, check_batches, from_rows, plain, positions_in_segments
from pstar_jax.config.errors import DataError
from pstar_jax.model.staged import compose_loss

EPS32 = float(np.finfo(np.float32).eps)
LLAMA = LlamaConfig(vocab_size=101, d_model=36, n_layer=2, n_head=6, n_kv_head=2, d_ff=56, seq_len=32,
                    rope_scaling=Llama3RopeScaling(8.0, 1.0, 4.0, 16))  # GQA (3 query heads per kv head), RoPE
GEMMA = dataclasses.replace(LLAMA, head_dim=10, family="gemma3_text", qk_norm=True, rope_scaling=LinearRopeScaling(4.0),
                                 layer_types=("sliding_attention", "full_attention"), sliding_window=5,
                                 rope_local_theta=100.0, query_pre_attn_scalar=7.0, final_softcap=3.0)
FAMILIES = {
    "gpt": lambda: StagedGPT(dataclasses.replace(preset("tiny"), seq_len=32, vocab_size=101)),
    "llama": lambda: StagedLlama(LLAMA),
    "qwen": lambda: StagedLlama(dataclasses.replace(LLAMA, qkv_bias=True, family="qwen2", tie_embeddings=True,
                                                    rope_scaling=None)),
    "mistral": lambda: StagedLlama(dataclasses.replace(LLAMA, head_dim=10, family="mistral", rope_scaling=None)),
    "qwen3": lambda: StagedLlama(dataclasses.replace(LLAMA, head_dim=10, family="qwen3", qk_norm=True,
                                                     rope_scaling=None)),
    # examples longer than the sliding window (5), which must not reach across them
    "gemma3": lambda: StagedLlama(GEMMA),
}


def test_from_rows_follows_the_interface():
    """Inputs/targets shift by one; positions restart per example; a target is trained only when
    labelled and within its input's example (never across a boundary, never from padding)."""
    tokens = np.array([[5, 6, 7, 8, 9, 10, 11, 0, 0]])
    segments = np.array([[1, 1, 1, 2, 2, 2, 2, 0, 0]])
    labels = np.array([[0, 1, 1, 0, 1, 1, 1, 0, 0]])
    b = from_rows(tokens, segments, labels)
    np.testing.assert_array_equal(b.tokens, [[5, 6, 7, 8, 9, 10, 11, 0]])
    np.testing.assert_array_equal(b.targets, [[6, 7, 8, 9, 10, 11, 0, 0]])
    np.testing.assert_array_equal(b.segment_ids, [[1, 1, 1, 2, 2, 2, 2, 0]])
    np.testing.assert_array_equal(b.positions, [[0, 1, 2, 0, 1, 2, 3, 0]])
    np.testing.assert_array_equal(b.loss_mask, [[1, 1, 0, 1, 1, 1, 0, 0]])
    assert b.loss_mask.dtype == np.float32 and b.tokens.dtype == b.positions.dtype == np.int32
    p = plain(tokens[:, :-1], tokens[:, 1:])
    np.testing.assert_array_equal(p.positions, np.arange(8)[None])
    assert p.loss_mask.sum() == 8 and (p.segment_ids == 1).all()
    np.testing.assert_array_equal(positions_in_segments(np.array([[3, 3, 0, 0, 1]])), [[0, 1, 0, 0, 0]])


class _Unpacked:
    vocab_size = 50
    name = "MyLM"


def test_bad_ids_and_unpacking_models_are_refused_with_one_line():
    tok = np.zeros((2, 8), np.int32)
    ok = plain(tok, tok)
    check_batches([ok], _Unpacked())
    with pytest.raises(DataError, match=r"-100 .*loss mask of an SFT file \(pstar-tokens --chat\)"):
        check_batches([ok._replace(targets=np.full_like(tok, -100))], _Unpacked())
    with pytest.raises(DataError, match="targets hold id 50, outside the model's vocabulary of 50 ids"):
        check_batches([ok._replace(targets=tok + 50)], _Unpacked())
    with pytest.raises(DataError, match="tokens hold id -3"):
        check_batches([ok._replace(tokens=tok - 3)], _Unpacked())
    packed = ok._replace(segment_ids=np.array([[1] * 4 + [2] * 4] * 2, np.int32))
    with pytest.raises(DataError, match="model MyLM does not follow segment ids"):
        check_batches([packed], _Unpacked())
    check_batches([packed], type("Packing", (_Unpacked,), {"supports_packing": True})())


def _example_rows(lengths, L, vocab, seed):
    """Examples of ``lengths`` tokens, random labels: (packed row, one row per example alone), [1, L+1] each."""
    rng = np.random.default_rng(seed)
    examples = [(rng.integers(0, vocab, n), rng.integers(0, 2, n)) for n in lengths]
    packed = [np.zeros((1, L + 1), np.int64) for _ in range(3)]
    alone = []
    at = 0
    for k, (tok, lab) in enumerate(examples, start=1):
        n = len(tok)
        for arr, value in zip(packed, (tok, k, lab)):
            arr[0, at:at + n] = value
        row = [np.zeros((1, L + 1), np.int64) for _ in range(3)]
        for arr, value in zip(row, (tok, 1, lab)):
            arr[0, :n] = value
        alone.append(from_rows(*row))
        at += n
    return from_rows(*packed), alone


@pytest.mark.parametrize("family", FAMILIES)
def test_packed_row_equals_its_examples_alone(family):
    """fp32: the loss sum and every gradient of a packed row of 3 examples equal the sums over the
    examples run alone (each padded, with its own mask), to fp32 rounding."""
    assert_packed_row_equals_its_examples_alone(FAMILIES[family]())


def assert_packed_row_equals_its_examples_alone(model, ulps=lambda name: 64):
    """The check above for ``model``, each gradient to ``ulps(name)`` of its largest value."""
    L = model.seq_len
    packed, alone = _example_rows((9, 14, 7), L, model.vocab_size, seed=3)
    assert int(packed.segment_ids.max()) == 3 and packed.loss_mask.sum() > 0
    loss = compose_loss(model.stages(jnp.float32))
    params = model.init_params(0)

    def loss_sum(p, b):
        return loss(p, jax.tree.map(jnp.asarray, b)) * b.loss_mask.sum()
    value, grads = jax.value_and_grad(loss_sum)(params, packed)
    parts = [jax.value_and_grad(loss_sum)(params, b) for b in alone]
    expected = sum(v for v, _ in parts)
    np.testing.assert_allclose(value, expected, rtol=0, atol=64 * EPS32 * abs(float(expected)))
    for name in grads:
        want = sum(np.asarray(g[name]) for _, g in parts)
        atol = ulps(name) * EPS32 * max(float(np.abs(want).max()), 1e-30)
        np.testing.assert_allclose(grads[name], want, rtol=0, atol=atol, err_msg=name)


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_plain_batch_is_bit_identical_to_the_unmasked_model(family):
    """Plain data through the segment-aware path gives the module's own logits bit for bit."""
    model = FAMILIES[family]()
    params = model.init_params(0)
    module = model.module(params)
    tok = np.random.default_rng(0).integers(0, model.vocab_size, (2, model.seq_len))
    b = plain(tok, tok)
    want = module(jnp.asarray(tok))
    got = module(jnp.asarray(tok), segment_ids=jnp.asarray(b.segment_ids), positions=jnp.asarray(b.positions))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_batch_is_a_pytree_of_five_fields():
    tok = np.zeros((1, 4), np.int32)
    assert len(jax.tree.leaves(plain(tok, tok))) == 5 and Batch._fields[0] == "tokens"
