"""The process runtime: flags and variables checked in one line, the join deadline, the
backend-free watchdog, the stop agreement of a single process."""

import os
import subprocess
import sys
import time

import pytest

from pstar_jax.run import distributed
from pstar_jax.config import ConfigError
from pstar_jax.run.distributed import EXIT_PEER_FAILED, Watchdog, agree_to_stop, resolve

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def no_env(monkeypatch):
    for name in ("PSTAR_COORDINATOR", "PSTAR_NUM_PROCESSES", "PSTAR_PROCESS_ID"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_resolve_from_flags_and_variables(no_env):
    assert resolve(None, None, None) is None
    assert resolve("h:1234", 2, 1) == ("h:1234", 2, 1)
    no_env.setenv("PSTAR_COORDINATOR", "10.0.0.1:29500")
    no_env.setenv("PSTAR_NUM_PROCESSES", "4")
    no_env.setenv("PSTAR_PROCESS_ID", "3")
    assert resolve(None, None, None) == ("10.0.0.1:29500", 4, 3)
    assert resolve(None, None, 0) == ("10.0.0.1:29500", 4, 0)  # a flag wins over its variable


@pytest.mark.parametrize("args, env, words", [
    (("h:1", 0, 0), {}, "--num-processes must be at least 1, got 0"),
    (("h:1", 2, 2), {}, "--process-id must be in 0..1 for --num-processes 2, got 2"),
    (("h:1", 2, -1), {}, "--process-id must be in 0..1"),
    (("h", 2, 0), {}, "--coordinator must be HOST:PORT"),
    (("h:99999", 2, 0), {}, "--coordinator must be HOST:PORT"),
    ((None, None, None), {"PSTAR_NUM_PROCESSES": "abc"}, "PSTAR_NUM_PROCESSES='abc' is not an integer"),
    (("h:1", 2, None), {"PSTAR_PROCESS_ID": "1.5"}, "PSTAR_PROCESS_ID='1.5' is not an integer"),
    (("h:1", 2, None), {}, "multi-host training needs"),
])
def test_bad_process_settings_are_one_sentence(no_env, args, env, words):
    for k, v in env.items():
        no_env.setenv(k, v)
    with pytest.raises(ConfigError) as err:
        resolve(*args)
    assert words in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("limit", [-1.0, 0.0, float("nan"), float("inf")])
def test_watchdog_refuses_a_limit_that_is_not_a_positive_time(limit):
    with pytest.raises(ConfigError, match="--step-timeout must be a positive number of seconds"):
        Watchdog(limit)


def test_watchdog_stays_quiet_while_steps_progress():
    dog = Watchdog(0.4)
    for step in range(6):
        time.sleep(0.1)
        dog.progress(step)
    dog.stop()


def test_watchdog_times_nothing_before_the_first_step_nor_inside_untimed(monkeypatch):
    """Compiling the first step (or the first evaluation) on a loaded machine is not a hang."""
    ended = []
    monkeypatch.setattr(distributed, "hard_exit", lambda code, line=None: ended.append((code, line)))
    dog = Watchdog(0.2)
    try:
        time.sleep(0.8)  # the first steps compile
        with dog.untimed():
            time.sleep(0.8)  # an evaluation before the clock runs: still not timed after it
        assert not ended
        dog.progress(1)
        with dog.untimed():
            time.sleep(0.8)  # the first evaluation compiles
        assert not ended
        time.sleep(0.8)  # the second step hangs
        assert ended and ended[0][0] == EXIT_PEER_FAILED and "step 1 made no progress" in ended[0][1]
    finally:
        dog.stop()


def test_agree_to_stop_in_one_process_is_the_local_flag():
    assert agree_to_stop(True) is True and agree_to_stop(False) is False


def run_python(code, timeout_s=60):
    env = {k: v for k, v in os.environ.items() if not k.startswith("PSTAR_")}
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout_s)
    return proc, time.monotonic() - start


def test_watchdog_ends_a_stuck_process_without_calling_the_backend():
    """The backend is broken (jax.process_index raises): the watchdog still ends the process."""
    proc, _ = run_python("import time, jax\n"
                         "from pstar_jax.run.distributed import Watchdog\n"
                         "def broken(): raise RuntimeError('backend gone')\n"
                         "jax.process_index = broken\n"
                         "Watchdog(0.5, process_index=1).progress(7)\n"
                         "time.sleep(20)\n")
    assert proc.returncode == EXIT_PEER_FAILED, proc.stderr
    assert proc.stderr.strip() == ("pstar-train: error: step 7 made no progress for 0.5 s (process 1); "
                                   "another process probably died or hangs")


@pytest.mark.slow
def test_unreachable_coordinator_is_one_line_within_the_timeout():
    import socket
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc, took = run_python("from pstar_jax.run.distributed import initialize\n"
                            f"initialize('127.0.0.1:{port}', 2, 1, timeout_s=3)\n")
    assert proc.returncode == EXIT_PEER_FAILED, proc.stderr[-2000:]
    assert proc.stderr.strip() == (f"pstar-train: error: process 1: the 2 processes did not all join through the "
                                   f"coordinator 127.0.0.1:{port} within 3 s; check that process 0 runs there and "
                                   "every process has the same --coordinator")
    assert took < 30


@pytest.mark.parametrize("error, code, trace", [
    # jax 0.11.2 raised a dead peer's gloo error as a ValueError from process_allgather's jit
    (ValueError("UNKNOWN: Gloo AllGather failed: Read error: Connection reset by peer"), 3, False),
    (RuntimeError("list index out of range"), 1, True),  # not ours and not a peer's: its trace is kept
    (FloatingPointError("the loss is not finite at step 3"), 1, True),
    (ConfigError("evaluation does not fit: lower the batch"), 2, False),
])
def test_any_error_of_a_multi_process_run_ends_the_process_at_once(monkeypatch, capsys, error, code, trace):
    """In a multi-process run every error leaves through hard_exit (the interpreter's exit would join
    worker threads and run jax's shutdown barrier, both of which can wait on a dead peer); one
    process alone raises as usual."""
    from pstar_jax.run import distributed
    exits = []

    def fake_exit(status, line=None):
        exits.append((status, line))
        raise SystemExit(status)
    monkeypatch.setattr(distributed, "hard_exit", fake_exit)
    with pytest.raises(type(error)):
        with distributed.peer_failures_end_the_process():
            raise error
    monkeypatch.setattr(distributed.jax, "process_count", lambda: 2)
    with pytest.raises(SystemExit):
        with distributed.peer_failures_end_the_process():
            raise error
    (status, line), = exits
    assert status == code and line.startswith("pstar-train: error: process 0: ") and str(error)[:150] in line
    assert (code == 3) == ("another process probably died" in line)
    assert ("Traceback" in capsys.readouterr().err) == trace
