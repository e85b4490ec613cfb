"""pstar-machine: measure this machine's rates once and keep them where the planner looks.

    pstar-machine                 # measured only if no rates are kept yet; prints the file and the rates
    pstar-machine --remeasure     # measure again (after a driver, jax or hardware change)
    pstar-machine --disk DIR      # also read the disk under DIR (a base's safetensors): the disk tier's rates

The rates (copies each way, matmul FLOP/s, a chunk's optimizer update on the device and on the
host over every core) go into a JSON file under $PSTAR_MACHINES_DIR or ~/.cache/pstar_jax/machines,
named by platform, device kind, jax version, core count and compute dtype (pstar_jax/planner/measure.py).
``--disk DIR`` reads the files already in DIR (nothing is written there) for the two rates at which
frozen chunks come back from a local disk: whole chunks from a cache file, and tensors straight from
safetensors files, transposed on the CPU (pstar_jax/io/disk_rates.py); they are kept in the same file
and kept when the other rates are measured again.
pstar-train and pstar-plan plan with these rates unless ``--machine NAME_OR_FILE`` picks others.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from typing import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    """Measure this machine (its first device) and save the rates where pstar-train looks for them."""
    p = argparse.ArgumentParser(prog="pstar-machine", description=main.__doc__)
    p.add_argument("--precision", choices=("bf16", "fp32"), default="bf16",
                   help="the compute dtype whose matmul and update rates to measure (default bf16)")
    p.add_argument("--remeasure", action="store_true", help="measure again even if rates are kept")
    p.add_argument("--disk", metavar="DIR", help="also measure reads from the disk holding DIR (the base's "
                   "safetensors files, or a chunk cache): read only, at most 2 GiB or 10 s per rate")
    args = p.parse_args(argv)
    from pstar_jax.config import ConfigError
    from pstar_jax.io.disk_rates import disk_files, measure_disk
    try:
        files = disk_files(args.disk) if args.disk is not None else []
    except (ConfigError, OSError) as err:
        print(f"pstar-machine: error: {err}", file=sys.stderr)
        return 2

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh

    from pstar_jax.config import OptimConfig
    from pstar_jax.plan.machine import save_machine
    from pstar_jax.planner.measure import machine_key, machines_dir, saved_machine
    from pstar_jax.engine.memory import Placement
    from pstar_jax.engine.optim import ChunkOptimizer, default_tx

    placement = Placement(Mesh(np.array(jax.devices()[:1]), ("data",)))
    optimizer = ChunkOptimizer(default_tx(OptimConfig()), placement,
                               jnp.bfloat16 if args.precision == "bf16" else jnp.float32)
    try:
        machine = saved_machine(placement, optimizer, args.remeasure, must_keep=True)
    except OSError as err:
        print(f"pstar-machine: cannot keep the rates in {machines_dir()} ({err.strerror}); set "
              f"PSTAR_MACHINES_DIR to a writable directory", file=sys.stderr)
        return 2
    path = machines_dir() / f"{machine_key(optimizer.param_dtype)}.json"
    if args.disk is not None:
        try:
            read, tensors = measure_disk(files)
        except OSError as err:
            print(f"pstar-machine: error: cannot read {err.filename or args.disk} ({err.strerror}); pass a directory "
                  f"whose files this user can read", file=sys.stderr)
            return 2
        machine = dataclasses.replace(machine, disk_read_bytes_per_s=read, disk_tensor_bytes_per_s=tensors,
                                      disk_measured_on=os.path.abspath(args.disk))
        try:
            save_machine(machine, path)
        except OSError as err:
            print(f"pstar-machine: cannot keep the rates in {machines_dir()} ({err.strerror}); set "
                  f"PSTAR_MACHINES_DIR to a writable directory", file=sys.stderr)
            return 2
    print(path)
    print(json.dumps(dataclasses.asdict(machine), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
