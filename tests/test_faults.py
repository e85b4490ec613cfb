"""Fault injection: bad checkpoint and export paths, concurrent runs, corrupted metadata and
exports, full and read-only file systems mid-run, signals to multi-process runs and the launcher.

Full and read-only file systems are small tmpfs mounts made by the test (skipped where mounting
is not allowed). Every case ends in one line and a defined exit, never a hang or a traceback.
"""

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import numpy as np
import pytest

from pstar_jax.io.checkpoint import Checkpointer
from pstar_jax.io.run_lock import DirectoryLock
from pstar_jax.cli.train import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASE = ["--quiet", "--precision", "fp32", "--batch-size", "8", "--lr", "3e-3"]


def one_line(err: str, *words: str) -> str:
    err = err.strip()
    assert err.startswith("pstar-train: error:") and "\n" not in err and "Traceback" not in err, err
    for w in words:
        assert w in err, err
    return err


def env_without_fake_devices():
    """Each process makes its own devices; compilations are shared through conftest's cache."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    return dict(env, JAX_COMPILATION_CACHE_DIR=os.path.join(tempfile.gettempdir(), "pstar_jax_test_xla_cache"),
                JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0", JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")


def run_cli(args, env=None, **kw):
    return subprocess.Popen([sys.executable, "-m", "pstar_jax.cli.train", *BASE, *args], cwd=ROOT,
                            env=env or env_without_fake_devices(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, **kw)


def wait_for(predicate, timeout_s, proc=None, output=None):
    """Wait until ``predicate()``; if ``proc`` exits first or time runs out, fail showing what the
    processes wrote: ``output()`` (processes writing to log files), else ``proc``'s stderr pipe."""
    def shown():
        if output is not None:
            return output()
        if proc is None or proc.stderr is None:
            return ""
        if proc.poll() is None:
            proc.kill()  # reading a live process's pipe would wait for its end
        return proc.stderr.read()[-2000:]

    deadline = time.monotonic() + timeout_s
    while not predicate():
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"exited early with {proc.returncode}: {shown()}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s: {shown()}")
        time.sleep(0.05)


@contextlib.contextmanager
def tmpfs(path, size):
    """A small file system of its own at ``path``; skips the test where mounting is not allowed."""
    os.makedirs(path, exist_ok=True)
    if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                      capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def remount_read_only(path, timeout_s=60):
    """Retried: the kernel refuses while a file is open for writing (mid-save)."""
    deadline = time.monotonic() + timeout_s
    while subprocess.run(["mount", "-o", "remount,ro", str(path)], capture_output=True).returncode:
        assert time.monotonic() < deadline, "could not remount read-only"
        time.sleep(0.01)


# -- data loss ----------------------------------------------------------------------------------


@pytest.mark.parametrize("keep", ["0", "-1"])
def test_keep_checkpoints_below_one_is_refused_before_work(tmp_path, capsys, keep):
    d = tmp_path / "ck"
    assert main([*BASE, "--steps", "2", "--checkpoint-dir", str(d), "--keep-checkpoints", keep]) == 2
    one_line(capsys.readouterr().err, "--keep-checkpoints must be a whole number of at least 1")
    assert not d.exists()


def test_a_live_run_owns_its_directory_and_a_dead_one_does_not(tmp_path, capsys):
    d = tmp_path / "ck"
    d.mkdir()
    lock = DirectoryLock(str(d))  # another run, alive
    try:
        assert main([*BASE, "--steps", "2", "--checkpoint-dir", str(d)]) == 2
        one_line(capsys.readouterr().err,
                 f"another run (pid {os.getpid()} on host {socket.gethostname()}) is using --checkpoint-dir")
        assert sorted(os.listdir(d)) == [".pstar-run.lock"]
    finally:
        lock.release()
    # A run killed while holding the lock does not hold it any more.
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; sys.path.insert(0, sys.argv[1]); "
                               "from pstar_jax.io.run_lock import DirectoryLock; DirectoryLock(sys.argv[2]); "
                               "print('locked', flush=True); time.sleep(600)", ROOT, str(d)],
                              stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "locked"
    holder.kill()
    holder.wait()
    assert main([*BASE, "--steps", "2", "--checkpoint-dir", str(d)]) == 0
    assert Checkpointer(str(d)).latest_step() == 2


