"""Stages that keep their vjp residuals (issue 31 part 4): the forward returns the residuals and
the backward runs from them, no forward again. Equal to today's recompute within fp32 rounding:
the forward under jax.vjp and the recompute are fused differently by XLA, so the activations
differ in their last bits (2.4e-7 at most in a block's grads on the tiny Llama, see
docs/plans/issue31-chunks-and-disk.md, section 3)."""

import dataclasses
import re

import jax
import numpy as np
import pytest

from pstar_models import build_model
from pstar_models.llama import PRESETS, StagedLlama
from pstar_models.lora import LoraSpec
from pstar_jax.config import EngineConfig, OptimConfig
from pstar_jax.config.lora import LoraConfig
from pstar_jax.model.lora import frozen_for_lora
from pstar_jax.engine.optim import default_tx
from pstar_jax.model.freeze import trainable
from pstar_jax.model.tiling import TileBudget
from pstar_jax.plan.machine import H200
from pstar_jax.planner.build import chunked_engine
from frozen_engines import mesh
from sft_batches import sft_steps

OPTIM = OptimConfig(lr=3e-3, warmup_steps=2, total_steps=10, weight_decay=0.1, clip_norm=1e6)


def spy(fns, name: str, calls: list) -> None:
    """Record the stage index of each call of ``fns.<name>(bound, first)``."""
    real = getattr(fns, name)
    setattr(fns, name, lambda bound, *args: calls.append(bound.index) or real(bound, *args))


def _engine(m, frozen, keep: int, budget=None, W=1):
    """A chunked engine over 3 micro-batches whose chunks move every step (frozen_engines.chunked's
    budget, with room for every stage input and residual kept), the last ``keep`` blocks keeping theirs."""
    cfg = EngineConfig(device_memory=budget, precision="fp32", micro_batches=3, keep_residuals=keep)
    engine = chunked_engine(m, cfg, default_tx(OPTIM), mesh(W), (4, 64), H200, clip_norm=OPTIM.clip_norm,
                            trainable=trainable(frozen))
    if budget is not None:
        return engine
    shape = engine.plan_for((4, 64)).shape
    reads = max(sum(shape.chunk_bytes[c] for c in cs) for cs in shape.stage_chunks)
    room = shape.busiest_working_bytes + 2 * reads + max(shape.chunk_bytes)
    return _engine(m, frozen, keep, room, W)


# 4 x 64 tokens in tiles of 8 positions (8 tiles) for the MLP and attention's scores (not 4 tiles
# of 16: attention's [4, 16] tile positions would look like a LoRA weight to the check below)
TILES = TileBudget(scores_bytes=4 * 4 * 6 * 64 * 8, mlp_bytes=4 * 4 * 96 * 8)


def _model(lora: bool, tiles: bool):
    """The tiny Llama, LoRA r 4 or not, its MLP and attention in 8 tiles or in one."""
    spec = LoraSpec(rank=4, alpha=16.0) if lora else None
    if tiles:
        return StagedLlama(dataclasses.replace(PRESETS["llama-tiny"], lora=spec), TILES)
    return build_model("llama-tiny", lora=spec)


def _engines(lora: bool, keep: int, tiles: bool = False):
    m = _model(lora, tiles)
    frozen = frozen_for_lora(m, LoraConfig(rank=4)) if lora else set()
    return m, frozen, _engine(m, frozen, 0), _engine(m, frozen, keep)


@pytest.mark.parametrize("lora,keep,tiles", [(True, 1, False), (True, 2, False), (True, 2, True), (False, 2, True),
                                             pytest.param(False, 2, False, marks=pytest.mark.slow)])
