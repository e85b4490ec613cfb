"""pstar-launch: start N pstar-train processes on this machine, joined by jax.distributed.

    pstar-launch -n 2 --local-devices 2 -- --steps 20 --metrics-out m.jsonl

Each process gets PSTAR_COORDINATOR / PSTAR_NUM_PROCESSES / PSTAR_PROCESS_ID and, on a CPU,
``--local-devices`` fake devices, so 2 processes x 2 devices train with W=4. Process 0's output
is shown; the others' goes to ``--log-dir`` (``runs/launch`` by default, never the bare current
directory), one ``pstar_process_N.log`` each.

The launcher watches every trainer: the first one to fail is named, the others are stopped, and
the launcher exits with its code. SIGINT (Ctrl-C) or SIGTERM to the launcher is forwarded once to
every trainer, which agree on a step, save and exit; the launcher waits for them. Trainers run in
their own session, so a terminal's Ctrl-C reaches them only through the launcher (one signal, not
two), and on Linux they get SIGTERM if the launcher dies, so none is left orphaned.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Sequence

from pstar_jax.cli import flags as cli
from pstar_jax.config import ConfigError

PR_SET_PDEATHSIG = 1
GRACE_S = 60  # how long stopped trainers get to save before they are killed
LOG_DIR = os.path.join("runs", "launch")  # the others' logs, under the repository's ignored runs/


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:  # runs in the child between fork and exec
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        except (OSError, AttributeError):
            pass


def describe(code: int) -> str:
    return f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"


def exit_status(code: int) -> int:
    return 128 - code if code < 0 else code


class Trainers:
    """The trainer processes and what became of them, in the order they ended.

    A thread per trainer waits for it, so the first to fail is known even when a peer's death
    makes the others fail within milliseconds (the launcher must name the cause, not the echo)."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []
        self.ended: list[tuple[int, int]] = []  # (process index, return code), first ended first
        self._lock = threading.Lock()

    def start(self, proc: subprocess.Popen) -> None:
        i = len(self.procs)
        self.procs.append(proc)
        threading.Thread(target=self._wait_for, args=(i, proc), daemon=True).start()

    def _wait_for(self, i: int, proc: subprocess.Popen) -> None:
        code = proc.wait()
        with self._lock:
            self.ended.append((i, code))

    @property
    def failed(self) -> tuple[int, int] | None:
        """(process index, return code) of the first trainer that failed."""
        with self._lock:
            return next(((i, code) for i, code in self.ended if code != 0), None)

    def running(self) -> bool:
        with self._lock:
            return len(self.ended) < len(self.procs)

    def _alive(self) -> list[subprocess.Popen]:
        with self._lock:
            done = {i for i, _ in self.ended}
        return [proc for i, proc in enumerate(self.procs) if i not in done]

    def send(self, signum: int) -> None:
        for proc in self._alive():
            try:
                os.kill(proc.pid, signum)  # not send_signal: its poll() would race the waiting thread
            except ProcessLookupError:
                pass

    def wait(self, timeout_s: float) -> None:
        """Wait for all; kill those still running after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while self.running() and time.monotonic() < deadline:
            time.sleep(0.05)
        for proc in self._alive():
            try:
                os.kill(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        while self.running():
            time.sleep(0.05)


def _last_line(log_dir: str, i: int) -> str:
    """', saying: LINE' with the last line process ``i`` (>= 1) wrote to its log, so that its reason
    shows where the launcher stops (process 0 writes to the terminal itself); '' if none."""
    if not i:
        return ""
    try:
        with open(os.path.join(log_dir, f"pstar_process_{i}.log"), "rb") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - 4096))
            lines = [line for line in f.read().decode(errors="replace").splitlines() if line.strip()]
    except OSError:
        return ""
    return f", saying: {lines[-1].strip()[:500]}" if lines else ""


def build_parser() -> argparse.ArgumentParser:
    p = cli.Parser(prog="pstar-launch", description=__doc__.splitlines()[0].split(": ", 1)[1])
    p.add_argument("-n", "--num-processes", type=int, default=2, help="pstar-train processes to start (default: 2)")
    p.add_argument("--local-devices", type=int, default=None, help="fake CPU devices per process")
    p.add_argument("--log-dir", default=LOG_DIR, help="where processes 1.. write their output, one "
                   f"pstar_process_N.log each (default: {LOG_DIR})")
    p.add_argument("--timeout", type=float, default=None, help="stop everything after this many seconds")
    p.add_argument("train_args", nargs=argparse.REMAINDER, help="-- then pstar-train's flags")
    return p


def run(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.num_processes < 1:
        raise ConfigError(f"--num-processes must be at least 1, got {args.num_processes}")
    train_args = [a for a in args.train_args if a != "--"]
    port = free_port()
    log_dir = args.log_dir
    if args.num_processes > 1:  # processes 1.. write their logs there before any trainer starts
        try:
            os.makedirs(log_dir, exist_ok=True)
            probe = os.path.join(log_dir, "pstar_process_1.log")
            open(probe, "a").close()
        except OSError as err:
            raise ConfigError(f"--log-dir {log_dir}: cannot write the processes' logs there "
                              f"({err.strerror or err}); give a writable directory") from None
    signalled: list[int] = []

    def forward(signum, frame) -> None:  # no KeyboardInterrupt: the trainers save, the launcher waits
        signalled.append(signum)
        if len(signalled) == 1:
            print(f"pstar-launch: forwarding {signal.Signals(signum).name} to the trainers; waiting for their "
                  "checkpoints", file=sys.stderr, flush=True)
        trainers.send(signum)

    trainers = Trainers()
    old = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    logs = []
    try:
        for i in range(args.num_processes):
            env = dict(os.environ, PSTAR_COORDINATOR=f"127.0.0.1:{port}", PSTAR_NUM_PROCESSES=str(args.num_processes),
                       PSTAR_PROCESS_ID=str(i), PYTHONUNBUFFERED="1")
            cmd = [sys.executable, "-m", "pstar_jax.cli.train", *train_args]
            if args.local_devices:
                cmd += ["--local-devices", str(args.local_devices)]
            out = None
            if i:
                out = open(os.path.join(log_dir, f"pstar_process_{i}.log"), "w")
                logs.append(out)
            trainers.start(subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT if out else None,
                                                   start_new_session=True, preexec_fn=_die_with_parent))
            if signalled:  # a signal during the start-up reaches the trainers started after it too
                trainers.send(signalled[-1])
        start = time.monotonic()
        while trainers.running():
            if trainers.failed:
                i, code = trainers.failed
                print(f"pstar-launch: process {i} {describe(code)}{_last_line(log_dir, i)}; stopping the others",
                      file=sys.stderr, flush=True)
                trainers.send(signal.SIGTERM)
                trainers.wait(GRACE_S)
                return exit_status(code)
            if args.timeout and time.monotonic() - start > args.timeout and not signalled:
                print(f"pstar-launch: stopped after {args.timeout:.0f} s", file=sys.stderr, flush=True)
                trainers.send(signal.SIGTERM)
                trainers.wait(GRACE_S)
                return 124
            time.sleep(0.05)
        if trainers.failed:
            i, code = trainers.failed
            print(f"pstar-launch: process {i} {describe(code)}", file=sys.stderr, flush=True)
            return exit_status(code)
        return 0
    finally:
        trainers.send(signal.SIGTERM)  # only reached with trainers alive on an unexpected error
        trainers.wait(GRACE_S)
        for log in logs:
            log.close()
        for sig, handler in old.items():
            signal.signal(sig, handler)


def main(argv: Sequence[str] | None = None) -> int:
    return cli.run_main("pstar-launch", run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