@pytest.mark.slow
def test_two_runs_started_at_once_into_one_directory(tmp_path):
    """Exactly one trains; the other is refused in one line and deletes nothing."""
    d = tmp_path / "ck"
    procs = [run_cli(["--steps", "3", "--checkpoint-every", "1", "--keep-checkpoints", "5", "--checkpoint-dir", str(d)])
             for _ in range(2)]
    results = [(p.wait(timeout=240), p.stderr.read()) for p in procs]
    codes = sorted(code for code, _ in results)
    assert codes == [0, 2], results
    refused = next(err for code, err in results if code == 2)
    assert "another run" in refused or "already holds checkpoints" in refused, refused
    one_line(refused)
    assert Checkpointer(str(d)).committed_steps() == [1, 2, 3]


def test_export_never_overwrites_other_files_and_is_checked_before_training(tmp_path, capsys):
    out, metrics = tmp_path / "export", tmp_path / "m.jsonl"
    out.mkdir()
    (out / "config.json").write_text("mine")
    assert main([*BASE, "--steps", "1", "--export-flax", str(out), "--metrics-out", str(metrics)]) == 2
    one_line(capsys.readouterr().err, "--export-flax", "holds other files")
    assert (out / "config.json").read_text() == "mine" and not metrics.exists()
    (tmp_path / "file").write_text("x")
    for bad, words in ((tmp_path / "file", "is a file"), (tmp_path / "file" / "sub", "is under the file")):
        assert main([*BASE, "--steps", "1", "--export-flax", str(bad), "--metrics-out", str(metrics)]) == 2
        one_line(capsys.readouterr().err, words)
        assert not metrics.exists()
    # An earlier export is replaced.
    fresh = tmp_path / "fresh"
    assert main([*BASE, "--steps", "1", "--export-flax", str(fresh)]) == 0
    assert main([*BASE, "--steps", "2", "--export-flax", str(fresh)]) == 0
    assert sorted(os.listdir(fresh)) == ["config.json", "params"]
    assert not [n for n in os.listdir(tmp_path) if "pstar-tmp" in n]


def test_export_to_a_read_only_place_is_refused_before_training(tmp_path, capsys):
    with tmpfs(tmp_path / "ro", "1m") as ro:
        remount_read_only(ro)
        assert main([*BASE, "--steps", "1", "--export-flax", str(ro / "out")]) == 2
        one_line(capsys.readouterr().err, "cannot be written", "read-only")


def two_checkpoints(tmp_path):
    d = tmp_path / "ck"
    assert main([*BASE, "--steps", "4", "--stop-after", "4", "--checkpoint-every", "2", "--checkpoint-dir", str(d)]) == 0
    assert Checkpointer(str(d)).committed_steps() == [2, 4]
    return d


def meta_file(d, step):
    return d / str(step) / "meta" / "metadata"


def test_metadata_naming_another_step_blames_that_step(tmp_path, capsys):
    d = two_checkpoints(tmp_path)
    shutil.copyfile(meta_file(d, 2), meta_file(d, 4))
    assert main([*BASE, "--steps", "6", "--resume", "--checkpoint-dir", str(d)]) == 2
    err = one_line(capsys.readouterr().err, "checkpoint step 4", "metadata of step 2", f"remove {d}/4 ")
    assert f"{d}/2 " not in err
    assert Checkpointer(str(d)).committed_steps() == [2, 4]


@pytest.mark.slow
def test_metadata_missing_a_key_is_one_line(tmp_path, capsys):
    d = two_checkpoints(tmp_path)
    meta = json.loads(meta_file(d, 4).read_text())
    del meta["data_position"]
    meta_file(d, 4).write_text(json.dumps(meta))
    assert main([*BASE, "--steps", "6", "--resume", "--allow-config-change", "--checkpoint-dir", str(d)]) == 2
    one_line(capsys.readouterr().err, "checkpoint step 4", "incomplete metadata (no data_position)")


def test_refused_resume_creates_nothing_and_checkpoint_dir_under_a_file(tmp_path, capsys):
    missing = tmp_path / "missing"
    assert main([*BASE, "--steps", "2", "--resume", "--checkpoint-dir", str(missing)]) == 2
    one_line(capsys.readouterr().err, "no checkpoint in")
    assert not missing.exists()
    (tmp_path / "file").write_text("x")
    assert main([*BASE, "--steps", "2", "--checkpoint-dir", str(tmp_path / "file" / "ck")]) == 2
    one_line(capsys.readouterr().err, "is under the file")


def test_init_from_flax_with_resume_is_refused(tmp_path, capsys):
    assert main([*BASE, "--steps", "2", "--resume", "--checkpoint-dir", str(tmp_path / "ck"),
                 "--init-from-flax", str(tmp_path / "x")]) == 2
    one_line(capsys.readouterr().err, "--init-from-flax and --resume conflict")