def test_kept_residuals_train_as_recompute_does(lora, keep, tiles):
    """A tiny Llama, LoRA over a frozen base and full fine-tuning, some stages keeping their
    residuals, three micro-batches, chunks moving every step: losses and weights equal the
    recompute's within fp32 rounding over 3 steps; kept stages ran no recomputing backward and
    kept none of their weights among the residuals. With ``tiles`` the MLP and attention run in
    4 tiles (pstar_jax.model.tiling): a kept block keeps its MLP and projection tiles' residuals
    too, so its backward recomputes only attention's tiles."""
    m, frozen, today, kept = _engines(lora, keep, tiles)
    head = len(kept.bound) - 1
    keep = kept.plan_for((4, 64)).shape.keeping
    assert keep == frozenset(range(head - len(keep), head)) and len(keep) > 0, "the last blocks keep"
    recomputed, from_residuals, recomputed_all = [], [], []
    spy(kept.fns, "backward", recomputed)
    spy(kept.fns, "backward_kept", from_residuals)
    spy(today.fns, "backward", recomputed_all)
    for step in sft_steps(3, micro_batches=3, seed=5):
        a, b = today.step(step), kept.step(step)
        assert a.h2d_bytes > 0 and b.h2d_bytes > 0, "the budgets must make chunks move every step"
        assert (b.h2d_bytes, b.d2h_bytes) == (b.predicted_h2d_bytes, b.predicted_d2h_bytes)
        assert b.device_chunk_peak_bytes <= kept.plan.peak_device_bytes
        np.testing.assert_allclose(b.loss, a.loss, rtol=2e-6)
        np.testing.assert_allclose(b.grad_norm, a.grad_norm, rtol=1e-5)
    shape, shape0 = kept.plan_for((4, 64)).shape, today.plan_for((4, 64)).shape
    for i in range(head):  # the trace: a kept stage's residuals join its input item, its backward runs no forward
        res = shape.residual_bytes[i]
        assert shape.input_bytes[i] == shape0.input_bytes[i] + res and (res > 0) == (i in keep)
        if i in keep:
            # no forward again, and with tiles none of the MLP's or projections' tiles either
            saved = (1.4 if tiles else 0.5) * shape0.fwd_flops[i]
            assert shape.bwd_flops[i] < shape0.bwd_flops[i] - saved
        else:
            assert (shape.bwd_flops[i], shape.fwd_non_model[i]) == (shape0.bwd_flops[i], shape0.fwd_non_model[i])
    for name, value in today.params().items():
        np.testing.assert_allclose(kept.params()[name], value, rtol=1e-5, atol=1e-6, err_msg=name)
        if name in frozen:
            np.testing.assert_array_equal(kept.params()[name], value, err_msg=name)
    assert set(recomputed) & keep == set() and set(from_residuals) == keep & set(recomputed_all)
    weight_shapes = {tuple(shape) for shape in m.param_shapes().values() if len(shape) > 1}
    for _, _, shapes in kept.fns._residuals.values():
        assert not weight_shapes & set(map(tuple, shapes)), "a weight was kept as a residual"


def test_no_kept_stage_is_todays_engine():
    """Off by default: nothing is kept and no keep-mode function is compiled."""
    _, _, today, _ = _engines(True, 0)
    today.step(sft_steps(1, micro_batches=3)[0])
    assert today.plan.peak_device_bytes and today.plan_for((4, 64)).shape.keeping == frozenset()
    assert not today.fns._residuals
    assert not any(str(key[0]).startswith(("fwd_keep", "bwd_kept")) for key in today.fns._cache)


def test_pstar_plan_reports_the_kept_blocks(capsys):
    from pstar_jax.cli.plan import main
    flags = ["--model", "llama-tiny", "--batch-size", "4", "--seq-len", "64", "--no-search"]
    assert main([*flags, "--keep-residuals", "1"]) == 0
    kept = [line for line in capsys.readouterr().out.splitlines() if "residuals" in line]
    assert len(kept) == 1 and re.fullmatch(r"blocks keeping their residuals: 1 of 2, [\d.]+ [KM]iB per micro-batch, "
                                           r"(on the device|with the stage inputs: .*)", kept[0]), kept
    assert main(flags) == 0 and "residuals" not in capsys.readouterr().out


@pytest.mark.parametrize("value,words", [("-1", "'-1' is not a count of blocks"),
                                         ("3", "--keep-residuals 3 is more than the model's 2 blocks")])
def test_bad_kept_blocks_are_one_line(capsys, value, words):
    from pstar_jax.cli.plan import main
    assert main(["--model", "llama-tiny", "--batch-size", "4", "--no-search", "--keep-residuals", value]) == 2
    err = capsys.readouterr().err.strip()
    assert words in err and "\n" not in err, err


