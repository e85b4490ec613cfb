"""Test setup: 8 fake CPU devices (set before JAX starts) and a shared compilation cache."""

import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
from pstar_jax.compat import patient_cpu_collectives  # noqa: E402

patient_cpu_collectives()  # 8 device threads on 2 loaded cores reach an all-reduce a minute apart
# Measured machine rates go to a folder of the test session, not the user's cache.
os.environ["PSTAR_MACHINES_DIR"] = tempfile.mkdtemp(prefix="pstar_machines_")

import jax  # noqa: E402

# Many tests compile the same tiny stage functions; a persistent cache makes repeats cheap.
jax.config.update("jax_compilation_cache_dir", os.path.join(tempfile.gettempdir(), "pstar_jax_test_xla_cache"))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
# Implicit rank promotion hides shape bugs (a [B] + [B, 1] that should have been an error).
jax.config.update("jax_numpy_rank_promotion", "raise")