def test_empty_and_corrupted_flax_exports_are_refused(tmp_path, capsys):
    from pstar_models.gpt import build_model
    from pstar_jax.io.flax_io import export_flax
    shapes = build_model("tiny").param_shapes()
    empty = tmp_path / "empty"
    (empty / "params").mkdir(parents=True)
    assert main([*BASE, "--steps", "1", "--init-from-flax", str(empty)]) == 2
    one_line(capsys.readouterr().err, "no Flax export")
    params = {n: np.zeros(s, np.float32) for n, s in shapes.items()}
    first = sorted(params)[0]
    params[first].flat[0] = np.nan
    export_flax(str(tmp_path / "nan"), params, {})
    assert main([*BASE, "--steps", "1", "--init-from-flax", str(tmp_path / "nan")]) == 2
    one_line(capsys.readouterr().err, "non-finite values", first)
    params[first] = np.zeros((3,), np.float32)
    export_flax(str(tmp_path / "shape"), params, {})
    assert main([*BASE, "--steps", "1", "--init-from-flax", str(tmp_path / "shape")]) == 2
    one_line(capsys.readouterr().err, "does not match the model", first)


@pytest.mark.parametrize("argv, env, words", [
    (["--coordinator", "127.0.0.1:1", "--num-processes", "0", "--process-id", "0"], {},
     "--num-processes must be a whole number of at least 1"),
    ([], {"PSTAR_COORDINATOR": "127.0.0.1:1", "PSTAR_NUM_PROCESSES": "abc", "PSTAR_PROCESS_ID": "0"},
     "PSTAR_NUM_PROCESSES='abc' is not an integer"),
])
def test_bad_process_settings_are_one_line(monkeypatch, capsys, argv, env, words):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert main([*BASE, "--steps", "1", *argv]) == 2
    one_line(capsys.readouterr().err, words)


# -- full and read-only file systems during saves -------------------------------------------------


def check_failed_save(proc, d, cause, timeout_s=120, read_only=False):
    out, err = proc.communicate(timeout=timeout_s)  # a hang at exit fails here
    assert proc.returncode == 1, err[-3000:]
    line = one_line(err.strip().splitlines()[-1] if err.strip() else "", cause, "the latest good checkpoint is step")
    assert "Traceback" not in err and "ERROR:absl" not in err, err[-3000:]
    good = int(line.rsplit("step ", 1)[1])
    names = os.listdir(d)
    if not read_only:  # nothing can be removed from a read-only file system; resume skips it
        assert not [n for n in names if "tmp" in n], names
    ckpt = Checkpointer(str(d))
    assert ckpt.latest_step() == good and ckpt.meta(good)["step"] == good
    return good


@pytest.mark.slow
def test_full_disk_during_a_save_is_one_line_and_keeps_earlier_checkpoints(tmp_path):
    with tmpfs(tmp_path / "small", "1400k") as fs:
        d = fs / "ck"
        proc = run_cli(["--steps", "1000", "--checkpoint-every", "1", "--keep-checkpoints", "100",
                        "--checkpoint-dir", str(d)])
        good = check_failed_save(proc, d, "the disk is full")
        assert good >= 1


@pytest.mark.slow
def test_read_only_checkpoint_dir_mid_run_is_one_line_and_no_hang(tmp_path):
    with tmpfs(tmp_path / "fs", "64m") as fs:
        d, metrics = fs / "ck", tmp_path / "m.jsonl"
        proc = run_cli(["--steps", "100000", "--checkpoint-every", "2", "--checkpoint-dir", str(d),
                        "--metrics-out", str(metrics)])
        wait_for(lambda: d.exists() and any(n.isdigit() for n in os.listdir(d)), 180, proc)
        remount_read_only(fs)
        check_failed_save(proc, d, "the file system is read-only", read_only=True)


@pytest.mark.slow
def test_step_timeout_does_not_count_compilation(tmp_path):
    """A limit below the compilation of the first two steps (0.6 and 2 s here without the compilation cache) and of the first
    evaluation (after the third step): they are not timed, and the run ends normally."""
    env = {k: v for k, v in env_without_fake_devices().items() if not k.startswith(("JAX_COMP", "JAX_PERS"))}
    proc = run_cli(["--steps", "4", "--eval-every", "3", "--step-timeout", "0.5"], env=env)  # compiles afresh
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    assert "made no progress" not in err and out.splitlines()[-1].startswith("done:"), out[-2000:]


