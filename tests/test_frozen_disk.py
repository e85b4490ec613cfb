"""Frozen chunks from disk (pstar_jax/io/frozen_disk.py): straight from safetensors and from a cache.

Every chunk a source reads is, byte for byte, the one pstar-train builds from the same base
(``pack_chunk(...).astype(dtype)``, padding zero), for bf16, fp16 and fp32 files, transposed
kernels, a table cut short (GPT-2's wpe) and sharded files. A matching cache is reused untouched;
another layout, base or a damaged file rewrites it; a base file changed mid-run and a cache file
leading out of its directory are refused in one line."""

import errno
import functools
import os

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from pstar_jax.config import CheckpointError, ConfigError, HFCheckpointError
from pstar_jax.config.lora import LoraConfig
from pstar_jax.engine.chunks import build_layout, pack_chunk
from pstar_jax.io import frozen_disk
from pstar_jax.io.frozen_disk import CACHE_FILE, ChunkCache, SafetensorsChunks
from pstar_jax.io.hf import HFCheckpoint, read_hf_config
from pstar_jax.model.freeze import trainable
from pstar_jax.model.lora import base_shapes, frozen_for_lora
from pstar_jax.model.staged import decays
from pstar_models import hf as mhf
from pstar_models.lora import LoraSpec
from pstar_models.llama import LlamaConfig, StagedLlama
from test_hf import write_family_checkpoint

CHUNK = 12288  # several frozen chunks per tiny model, trainable (adapter) chunks between them
BF16 = ml_dtypes.bfloat16
LORA = LoraSpec(rank=4, alpha=16.0)


def one_line(err, kind=ConfigError):
    message = str(err.value)
    assert "\n" not in message and isinstance(err.value, kind), message
    return message


def lora_setup(src, seq_len, chunk=CHUNK):
    """The LoRA model of an HF directory, its layout (the base frozen) and the base's tensors."""
    model = mhf.build_from_hf(read_hf_config(src), lora=LORA, seq_len=seq_len)
    frozen = frozen_for_lora(model, LoraConfig(rank=4))
    layout = build_layout(model.param_shapes(), functools.partial(decays, model), chunk, trainable=trainable(frozen))
    assert layout.trainable_chunks and len(layout.trainable_chunks) < layout.n_chunks
    return layout, HFCheckpoint(src, mhf.hf_tensors(model), base_shapes(model))


def built(layout, hf, c, dtype=BF16):
    """Chunk c as pstar-train builds it (engine/executor.py:_init_chunks)."""
    return np.asarray(pack_chunk(layout, c, hf.__getitem__).astype(jnp.dtype(dtype)))


def read(reader, c):
    out = np.frombuffer(np.full(reader.nbytes(c), 0xA5, np.uint8).tobytes(), reader.dtype).copy()  # not zeros
    reader.read_into(c, out)
    return out


def assert_same_chunks(reader, layout, hf, dtype=BF16):
    frozen = [c for c in range(layout.n_chunks) if layout.is_frozen(c)]
    assert list(reader.chunks) == frozen
    for c in frozen:
        assert reader.nbytes(c) == layout.numel_of(c) * np.dtype(dtype).itemsize
        assert read(reader, c).tobytes() == built(layout, hf, c, dtype).tobytes(), c


# -- checkpoints written by transformers ------------------------------------------------------------

@functools.cache
def transformers_dir(root, family, dtype):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    if family == "gpt2":  # 80 positions, of which seq_len 64 are kept
        config = transformers.GPT2Config(vocab_size=96, n_positions=80, n_embd=48, n_layer=2, n_head=3)
    else:  # GQA, untied head, sharded files
        config = transformers.LlamaConfig(vocab_size=96, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
                                          num_attention_heads=6, num_key_value_heads=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    src = os.path.join(root, f"{family}-{dtype}")
    transformers.AutoModelForCausalLM.from_config(config).to(getattr(torch, dtype)).save_pretrained(
        src, max_shard_size="40KB" if family == "llama" else "10GB", safe_serialization=True)
    return src


@pytest.fixture(scope="module")
def hf_root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("hf"))


