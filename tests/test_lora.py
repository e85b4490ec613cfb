"""LoRA: adapters on the projections (models/lora.py) over a frozen base (pstar_jax/config/lora.py, pstar_jax/model/lora.py).

Step 0 equals the base model bit for bit; the adapter's forward is W x + b + scale x A B; the
chunked engine under eviction equals the plain engine running the same LoRA model; the frozen
base never changes and exactly the adapters (and modules_to_save) train."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from pstar_models import build_model
from pstar_models.lora import LoraLinear, LoraSpec
from pstar_jax.config import ConfigError, EngineConfig
from pstar_jax.planner.build import plan_model
from pstar_jax.model.freeze import trainable
from pstar_jax.config.lora import LoraConfig
from pstar_jax.model.lora import adapter_names, frozen_for_lora, is_adapter
from pstar_jax.plan.machine import H200
from pstar_jax.engine.memory import Space
from pstar_jax.engine.optim import default_tx
from frozen_engines import CHUNK, OPTIM, chunked, mesh, plain
from sft_batches import batches

EPS32 = float(np.finfo(np.float32).eps)
needs_8 = pytest.mark.skipif(len(jax.devices()) < 8, reason="needs conftest's 8 fake devices")
FAMILIES = ("tiny", "llama-tiny", "qwen3-0.6b")
# Presets shrunk to test size (the family's code paths: Qwen3's q/k norms, head_dim 16 != 32 / 4).
SHRUNK = {"qwen3-0.6b": dict(vocab_size=256, d_model=32, n_layer=2, n_head=4, n_kv_head=2, d_ff=48, head_dim=16,
                             seq_len=64)}


def base_model(name="tiny"):
    return build_model(name, **SHRUNK.get(name, {}))


def lora_model(name="tiny", **spec):
    return build_model(name, lora=LoraSpec(**{"rank": 4, "alpha": 16.0, **spec}), **SHRUNK.get(name, {}))


# -- the model side ----------------------------------------------------------------------------

@pytest.mark.parametrize("name", FAMILIES)
def test_adapters_are_named_shaped_and_initialised_as_peft(name):
    m = lora_model(name)
    shapes = m.param_shapes()
    base = base_model(name).param_shapes()
    adapters = adapter_names(m)
    assert {n for n in shapes if not is_adapter(n)} == set(base)
    projections = ({"attn.qkv", "attn.proj", "mlp.fc", "mlp.proj"} if name == "tiny"
                   else {"attn.q", "attn.k", "attn.v", "attn.o", "mlp.gate", "mlp.up", "mlp.down"})
    n_layer = m.config.n_layer
    assert set(adapters) == {f"blocks.{i}.{p}.lora.{leaf}" for i in range(n_layer) for p in projections
                             for leaf in ("lora_a", "lora_b")}
    for n in adapters:
        kernel = shapes[n.replace(".lora.lora_a", ".kernel").replace(".lora.lora_b", ".kernel")]
        value = np.asarray(m.init_tensor(n, 0))
        if n.endswith("lora_a"):
            assert shapes[n] == (kernel[0], 4)
            bound = 1 / math.sqrt(kernel[0])  # torch kaiming_uniform_(a=sqrt(5)) on [rank, in]
            assert np.abs(value).max() <= bound and np.abs(value).max() > 0.8 * bound
        else:
            assert shapes[n] == (4, kernel[1]) and not value.any()
    a = [np.asarray(m.init_tensor(n, 0)) for n in adapters if n.endswith("lora_a")]
    assert len({x.tobytes() for x in a}) == len(a), "every adapter draws its own values"


@pytest.mark.parametrize("name", FAMILIES)
def test_step_zero_equals_the_base_model_bit_for_bit(name):
    """lora_b is zero: the LoRA model's logits (training forward and cached decoding) are the base
    model's exactly, and the base tensors are drawn the same with or without adapters."""
    m, b = lora_model(name), base_model(name)
    pl, pb = m.init_params(0), b.init_params(0)
    for n in pb:
        np.testing.assert_array_equal(pl[n], pb[n], err_msg=n)
    tokens = np.random.default_rng(0).integers(0, 256, (2, 16))
    ml, mb = m.module(pl), b.module(pb)
    np.testing.assert_array_equal(np.asarray(ml(tokens)), np.asarray(mb(tokens)))
    cache_l, cache_b = ml.init_cache(2, 16, jnp.float32), mb.init_cache(2, 16, jnp.float32)
    np.testing.assert_array_equal(np.asarray(ml.decode(tokens, cache_l, 0)[0]),
                                  np.asarray(mb.decode(tokens, cache_b, 0)[0]))


