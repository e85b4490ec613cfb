import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from pstar_models.gpt import GPT, GPTConfig, PRESETS, StagedGPT, gpt_from_params, preset
from pstar_jax.data.batch import plain
from pstar_jax.model.staged import cast_params, compose_loss, validate_stages

TINY = preset("tiny")
UNTIED = dataclasses.replace(TINY, tie_embeddings=False)


def assert_fp32_close(actual, desired, err_msg=""):
    """Equal up to fp32 rounding at the values' scale (sums of a few hundred terms)."""
    desired = np.asarray(desired)
    atol = 64 * np.finfo(np.float32).eps * float(np.max(np.abs(desired)))
    np.testing.assert_allclose(actual, desired, rtol=0, atol=atol, err_msg=err_msg)


def batch(config: GPTConfig, B: int = 2, L: int = 16, seed: int = 1) -> tuple[jax.Array, jax.Array]:
    tokens_BxLp1 = jax.random.randint(jax.random.key(seed), (B, L + 1), 0, config.vocab_size)
    return tokens_BxLp1[:, :-1], tokens_BxLp1[:, 1:]


def module_params(model: GPT) -> dict[str, jax.Array]:
    return {".".join(map(str, path)): var.get_value()
            for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param))}


@pytest.mark.parametrize("config", [TINY, UNTIED], ids=["tied", "untied"])
def test_stages_compose_to_gpt_loss(config):
    staged = StagedGPT(config)
    stages = staged.stages(jnp.float32)
    validate_stages(stages, staged.param_shapes())
    params = staged.init_params(0)
    tokens, targets = batch(config)
    staged_loss = compose_loss(stages)(params, tokens, targets)
    # The head stage sums its loss a tile at a time (pstar_jax.model.loss), the module's loss is the
    # whole-logits mean: equal to fp32 rounding, not bit for bit.
    assert_fp32_close(staged_loss, gpt_from_params(config, params).loss(tokens, targets))

    grads = jax.grad(compose_loss(stages))(params, tokens, targets)
    module_grads = jax.grad(lambda p: gpt_from_params(config, p).loss(tokens, targets))(params)
    for name in params:
        assert_fp32_close(grads[name], module_grads[name], err_msg=name)


@pytest.mark.parametrize("config", [TINY, UNTIED], ids=["tied", "untied"])
def test_init_params_match_module_names_and_gpt2_statistics(config):
    """Tensor by tensor: the module's names and shapes, GPT-2's init, deterministic per seed."""
    staged = StagedGPT(config)
    params = staged.init_params(3)
    expected = module_params(GPT(config, rngs=nnx.Rngs(3)))
    assert set(params) == set(expected)
    for name, value in params.items():
        assert value.dtype == jnp.float32 and value.shape == expected[name].shape, name
        np.testing.assert_array_equal(value, staged.init_tensor(name, 3), err_msg=name)
        if name.endswith("bias"):
            assert not np.any(value)
        elif name.endswith("scale"):
            assert np.all(np.asarray(value) == 1)
    big = StagedGPT(dataclasses.replace(config, vocab_size=4096))
    wte = np.asarray(big.init_tensor("wte.embedding", 0))
    assert abs(wte.std() - 0.02) < 1e-3 and abs(wte.mean()) < 1e-3
    assert not np.array_equal(params["wpe"], staged.init_params(4)["wpe"])

    shapes = staged.param_shapes()
    assert list(shapes) == list(params)
    assert all(shapes[n] == params[n].shape for n in params)
    names = list(shapes)
    assert names[:2] == ["wte.embedding", "wpe"]
    assert names[-1] == ("ln_f.bias" if config.tie_embeddings else "head.kernel")
    block_of = [int(n.split(".")[1]) for n in names if n.startswith("blocks.")]
    assert block_of == sorted(block_of)


def test_gpt_from_params_round_trips():
    module = GPT(UNTIED, rngs=nnx.Rngs(0))
    params = module_params(module)
    tokens, _ = batch(UNTIED)
    np.testing.assert_array_equal(gpt_from_params(UNTIED, params)(tokens), module(tokens))
    with pytest.raises(ValueError, match="head.kernel"):
        gpt_from_params(TINY, params)