@pytest.mark.hf_reference
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_safetensors_chunks_equal_the_chunks_pstar_train_builds(hf_root, family, dtype, monkeypatch):
    src = transformers_dir(hf_root, family, dtype)
    layout, hf = lora_setup(src, 64 if family == "gpt2" else 32)
    with SafetensorsChunks(hf, layout) as reader:
        assert_same_chunks(reader, layout, hf)
        pieces = [p for ps in reader.pieces.values() for p in ps]
    assert {p.dtype for p in pieces} == {np.dtype(getattr(np, dtype) if dtype != "bfloat16" else BF16)}
    if family == "llama":
        assert len({p.file for p in pieces}) > 1 and any(p.transpose for p in pieces)
    else:
        assert hf.truncated == {"wpe": (80, 64)}
        wpe = next(p for p in pieces if p.name == "wpe")
        assert wpe.shape == (64, 48) and wpe.size_bytes == 64 * 48 * wpe.dtype.itemsize
    # Blocks of a few rows on four workers: tensors (and transposes) split across reads.
    monkeypatch.setattr(frozen_disk, "BLOCK_BYTES", 300)
    with SafetensorsChunks(hf, layout, workers=4) as reader:
        assert_same_chunks(reader, layout, hf)


@pytest.mark.hf_reference
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_fp32_chunks_and_a_cache_of_them(hf_root, tmp_path, dtype):
    src = transformers_dir(hf_root, "llama", dtype)
    layout, hf = lora_setup(src, 32)
    with SafetensorsChunks(hf, layout, np.float32) as reader:
        assert_same_chunks(reader, layout, hf, np.float32)
        with ChunkCache(str(tmp_path / "cache"), layout, reader, "base", np.float32, workers=2) as cache:
            assert cache.written
            assert_same_chunks(cache, layout, hf, np.float32)


# -- checkpoints written here (fast) ------------------------------------------------------------------

def base_dir(tmp_path, dtype=np.float32, name="src"):
    """A tiny Llama's HF directory (the models' own maps, fp32 unless said), and its LoRA layout and tensors."""
    model = StagedLlama(LlamaConfig(vocab_size=96, d_model=48, n_layer=2, n_head=6, n_kv_head=2, d_ff=80, seq_len=32,
                                    max_position_embeddings=32, lora=LORA))
    src = str(tmp_path / name)
    write_family_checkpoint(src, model, dtype)
    return (src, *lora_setup(src, 32))


@pytest.mark.parametrize("dtype", [np.float32, np.float16, BF16])
def test_cache_from_a_source_or_from_tensors_holds_the_same_bytes(tmp_path, dtype):
    src, layout, hf = base_dir(tmp_path, dtype)
    with SafetensorsChunks(hf, layout) as reader, \
            ChunkCache(str(tmp_path / "a"), layout, reader, "fp") as from_reader, \
            ChunkCache(str(tmp_path / "b"), layout, hf, "fp") as from_tensors:
        assert_same_chunks(from_reader, layout, hf)
        assert_same_chunks(from_tensors, layout, hf)
        offsets = from_reader._offsets
        assert all(o % frozen_disk.ALIGN_BYTES == 0 for o in offsets.values())
        assert list(offsets) == sorted(offsets, key=offsets.get)  # chunk-ordered
    assert sorted(os.listdir(tmp_path / "a")) == [CACHE_FILE]  # no temp file left


def test_a_matching_cache_is_reused_and_another_rewritten(tmp_path):
    src, layout, hf = base_dir(tmp_path)
    directory = str(tmp_path / "cache")
    path = os.path.join(directory, CACHE_FILE)
    with ChunkCache(directory, layout, hf, "fp") as cache:
        assert cache.written
    os.utime(path, ns=(1_000_000_000, 1_000_000_000))  # an old cache: a rewrite would show
    before = os.stat(path)
    frozen = [c for c in range(layout.n_chunks) if layout.is_frozen(c)]
    for chunks in (None, frozen[1:]):  # all of them, or fewer than the cache holds
        with ChunkCache(directory, layout, hf, "fp", chunks=chunks) as cache:
            assert not cache.written and list(cache.chunks) == (chunks or frozen)
            assert read(cache, frozen[-1]).tobytes() == built(layout, hf, frozen[-1]).tobytes()
        after = os.stat(path)
        assert (after.st_ino, after.st_mtime_ns, after.st_size) == (before.st_ino, before.st_mtime_ns, before.st_size)
    # Another base, dtype or layout: rewritten, and then right for it.
    with ChunkCache(directory, layout, hf, "another fingerprint") as cache:
        assert cache.written and os.stat(path).st_ino != before.st_ino
    with ChunkCache(directory, layout, hf, "another fingerprint", np.float32) as cache:
        assert cache.written
        assert_same_chunks(cache, layout, hf, np.float32)
    other, _ = lora_setup(src, 32, chunk=2 * CHUNK)
    with ChunkCache(directory, other, hf, "another fingerprint", np.float32) as cache:
        assert cache.written
        assert_same_chunks(cache, other, hf, np.float32)


