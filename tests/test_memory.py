import os
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from pstar_jax.engine.memory import ChunkStore, Placement, Space, space_of

NUMEL = 1024
CHUNK_BYTES = NUMEL * 4  # float32


def one_device() -> Placement:
    return Placement(Mesh(np.array(jax.devices()[:1]), ("data",)))


def chunk(placement: Placement, value: float, space: Space) -> jax.Array:
    return placement.put(jnp.full((NUMEL,), value, jnp.float32), space)


def store_of(n_chunks: int, space: Space, budget_chunks: int = 2) -> ChunkStore:
    """A store with ``n_chunks`` param chunks of value i in ``space``, budget ``budget_chunks``."""
    placement = one_device()
    store = ChunkStore(placement, budget_chunks * CHUNK_BYTES)
    for i in range(n_chunks):
        store.put(("param", i), chunk(placement, i, space))
    return store


def test_put_counts_bytes_per_space():
    """put() adds each chunk's per-device bytes to the count of the space it lives in."""
    placement = one_device()
    store = ChunkStore(placement, 10 * CHUNK_BYTES)
    store.put(("param", 0), chunk(placement, 0, Space.DEVICE))
    store.put(("master", 0), chunk(placement, 0, Space.HOST))
    store.put(("master", 1), chunk(placement, 1, Space.HOST))
    assert store.bytes == {Space.DEVICE: CHUNK_BYTES, Space.HOST: 2 * CHUNK_BYTES}
    store.put(("master", 1), chunk(placement, 1, Space.DEVICE))  # replaces the host copy
    assert store.bytes == {Space.DEVICE: 2 * CHUNK_BYTES, Space.HOST: CHUNK_BYTES}
    assert store.spaces(("master", 1)) == (Space.DEVICE,)
    assert store.keys("master") == [("master", 0), ("master", 1)]
    assert store.traffic.h2d_bytes == store.traffic.d2h_bytes == 0


def test_fetch_keeps_host_copy_and_clean_evict_is_free():
    """get(DEVICE) of a host chunk copies it down; evicting it unchanged moves nothing back."""
    store = store_of(1, Space.HOST)
    key = ("param", 0)
    fetched = store.get(key, Space.DEVICE)
    assert fetched.sharding.memory_kind == "device"
    assert set(store.spaces(key)) == {Space.DEVICE, Space.HOST}
    assert store.traffic.h2d_bytes == CHUNK_BYTES and store.traffic.d2h_bytes == 0
    assert store.bytes == {Space.DEVICE: CHUNK_BYTES, Space.HOST: CHUNK_BYTES}
    assert store.get(key, Space.DEVICE) is fetched  # already there: no second copy
    assert store.traffic.h2d_bytes == CHUNK_BYTES
    store.evict(key)
    assert store.spaces(key) == (Space.HOST,)
    assert store.traffic.d2h_bytes == 0
    assert store.bytes == {Space.DEVICE: 0, Space.HOST: CHUNK_BYTES}
    assert store.peek(key).sharding.memory_kind == "pinned_host"
    np.testing.assert_array_equal(np.asarray(store.peek(key)), np.zeros(NUMEL, np.float32))


def test_evict_device_only_chunk_copies_up():
    """Evicting a chunk with no host copy moves it d2h, counted once, values intact."""
    store = store_of(1, Space.DEVICE)
    key = ("param", 0)
    store.put(key, chunk(store.placement, 3.0, Space.DEVICE))
    store.evict(key)
    assert store.spaces(key) == (Space.HOST,)
    assert store.traffic.d2h_bytes == CHUNK_BYTES and store.traffic.h2d_bytes == 0
    assert store.bytes == {Space.DEVICE: 0, Space.HOST: CHUNK_BYTES}
    host = store.peek(key)
    assert host.sharding.memory_kind == "pinned_host"
    np.testing.assert_array_equal(np.asarray(host), np.full(NUMEL, 3.0, np.float32))
    store.evict(key)  # already host-only: nothing moves
    assert store.traffic.d2h_bytes == CHUNK_BYTES


def test_get_host_copy_of_device_chunk():
    """get(HOST) of a device chunk copies it up and keeps both copies, counting both spaces."""
    store = store_of(1, Space.DEVICE)
    host = store.get(("param", 0), Space.HOST)
    assert host.sharding.memory_kind == "pinned_host" and space_of(host) is Space.HOST
    assert store.traffic.d2h_bytes == CHUNK_BYTES
    assert store.bytes == {Space.DEVICE: CHUNK_BYTES, Space.HOST: CHUNK_BYTES}
    store.drop_copy(("param", 0), Space.DEVICE)
    assert store.spaces(("param", 0)) == (Space.HOST,) and store.bytes[Space.DEVICE] == 0
    store.drop_copy(("param", 0), Space.HOST)  # the only copy is never dropped
    assert store.spaces(("param", 0)) == (Space.HOST,)