# -- signals during start-up ---------------------------------------------------------------------


def signal_at(args, phase, sig, timeout_s=240):
    """Start pstar-train (start-up lines on), send ``sig`` when its stderr shows the line that
    starts with ``phase`` (or, a compiled pattern, that it matches); (exit status, stderr)."""
    import queue
    import threading
    env = dict(env_without_fake_devices(), PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-m", "pstar_jax.cli.train", *[a for a in BASE if a != "--quiet"], *args],
                            cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    lines_read: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines_read.put(line) for line in proc.stderr] + [lines_read.put(None)],
                     daemon=True).start()
    err, deadline = [], time.monotonic() + timeout_s
    try:
        while True:
            line = lines_read.get(timeout=max(deadline - time.monotonic(), 0.1))
            if line is None:
                raise AssertionError(f"ended before {phase!r}: {''.join(err)[-3000:]}")
            err.append(line)
            if phase.match(line) if isinstance(phase, re.Pattern) else line.startswith(phase):
                proc.send_signal(sig)
                break
        code = proc.wait(timeout=120)
        while (line := lines_read.get(timeout=10)) is not None:
            err.append(line)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        proc.stderr.close()
    return code, "".join(err)


@pytest.mark.slow
@pytest.mark.parametrize("phase, sig", [("building the model", signal.SIGINT), ("tracing", signal.SIGINT),
                                        ("planning", signal.SIGINT), ("tracing", signal.SIGTERM)])
def test_a_signal_during_start_up_is_one_line_and_exit_128_plus_it(phase, sig):
    """Once 3 of 4 such runs printed 'interrupted' and died of a segmentation fault (the
    interpreter's teardown while XLA compiled), or jaxlib swallowed the Ctrl-C and training ran on."""
    code, err = signal_at(["--steps", "50"], phase, sig)
    line = "pstar-train: interrupted" if sig == signal.SIGINT else "pstar-train: terminated (SIGTERM)"
    assert code == 128 + sig and err.strip().splitlines()[-1] == line, (code, err[-3000:])
    assert "Traceback" not in err


LONG_CALL_INTO_C = """
import numpy as np
from pstar_jax.run.exits import signals_end_the_process
a = np.ones((9000, 9000), np.float32)
with signals_end_the_process("pstar-x"):
    print("ready", flush=True)
    np.dot(a, a)  # seconds in one call that releases the GIL and ignores signals, as XLA's compiler does
    print("returned", flush=True)
"""


