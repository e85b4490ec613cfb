import os

import numpy as np
import pytest

from pstar_jax.data import corpus as corpus_module, token_files as data
from pstar_jax.data.batch import Batch
from pstar_jax.data.stream import Batches
from pstar_jax.config.errors import DataError


@pytest.mark.parametrize("vocab_size, suffix, dtype", [(256, ".u16.bin", np.uint16), (70_000, ".u32.bin", np.uint32)])
def test_write_load_round_trip(tmp_path, vocab_size, suffix, dtype):
    tokens = np.random.default_rng(0).integers(0, vocab_size, size=1000)
    path = tmp_path / f"t{suffix}"
    data.write_tokens(path, tokens, vocab_size)
    loaded = data.load_tokens(path)
    assert isinstance(loaded, np.memmap) and loaded.dtype == dtype and not loaded.flags.writeable
    np.testing.assert_array_equal(loaded, tokens)
    assert sorted(os.listdir(tmp_path)) == [path.name, path.name + ".json"]  # no temp file left
    assert data.read_token_info(path) == {"tokenizer": "array", "vocab_size": vocab_size, "eos_id": None,
                                          "max_id": int(tokens.max()), "num_tokens": 1000,
                                          "dtype": np.dtype(dtype).name}


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_token_files_get_the_umasks_permissions(tmp_path, umask):
    """A token file and its sidecar are created like any file under the user's umask (0644 under
    022), not private as tempfile makes its files: the group reading a shared data directory can."""
    old = os.umask(umask)
    try:
        path = tmp_path / "t.u16.bin"
        data.write_tokens(path, np.arange(10), 256)
        data.write_tokens(path, np.arange(20), 256, overwrite=True)
    finally:
        os.umask(old)
    for name in (path, data.sidecar_path(path)):
        assert os.stat(name).st_mode & 0o777 == 0o666 & ~umask, name


def test_write_refuses_overwrite_and_wrong_suffix(tmp_path):
    path = tmp_path / "t.u16.bin"
    data.write_tokens(path, np.arange(10), 256)
    with pytest.raises(DataError, match="already exists"):
        data.write_tokens(path, np.arange(20), 256)
    assert len(data.load_tokens(path)) == 10
    data.write_tokens(path, np.arange(20), 256, overwrite=True)
    assert len(data.load_tokens(path)) == 20
    with pytest.raises(DataError, match=r"must end in \.u32\.bin"):
        data.write_tokens(tmp_path / "big.u16.bin", np.arange(10), 70_000)
    with pytest.raises(DataError, match=r"token ids must be in \[0, 5\).*got 9"):
        data.write_tokens(tmp_path / "v.u16.bin", np.arange(10), 5)
    with pytest.raises(DataError, match=r"got -1"):
        data.write_tokens(tmp_path / "n.u16.bin", np.array([3, -1]), 256)
    with pytest.raises(DataError, match="needs at least 2"):
        data.write_tokens(tmp_path / "one.u16.bin", np.array([3]), 256)
    assert sorted(os.listdir(tmp_path)) == ["t.u16.bin", "t.u16.bin.json"]


def test_load_errors(tmp_path):
    with pytest.raises(DataError, match=r"does not exist; make one with `pstar-tokens`"):
        data.load_tokens(tmp_path / "missing.u16.bin")
    (tmp_path / "empty.u16.bin").write_bytes(b"")
    with pytest.raises(DataError, match="holds 0 tokens"):
        data.load_tokens(tmp_path / "empty.u16.bin")
    (tmp_path / "odd.u32.bin").write_bytes(b"\x00" * 6)
    with pytest.raises(DataError, match="not a whole number"):
        data.load_tokens(tmp_path / "odd.u32.bin")
    np.arange(8, dtype=np.uint16).tofile(tmp_path / "raw.bin")
    with pytest.raises(DataError, match="pass dtype="):
        data.load_tokens(tmp_path / "raw.bin")
    np.testing.assert_array_equal(data.load_tokens(tmp_path / "raw.bin", dtype=np.uint16), np.arange(8))


def test_load_checks_sidecar(tmp_path):
    path = tmp_path / "t.u16.bin"
    data.write_tokens(path, np.arange(10), 256)
    with open(path, "r+b") as f:  # a copy cut short, with its sidecar beside it
        f.truncate(16)
    with pytest.raises(DataError, match=r"holds 8 uint16 tokens but its sidecar records 10 uint16 tokens"):
        data.load_tokens(path)
    data.sidecar_path(path).write_text("[1]")
    with pytest.raises(DataError, match=r"t.u16.bin.json is not a pstar-tokens sidecar"):
        data.load_tokens(path)
    data.sidecar_path(path).unlink()
    np.testing.assert_array_equal(data.load_tokens(path), np.arange(8))  # no sidecar: still loads
    with pytest.raises(DataError, match=r"is a directory"):
        data.load_tokens(tmp_path)


def test_load_unreadable_names_the_file(tmp_path, monkeypatch):
    path = tmp_path / "t.u16.bin"
    data.write_tokens(path, np.arange(10), 256)

    def refuse(*args, **kwargs):  # what a file without read permission does (root ignores chmod)
        raise PermissionError(13, "Permission denied")
    monkeypatch.setattr(data.np, "memmap", refuse)
    with pytest.raises(DataError, match=f"^cannot read data file {path}: Permission denied$"):
        data.load_tokens(path)