def test_preset_sizes_without_allocating():
    assert abs(StagedGPT(preset("GPT3_175B")).n_params() / 175e9 - 1) < 0.03
    assert 1.0e9 < StagedGPT(preset("GPT2_1B")).n_params() < 1.3e9
    big = preset("GPT3_175B")
    assert (big.d_model, big.n_layer, big.n_head, big.seq_len, big.vocab_size) == (12288, 96, 96, 1024, 50257)


def test_flops_count_the_same_matmuls_tied_or_untied():
    tied, untied = StagedGPT(TINY), StagedGPT(UNTIED)
    assert untied.n_params() == tied.n_params() + TINY.vocab_size * TINY.d_model
    assert untied.flops_per_token() == tied.flops_per_token()
    n_matmul = tied.n_params() - TINY.seq_len * TINY.d_model
    assert tied.flops_per_token() == 6 * n_matmul + 6 * TINY.n_layer * TINY.seq_len * TINY.d_model


def test_block_stages_share_one_apply():
    staged = StagedGPT(dataclasses.replace(TINY, n_layer=4))
    stages = staged.stages(jnp.float32)
    assert [s.name for s in stages] == ["embed", "block_0", "block_1", "block_2", "block_3", "head"]
    assert len({id(s.apply) for s in stages[1:-1]}) == 1
    again = staged.stages(jnp.float32)
    assert all(a.apply is b.apply for a, b in zip(stages, again))


def test_decay_matrices_only():
    staged = StagedGPT(UNTIED)
    assert staged.decays("wte.embedding") and staged.decays("wpe") and staged.decays("head.kernel")
    assert staged.decays("blocks.0.attn.qkv.kernel")
    assert not staged.decays("blocks.0.attn.qkv.bias")
    assert not staged.decays("blocks.1.ln2.scale") and not staged.decays("ln_f.bias")


@pytest.mark.parametrize("config", [TINY, UNTIED], ids=["tied", "untied"])
def test_bf16_stages_close_to_fp32(config):
    staged = StagedGPT(config)
    params = staged.init_params(0)
    tokens, targets = batch(config)
    fp32 = compose_loss(staged.stages(jnp.float32))(params, tokens, targets)
    stages = staged.stages(jnp.bfloat16)
    bf16_params = cast_params(params, jnp.bfloat16)
    bf16 = compose_loss(stages)(bf16_params, tokens, targets)
    assert bf16.dtype == jnp.float32
    np.testing.assert_allclose(bf16, fp32, rtol=5e-2)

    take = lambda s: tuple(bf16_params[n] for n in s.param_names)
    side = plain(np.asarray(tokens), np.asarray(targets))
    h = stages[0].apply(take(stages[0]), side.tokens, side)
    assert h.dtype == jnp.bfloat16
    assert stages[1].apply(take(stages[1]), h, side).dtype == jnp.bfloat16


def test_future_tokens_do_not_change_earlier_logits():
    model = GPT(TINY, rngs=nnx.Rngs(0))
    tokens, _ = batch(TINY)
    changed = tokens.at[:, 10].set((tokens[:, 10] + 1) % TINY.vocab_size)
    before, after = model(tokens), model(changed)
    np.testing.assert_array_equal(before[:, :10], after[:, :10])
    assert not np.allclose(before[:, 10:], after[:, 10:])


@pytest.mark.parametrize("change, match", [
    (dict(d_model=30, n_head=4), "divisible by n_head"),
    (dict(vocab_size=0), "vocab_size must be a positive integer"),
    (dict(n_layer=-1), "n_layer must be a positive integer"),
    (dict(mlp_ratio=0), "mlp_ratio must be a positive integer"),
])
def test_config_validation(change, match):
    with pytest.raises(ValueError, match=match):
        dataclasses.replace(TINY, **change)


def test_unknown_preset():
    with pytest.raises(ValueError, match="unknown model preset 'GPT9_1T'; choose one of: tiny, small"):
        preset("GPT9_1T")
    assert set(PRESETS) >= {"tiny", "small", "GPT2_1B", "GPT_DS_68B", "GPT3_175B"}