def test_store_never_exceeds_the_budget_and_changes_nothing_when_refusing():
    """Making room is the plan's job: a fetch or put over the budget raises MemoryError, state intact."""
    store = store_of(3, Space.HOST, budget_chunks=2)
    store.get(("param", 0), Space.DEVICE)
    store.get(("param", 1), Space.DEVICE)
    before = (dict(store.bytes), store.traffic.h2d_bytes, store.traffic.d2h_bytes)
    with pytest.raises(MemoryError, match="over the plan's 8.00 KiB"):
        store.get(("param", 2), Space.DEVICE)
    with pytest.raises(MemoryError):
        store.put(("slot", 0), chunk(store.placement, 1.0, Space.DEVICE))
    assert (dict(store.bytes), store.traffic.h2d_bytes, store.traffic.d2h_bytes) == before
    assert store.spaces(("param", 2)) == (Space.HOST,) and ("slot", 0) not in store
    store.evict(("param", 0))  # the plan's eviction makes room: now it fits
    store.get(("param", 2), Space.DEVICE)
    assert store.peak_device_bytes == 2 * CHUNK_BYTES


def test_take_removes_and_returns():
    """take() hands over the copy in the asked space and forgets the chunk and its bytes."""
    store = store_of(2, Space.HOST)
    store.get(("param", 1), Space.DEVICE)
    value = store.take(("param", 1), Space.DEVICE)
    assert value.sharding.memory_kind == "device"
    np.testing.assert_array_equal(np.asarray(value), np.ones(NUMEL, np.float32))
    assert ("param", 1) not in store and store.keys("param") == [("param", 0)]
    assert store.bytes == {Space.DEVICE: 0, Space.HOST: CHUNK_BYTES}
    host = store.take(("param", 0), Space.HOST)
    assert host.sharding.memory_kind == "pinned_host"
    assert store.bytes == {Space.DEVICE: 0, Space.HOST: 0} and store.traffic.d2h_bytes == 0


def test_pytree_values():
    """An optax-like state pytree is one entry; its scalars count in full and move with it."""
    placement = one_device()
    store = ChunkStore(placement, 10 * CHUNK_BYTES)
    state = placement.put({"count": jnp.int32(0), "mu": jnp.zeros(NUMEL), "nu": jnp.zeros(NUMEL)}, Space.HOST)
    store.put(("opt", 0), state)
    assert store.bytes[Space.HOST] == 2 * CHUNK_BYTES + 4
    on_device = store.get(("opt", 0), Space.DEVICE)
    assert {leaf.sharding.memory_kind for leaf in jax.tree.leaves(on_device)} == {"device"}
    assert store.traffic.h2d_bytes == 2 * CHUNK_BYTES + 4


@pytest.mark.skipif(len(jax.devices()) < 8, reason="needs conftest's 8 fake devices")
def test_per_device_bytes_over_eight_devices():
    """A chunk sharded over 8 devices costs nbytes/8 per device; replicated scalars cost in full."""
    placement = Placement(Mesh(np.array(jax.devices()[:8]), ("data",)))
    assert placement.n_devices == 8
    x = placement.put(jnp.zeros((NUMEL,), jnp.float32), Space.DEVICE)
    assert len(x.addressable_shards) == 8 and x.addressable_shards[0].data.shape == (NUMEL // 8,)
    assert placement.per_device_bytes(x) == CHUNK_BYTES // 8
    scalar = placement.put(jnp.float32(1.0), Space.HOST)
    assert scalar.sharding.is_fully_replicated and scalar.sharding.memory_kind == "pinned_host"
    assert placement.per_device_bytes(scalar) == 4
    assert placement.per_device_bytes({"s": scalar, "x": x, "y": x}) == 2 * CHUNK_BYTES // 8 + 4
    store = ChunkStore(placement, CHUNK_BYTES // 8)
    store.put(("param", 0), placement.put(jnp.zeros((NUMEL,), jnp.float32), Space.HOST))
    store.get(("param", 0), Space.DEVICE)
    assert store.bytes == {Space.DEVICE: CHUNK_BYTES // 8, Space.HOST: CHUNK_BYTES // 8}
    assert store.traffic.h2d_bytes == CHUNK_BYTES // 8


def test_host_budget_and_backend_settings(monkeypatch):
    """--host-memory sets the pinned pool; a user's own pool limit caps it; both reach the env first."""
    import subprocess
    import sys

    from pstar_jax.engine.memory import host_budget_bytes
    monkeypatch.delenv("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB", raising=False)
    assert host_budget_bytes("2GiB") == 2 * 2**30
    assert 0 < host_budget_bytes(None)
    monkeypatch.setenv("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB", "1")
    assert host_budget_bytes("2GiB") == 10**9
    code = ("import os\nfrom pstar_jax.engine.memory import configure_backend\nconfigure_backend('0.5', 3 * 10**9)\n"
            "print(os.environ['XLA_PYTHON_CLIENT_MEM_FRACTION'], os.environ['XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB'])")
    env = {k: v for k, v in os.environ.items() if not k.startswith("XLA_P")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert out.stdout.split() == ["0.500", "3"], out.stderr