def test_a_signal_ends_start_up_at_once_even_inside_a_long_call_into_c():
    """Python runs a signal's handler only between bytecodes; before the watcher thread, SIGTERM
    during a first step's compilation (minutes at --seq-len 65536) waited for it to finish."""
    proc = subprocess.Popen([sys.executable, "-c", LONG_CALL_INTO_C], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "ready\n"
    time.sleep(0.3)
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 143 and err == "pstar-x: terminated (SIGTERM)\n" and "returned" not in out, err
    assert time.monotonic() - sent < 5


HUNG_STEP = """
import numpy as np
from pstar_jax.run.exits import signals_end_the_process
from pstar_jax.run.signals import StopSignal
a = np.ones((9000, 9000), np.float32)
with signals_end_the_process("pstar-x"):
    stop = StopSignal()
    stop.nothing_to_save = False  # a step has returned: a signal asks to stop after the next one
    print("ready", flush=True)
    np.dot(a, a)  # a step that holds the main thread in C (a hung device would for ever)
    print("returned", flush=True)
"""


def test_a_second_signal_ends_a_run_whose_step_does_not_return():
    """The first signal is left to the loop (stop after this step, with a checkpoint); a step that
    never returned (a Qwen3.5 step hung in a BLAS call once) then ignored every later one."""
    proc = subprocess.Popen([sys.executable, "-c", HUNG_STEP], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "ready\n"
    time.sleep(0.3)
    proc.send_signal(signal.SIGTERM)
    time.sleep(1.0)
    assert proc.poll() is None  # left to the loop's handler, which waits for the step
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 143 and err == "pstar-x: terminated (SIGTERM)\n" and "returned" not in out, err
    assert time.monotonic() - sent < 5


@pytest.mark.slow
def test_ctrl_c_before_a_step_ends_keeps_the_checkpoint_and_after_one_saves_one(tmp_path):
    d = tmp_path / "ck"
    assert main([*BASE, "--steps", "6", "--stop-after", "2", "--checkpoint-dir", str(d)]) == 0
    code, err = signal_at(["--steps", "6", "--resume", "--checkpoint-dir", str(d)], "restoring", signal.SIGINT)
    assert code == 130 and err.strip().splitlines()[-1] == "pstar-train: interrupted", err[-3000:]
    assert Checkpointer(str(d)).committed_steps() == [2]
    # While the first step compiles (minutes in XLA at a long --seq-len, where Python's handlers
    # cannot run) nothing has been trained since the checkpoint: Ctrl-C ends the run at once.
    code, err = signal_at(["--steps", "6", "--resume", "--checkpoint-dir", str(d)], "compiling the first step",
                          signal.SIGINT)
    assert code == 130 and err.strip().splitlines()[-1].endswith("pstar-train: interrupted"), err[-3000:]
    assert Checkpointer(str(d)).committed_steps() == [2]
    # After a step, Ctrl-C stops after the current step with a checkpoint.
    # 100,000 steps: with 100 the run once ended (90 steps/s on CI) before the signal arrived.
    # The pattern is the bar past step 3 (not "3/": the bar refreshes at most every 0.1 s).
    code, err = signal_at(["--steps", "100000", "--resume", "--checkpoint-dir", str(d), "--allow-config-change"],
                          re.compile(r".*\|\s*([3-9]|[1-9]\d+)/100000 \["), signal.SIGINT)
    assert code == 0 and "stopped by SIGINT after step" in err and f"checkpoint saved in {d}" in err, err[-3000:]
    assert len(Checkpointer(str(d)).committed_steps()) == 2


# -- signals to multi-process runs and to the launcher --------------------------------------------


def free_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(i, port, extra, log):
    env = dict(env_without_fake_devices(), PSTAR_COORDINATOR=f"127.0.0.1:{port}", PSTAR_NUM_PROCESSES="2",
               PSTAR_PROCESS_ID=str(i), PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "pstar_jax.cli.train", "--local-devices", "1", *BASE, "--heartbeat-timeout", "10", *extra]
    return subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)


def logs_of(tmp_path, n=2):
    """The tail of each spawned process's log, its Python lines (native stack frames, '@', left out)."""
    def output():
        texts = []
        for i in range(n):
            path = tmp_path / f"p{i}.log"
            text = path.read_text() if path.exists() else ""
            text = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("@"))
            texts.append(f"--- process {i}:\n{text[-2000:]}")
        return "\n".join(texts)
    return output


def lines(path):
    return path.read_text().count("\n") if path.exists() else 0


@pytest.mark.slow
@pytest.mark.parametrize("targets, gap_s", [((1,), 0.0), ((0, 1), 0.03)])
def test_signal_to_some_processes_stops_all_at_one_step_with_a_checkpoint(tmp_path, targets, gap_s):
    """SIGTERM to process 1 only, or SIGINT to both 30 ms apart: both save the same step, exit 0."""
    d, metrics = tmp_path / "ck", tmp_path / "m.jsonl"
    port = free_port()
    logs = [open(tmp_path / f"p{i}.log", "w") for i in range(2)]
    procs = [spawn(i, port, ["--steps", "100000", "--checkpoint-dir", str(d), "--metrics-out", str(metrics)], logs[i])
             for i in range(2)]
    try:
        wait_for(lambda: lines(metrics) >= 3, 180, procs[0], logs_of(tmp_path))
        sig = signal.SIGTERM if targets == (1,) else signal.SIGINT
        for i in targets:
            procs[i].send_signal(sig)
            time.sleep(gap_s)
        codes = [p.wait(timeout=120) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        for log in logs:
            log.close()
    text = [(tmp_path / f"p{i}.log").read_text() for i in range(2)]
    assert codes == [0, 0], text[0][-2000:] + text[1][-2000:]
    step = Checkpointer(str(d)).latest_step()
    assert step is not None and step == lines(metrics), (step, lines(metrics))
    assert f"after step {step}; checkpoint saved" in text[0]
    assert not any("Traceback" in t for t in text)


def children(pid):
    path = f"/proc/{pid}/task/{pid}/children"
    return [int(c) for c in open(path).read().split()] if os.path.exists(path) else []


def alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(")")[-1].split()[0] != "Z"


def reap_orphans(pids):
    """Whatever the outcome, leave no trainer of this test running."""
    for pid in pids:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)


