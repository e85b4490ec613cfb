"""The stored reference of full-fine-tuning DPO (pstar_jax.data.ref_logps): its values equal a direct
forward's, batches carry them by row index, and a file made for other data, base or model, or a
truncated or damaged one, is refused in one line."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pstar_jax.config.errors import DataError
from pstar_jax.config.preference import PreferenceConfig
from pstar_jax.data.batch import from_rows
from pstar_jax.data.ref_logps import (RefLogps, load_ref_logps, pairs_per_row, ref_path, reference_values,
                                      write_ref_logps)
from pstar_jax.data.rows import PackedBatches, Rows
from pstar_jax.model.preference import compose_logps, compose_preference, pairs_of, segment_sums
from test_preference_loss import SEQ_LEN, pack_rows, random_pairs

FINGERPRINT = {"data": {"size_bytes": 10, "mtime_ns": 1, "sidecar_sha256": "ab"}, "base": {"sha256": "cd"},
               "model": {"d_model": 32}}


@pytest.fixture(scope="module")
def setup():
    """A tiny Llama, reference params, and 5 preference rows of 1 or 2 pairs."""
    from pstar_models.llama import LlamaConfig, StagedLlama
    model = StagedLlama(LlamaConfig(vocab_size=61, d_model=32, n_layer=2, n_head=4, n_kv_head=2, d_ff=64,
                                    seq_len=SEQ_LEN, max_position_embeddings=64))
    params = model.init_params(0)
    pairs = random_pairs(61) + random_pairs(61, seed=1)[:3]
    rows = Rows(*pack_rows(pairs, [[0, 1], [3], [2, 5], [4, 6], [0]], SEQ_LEN + 1))
    logps = jax.jit(compose_logps(model))
    forward = lambda batches: [np.asarray(logps(params, jax.tree.map(jnp.asarray, b))) for b in batches]  # noqa: E731
    return model, params, rows, forward


def direct_pair_sums(forward, rows, index):
    """[B, P] chosen and rejected sums of a direct forward over rows ``index``."""
    batch = from_rows(*(np.asarray(getattr(rows, f))[index] for f in Rows._fields))
    logp = forward([batch])[0] * np.asarray(batch.loss_mask)
    return pairs_of(segment_sums(jnp.asarray(logp), jnp.asarray(batch.segment_ids))), batch


def stored(setup, tmp_path, rows_per_batch=2, micro_batches=1):
    _, _, rows, forward = setup
    path = tmp_path / "pairs.ref.f32"
    write_ref_logps(path, np.concatenate(list(reference_values(rows, forward, rows_per_batch, micro_batches))),
                    FINGERPRINT)
    return path


@pytest.mark.parametrize("rows_per_batch, micro_batches", [(2, 1), (1, 3), (5, 1)])
def test_the_stored_values_equal_a_direct_forwards_and_batches_carry_them_by_row(setup, tmp_path, rows_per_batch,
                                                                                 micro_batches):
    _, _, rows, forward = setup
    ref = load_ref_logps(stored(setup, tmp_path, rows_per_batch, micro_batches), rows, FINGERPRINT)
    assert ref.values.shape == (8, 2) and list(pairs_per_row(rows.segments)) == [2, 1, 2, 2, 1]
    batches = PackedBatches(rows, 5, seed=3, ref=ref)
    for _ in range(2):  # shuffled rows: each batch's values are its own rows'
        batch = next(batches)
        ids = np.asarray(batch.tokens)
        order = [next(r for r in range(5) if np.array_equal(np.asarray(rows.tokens)[r, :-1], row)) for row in ids]
        (chosen, rejected), _ = direct_pair_sums(forward, rows, np.array(order))
        got_c, got_r = pairs_of(segment_sums(jnp.asarray(batch.ref_logp * batch.loss_mask),
                                             jnp.asarray(batch.segment_ids)))
        np.testing.assert_allclose(got_c, chosen, rtol=0, atol=1e-5 * float(np.abs(chosen).max()))
        np.testing.assert_allclose(got_r, rejected, rtol=0, atol=1e-5 * float(np.abs(rejected).max()))
        assert np.all(np.asarray(batch.ref_logp)[np.asarray(batch.loss_mask) == 0] == 0)


@pytest.mark.parametrize("loss", ["sigmoid", "ipo"])
def test_a_step_on_stored_values_equals_one_on_the_direct_forward(setup, tmp_path, loss):
    model, params, rows, forward = setup
    ref = load_ref_logps(stored(setup, tmp_path), rows, FINGERPRINT)
    cfg = PreferenceConfig(objective="dpo", loss=loss, beta=0.3)
    index = np.array([4, 0, 2])
    batch = from_rows(*(np.asarray(getattr(rows, f))[index] for f in Rows._fields))
    direct = forward([batch])[0]
    fn = compose_preference(model, cfg)
    ours = fn(params, jax.tree.map(jnp.asarray, batch), jnp.asarray(ref.attach(batch, index).ref_logp))
    theirs = fn(params, jax.tree.map(jnp.asarray, batch), jnp.asarray(direct))
    np.testing.assert_allclose(float(ours[0]), float(theirs[0]), rtol=1e-5, atol=1e-7)
    for name in ours[1]:
        np.testing.assert_allclose(float(ours[1][name]), float(theirs[1][name]), rtol=1e-5, atol=1e-6, err_msg=name)


def test_the_file_sits_beside_the_data():
    assert ref_path("/d/pairs.sft.u16.bin").name == "pairs.ref.f32"
    assert ref_path("/d/pairs.sft.u32.bin").name == "pairs.ref.f32"


@pytest.mark.parametrize("part", ["data", "base", "model"])
def test_a_file_for_other_data_base_or_model_is_refused_naming_it(setup, tmp_path, part):
    path = stored(setup, tmp_path)
    other = {**FINGERPRINT, part: {**FINGERPRINT[part], "x": 1}}
    words = {"data": "other data", "base": "another base", "model": "another model"}[part]
    with pytest.raises(DataError, match=f"made for {words} \\(fingerprint.{part}.x differs\\)") as e:
        load_ref_logps(path, setup[2], other)
    assert "\n" not in str(e.value)


def test_truncated_damaged_unfinished_or_short_files_are_refused(setup, tmp_path):
    rows = setup[2]
    path = stored(setup, tmp_path)
    whole = path.read_bytes()
    path.write_bytes(whole[:-4])
    with pytest.raises(DataError, match="truncated or damaged"):
        load_ref_logps(path, rows, FINGERPRINT)
    path.write_bytes(np.full(16, np.nan, np.float32).tobytes())
    with pytest.raises(DataError, match="non-finite values; it is damaged"):
        load_ref_logps(path, rows, FINGERPRINT)
    write_ref_logps(path, np.zeros((7, 2), np.float32), FINGERPRINT)
    with pytest.raises(DataError, match="holds 7 pairs but the data has 8"):
        load_ref_logps(path, rows, FINGERPRINT)
    path.with_name(path.name + ".json").write_text("{not json")
    with pytest.raises(DataError, match="is not a reference log-probs sidecar"):
        load_ref_logps(path, rows, FINGERPRINT)
    path.with_name(path.name + ".json").unlink()
    with pytest.raises(DataError, match="has no sidecar"):
        load_ref_logps(path, rows, FINGERPRINT)


def test_rows_the_file_has_no_pair_for_are_refused():
    ref = RefLogps(np.zeros((1, 2), np.float32), np.array([1]))
    tokens, segments, labels = pack_rows(random_pairs(61), [[0, 1]], SEQ_LEN + 1)
    with pytest.raises(DataError, match="does not belong to these rows"):
        ref.attach(from_rows(tokens, segments, labels), np.array([0]))


@pytest.mark.parametrize("n_devices", [1, 2])
def test_the_chunked_engines_forward_only_pass_gives_the_direct_values_with_chunks_streaming(setup, n_devices):
    """The reference pass is the evaluation's forward-only plan with the log-probs head: its values
    are the direct forward's (rows sharded over the devices: each row's own), chunks move under it,
    and it leaves the params as they were."""
    from pstar_jax.config import EngineConfig, OptimConfig
    from pstar_jax.engine.optim import default_tx
    from pstar_jax.model.preference import PreferenceModel
    from pstar_jax.plan.machine import H200
    from pstar_jax.planner.build import chunked_engine
    model, params, rows, forward = setup
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:n_devices]), ("data",))
    engine = chunked_engine(PreferenceModel(model, PreferenceConfig(objective="dpo", loss="sigmoid")),
                            EngineConfig(chunk_numel=4096, precision="fp32", micro_batches=2),
                            default_tx(OptimConfig(lr=1e-3)), mesh, (2, SEQ_LEN), H200, clip_norm=None,
                            init_params=params)
    values = np.concatenate(list(reference_values(rows, engine.reference_logps, 2, 2)))
    assert engine.store.traffic.h2d_bytes > 0, "the chunks should stream"
    expected = np.concatenate(list(reference_values(rows, forward, 5)))
    np.testing.assert_allclose(values, expected, rtol=0, atol=1e-5 * float(np.abs(expected).max()))
    for name, p in engine.params().items():
        np.testing.assert_array_equal(np.asarray(p), np.asarray(params[name]), err_msg=name)
