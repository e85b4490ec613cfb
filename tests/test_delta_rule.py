"""The chunked gated delta rule (models/delta_rule.py) equals transformers' torch implementation in
fp32 (Qwen3-Next's on 4.57, Qwen3.5's on 5.x), outputs, final state and gradients; packed rows give
each example its own outputs; the recurrent step (decoding) equals the chunked form."""

import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pstar_models.delta_rule import chunk_gated_delta_rule, recurrent_gated_delta_rule

REFERENCES = ["transformers.models.qwen3_next.modeling_qwen3_next", "transformers.models.qwen3_5.modeling_qwen3_5"]
B, HK, H, K, V = 2, 2, 4, 16, 12  # grouped: each key head serves two value heads


def inputs(L: int, seed: int = 0, decay: float = 0.3) -> dict:
    rng = np.random.default_rng(seed)
    f = lambda *shape: rng.normal(size=shape).astype(np.float32)  # noqa: E731
    return dict(q=f(B, L, HK, K), k=f(B, L, HK, K), v=f(B, L, H, V), g=-np.abs(f(B, L, H)) * np.float32(decay),
                beta=1 / (1 + np.exp(-f(B, L, H))), state=f(B, H, K, V))


def reference(name: str, kind: str = "chunk"):
    module = pytest.importorskip(name, reason=f"{name} is not in this transformers")
    return getattr(module, f"torch_{kind}_gated_delta_rule")


def torch_rule(fn, x: dict, torch):
    """The reference on x (key heads repeated as the modules do before calling it), with grads."""
    t = {n: torch.tensor(a, requires_grad=True) for n, a in x.items()}
    rep = lambda a: a.repeat_interleave(H // HK, dim=2)  # noqa: E731
    out, state = fn(rep(t["q"]), rep(t["k"]), t["v"], t["g"], t["beta"], initial_state=t["state"],
                    output_final_state=True, use_qk_l2norm_in_kernel=True)
    return t, out, state


def assert_close(ours, theirs, what: str):
    ours, theirs = np.asarray(ours), np.asarray(theirs)
    scale = max(float(np.abs(theirs).max()), 1.0)
    assert np.abs(ours - theirs).max() <= 2e-6 * scale, (what, np.abs(ours - theirs).max(), scale)


@pytest.mark.hf_reference
@pytest.mark.parametrize("name", REFERENCES, ids=["qwen3_next", "qwen3_5"])
@pytest.mark.parametrize("L,decay", [(150, 0.3), (64, 0.3), (37, 4.0)], ids=["ragged", "one_chunk", "steep"])
def test_outputs_state_and_grads_equal_transformers(name, L, decay):
    torch = pytest.importorskip("torch")
    x = inputs(L, decay=decay)
    t, out_t, state_t = torch_rule(reference(name), x, torch)
    rng = np.random.default_rng(1)
    w_out, w_state = rng.normal(size=out_t.shape).astype(np.float32), rng.normal(size=state_t.shape).astype(np.float32)
    ((out_t * torch.tensor(w_out)).sum() + (state_t * torch.tensor(w_state)).sum()).backward()

    def loss(x):
        out, state = chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], state_BxHxKxV=x["state"])
        return jnp.sum(out * w_out) + jnp.sum(state * w_state), (out, state)

    grads, (out, state) = jax.grad(loss, has_aux=True)(x)
    assert_close(out, out_t.detach().numpy(), "outputs")
    assert_close(state, state_t.detach().numpy(), "final state")
    for n in x:
        assert_close(grads[n], t[n].grad.numpy(), f"d loss / d {n}")


@pytest.mark.parametrize("decay", [0.3, 8.0], ids=["mild", "steep"])
def test_packed_rows_give_each_example_its_own_outputs(decay):
    """Examples of 50, 14 (ending exactly at a chunk boundary), 70 (crossing two) and 16 tokens, and
    one that starts a chunk: each one's outputs equal it alone from a zero state, and the row's final
    state is the last example's."""
    lengths = [50, 14, 70, 16]
    L = sum(lengths)
    x = inputs(L, seed=3, decay=decay)
    segments = np.repeat(np.arange(1, len(lengths) + 1), lengths)[None].repeat(B, 0)
    out, state = chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], jnp.asarray(segments))
    start = 0
    for n in lengths:
        part = {k: a[:, start:start + n] for k, a in x.items() if k != "state"}
        alone, alone_state = chunk_gated_delta_rule(part["q"], part["k"], part["v"], part["g"], part["beta"])
        assert_close(out[:, start:start + n], alone, f"example at {start}")
        start += n
    assert_close(state, alone_state, "final state")


@pytest.mark.parametrize("decay", [0.3, 8.0], ids=["mild", "steep"])
def test_packed_rows_grads_stay_within_each_example(decay):
    """The gradient of one example's outputs reaches none of the other examples' inputs (and with
    steep decays, whose sums differ by more than exp can hold, none is inf or nan)."""
    x = inputs(100, seed=4, decay=decay)
    segments = jnp.asarray(np.repeat([1, 2], [40, 60])[None].repeat(B, 0))
    grads = jax.grad(lambda x: jnp.sum(chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"],
                                                              segments)[0][:, 40:]))(x)
    for n in ("q", "k", "v", "g", "beta"):
        assert np.all(np.isfinite(np.asarray(grads[n]))), n
        assert np.all(np.asarray(grads[n])[:, :40] == 0), n
        assert np.any(np.asarray(grads[n])[:, 40:] != 0), n