def start_launcher(tmp_path, extra, **popen):
    """pstar-launch with two trainers of BASE training 'forever', logs in tmp_path."""
    cmd = [sys.executable, "-m", "pstar_jax.cli.launch", "-n", "2", "--local-devices", "1", "--log-dir", str(tmp_path),
           "--", *BASE, "--steps", "100000", "--heartbeat-timeout", "10", *extra]
    return subprocess.Popen(cmd, cwd=ROOT, env=env_without_fake_devices(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **popen)


@pytest.mark.slow
@pytest.mark.parametrize("sig, to_group", [(signal.SIGTERM, False), (signal.SIGINT, True)])
def test_launcher_forwards_one_signal_and_waits_for_the_checkpoints(tmp_path, sig, to_group):
    """SIGTERM to the launcher, or Ctrl-C at its terminal (SIGINT to its process group): one
    signal reaches each trainer, they save the same step, nothing is left running."""
    d, metrics = tmp_path / "ck", tmp_path / "m.jsonl"
    trainers = []
    launcher = start_launcher(tmp_path, ["--checkpoint-dir", str(d), "--metrics-out", str(metrics)],
                              start_new_session=True)
    try:
        wait_for(lambda: lines(metrics) >= 2, 180, launcher)
        trainers[:] = children(launcher.pid)
        assert len(trainers) == 2
        if to_group:
            os.killpg(launcher.pid, sig)
        else:
            launcher.send_signal(sig)
        out, err = launcher.communicate(timeout=120)
        orphans = [pid for pid in trainers if alive(pid)]
    finally:
        if launcher.poll() is None:
            launcher.kill()
        reap_orphans(trainers)
    assert launcher.returncode == 0, err[-3000:]
    assert "Traceback" not in err and f"forwarding {sig.name}" in err, err[-3000:]
    assert err.count("stopped by") == 1 and "interrupted" not in err, err[-3000:]
    step = Checkpointer(str(d)).latest_step()
    assert step == lines(metrics) and f"after step {step}; checkpoint saved" in err
    assert not orphans, "orphaned trainers"


@pytest.mark.slow
def test_launcher_reports_whichever_trainer_fails_first_and_stops_the_rest(tmp_path):
    metrics = tmp_path / "m.jsonl"
    trainers = []
    launcher = start_launcher(tmp_path, ["--metrics-out", str(metrics)])
    try:
        wait_for(lambda: lines(metrics) >= 2, 180, launcher)
        trainers[:] = children(launcher.pid)
        os.kill(trainers[1], signal.SIGKILL)
        out, err = launcher.communicate(timeout=120)
        orphans = [pid for pid in trainers if alive(pid)]
    finally:
        if launcher.poll() is None:
            launcher.kill()
        reap_orphans(trainers)
    assert launcher.returncode == 128 + signal.SIGKILL, err[-3000:]
    # Process 1 is named whichever way the race goes: the launcher stops process 0, or process 0
    # has already ended by itself on the dead peer (then there is nothing left to stop).
    assert "pstar-launch: process 1 was killed by SIGKILL" in err, err[-3000:]
    assert "pstar-launch: process 0" not in err, err[-3000:]
    assert not orphans, "orphaned trainers"


@pytest.mark.slow
def test_dead_peer_is_one_line_without_a_native_stack(tmp_path):
    """kill -9 one process: the other ends with exit 3 and one line within the step timeout, set
    below the heartbeat timeout as the README says (a collective over the dead peer fails at once,
    or the watchdog ends a survivor that waits elsewhere; jax's heartbeat would abort natively)."""
    port = free_port()
    metrics = tmp_path / "m.jsonl"
    logs = [open(tmp_path / f"p{i}.log", "w") for i in range(2)]
    procs = [spawn(i, port, ["--steps", "100000", "--metrics-out", str(metrics), "--step-timeout", "6",
                             "--heartbeat-timeout", "30"], logs[i]) for i in range(2)]
    try:
        wait_for(lambda: lines(metrics) >= 2, 180, procs[0], logs_of(tmp_path))
        procs[1].send_signal(signal.SIGKILL)
        killed = time.monotonic()
        code = procs[0].wait(timeout=60)
        waited = time.monotonic() - killed
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        for log in logs:
            log.close()
    log = (tmp_path / "p0.log").read_text()
    python_lines = "\n".join(line for line in log.splitlines() if not line.lstrip().startswith("@"))
    assert code == 3 and waited < 12, (code, waited, python_lines[-4000:])  # native stack frames left out
    assert "Check failure stack trace" not in log and "Traceback" not in log, log[-3000:]
    one_line(log.strip().splitlines()[-1], "another process probably died")
