"""The plan as data, and how it is made: the step as moments and accesses (``schedule``), which
item leaves the device (``eviction``), the replay of a step over its items (``replay``), where every
chunk is at every moment (``placement``), the predicted step time (``predict``) and the machine rates
it uses (``machine``).

Pure Python over numbers: nothing here holds an array or compiles a function, so the executor (in
``pstar_jax.engine``) carries a plan out and the planner (``pstar_jax.planner``) makes one."""


def __getattr__(name: str) -> object:  # the names of the module this package replaced (pstar_jax._moved)
    from pstar_jax._moved import package_attr
    return package_attr(__name__, name)
