"""pstar_jax.data.packing: every example whole in one row, in order, with its labels; tight packing on a
log-normal length mix; the file round-trips, is refused when damaged, and is written atomically."""

import dataclasses
import errno
import json
import os
import stat

import numpy as np
import pytest

from pstar_jax.data import packing
from pstar_jax.config.errors import DataError


def _examples(lengths, seed=0, vocab=1000):
    rng = np.random.default_rng(seed)
    lengths = np.asarray(lengths, np.int64)
    total = int(lengths.sum())
    return packing.Examples(rng.integers(0, vocab, total).astype(np.uint32),
                            rng.integers(0, 2, total).astype(np.uint8), lengths)


def _unpack(rows):
    """The examples of packed rows as (tokens, labels) tuples, and checks of the layout per row."""
    found = []
    for tokens, segments, labels in zip(rows.tokens, rows.segments, rows.labels):
        real = np.flatnonzero(segments)
        n = len(real)
        assert (real == np.arange(n)).all()  # padding only after the last example
        assert (tokens[n:] == 0).all() and (labels[n:] == 0).all()
        if n:
            seg = segments[:n].astype(np.int64)
            assert seg[0] == 1 and set(np.diff(seg)) <= {0, 1}  # numbered 1, 2, ... in row order
            for k in range(1, seg[-1] + 1):
                where = seg == k
                found.append((tuple(tokens[:n][where].tolist()), tuple(labels[:n][where].tolist())))
    return found


def test_every_example_lands_whole_and_once():
    ex = _examples([5, 17, 1, 9, 9, 9, 17, 3, 2, 17, 8])
    rows = packing.pack(ex, seq_len=16, seed=3)
    assert rows.tokens.shape == (rows.rows, 17) and rows.seq_len == 16
    want = sorted((tuple(ex.tokens[s:s + n].tolist()), tuple(ex.labels[s:s + n].tolist()))
                  for s, n in zip(ex.starts, ex.lengths))
    assert sorted(_unpack(rows)) == want
    assert rows.rows == int(np.ceil(ex.lengths.sum() / 17))  # this mix packs perfectly
    pairs = [(ex.tokens[s:s + n], ex.labels[s:s + n]) for s, n in zip(ex.starts, ex.lengths)]
    from_pairs = packing.pack(pairs, seq_len=16, seed=3)
    np.testing.assert_array_equal(from_pairs.tokens, rows.tokens)
    np.testing.assert_array_equal(from_pairs.labels, rows.labels)
    with pytest.raises(DataError, match="1 to seq_len \\+ 1 = 17 tokens"):
        packing.pack(_examples([18]), seq_len=16)


def test_deterministic_given_the_seed():
    ex = _examples(np.random.default_rng(1).integers(1, 60, 300))
    a, b, c = (packing.pack(ex, 63, seed) for seed in (7, 7, 8))
    for name in ("tokens", "segments", "labels"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name))
    assert not np.array_equal(a.tokens, c.tokens) and sorted(_unpack(a)) == sorted(_unpack(c))


def test_log_normal_mix_packs_above_95_percent():
    """Conversation lengths of median 200 tokens into rows of 2049: best-fit decreasing leaves < 5% padding."""
    rng = np.random.default_rng(0)
    lengths = np.clip(np.round(rng.lognormal(np.log(200), 0.9, 20_000)), 1, 2049).astype(np.int64)
    rows = packing.pack(packing.Examples(np.ones(lengths.sum(), np.uint32), np.ones(lengths.sum(), np.uint8),
                                         lengths), seq_len=2048, seed=0)
    assert packing.real_position_fraction(rows.segments) >= 0.95
    assert rows.rows * 2049 >= lengths.sum() and np.count_nonzero(rows.segments) == lengths.sum()


def test_assign_rows_scales():
    """A million examples: the bucketed best fit is O(n log n), well under a minute on one core."""
    import time
    lengths = np.clip(np.random.default_rng(2).lognormal(np.log(200), 0.9, 1_000_000), 1, 2049).astype(np.int64)
    start = time.perf_counter()
    row_of, offset_of, rows = packing.assign_rows(lengths, 2049, 0)
    assert time.perf_counter() - start < 60
    used = np.bincount(row_of, weights=lengths, minlength=rows)
    assert used.max() <= 2049 and lengths.sum() / (rows * 2049) > 0.95
    end = offset_of + lengths
    order = np.lexsort((offset_of, row_of))  # within each row, examples do not overlap
    same_row = row_of[order][1:] == row_of[order][:-1]
    assert (offset_of[order][1:][same_row] >= end[order][:-1][same_row]).all()


