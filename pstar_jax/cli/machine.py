"""pstar-machine: measure this machine's rates once and keep them where the planner looks.

    pstar-machine                 # measured only if no rates are kept yet; prints the file and the rates
    pstar-machine --remeasure     # measure again (after a driver, jax or hardware change)

The rates (copies each way, matmul FLOP/s, a chunk's optimizer update on the device and on the
host over every core) go into a JSON file under $PSTAR_MACHINES_DIR or ~/.cache/pstar_jax/machines,
named by platform, device kind, jax version, core count and compute dtype (pstar_jax/planner/measure.py).
pstar-train and pstar-plan plan with these rates unless ``--machine NAME_OR_FILE`` picks others.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    """Measure this machine (its first device) and save the rates where pstar-train looks for them."""
    p = argparse.ArgumentParser(prog="pstar-machine", description=main.__doc__)
    p.add_argument("--precision", choices=("bf16", "fp32"), default="bf16",
                   help="the compute dtype whose matmul and update rates to measure (default bf16)")
    p.add_argument("--remeasure", action="store_true", help="measure again even if rates are kept")
    args = p.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh

    from pstar_jax.config import OptimConfig
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
    print(machines_dir() / f"{machine_key(optimizer.param_dtype)}.json")
    print(json.dumps(dataclasses.asdict(machine), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
