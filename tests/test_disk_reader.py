"""The disk reader's read-ahead ring (pstar_jax/engine/disk.py: DiskReader), over a fake ChunkReader.

Each chunk comes back with its own values and size, in the order scheduled, from a page-aligned
buffer; no more than ``slots`` chunks are ever read and not released; a take out of order, a
release of what was not taken and a read that fails are refused in one RuntimeError (the read's
own error), and the reader works on after a cancel. close() and cancel() wake a thread waiting
for a free slot and a take waiting for its read, so nothing hangs."""

import threading

import numpy as np
import pytest

from pstar_jax.engine.disk import DiskReader

WAIT_S = 2.0  # what "promptly" allows; every wait here ends far sooner unless something hangs


def values(c, numel):
    return (1000 * c + np.arange(numel)).astype(np.float32)


class FakeChunks:
    """A ChunkReader of chunks ``c`` with ``numels[c]`` float32 values from ``values``: it records
    the order reads start, blocks a read of ``c`` on ``gates[c]`` and raises ``errors[c]``.

    ``cv`` guards ``reads`` and ``released``; tests release under it (``release``), so a read
    that a release lets start is counted after that release: ``max_out`` is exact."""

    def __init__(self, numels, dtype=np.float32):
        self.numels, self.dtype = dict(numels), np.dtype(dtype)
        self.reads, self.released, self.max_out = [], 0, 0
        self.gates, self.errors = {}, {}
        self.cv = threading.Condition()

    def nbytes(self, c):
        return self.numels[c] * self.dtype.itemsize

    def read_into(self, c, out):
        assert out.shape == (self.numels[c],) and out.dtype == self.dtype and out.flags.c_contiguous
        with self.cv:
            self.reads.append(c)
            self.max_out = max(self.max_out, len(self.reads) - self.released)
            self.cv.notify_all()
        if c in self.gates:
            assert self.gates[c].wait(WAIT_S), "a gated read was never let through"
        if c in self.errors:
            raise self.errors[c]
        out[:] = values(c, out.size)

    def check_unchanged(self):
        pass

    def started(self, n, timeout=WAIT_S):
        """Whether ``n`` reads have started within ``timeout`` seconds."""
        with self.cv:
            return self.cv.wait_for(lambda: len(self.reads) >= n, timeout)

    def release(self, reader, c):
        with self.cv:
            reader.release(c)
            self.released += 1


def in_thread(fn):
    """Run ``fn`` on a thread of its own; (thread, box) where box holds its result or error."""
    box = {}

    def target():
        try:
            box["result"] = fn()
        except BaseException as e:
            box["error"] = e
    t = threading.Thread(target=target, daemon=True)
    t.start()
    return t, box


def finished(t):
    t.join(WAIT_S)
    return not t.is_alive()


@pytest.fixture
def make():
    readers = []

    def make(numels, slots=4, **kw):
        fake = FakeChunks(numels)
        readers.append(DiskReader(fake, np.float32, slots=slots, **kw))
        return fake, readers[-1]
    yield make
    for r in readers:
        r.close()


def test_values_and_sizes_of_each_chunk_in_schedule_order(make):
    numels = {0: 1000, 1: 5, 2: 40_000, 3: 1, 4: 3000}
    fake, reader = make(numels, slots=2)
    order = [2, 0, 3, 2, 4, 1]  # a chunk may be read twice in a step (fetched twice)
    reader.schedule(order[:3])
    reader.schedule(order[3:])
    assert reader.pending == tuple(order)
    for i, c in enumerate(order):
        buf = reader.take(c)
        assert buf.shape == (numels[c],) and buf.dtype == np.float32
        np.testing.assert_array_equal(buf, values(c, numels[c]))
        assert buf.ctypes.data % 4096 == 0
        assert reader.pending == tuple(order[i + 1:])
        fake.release(reader, c)
    assert fake.reads == order
    assert reader.read_bytes == sum(4 * numels[c] for c in order)