def test_check_vocab(monkeypatch):
    data.check_vocab(np.array([0, 9]), 10)
    with pytest.raises(DataError, match=r"token id 10, but the model's vocabulary has 10 ids \(0 to 9\); "
                       r"tokenize with the model's tokenizer or pass --vocab-size >= 11$"):
        data.check_vocab(np.array([0, 10]), 10)
    # Scanned in chunks: the largest id is found in any chunk, including a short last one.
    monkeypatch.setattr(data, "_SCAN_NUMEL", 7)
    tokens = np.zeros(50, np.uint32)
    for at in (0, 6, 7, 48, 49):
        tokens[:] = 0
        tokens[at] = 70_000
        assert data.max_token(tokens) == 70_000
        with pytest.raises(DataError, match="token id 70000"):
            data.check_vocab(tokens, 70_000)


def _take(batches, n):
    """(tokens, targets) of the next n batches (plain data: every other field is fixed)."""
    out = []
    for _ in range(n):
        b = next(batches)
        assert isinstance(b, Batch)
        np.testing.assert_array_equal(b.loss_mask, 1.0)
        np.testing.assert_array_equal(b.segment_ids, 1)
        np.testing.assert_array_equal(b.positions, np.broadcast_to(np.arange(b.tokens.shape[1]), b.tokens.shape))
        out.append((b.tokens, b.targets))
    return out


def test_batches_deterministic_and_shifted():
    tokens = np.arange(1000, dtype=np.uint16)
    first = _take(Batches(tokens, 4, 16, seed=3), 5)
    again = _take(Batches(tokens, 4, 16, seed=3), 5)
    other = _take(Batches(tokens, 4, 16, seed=4), 5)
    for (x, y), (x2, y2) in zip(first, again):
        assert x.shape == y.shape == (4, 16) and x.dtype == y.dtype == np.int32
        np.testing.assert_array_equal(x, x2)
        np.testing.assert_array_equal(y, y2)
        np.testing.assert_array_equal(x[:, 1:], y[:, :-1])
        np.testing.assert_array_equal(y, x + 1)  # arange data: each target is the next token
        assert np.all(x[:, 0] % 16 == 0)  # windows start on the seq_len stride
    assert any(not np.array_equal(a[0], b[0]) for a, b in zip(first, other))


def test_batches_exact_resume():
    tokens = np.random.default_rng(1).integers(0, 256, size=500).astype(np.uint16)
    fresh = Batches(tokens, 3, 8, seed=0)
    stream = _take(fresh, 50)  # 62 windows per epoch, so this crosses epoch boundaries
    assert fresh.state() == {"position": 50}
    for k in (0, 7, 20, 21, 49):
        resumed = _take(Batches(tokens, 3, 8, seed=0, position=k), 50 - k)
        for (x, y), (x2, y2) in zip(stream[k:], resumed):
            np.testing.assert_array_equal(x, x2)
            np.testing.assert_array_equal(y, y2)


def test_epochs_reshuffle_on_small_data():
    tokens = np.arange(4 * 5 + 1, dtype=np.uint16)  # exactly 5 windows of seq_len 4
    batches = Batches(tokens, 2, 4, seed=0)
    assert batches.windows_per_epoch == 5
    starts = np.concatenate([x[:, 0] for x, _ in _take(batches, 20)])  # 40 rows = 8 epochs
    epochs = starts.reshape(8, 5)
    for epoch in epochs:
        assert sorted(epoch) == [0, 4, 8, 12, 16]  # each epoch visits every window once
    assert len({tuple(e) for e in epochs}) > 1


def test_process_split_partitions_global_batch():
    tokens = np.random.default_rng(2).integers(0, 256, size=2000).astype(np.uint16)
    whole = _take(Batches(tokens, 8, 16, seed=5, position=3), 4)
    parts = [_take(Batches(tokens, 8, 16, seed=5, process_index=i, process_count=4, position=3), 4) for i in range(4)]
    for step, (x, y) in enumerate(whole):
        np.testing.assert_array_equal(np.concatenate([p[step][0] for p in parts]), x)
        np.testing.assert_array_equal(np.concatenate([p[step][1] for p in parts]), y)
        assert all(p[step][0].shape == (2, 16) for p in parts)
    with pytest.raises(DataError, match="divisible by process_count 3"):
        Batches(tokens, 8, 16, seed=0, process_count=3)


def test_batches_too_little_data():
    with pytest.raises(DataError, match="data has 16 tokens.*seq_len \\+ 1 = 17"):
        Batches(np.arange(16), 2, 16, seed=0)


def test_default_corpus_deterministic():
    corpus = corpus_module.default_corpus(max_bytes=200_000)
    assert corpus.dtype == np.uint16 and len(corpus) == 200_000
    assert corpus.max() < 256
    np.testing.assert_array_equal(corpus, corpus_module.default_corpus(max_bytes=200_000))


def test_default_corpus_falls_back_without_sources(tmp_path, monkeypatch):
    monkeypatch.setattr(corpus_module.sysconfig, "get_paths", lambda: {"stdlib": str(tmp_path)})
    corpus = corpus_module.default_corpus()
    assert len(corpus) > 1000 and corpus.max() < 256
    np.testing.assert_array_equal(corpus, corpus_module.default_corpus())
