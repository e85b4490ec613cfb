"""The numba kernels of the fused host AdamW (pstar_jax.engine.host_adam) and the triad it is measured by.

Each runs over whole arrays it is given (slices of host chunks) and releases the GIL, so a thread
pool runs several at once.
"""

import numba
import numpy as np
from llvmlite import ir
from numba import types as nb_types
from numba.extending import intrinsic


@intrinsic
def f32_bits(typingctx, x):
    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], ir.IntType(32))
    return nb_types.uint32(nb_types.float32), codegen


@intrinsic
def fma(typingctx, a, b, c):
    def codegen(context, builder, sig, args):
        return builder.fma(*args)
    return nb_types.float32(nb_types.float32, nb_types.float32, nb_types.float32), codegen


@intrinsic
def bits_f32(typingctx, x):
    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], ir.FloatType())
    return nb_types.float32(nb_types.uint32), codegen


# error_model numpy: no division checks, so the loop vectorises. No fast math: the kernel
# rounds exactly where it says (its FMAs are explicit).
_JIT = dict(nogil=True, error_model="numpy", cache=True)


@numba.njit(inline="always", **_JIT)
def to_bf16(p):
    """Round to nearest even, as XLA's convert; a NaN stays a (quiet) NaN."""
    b = f32_bits(p)
    rounded = (b + np.uint32(0x7FFF) + ((b >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
    nan = (b & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    return np.uint16(((b >> np.uint32(16)) | np.uint32(0x40)) if nan else rounded)


@numba.njit(inline="always", **_JIT)
def adamw_one(g, p, m, v, scale, b1, b2, omb1, omb2, rbc1, rbc2, eps, eps_root, wd, step, bf16):
    """optax.adamw on one element (omb1 = 1 - b1; rbc1, rbc2 the reciprocal bias corrections;
    step = -lr), rounded as XLA's CPU compiler rounds optax's expressions: a division by a
    bias correction is a multiplication by its reciprocal, and multiply-adds are FMAs. Which
    product of ``(1 - b1) * g + b1 * m`` LLVM fuses there depends on the grad's dtype."""
    g = g * scale
    m = fma(b1, m, omb1 * g) if bf16 else fma(omb1, g, b1 * m)
    v = fma(b2, v, omb2 * (g * g))
    u = (m * rbc1) / (np.sqrt(fma(v, rbc2, eps_root)) + eps)
    u = fma(wd, p, u)
    return fma(step, u, p), m, v

# The scalars travel as arguments, not in an array: LLVM can then keep them in registers
# (it cannot prove an array of them is not written through the other arrays).


@numba.njit(**_JIT)
def adamw_bf16(grad_params, master, mu, nu, scale, b1, b2, omb1, omb2, rbc1, rbc2, eps, eps_root, wd, step):
    """grad_params: bf16 bits of the grad in, of the new params out."""
    for i in range(master.shape[0]):
        g = bits_f32(np.uint32(grad_params[i]) << np.uint32(16))
        p, mu[i], nu[i] = adamw_one(g, master[i], mu[i], nu[i], scale, b1, b2, omb1, omb2, rbc1, rbc2,
                                     eps, eps_root, wd, step, True)
        master[i] = p
        grad_params[i] = to_bf16(p)


@numba.njit(**_JIT)
def adamw_f32(grad_params, master, mu, nu, scale, b1, b2, omb1, omb2, rbc1, rbc2, eps, eps_root, wd, step):
    for i in range(master.shape[0]):
        p, mu[i], nu[i] = adamw_one(grad_params[i], master[i], mu[i], nu[i], scale, b1, b2, omb1, omb2,
                                     rbc1, rbc2, eps, eps_root, wd, step, False)
        master[i] = p
        grad_params[i] = p


@numba.njit(**_JIT)
def triad(a, b, c, s):
    """STREAM's triad, a = b + s * c: the memory bandwidth the update can hope for."""
    for i in range(a.shape[0]):
        a[i] = b[i] + s * c[i]


@numba.njit(**_JIT)
def triad_in_place(a, b, s):
    """a = a + s * b: the triad with the update's access pattern (every array written is read
    first, so no write-allocate traffic beyond the bytes counted)."""
    for i in range(a.shape[0]):
        a[i] = a[i] + s * b[i]