def test_numel_of_overrides_the_bytes(make):
    fake, reader = make({0: 100, 1: 7}, numel_of={0: 100, 1: 7}.__getitem__)
    fake.nbytes = lambda c: pytest.fail("the reader asked nbytes although numel_of was given")
    reader.schedule([1, 0])
    np.testing.assert_array_equal(reader.take(1), values(1, 7))
    np.testing.assert_array_equal(reader.take(0), values(0, 100))


def test_buffers_grow_when_a_larger_chunk_is_scheduled(make):
    fake, reader = make({0: 10, 1: 100_000}, slots=1)
    reader.schedule([0])
    small = reader.take(0)
    assert small.ctypes.data % 4096 == 0
    fake.release(reader, 0)
    reader.schedule([1, 0])
    big = reader.take(1)
    np.testing.assert_array_equal(big, values(1, 100_000))
    assert big.ctypes.data % 4096 == 0
    fake.release(reader, 1)
    np.testing.assert_array_equal(reader.take(0), values(0, 10))


@pytest.mark.parametrize("slots", [1, 3])
def test_never_more_than_slots_chunks_read_and_not_released(make, slots):
    order = [c % 5 for c in range(20)]
    fake, reader = make({c: 64 * (c + 1) for c in range(5)}, slots=slots)
    reader.schedule(order)
    held = []
    for i, c in enumerate(order):  # hold a varying number of buffers before releasing
        np.testing.assert_array_equal(reader.take(c), values(c, 64 * (c + 1)))
        held.append(c)
        while len(held) > i % slots:
            fake.release(reader, held.pop(0))
    for c in held:
        fake.release(reader, c)
    assert fake.reads == order and fake.max_out == slots


def test_a_full_ring_waits_for_a_release(make):
    fake, reader = make({c: 16 for c in range(8)}, slots=3)
    reader.schedule(range(8))
    assert fake.started(3)
    reader.take(0)
    assert not fake.started(4, timeout=0.1)  # three buffers out (one taken, two read ahead): no fourth
    fake.release(reader, 0)
    assert fake.started(4)
    assert fake.max_out == 3


def test_take_out_of_order_or_unscheduled_raises_at_once(make):
    fake, reader = make({0: 8, 1: 8, 2: 8})
    with pytest.raises(RuntimeError, match=r"take\(1\) but no read is scheduled"):
        reader.take(1)
    fake.gates[0] = threading.Event()
    reader.schedule([0, 1])
    assert fake.started(1)
    with pytest.raises(RuntimeError, match=r"take\(1\) but the next read scheduled is chunk 0"):
        reader.take(1)  # while 0 is still being read: no wait
    fake.gates[0].set()
    with pytest.raises(RuntimeError, match=r"take\(2\) but the next read scheduled is chunk 0"):
        reader.take(2)
    np.testing.assert_array_equal(reader.take(0), values(0, 8))  # the refused takes changed nothing
    np.testing.assert_array_equal(reader.take(1), values(1, 8))


def test_release_of_what_was_not_taken_raises(make):
    _, reader = make({0: 8, 1: 8})
    reader.schedule([0, 1])
    with pytest.raises(RuntimeError, match=r"release\(0\) but chunk 0 is not taken"):
        reader.release(0)
    reader.take(0)
    reader.release(0)
    with pytest.raises(RuntimeError, match=r"release\(0\) but chunk 0 is not taken"):
        reader.release(0)