@pytest.mark.parametrize("damage", ["truncated", "header", "empty", "foreign"])
def test_a_damaged_cache_is_rewritten_not_read(tmp_path, damage):
    src, layout, hf = base_dir(tmp_path)
    directory = str(tmp_path / "cache")
    path = os.path.join(directory, CACHE_FILE)
    ChunkCache(directory, layout, hf, "fp").close()
    size = os.path.getsize(path)
    if damage == "truncated":  # a copy cut short: the header is intact
        os.truncate(path, size - 4096)
    elif damage == "header":
        with open(path, "r+b") as f:
            f.seek(20)
            f.write(b"\xff\xfe")
    else:
        with open(path, "wb") as f:
            f.write(b"" if damage == "empty" else b"\0" * size)
    with ChunkCache(directory, layout, hf, "fp") as cache:
        assert cache.written and os.path.getsize(path) == size
        assert_same_chunks(cache, layout, hf)


def test_a_base_file_changed_after_construction_is_one_line(tmp_path):
    src, layout, hf = base_dir(tmp_path)
    weights = os.path.join(src, "model.safetensors")
    reader = SafetensorsChunks(hf, layout)
    reader.check_unchanged()
    st = os.stat(weights)
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 1))  # touched, the bytes unchanged
    with pytest.raises(CheckpointError) as err:
        reader.check_unchanged()
    assert one_line(err) == (f"the base file model.safetensors in {src} changed while the run was reading it; put "
                             "back the base it started from and resume from the last checkpoint")
    reader.close()
    reader = SafetensorsChunks(hf, layout)
    os.rename(weights, weights + ".old")  # replaced by a copy: another file
    with open(weights + ".old", "rb") as f, open(weights, "wb") as g:
        g.write(f.read())
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))
    with pytest.raises(CheckpointError) as err:
        reader.check_unchanged()
    assert "model.safetensors" in one_line(err)
    os.truncate(weights + ".old", 1000)  # the file it holds open, cut short under a read
    with pytest.raises(CheckpointError) as err:
        read(reader, reader.chunks[-1])
    assert "changed while the run was reading it" in one_line(err)
    reader.close()


def test_a_cache_file_changed_under_a_run_is_one_line(tmp_path):
    src, layout, hf = base_dir(tmp_path)
    directory = str(tmp_path / "cache")
    cache = ChunkCache(directory, layout, hf, "fp")
    ChunkCache(directory, layout, hf, "another").close()  # another run's cache renamed over the name
    cache.check_unchanged()  # this one's file is untouched
    assert_same_chunks(cache, layout, hf)
    with open(f"/proc/self/fd/{cache._fd}", "r+b") as f:  # the file it holds, whatever its name now
        f.truncate(8192)
    with pytest.raises(CheckpointError) as err:
        cache.check_unchanged()
    assert "frozen-chunk cache" in one_line(err)
    cache.close()


def test_a_nonfinite_base_tensor_is_one_line_on_its_first_read(tmp_path):
    src, layout, hf = base_dir(tmp_path)
    from safetensors.numpy import load_file, save_file
    path = os.path.join(src, "model.safetensors")
    tensors = load_file(path)
    tensors["model.layers.1.mlp.down_proj.weight"][3, 5] = np.nan
    save_file(tensors, path)
    layout, hf = lora_setup(src, 32)
    with SafetensorsChunks(hf, layout) as reader:
        c = layout.slot("blocks.1.mlp.down.kernel").chunk
        with pytest.raises(HFCheckpointError) as err:
            read(reader, c)
    assert "model.layers.1.mlp.down_proj.weight" in one_line(err) and "NaN" in str(err.value)


