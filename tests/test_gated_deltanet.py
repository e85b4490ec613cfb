"""Gated DeltaNet (models/gated_deltanet.py) gives transformers' Qwen3_5GatedDeltaNet output for the
same weights in fp32 (5.x only: 4.57 has no qwen3_5), keeps packed examples apart through the
convolution and the rule, and decodes through its cache as the full forward; bad sizes are one line."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from pstar_models.gated_deltanet import DeltaNetShape, GatedDeltaNet, init_delta_cache

SHAPE = DeltaNetShape(d_model=32, n_key_heads=2, n_value_heads=4, d_key=8, d_value=6, conv_kernel=4, norm_eps=1e-6)


def layer(seed: int = 0) -> GatedDeltaNet:
    """Our layer with every tensor random (norm scale, dt_bias too), so each one changes the output."""
    module = GatedDeltaNet(SHAPE, 0.02, rngs=nnx.Rngs(seed))
    graph, state = nnx.split(module)
    keys = iter(jax.random.split(jax.random.key(seed + 1), 16))
    state = jax.tree.map(lambda p: p + 0.3 * jax.random.normal(next(keys), p.shape), state)
    return nnx.merge(graph, state)


def assert_rounding(got: np.ndarray, expected: np.ndarray) -> None:
    """Equal to fp32 rounding at the outputs' scale: transformers' own fp32 output is 6e-6 of its
    scale off its float64 one on this layer (test_the_layer_gives_transformers_output)."""
    bound = 1e-5 * np.abs(expected).max()
    assert np.abs(got - expected).max() <= bound, (np.abs(got - expected).max(), bound)


def x_BxLxD(L: int, seed: int = 2) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(2, L, SHAPE.d_model)).astype(np.float32)


@pytest.mark.hf_reference
def test_the_layer_gives_transformers_output():
    torch = pytest.importorskip("torch")
    qwen3_5 = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5",
                                  reason="transformers.models.qwen3_5 is not in this transformers (5.x has it)")
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig
    config = Qwen3_5TextConfig(hidden_size=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                               linear_value_head_dim=6, linear_conv_kernel_dim=4, num_hidden_layers=1,
                               layer_types=["linear_attention"], rms_norm_eps=1e-6)
    ref = qwen3_5.Qwen3_5GatedDeltaNet(config, 0).float()
    ours = layer()
    t = lambda a: torch.tensor(np.asarray(a))  # noqa: E731
    with torch.no_grad():
        for name, ours_name in (("in_proj_qkv", "in_qkv"), ("in_proj_z", "in_z"), ("in_proj_b", "in_b"),
                                ("in_proj_a", "in_a"), ("out_proj", "out")):
            getattr(ref, name).weight.copy_(t(getattr(ours, ours_name).kernel[...]).T)
        ref.conv1d.weight.copy_(t(ours.conv.kernel[...]))
        ref.dt_bias.copy_(t(ours.dt_bias[...]))
        ref.A_log.copy_(t(ours.A_log[...]))
        ref.norm.weight.copy_(t(ours.norm.scale[...]))
        x = x_BxLxD(70)
        expected = ref(t(x)).numpy()
        exact = ref.double()(t(x).double()).numpy()
    got = np.asarray(ours(jnp.asarray(x)))
    # fp32 rounding at this layer's scale: the gated norm divides by each head's RMS, which magnifies
    # the rule's rounding, so the bound is the reference's own fp32 error (against its float64 run).
    rounding = np.abs(expected - exact).max()
    assert 0 < rounding < 1e-5 * np.abs(exact).max()
    assert np.abs(got - expected).max() <= 2 * rounding, (np.abs(got - expected).max(), rounding)
    assert np.abs(got - exact).max() <= 2 * rounding, (np.abs(got - exact).max(), rounding)


def test_packed_examples_keep_apart_through_the_convolution_and_the_rule():
    """Each example of a packed row (one shorter than the convolution, one crossing a chunk) gives
    the same outputs, to the last bits, whatever its neighbours hold; and its outputs alone, to
    fp32 rounding of the chunked rule at another chunk alignment: 3e-5 of the outputs' scale
    (measured 1.5e-5 on the 66-token example, whose chunk boundary falls 57 tokens in when packed,
    64 alone; transformers' own fp32 error on it alone is 3.4e-6 of the scale)."""
    ours = layer()
    lengths = [5, 2, 66, 9]
    x = x_BxLxD(sum(lengths), seed=3)
    segments = jnp.asarray(np.repeat(np.arange(1, 5), lengths)[None].repeat(2, 0))
    packed = np.asarray(ours(jnp.asarray(x), segments))
    starts = np.cumsum([0] + lengths)
    for k, n in enumerate(lengths):
        own = slice(starts[k], starts[k] + n)
        others = x_BxLxD(sum(lengths), seed=10 + k)
        others[:, own] = x[:, own]
        again = np.asarray(ours(jnp.asarray(others), segments))[:, own]
        np.testing.assert_allclose(again, packed[:, own], rtol=0, atol=4 * np.finfo(np.float32).eps)
        alone = np.asarray(ours(jnp.asarray(x[:, own])))
        bound = 3e-5 * np.abs(alone).max()
        assert np.abs(packed[:, own] - alone).max() <= bound, (k, np.abs(packed[:, own] - alone).max(), bound)


def test_decoding_through_the_cache_equals_the_full_forward():
    """A 7-token prompt in one call, then tokens one at a time and a 3-token call: the outputs of
    the whole row at once."""
    ours = layer()
    x = jnp.asarray(x_BxLxD(13, seed=4))
    whole = np.asarray(ours(x))
    cache = init_delta_cache(SHAPE, 2, jnp.float32)
    outs = []
    for a, b in ((0, 7), (7, 8), (8, 9), (9, 10), (10, 13)):
        out, cache = ours.decode(x[:, a:b], cache)
        outs.append(np.asarray(out))
    assert_rounding(np.concatenate(outs, axis=1), whole)


@pytest.mark.parametrize("field,value,message", [
    ("n_value_heads", 3, "linear_num_value_heads=3 must be a multiple of linear_num_key_heads=2"),
    ("conv_kernel", 0, "linear_conv_kernel_dim must be a positive integer, got 0"),
    ("d_key", 8.0, "linear_key_head_dim must be a positive integer, got 8.0"),
])
def test_bad_sizes_are_one_line_naming_the_config_json_field(field, value, message):
    import dataclasses
    with pytest.raises(ValueError) as err:
        dataclasses.replace(SHAPE, **{field: value})
    assert str(err.value) == message