def test_kept_residuals_go_to_host_memory_and_back():
    """A budget with room for one kept stage's input and residuals at a time: the plan sends the
    others to pinned host memory after their forward and fetches them back before their backward
    (whole items: input and residuals); the bytes moved are the plan's and the losses equal the
    recompute's within fp32 rounding."""
    m = build_model("llama-tiny", lora=LoraSpec(rank=4, alpha=16.0))
    frozen = frozen_for_lora(m, LoraConfig(rank=4))
    shape = _engine(m, frozen, 2, budget=2**30).plan_for((4, 64)).shape
    reads = max(sum(shape.chunk_bytes[c] for c in cs) for cs in shape.stage_chunks)
    kept = _engine(m, frozen, 2, shape.busiest_non_model_bytes + 2 * reads + max(shape.chunk_bytes)
                   + max(shape.input_bytes))
    today = _engine(m, frozen, 0)
    offloaded = {item for moment in kept.plan.moments for item in moment.evict if item[0] == "act"}
    assert kept.plan.input_offload_bytes > 0 and any(shape.residual_bytes[item[1]] for item in offloaded)
    for step in sft_steps(2, micro_batches=3, seed=7):
        a, b = today.step(step), kept.step(step)
        assert (b.h2d_bytes, b.d2h_bytes) == (b.predicted_h2d_bytes, b.predicted_d2h_bytes)
        assert b.d2h_bytes >= kept.plan.input_offload_bytes
        np.testing.assert_allclose(b.loss, a.loss, rtol=2e-6)


def test_auto_plans_the_fastest_kept_count(capsys):
    """--keep-residuals auto answers as the fastest of the counts it tries (here 0, 1 and 2 blocks)."""
    from pstar_jax.cli.plan import main
    flags = ["--model", "llama-tiny", "--batch-size", "4", "--seq-len", "64", "--no-search"]
    answers = {}
    for value in ("0", "1", "2", "auto"):
        assert main([*flags, "--keep-residuals", value]) == 0
        out = capsys.readouterr().out
        kept = re.search(r"blocks keeping their residuals: (\d) of 2", out)
        answers[value] = (int(kept.group(1)) if kept else 0, re.search(r"predicted: (.*)/step", out).group(1))
    def seconds(text):
        value, unit = text.split()
        return float(value) * {"ns": 1e-9, "µs": 1e-6, "us": 1e-6, "ms": 1e-3, "s": 1.0}[unit]
    assert answers["auto"] == answers[str(answers["auto"][0])], answers  # one of the counts tried, as planned alone
    assert seconds(answers["auto"][1]) == min(seconds(answers[v][1]) for v in ("0", "1", "2")), answers


@pytest.mark.skipif(len(jax.devices()) < 2, reason="needs conftest's fake devices")
@pytest.mark.parametrize("tiles", [False, True])
def test_kept_residuals_over_two_devices(tiles):
    """ZeRO over 2 devices: each keeps its own rows' residuals (flattened, sharded over the data
    axis), with ``tiles`` its tiles' too; losses equal the recompute's within fp32 rounding."""
    m = _model(True, tiles)
    frozen = frozen_for_lora(m, LoraConfig(rank=4))
    today, kept = _engine(m, frozen, 0, W=2), _engine(m, frozen, 2, W=2)
    assert kept.plan_for((4, 64)).shape.keeping
    for step in sft_steps(1, micro_batches=3, seed=9):
        a, b = today.step(step), kept.step(step)
        np.testing.assert_allclose(b.loss, a.loss, rtol=2e-6)


def test_the_plain_engine_refuses_kept_blocks_in_one_line(capsys):
    """The plain engine has no stages to keep (XLA and --remat decide what it keeps): asked to, it
    stops in one line before anything is built, rather than ignore the flag."""
    from pstar_jax.cli.train import main
    assert main(["--model", "llama-tiny", "--steps", "1", "--engine", "plain", "--keep-residuals", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--engine chunked" in err and "\n" not in err, err