def test_the_cache_directory_is_untrusted(tmp_path, monkeypatch):
    src, layout, hf = base_dir(tmp_path)
    outside = tmp_path / "outside"
    outside.write_bytes(b"precious")
    directory = tmp_path / "cache"
    directory.mkdir()
    (directory / CACHE_FILE).symlink_to(outside)
    with pytest.raises(ConfigError) as err:
        ChunkCache(str(directory), layout, hf, "fp")
    assert "outside" in one_line(err) and outside.read_bytes() == b"precious"
    assert sorted(os.listdir(directory)) == [CACHE_FILE]
    (directory / CACHE_FILE).unlink()
    (directory / CACHE_FILE).mkdir()
    with pytest.raises(ConfigError) as err:
        ChunkCache(str(directory), layout, hf, "fp")
    assert "is not a file" in one_line(err)
    with pytest.raises(ConfigError) as err:
        ChunkCache(str(outside), layout, hf, "fp")
    assert one_line(err) == (f"EngineConfig.frozen_cache {outside} is a file, not a directory; pass a directory for "
                             "the frozen chunks' cache")
    # A read-only place (tests run as root, so it is made to look read-only): a matching cache is
    # read, nothing is written; without one, one line before any work.
    good = str(tmp_path / "good")
    ChunkCache(good, layout, hf, "fp").close()

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system")
    monkeypatch.setattr("pstar_jax.config.paths.tempfile.mkstemp", read_only)
    monkeypatch.setattr("pstar_jax.io.frozen_disk.create_temp_beside", read_only)
    with ChunkCache(good, layout, hf, "fp") as cache:
        assert not cache.written
    with pytest.raises(ConfigError) as err:
        ChunkCache(good, layout, hf, "another")
    assert "read-only" in one_line(err)


def test_reads_refuse_a_wrong_buffer_or_chunk(tmp_path):
    src, layout, hf = base_dir(tmp_path)
    with SafetensorsChunks(hf, layout) as reader:
        c = reader.chunks[0]
        for bad in (np.zeros(layout.numel_of(c), np.float32), np.zeros(layout.numel_of(c) - 1, BF16),
                    np.zeros(2 * layout.numel_of(c), BF16)[::2]):
            with pytest.raises(ValueError):
                reader.read_into(c, bad)
        with pytest.raises(ValueError):
            reader.read_into(layout.trainable_chunks[0], np.zeros(layout.numel_of(c), BF16))
    with pytest.raises(ValueError):
        SafetensorsChunks(hf, layout, chunks=layout.trainable_chunks)


def test_odd_tensors_transposed_and_cut_short(tmp_path, monkeypatch):
    """What the models' maps do not use yet: a transposed table cut short, a transposed 3-D tensor, a scalar."""
    from safetensors.numpy import save_file
    rng = np.random.default_rng(0)
    stored = {"t": rng.standard_normal((6, 40)), "cube": rng.standard_normal((2, 3, 5)), "s": np.array(1.5),
              "rows": rng.standard_normal((30, 7))}
    src = tmp_path / "odd"
    src.mkdir()
    save_file({k: v.astype(np.float32) for k, v in stored.items()}, str(src / "model.safetensors"))
    (src / "config.json").write_text("{}")
    tensor_map = {"t": ("t", True, True), "cube": ("cube", True, False), "s": ("s", False, False),
                  "rows": ("rows", False, True)}
    shapes = {"t": (33, 6), "cube": (5, 3, 2), "s": (), "rows": (20, 7)}
    layout = build_layout(shapes, lambda n: False, 512, align=8, trainable=lambda n: False)
    hf = HFCheckpoint(str(src), tensor_map, shapes)
    monkeypatch.setattr(frozen_disk, "BLOCK_BYTES", 64)
    for dtype in (BF16, np.float32):
        with SafetensorsChunks(hf, layout, dtype, workers=3) as reader:
            assert_same_chunks(reader, layout, hf, dtype)