def test_the_recurrent_step_equals_the_chunked_rule():
    """Decoding: a prompt chunked, then tokens one at a time from its state, give the outputs and
    state of the whole sequence chunked."""
    x = inputs(90, seed=5)
    whole, whole_state = chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], state_BxHxKxV=x["state"])
    cut = lambda a, s: a[:, s]  # noqa: E731
    first = {n: cut(a, slice(0, 70)) for n, a in x.items() if n != "state"}
    rest = {n: cut(a, slice(70, None)) for n, a in x.items() if n != "state"}
    out, state = chunk_gated_delta_rule(*first.values(), state_BxHxKxV=x["state"])
    outs = [out]
    for t in range(20):
        o, state = recurrent_gated_delta_rule(*(a[:, t:t + 1] for a in rest.values()), state)
        outs.append(o)
    assert_close(jnp.concatenate(outs, axis=1), whole, "outputs")
    assert_close(state, whole_state, "state")


@pytest.mark.hf_reference
@pytest.mark.parametrize("name", REFERENCES, ids=["qwen3_next", "qwen3_5"])
def test_the_recurrent_step_equals_transformers(name):
    torch = pytest.importorskip("torch")
    fn = reference(name, "recurrent")
    x = inputs(5, seed=6)
    _, out_t, state_t = torch_rule(fn, x, torch)
    out, state = recurrent_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], x["state"])
    assert_close(out, out_t.detach().numpy(), "outputs")
    assert_close(state, state_t.detach().numpy(), "state")


def test_the_unit_lower_solve_and_its_gradients_equal_plain_forward_substitution():
    """unit_lower_solve (a loop with a back-substituting backward) against substitution unrolled in
    Python and differentiated by JAX: X = (I + strictly_lower(a))^-1 rhs and the gradients of a
    weighted sum of X for a and rhs."""
    from pstar_models.delta_rule import unit_lower_solve
    C, W = 8, 5
    rng = np.random.default_rng(0)
    a, rhs, w = (jnp.asarray(rng.normal(size=(3, C, n)).astype(np.float32)) for n in (C, W, W))
    a = a * 0.5

    def unrolled(a, rhs):
        rows = []
        for i in range(C):  # x_i = rhs_i - sum_{j<i} a_ij x_j
            x = rhs[:, i]
            for j in range(i):
                x = x - a[:, i, j, None] * rows[j]
            rows.append(x)
        return jnp.stack(rows, axis=1)
    theirs = unrolled(a, rhs)
    np.testing.assert_allclose(unit_lower_solve(a, rhs), theirs, rtol=0, atol=2e-6 * float(jnp.abs(theirs).max()))
    loss = lambda f: lambda a, rhs: jnp.sum(f(a, rhs) * w)  # noqa: E731
    ours, theirs = (jax.grad(loss(f), argnums=(0, 1))(a, rhs) for f in (unit_lower_solve, unrolled))
    for o, t in zip(ours, theirs):
        np.testing.assert_allclose(o, t, rtol=0, atol=2e-6 * float(jnp.abs(t).max()))
    assert not np.any(np.triu(np.asarray(ours[0])))  # the diagonal and above are not read


def test_the_rule_and_its_gradient_are_plain_xla_ops():
    """No custom call (a LAPACK triangular solve was one: on a CPU it ran scipy's multithreaded
    OpenBLAS from XLA's threads, and a training step hung there, every thread idle)."""
    x = {n: jnp.asarray(a) for n, a in inputs(70).items()}

    def loss(x):
        out, state = chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], state_BxHxKxV=x["state"])
        return jnp.sum(out) + jnp.sum(state)
    text = jax.jit(jax.grad(loss)).lower(x).as_text()
    assert "custom_call" not in text


def test_the_solve_off_the_cpu_is_the_backends_triangular_solve_with_the_same_answer():
    """Off a CPU, _substitute is lax.linalg.triangular_solve (cuBLAS's trsm on a GPU). Its flags,
    checked here on the CPU against the loop the CPU runs, in both directions (unit_lower_solve's
    forward substitutes down, its backward up). In a child process with OPENBLAS_NUM_THREADS=1, where LAPACK's solve
    cannot hang (see delta_rule.unit_lower_solve), under a time limit."""
    code = """
import numpy as np, jax, jax.numpy as jnp
from pstar_models import delta_rule as d
rng = np.random.default_rng(1)
m, rhs = (jnp.asarray(rng.normal(size=(3, 16, n)).astype(np.float32)) for n in (16, 6))
for reverse, part in ((False, jnp.tril(m, -1)), (True, jnp.triu(m, 1))):
    loop, trsm = d._substitute_rows(0.3 * part, rhs, reverse), d._substitute_trsm(0.3 * part, rhs, reverse)
    np.testing.assert_allclose(trsm, loop, rtol=0, atol=4e-6 * float(jnp.abs(loop).max()))
print("same")
"""
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parent.parent, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip() == "same", proc.stderr[-2000:]
