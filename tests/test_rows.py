"""Packed SFT rows as training data: resumable shuffled batches, the held-out split, the eval set,
opening an SFT file, and a run that trains on packed rows."""


import numpy as np
import pytest

import pstar_jax as ps
from pstar_jax.data import token_files as data, training
from pstar_jax.data.batch import Batch
from pstar_jax.config.errors import DataError
from pstar_jax.data.rows import PackedBatches, Rows, held_out_rows, packed_eval_batches


def rows(n=40, seq_len=16, seed=0):
    """n rows of two examples and some padding each; row r's tokens all equal r (ids < 256)."""
    rng = np.random.default_rng(seed)
    tokens = np.repeat(np.arange(n, dtype=np.uint16)[:, None], seq_len + 1, axis=1)
    segments = np.zeros((n, seq_len + 1), np.uint16)
    for r in range(n):
        a, b = rng.integers(2, seq_len // 2, 2)
        segments[r, :a], segments[r, a:a + b] = 1, 2
    labels = (rng.random((n, seq_len + 1)) < 0.5).astype(np.uint8)
    return Rows(tokens, segments, labels)


def _rows_of(batch):
    return batch.tokens[:, 0].tolist()


def test_packed_batches_shuffle_each_epoch_and_resume_exactly():
    data_rows = rows()
    fresh = PackedBatches(data_rows, 4, seed=1, seq_len=16)
    stream = [next(fresh) for _ in range(25)]  # 10 batches per epoch: crosses epoch boundaries
    assert isinstance(stream[0], Batch) and stream[0].tokens.shape == (4, 16)
    seen = [r for b in stream[:10] for r in _rows_of(b)]
    assert sorted(seen) == list(range(40)) and seen != list(range(40))  # each row once, shuffled
    assert [r for b in stream[10:20] for r in _rows_of(b)] != seen  # the next epoch in another order
    assert fresh.state() == {"position": 25}
    for k in (0, 9, 10, 17):
        resumed = PackedBatches(data_rows, 4, seed=1, position=k)
        for want in stream[k:]:
            got = next(resumed)
            for a, b in zip(got, want):
                np.testing.assert_array_equal(a, b)
    parts = [PackedBatches(data_rows, 4, seed=1, process_index=i, process_count=2) for i in range(2)]
    whole = next(PackedBatches(data_rows, 4, seed=1))
    np.testing.assert_array_equal(np.concatenate([next(p).tokens for p in parts]), whole.tokens)


def test_rows_are_checked_against_the_model():
    with pytest.raises(DataError, match="packed for seq_len 16, but the model trains at seq_len 32"):
        PackedBatches(rows(), 4, seed=0, seq_len=32)
    r = rows()
    with pytest.raises(DataError, match="three arrays"):
        PackedBatches(r._replace(labels=r.labels[:, :-1]), 4, seed=0)


def test_held_out_rows_are_never_trained_on_and_eval_reads_only_them():
    whole = rows(n=300)
    train, held = held_out_rows(whole)
    assert len(held.tokens) == 3 and len(train.tokens) == 297
    assert np.shares_memory(train.tokens, whole.tokens) and np.shares_memory(held.labels, whole.labels)
    stream = PackedBatches(train, 9, seed=0)
    assert max(max(_rows_of(next(stream))) for _ in range(3 * 33)) < 297
    evals = packed_eval_batches(held, 4, 2)
    assert [_rows_of(b) for b in evals] == [[297, 298, 299, 297], [298, 299, 297, 298]]
    assert training.evaluation_set(held, 4, 16, 2)[1].loss_mask.sum() == evals[1].loss_mask.sum()


def test_open_training_data_reads_an_sft_file_through_packing(tmp_path, monkeypatch):
    """An NAME.sft.u16.bin goes to packing.load_packed (checked against the vocabulary); other
    names stay token files."""
    loaded = rows()
    monkeypatch.setattr(training, "load_packed", lambda path: loaded)
    assert training.open_training_data(tmp_path / "chat.sft.u16.bin", 256) is loaded
    assert training.is_packed(loaded) and isinstance(training.training_batches(loaded, 4, 16, 0), PackedBatches)
    with pytest.raises(DataError, match="data holds token id 39, but the model's vocabulary has 30"):
        training.open_training_data(tmp_path / "chat.sft.u32.bin", 30)
    data.write_tokens(tmp_path / "plain.u16.bin", np.arange(100, dtype=np.uint16), 256)
    assert isinstance(training.open_training_data(tmp_path / "plain.u16.bin", 256), np.ndarray)


def _config(steps=2, **train):
    return ps.RunConfig(train=ps.TrainConfig(steps=steps, batch_size=4, **train),
                        model=ps.ModelConfig(seq_len=16), distributed=ps.DistributedConfig(data_parallel=1),
                        output=ps.OutputConfig(quiet=True), engine=ps.EngineConfig(precision="fp32"))


def test_run_trains_on_packed_rows_and_reports_trained_tokens():
    with ps.Run(_config(eval_every=2, eval_batches=1), tokens=rows(n=200)) as run:
        assert run.packed and isinstance(run.batches, PackedBatches)
        records = list(run.fit())
    for r in records:
        assert 0 < r["trained_tokens"] < 4 * 16 and np.isfinite(r["loss"])
        assert r["trained_tokens_per_s"] < r["tokens_per_s"]
    assert np.isfinite(records[-1]["eval_loss"])


def test_run_refuses_packed_rows_for_a_model_without_packing():
    from examples.my_model import build_model
    with pytest.raises(DataError, match="model MyLM does not follow segment ids"):
        ps.Run(_config(), model=build_model("mine", seq_len=16), tokens=rows())
