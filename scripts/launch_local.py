"""Start N pstar-train processes on this machine, joined by jax.distributed, to try multi-host.

    python scripts/launch_local.py -n 2 --local-devices 2 -- --steps 20 --metrics-out m.jsonl

Each process gets PSTAR_COORDINATOR / PSTAR_NUM_PROCESSES / PSTAR_PROCESS_ID and, on a CPU,
``--local-devices`` fake devices, so 2 processes x 2 devices train with W=4. Process 0's output
is shown; the others' goes to files beside it. If any process fails, the rest are stopped and
the launcher exits with that process's code, naming it.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("-n", "--num-processes", type=int, default=2)
    p.add_argument("--local-devices", type=int, default=None, help="fake CPU devices per process")
    p.add_argument("--log-dir", default=None, help="where processes 1.. write their output")
    p.add_argument("--timeout", type=float, default=None, help="stop everything after this many seconds")
    p.add_argument("train_args", nargs=argparse.REMAINDER, help="-- then pstar-train's flags")
    args = p.parse_args(argv)
    train_args = [a for a in args.train_args if a != "--"]
    port = free_port()
    log_dir = args.log_dir or os.getcwd()
    procs, logs = [], []
    for i in range(args.num_processes):
        env = dict(os.environ, PSTAR_COORDINATOR=f"127.0.0.1:{port}", PSTAR_NUM_PROCESSES=str(args.num_processes),
                   PSTAR_PROCESS_ID=str(i), PYTHONUNBUFFERED="1")
        cmd = [sys.executable, "-m", "pstar_jax.train", *train_args]
        if args.local_devices:
            cmd += ["--local-devices", str(args.local_devices)]
        out = None
        if i:
            out = open(os.path.join(log_dir, f"pstar_process_{i}.log"), "w")
            logs.append(out)
        procs.append(subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT if out else None))
    start = time.monotonic()
    code = 0
    try:
        while any(proc.poll() is None for proc in procs):
            failed = [(i, proc.returncode) for i, proc in enumerate(procs) if proc.returncode not in (None, 0)]
            if failed:
                i, code = failed[0]
                print(f"launch_local: process {i} exited with code {code}; stopping the others", file=sys.stderr)
                break
            if args.timeout and time.monotonic() - start > args.timeout:
                print(f"launch_local: stopped after {args.timeout:.0f} s", file=sys.stderr)
                code = 124
                break
            time.sleep(0.2)
        else:  # all ended by themselves
            failed = [(i, proc.returncode) for i, proc in enumerate(procs) if proc.returncode]
            if failed:
                i, code = failed[0]
                print(f"launch_local: process {i} exited with code {code}", file=sys.stderr)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
        for log in logs:
            log.close()
    return code


if __name__ == "__main__":
    raise SystemExit(main())