@pytest.mark.parametrize("rslora", [False, True])
def test_adapter_forward_is_w_x_plus_scaled_x_a_b(rslora):
    """y = x W + b + scale x A B against float64 numpy; scale alpha/rank (rslora: alpha/sqrt(rank))."""
    spec = LoraSpec(rank=4, alpha=12.0, rslora=rslora)
    layer = LoraLinear(16, 24, spec, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(1)
    W, bias = rng.normal(size=(16, 24)), rng.normal(size=24)
    A, B = rng.normal(size=(16, 4)), rng.normal(size=(4, 24))
    layer.kernel[...], layer.bias[...] = jnp.asarray(W, jnp.float32), jnp.asarray(bias, jnp.float32)
    layer.lora.lora_a[...], layer.lora.lora_b[...] = jnp.asarray(A, jnp.float32), jnp.asarray(B, jnp.float32)
    x = rng.normal(size=(3, 5, 16))
    scale = 12.0 / (2.0 if rslora else 4.0)
    assert layer.lora_scale == spec.scale == scale
    want = x @ W + bias + scale * (x @ A @ B)
    got = np.asarray(layer(jnp.asarray(x, jnp.float32)))
    np.testing.assert_allclose(got, want, rtol=0, atol=64 * EPS32 * np.abs(want).max())


@pytest.mark.slow
@pytest.mark.parametrize("name", FAMILIES)
def test_decoding_applies_the_adapter(name):
    """With trained (nonzero) adapters the cached decode gives the training forward's logits, and
    they differ from the base model's."""
    m = lora_model(name)
    params = m.init_params(0)
    rng = np.random.default_rng(2)
    for n in adapter_names(m):
        if n.endswith("lora_b"):
            params[n] = jnp.asarray(0.05 * rng.normal(size=params[n].shape), jnp.float32)
    module = m.module(params)
    tokens = rng.integers(0, 256, (2, 12))
    full = np.asarray(module(tokens))
    cache = module.init_cache(2, 12, jnp.float32)
    first, cache = module.decode(tokens[:, :8], cache, 0)
    rest, _ = module.decode(tokens[:, 8:], cache, 8)
    decoded = np.concatenate([np.asarray(first), np.asarray(rest)], axis=1)
    np.testing.assert_allclose(decoded, full, rtol=0, atol=256 * EPS32 * np.abs(full).max())
    base = base_model(name).module({n: v for n, v in params.items() if not is_adapter(n)})
    assert np.abs(np.asarray(base(tokens)) - full).max() > 1e-3


@pytest.mark.slow
def test_dropout_masks_are_inverted_per_projection_and_position_and_tiling_free():
    from pstar_models.lora import dropout, position_seeds
    from pstar_jax.data.batch import plain as plain_batch, with_dropout_seeds
    from pstar_jax.model.staged import compose_loss, stage_seeds
    from pstar_jax.model.tiling import TileBudget
    seeds = position_seeds(jnp.asarray([7, 8], jnp.uint32), 64)
    x = jnp.ones((2, 64, 32))
    y = np.asarray(dropout(x, seeds, 1, 0.25))
    assert set(np.unique(y)) == {0.0, np.float32(1 / 0.75)}
    assert abs((y == 0).mean() - 0.25) < 0.03
    assert not np.array_equal(y, np.asarray(dropout(x, seeds, 2, 0.25))), "each projection its own mask"
    assert not np.array_equal(y[0], y[1]) and not np.array_equal(y[:, 0], y[:, 1]), "rows and positions differ"
    b = stage_seeds(with_dropout_seeds(plain_batch(np.zeros((2, 4)), np.zeros((2, 4))), 0, 0, 0, 0), 1)
    assert not np.array_equal(np.asarray(b.dropout_seed), np.asarray(stage_seeds(b, 2).dropout_seed))
    # The MLP cut into 8-position tiles draws the masks of the whole sequence.
    spec = LoraSpec(rank=4, alpha=16.0, dropout=0.3)
    tokens = np.random.default_rng(0).integers(0, 256, (2, 64))
    batch = with_dropout_seeds(plain_batch(tokens, tokens), 0, 3, 0, 0)
    losses = []
    for budget in (TileBudget(), TileBudget(mlp_bytes=8 * 4 * 2 * 128)):
        from pstar_models.gpt import StagedGPT, preset
        m = StagedGPT(dataclasses.replace(preset("tiny"), lora=spec), tiling=budget)
        params = m.init_params(0)
        params = {n: (v + 0.05 if n.endswith("lora_b") else v) for n, v in params.items()}
        losses.append(float(compose_loss(m.stages(jnp.float32))(params, batch)))
        clean = float(compose_loss(m.stages(jnp.float32))(params, batch._replace(dropout_seed=None)))
    np.testing.assert_allclose(losses[0], losses[1], rtol=1e-6)
    assert abs(losses[0] - clean) > 1e-4, "dropout changes the loss"


def test_spec_and_model_validation():
    with pytest.raises(ValueError, match="matches no projection"):
        lora_model("tiny", targets=("attn.q",))
    with pytest.raises(ValueError, match="rank 33 exceeds"):
        lora_model("tiny", rank=33)
    with pytest.raises(ValueError, match="dropout"):
        LoraSpec(4, 8.0, dropout=1.0)
    m = lora_model("llama-tiny", targets=("attn.*",))
    assert {n.split(".")[2] + "." + n.split(".")[3] for n in adapter_names(m)} == {"attn.q", "attn.k", "attn.v",
                                                                                    "attn.o"}


# -- the engines -------------------------------------------------------------------------------

@pytest.mark.parametrize("micro_batches,dropout", [(1, 0.0), (2, 0.0), pytest.param(2, 0.1, marks=pytest.mark.slow)])
def test_chunked_under_eviction_equals_plain_and_trains_exactly_the_adapters(micro_batches, dropout):
    """fp32, 10 steps, chunks moving every step: losses and tensors equal the plain engine's with
    the same LoRA model, init and batches; frozen tensors bit-identical; only adapters change.
    With dropout the masks are the same in both engines and in the chunked engine's recomputed
    forward (else its grads, and so its tensors, would differ from plain's)."""
    m = lora_model("tiny", dropout=dropout)
    assert m.dropout_seeded == (dropout > 0)
    frozen = frozen_for_lora(m, LoraConfig(rank=4))
    assert frozen == {n for n in m.param_shapes() if not is_adapter(n)}
    engine, reference = chunked(m, frozen, micro_batches=micro_batches), plain(m, frozen, micro_batches)
    trained = {s.name for s in engine.layout.slots if not engine.layout.is_frozen(s.chunk)}
    assert trained == set(adapter_names(m))
    before = engine.params()
    la, lb = [], []
    for step in batches(10, micro_batches):
        r = engine.step(step)
        la.append(r.loss)
        lb.append(reference.step(step).loss)
        assert r.h2d_bytes == r.predicted_h2d_bytes and r.d2h_bytes == r.predicted_d2h_bytes
        assert r.h2d_bytes > 0, "the budget must make chunks move every step"
    np.testing.assert_allclose(la, lb, rtol=1e-5)
    pa, pb = engine.params(), reference.params()
    changed = set()
    for name in pa:
        if name in frozen:
            np.testing.assert_array_equal(pa[name], before[name], err_msg=name)
            np.testing.assert_array_equal(pb[name], before[name], err_msg=name)
        else:
            atol = 64 * EPS32 * max(1.0, float(np.abs(pb[name]).max()))
            np.testing.assert_allclose(pa[name], pb[name], rtol=1e-5, atol=atol, err_msg=name)
        if not np.array_equal(pa[name], before[name]):
            changed.add(name)
    assert changed == set(adapter_names(m))


@pytest.mark.slow
@needs_8
def test_zero_over_8_devices_equals_plain_on_one_with_the_same_dropout_masks():
    """Dropout seeds follow the global row, not the device: 8 devices equal 1."""
    m = lora_model("tiny", dropout=0.1)
    frozen = frozen_for_lora(m, LoraConfig(rank=4, dropout=0.1))
    engine, reference = chunked(m, frozen, W=8, batch=8), plain(m, frozen, W=1)
    for step in batches(10, batch=8):
        r = engine.step(step)
        np.testing.assert_allclose(r.loss, reference.step(step).loss, rtol=1e-5)
        assert r.h2d_bytes == r.predicted_h2d_bytes and r.h2d_bytes > 0
    pa, pb = engine.params(), reference.params()
    for name in pa:
        atol = 64 * EPS32 * max(1.0, float(np.abs(pb[name]).max()))
        np.testing.assert_allclose(pa[name], pb[name], rtol=1e-5, atol=atol, err_msg=name)


@pytest.mark.slow
def test_with_dropout_the_trace_runs_the_steps_batch_so_the_step_compiles_no_stage_and_the_plan_counts_masks():
    """The engine adds each row's dropout seed to the batch: the trace must compile the stage
    functions on that same pytree (else the first step compiles every one again) and so count
    the masks' memory. Stage functions are pstar_jax.engine.stages's jitted ``local``s; compilations are counted
    by JAX's backend-compile event (recorded on a persistent-cache hit too)."""
    import jax.monitoring

    compiled: list[str] = []

    def listen(event, duration_s, **info):
        if event == "/jax/core/compile/backend_compile_duration":
            compiled.append(str(info.get("fun_name")))
    m = lora_model("tiny", dropout=0.1)
    frozen = frozen_for_lora(m, LoraConfig(rank=4, dropout=0.1))
    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        engine = chunked(m, frozen, budget=None, batch=2)
        traced = compiled.count("jit(local)")
        compiled.clear()
        engine.step(batches(1, batch=2)[0])
        engine.flush()
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    assert traced > 0, "the trace compiles the stage functions"
    assert compiled.count("jit(local)") == 0, f"the step compiled stage functions again: {compiled}"
    with_masks = engine.plan_for((2, 64)).shape
    cfg = EngineConfig(chunk_numel=CHUNK, precision="fp32")
    without = plan_model(lora_model("tiny"), cfg, mesh(), (2, 64), H200, 2**40, default_tx(OPTIM),
                         trainable=trainable(frozen)).shape
    a = (*with_masks.fwd_non_model, with_masks.head_non_model, *with_masks.bwd_non_model)
    b = (*without.fwd_non_model, without.head_non_model, *without.bwd_non_model)
    assert all(x >= y for x, y in zip(a, b)) and sum(a) > sum(b), (a, b)


def test_modules_to_save_train_in_full_and_the_plan_counts_two_bytes_per_frozen_param():
    m = lora_model("tiny")
    frozen = frozen_for_lora(m, LoraConfig(rank=4, modules_to_save="wte,blocks.*.ln1"))
    assert "wte.embedding" not in frozen and "blocks.1.ln1.bias" not in frozen and "wpe" in frozen
    assert "blocks.0.attn.qkv.kernel" in frozen and not any(is_adapter(n) for n in frozen)
    engine = chunked(m, frozen, budget=None, precision="bf16")
    engine.step(batches(1)[0])
    layout, store = engine.layout, engine.store
    for c in range(layout.n_chunks):
        if layout.is_frozen(c):
            assert [k for k in (("slot", c), ("master", c), ("opt", c)) if k in store] == []
            assert store.placement.per_device_bytes(store.peek(("param", c))) == 2 * layout.numel_of(c)
            assert (Space.HOST in store.spaces(("param", c))) == (engine.plan.home(c) == "host")  # one home
    state = sum(engine.plan.opt_state_bytes[c] for c in layout.trainable_chunks)
    assert engine.model_data_bytes == sum(map(engine.chunk_bytes, range(layout.n_chunks))) + state
    with pytest.raises(ConfigError, match="'nope' matches no base tensor"):
        frozen_for_lora(m, LoraConfig(rank=4, modules_to_save="nope"))
    with pytest.raises(ConfigError, match="no LoRA adapters"):
        frozen_for_lora(build_model("tiny"), LoraConfig(rank=4))


def tiny_lora_flops_by_hand(trained_head: bool = False) -> int:
    """GPT "tiny" with rank-4 adapters on its four projections, counted by hand: a frozen tensor 4
    FLOPs per parameter and token (forward, input gradient), an adapter or trained one 6, the
    lookups (wpe; wte as a lookup) none, attention's two causal L x L matmuls 6 L D per layer."""
    D, L, V, layers, r = 32, 64, 256, 2, 4
    block = 2 * D + (D * 3 * D + 3 * D) + (D * D + D) + 2 * D + (D * 4 * D + 4 * D) + (4 * D * D + D)
    adapters = r * ((D + 3 * D) + (D + D) + (D + 4 * D) + (4 * D + D))  # [in, r] and [r, out] each
    head = V * D  # the tied embedding, as the head's kernel
    frozen = layers * block + 2 * D + (0 if trained_head else head)
    return 4 * frozen + 6 * (layers * adapters + (head if trained_head else 0)) + 6 * layers * L * D


def test_model_flops_count_frozen_tensors_at_four_per_parameter():
    from pstar_jax.model.staged import flops_per_token
    m = lora_model("tiny")
    assert (m.config.d_model, m.config.seq_len, m.config.vocab_size, m.config.n_layer) == (32, 64, 256, 2)
    assert m.config.tie_embeddings
    assert flops_per_token(m) == m.flops_per_token() == flops_per_token(m, frozenset())  # nothing frozen: as before
    assert flops_per_token(m, frozen_for_lora(m, LoraConfig(rank=4))) == tiny_lora_flops_by_hand()
    saved = frozen_for_lora(m, LoraConfig(rank=4, modules_to_save="wte"))
    assert flops_per_token(m, saved) == tiny_lora_flops_by_hand(trained_head=True)
    # The lookup of an untied embedding counts nothing, frozen or not.
    untied = build_model("tiny", tie_embeddings=False)
    assert flops_per_token(untied, {"wte.embedding", "wpe"}) == untied.flops_per_token()


# -- the CLI -----------------------------------------------------------------------------------

TRAIN = ["--quiet", "--precision", "fp32", "--batch-size", "8", "--lr", "1e-2", "--chunk-size", "8192",
         "--model", "tiny", "--lora-rank", "4"]


@pytest.mark.slow
def test_pstar_train_with_lora_runs_and_the_loss_falls(tmp_path, capsys):
    import json

    from pstar_jax.cli.train import main
    def losses(lr):  # the same batches in the same order at every learning rate
        metrics = tmp_path / f"m{lr}.jsonl"
        assert main([*TRAIN, "--steps", "12", "--lr", lr, "--metrics-out", str(metrics)]) == 0
        records = [json.loads(line) for line in open(metrics)]
        for r in records:  # model FLOPs count the frozen base at 4 per parameter
            np.testing.assert_allclose(r["model_tflops"] * 1e12 * r["step_s"] / (8 * 64), tiny_lora_flops_by_hand(),
                                       rtol=1e-12)
        return np.array([r["loss"] for r in records])
    trained = losses("1e-2")
    assert "frozen" in capsys.readouterr().out
    # Per-batch losses of this data vary by about 0.05 from batch to batch: compare with the same
    # batches under an update too small to matter, whose losses stay the base model's.
    gain = trained - losses("1e-9")
    assert len(gain) == 12 and gain[0] == 0 and np.all(gain[-6:] < 0) and gain[-6:].mean() < -0.05, gain


@pytest.mark.parametrize("flags,words", [
    (["--lora-targets", "attn.nope"], "matches no projection"),
    (["--lora-rank", "40"], "exceeds"),
    (["--lora-modules-to-save", "nope"], "matches no base tensor"),
    (["--lora-dropout", "1"], "--lora-dropout must be in [0, 1)"),
    (["--lora-rank", "0", "--lora-rslora"], "--lora-rslora is set but --lora-rank is 0"),
    (["--init-from-flax", "x"], "--lora-rank and --init-from-flax conflict"),
])
def test_bad_lora_flags_are_one_line(capsys, flags, words):
    from pstar_jax.cli.train import main
    assert main([*TRAIN, "--steps", "1", *flags]) == 2  # (a repeated flag's last value wins)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and words in err[0], err


@pytest.mark.slow
def test_a_lora_run_from_a_hugging_face_checkpoint_starts_at_the_base_loss(tmp_path):
    """--init-from-hf with --lora-rank: the base comes from the checkpoint (which has no adapters),
    the adapters from peft's init, and the first step's loss is the base model's."""
    import pstar_jax as ps
    from pstar_models.llama import LlamaConfig, StagedLlama
    from test_hf import write_family_checkpoint
    model = StagedLlama(LlamaConfig(vocab_size=300, d_model=48, n_layer=2, n_head=6, n_kv_head=2, d_ff=80,
                                    seq_len=32, max_position_embeddings=32))
    src = str(tmp_path / "src")
    write_family_checkpoint(src, model)
    tokens = np.random.default_rng(0).integers(0, 300, 4000).astype(np.uint16)
    first = {}
    for rank in (0, 4):
        config = ps.RunConfig(model=ps.ModelConfig(init_from_hf=src), train=ps.TrainConfig(steps=1, batch_size=4),
                              engine=ps.EngineConfig(precision="fp32", chunk_numel=16384, machine="h200"),
                              distributed=ps.DistributedConfig(data_parallel=1), output=ps.OutputConfig(quiet=True),
                              lora=ps.LoraConfig(rank=rank))
        with ps.Run(config, tokens=tokens, verbose=False) as run:
            params = run.engine.params()
            assert set(params) == set(run.model.param_shapes())
            if rank:
                assert {n for n in params if is_adapter(n)} == set(adapter_names(run.model))
                assert run.engine.layout.trainable_chunks and all(
                    run.engine.layout.is_frozen(s.chunk) != is_adapter(s.name) for s in run.engine.layout.slots)
            first[rank] = next(iter(run.fit()))["loss"]
            base = {n: v for n, v in params.items() if not is_adapter(n)}
            first[f"params{rank}"] = base
    for n, v in first["params0"].items():
        np.testing.assert_array_equal(first["params4"][n], v, err_msg=n)
    np.testing.assert_allclose(first[4], first[0], rtol=1e-6)


@pytest.mark.slow
def test_a_lora_run_with_dropout_stops_and_resumes_exactly(tmp_path):
    """Six straight steps equal three, a checkpoint, and three resumed: the adapters' state and
    the dropout masks (seeded by the step) come back the same."""
    import json

    from pstar_jax.cli.train import main
    flags = [*TRAIN, "--lora-dropout", "0.1", "--steps", "6"]
    straight, split, d = tmp_path / "s.jsonl", tmp_path / "p.jsonl", tmp_path / "ck"
    assert main([*flags, "--metrics-out", str(straight)]) == 0
    assert main([*flags, "--stop-after", "3", "--checkpoint-dir", str(d), "--metrics-out", str(split)]) == 0
    assert main([*flags, "--resume", "--checkpoint-dir", str(d), "--metrics-out", str(split)]) == 0

    def losses(path):
        return [json.loads(line)["loss"] for line in open(path)]
    assert losses(split) == losses(straight) and len(losses(straight)) == 6