def test_a_failed_read_raises_in_its_take_and_the_reader_works_after_cancel(make):
    fake, reader = make({c: 32 for c in range(4)}, slots=2)
    error = OSError(5, "Input/output error")
    fake.errors[1] = error
    reader.schedule([0, 1, 2, 3])
    np.testing.assert_array_equal(reader.take(0), values(0, 32))
    fake.release(reader, 0)
    with pytest.raises(OSError) as got:
        reader.take(1)
    assert got.value is error
    reader.cancel()
    assert reader.pending == ()
    del fake.errors[1]
    reader.schedule([1, 3])
    for c in (1, 3):
        np.testing.assert_array_equal(reader.take(c), values(c, 32))
        fake.release(reader, c)
    assert fake.reads[-2:] == [1, 3]
    assert reader.read_bytes == 4 * 32 * (len(fake.reads) - 1)  # every read but the failed one


def test_cancel_keeps_taken_buffers_taken_and_waits_for_the_read_in_flight(make):
    fake, reader = make({c: 16 for c in range(4)}, slots=3)
    fake.gates[2] = threading.Event()
    reader.schedule([0, 1, 2, 3])
    taken = reader.take(0)
    assert fake.started(3)  # 1 read, 2 in flight, 3 waits for a slot
    t, _ = in_thread(reader.cancel)
    t.join(0.05)
    assert t.is_alive()  # 2 is still being read
    fake.gates[2].set()
    assert finished(t) and reader.pending == ()
    reader.schedule([3, 1])  # two slots free: 0's stays taken
    for c in (3, 1):
        np.testing.assert_array_equal(reader.take(c), values(c, 16))
    np.testing.assert_array_equal(taken, values(0, 16))  # not read into
    fake.release(reader, 0)
    assert fake.reads == [0, 1, 2, 3, 1]


@pytest.mark.parametrize("stop, message", [("cancel", "the read of chunk 0 was cancelled while take(0) waited for it"),
                                           ("close", "the disk reader is closed")])
def test_cancel_or_close_wakes_a_take_waiting_for_its_read(make, stop, message):
    fake, reader = make({0: 16})
    fake.gates[0] = threading.Event()
    reader.schedule([0])
    assert fake.started(1)
    t, box = in_thread(lambda: reader.take(0))
    t.join(0.05)
    assert t.is_alive()  # the take waits for the read
    c, _ = in_thread(getattr(reader, stop))
    assert finished(t)  # woken while the read is still in flight
    assert str(box["error"]) == message
    fake.gates[0].set()
    assert finished(c)
    assert reader._thread.is_alive() == (stop == "cancel")


def test_close_while_the_thread_waits_for_a_free_slot(make):
    fake, reader = make({c: 16 for c in range(3)}, slots=2)
    reader.schedule([0, 1, 2])
    reader.take(0)
    reader.take(1)  # both slots out: 2 waits
    t, box = in_thread(reader.close)
    assert finished(t) and "error" not in box
    assert not reader._thread.is_alive()
    assert fake.reads == [0, 1]
    reader.close()  # idempotent
    with pytest.raises(RuntimeError, match="the disk reader is closed"):
        reader.take(2)
    with pytest.raises(RuntimeError, match="the disk reader is closed"):
        reader.schedule([2])


def test_the_thread_and_the_context_manager():
    fake = FakeChunks({0: 8})
    with DiskReader(fake, np.float32, slots=2) as reader:
        assert reader._thread.name == "pstar-disk-reader" and reader._thread.daemon
        reader.schedule([0])
        np.testing.assert_array_equal(reader.take(0), values(0, 8))
        reader.release(0)
    assert not reader._thread.is_alive()


def test_bad_arguments():
    with pytest.raises(ValueError, match="at least 1 staging slot"):
        DiskReader(FakeChunks({0: 8}), np.float32, slots=0)
    with DiskReader(FakeChunks({0: 3}, np.uint8), np.float32) as reader:  # 3 bytes: not whole float32s
        with pytest.raises(ValueError, match="not a whole number of float32 elements"):
            reader.schedule([0])
        assert reader.pending == ()
    with DiskReader(FakeChunks({0: 8}), np.float32) as reader:
        with pytest.raises(KeyError):
            reader.schedule([0, 7])  # an unknown chunk: nothing is queued
        assert reader.pending == ()