def test_file_round_trip_and_sidecar(tmp_path):
    rows = packing.pack(_examples([5, 17, 3, 9], vocab=70_000), seq_len=16, seed=0)
    path = tmp_path / "train.sft.u32.bin"
    with pytest.raises(DataError, match=r"must end in \.sft\.u32\.bin: name it .*train\.sft\.u32\.bin"):
        packing.write_packed(tmp_path / "train.sft.u16.bin", rows, {"vocab_size": 70_000})
    info = packing.write_packed(path, rows, {"vocab_size": 70_000, "eos_id": 3})
    assert packing.is_packed_file(path) and packing.is_packed_file(tmp_path / "absent.sft.u16.bin")
    loaded = packing.load_packed(path)
    assert isinstance(loaded.tokens, np.memmap) and loaded.tokens.dtype == np.uint32
    assert loaded.segments.dtype == np.uint16 and loaded.labels.dtype == np.uint8
    for name in ("tokens", "segments", "labels"):
        np.testing.assert_array_equal(getattr(loaded, name), getattr(rows, name))
    side = json.loads((tmp_path / "train.sft.u32.bin.json").read_text())
    assert side == info and side["format"] == "pstar-sft" and side["version"] == 1
    assert loaded.info["eos_id"] == 3 and loaded.vocab_size == 70_000 and loaded.seq_len == 16
    assert side["rows"] == rows.rows and side["real_position_fraction"] == pytest.approx(34 / (rows.rows * 17))
    with pytest.raises(DataError, match="already exists; pass overwrite=True"):
        packing.write_packed(path, rows, {"vocab_size": 70_000})
    from pstar_jax.data.token_files import load_tokens  # its .u32.bin suffix does not make it a plain token file
    with pytest.raises(DataError, match="is a packed SFT file .*, not a plain token file"):
        load_tokens(path)


def test_file_mode_follows_the_umask(tmp_path):
    rows = packing.pack(_examples([4, 4]), seq_len=8)
    old = os.umask(0o027)
    try:
        packing.write_packed(tmp_path / "a.sft.u16.bin", rows, {"vocab_size": 1000})
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "a.sft.u16.bin").stat().st_mode) == 0o640
    assert stat.S_IMODE((tmp_path / "a.sft.u16.bin.json").stat().st_mode) == 0o640


def test_malformed_files_are_one_line(tmp_path):
    rows = packing.pack(_examples([4, 4, 7]), seq_len=8)
    path = tmp_path / "a.sft.u16.bin"
    packing.write_packed(path, rows, {"vocab_size": 1000})
    raw = path.read_bytes()
    cases = {
        "short.sft.u16.bin": (raw[:-1], "is truncated or damaged"),
        "plain.sft.u16.bin": (b"\x01\x00" * 40, "is not a packed SFT file"),
        "v9.sft.u16.bin": (raw[:8] + (9).to_bytes(4, "little") + raw[12:], "of version 9"),
    }
    for name, (content, message) in cases.items():
        (tmp_path / name).write_bytes(content)
        with pytest.raises(DataError, match=message) as err:
            packing.load_packed(tmp_path / name)
        assert "\n" not in str(err.value)
    (tmp_path / "a.sft.u16.bin.json").write_text(json.dumps({"rows": 99, "seq_len": 8}))
    with pytest.raises(DataError, match="it is stale"):
        packing.load_packed(path)
    with pytest.raises(DataError, match="does not exist"):
        packing.load_packed(tmp_path / "none.sft.u16.bin")
    assert packing.is_packed_file(tmp_path / "plain.sft.u16.bin")  # by its name: load_packed says what is wrong
    (tmp_path / "plain.u16.bin").write_bytes(b"\x01\x00" * 40)
    assert not packing.is_packed_file(tmp_path / "plain.u16.bin") and not packing.is_packed_file(tmp_path)
    (tmp_path / "renamed.u16.bin").write_bytes(raw)
    assert packing.is_packed_file(tmp_path / "renamed.u16.bin")  # by its header


def test_failed_write_leaves_the_old_file(tmp_path, monkeypatch):
    rows = packing.pack(_examples([4, 4]), seq_len=8)
    path = tmp_path / "a.sft.u16.bin"
    path.write_bytes(b"old")

    def fail(*args, **kwargs):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(packing.os, "replace", fail)
    with pytest.raises(DataError, match=f"cannot write {path}: No space left on device"):
        packing.write_packed(path, rows, {"vocab_size": 1000}, overwrite=True)
    assert path.read_bytes() == b"old" and sorted(os.listdir(tmp_path)) == ["a.sft.u16.bin"]


def test_filling_in_pieces_gives_the_same_rows(monkeypatch):
    ex = _examples(np.random.default_rng(4).integers(1, 30, 500))
    whole = packing.pack(ex, 31, seed=1)
    monkeypatch.setattr(packing, "FILL_TOKENS", 7)  # many pieces, some cut inside long examples' runs
    pieces = packing.pack(ex, 31, seed=1)
    for name in ("tokens", "segments", "labels"):
        np.testing.assert_array_equal(getattr(pieces, name), getattr(whole, name))
    assert sorted(_unpack(pieces)) == sorted((tuple(ex.tokens[s:s + n].tolist()), tuple(ex.labels[s:s + n].tolist()))
                                             for s, n in zip(ex.starts, ex.lengths))


def test_full_disk_is_found_before_the_rows_are_mapped(tmp_path, monkeypatch):
    """The file's space is taken at once (a store into a memory-mapped page the disk has no room for is a
    SIGBUS, not an error); without posix_fallocate, zeros are written instead, to the same file."""
    rows = packing.pack(_examples([5, 9, 3]), seq_len=16)
    path = tmp_path / "a.sft.u16.bin"
    path.write_bytes(b"old")

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(DataError) as err:
        packing.write_packed(path, rows, {"vocab_size": 1000}, overwrite=True)
    assert str(err.value) == (f"cannot write {path}: No space left on device; free some space there or write it "
                              f"to another disk")
    assert path.read_bytes() == b"old" and sorted(os.listdir(tmp_path)) == ["a.sft.u16.bin"]
    monkeypatch.undo()
    packing.write_packed(tmp_path / "b.sft.u16.bin", rows, {"vocab_size": 1000})
    monkeypatch.delattr(os, "posix_fallocate")
    monkeypatch.setattr(packing, "ZEROS_BYTES", 7)  # zeros in many short writes, the last one shorter
    packing.write_packed(tmp_path / "c.sft.u16.bin", rows, {"vocab_size": 1000})
    assert (tmp_path / "c.sft.u16.bin").read_bytes() == (tmp_path / "b.sft.u16.bin").read_bytes()


def test_a_file_that_trains_no_token_is_refused_at_load(tmp_path, monkeypatch):
    rows = packing.pack(_examples([5, 9, 3, 12, 7]), seq_len=16)
    untrained = {"nothing": np.zeros_like(rows.labels),
                 "first tokens only": (rows.segments > 0) & (np.diff(rows.segments, prepend=0, axis=1) != 0)}
    for name, labels in untrained.items():  # an example's first token is no target: it follows no input of its own
        path = tmp_path / f"{name.replace(' ', '-')}.sft.u16.bin"
        packing.write_packed(path, dataclasses.replace(rows, labels=labels.astype(np.uint8)), {"vocab_size": 1000})
        with pytest.raises(DataError) as err:
            packing.load_packed(path)
        assert str(err.value).startswith(f"{path} trains no token (no position is labelled as a target within its "
                                         f"example), so training on it would learn nothing; repack it"), name
        assert "\n" not in str(err.value)
    one = np.zeros_like(rows.labels)
    last = np.flatnonzero(rows.segments[-1])[-1]
    assert rows.segments[-1, last - 1] == rows.segments[-1, last]  # the last row's last token is a target
    one[-1, last] = 1
    path = tmp_path / "one.sft.u16.bin"
    packing.write_packed(path, dataclasses.replace(rows, labels=one), {"vocab_size": 1000})
    monkeypatch.setattr(packing, "SCAN_POSITIONS", 17)  # a row at a time: found in the last block
    assert packing.load_packed(path).labels.sum() == 1
