"""Held-out loss: forward-only plans and passes, the held-out split, --eval-every in runs and metrics."""

import dataclasses
import json

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

import pstar_jax as ps
from pstar_models.gpt import StagedGPT, preset
from pstar_jax.config import ConfigError, EngineConfig, OptimConfig
from pstar_jax.data.token_files import write_tokens
from pstar_jax.data.stream import Batches, eval_batches, held_out_split
from pstar_jax.planner.build import chunked_engine
from pstar_jax.plan.machine import H200
from pstar_jax.engine.memory import Space
from pstar_jax.engine.optim import default_tx
from pstar_jax.engine.plain import PlainEngine
from pstar_jax.plan.forward import plan_forward
from pstar_jax.plan.placement import plan_step
from pstar_jax.planner.build import plan_model
from pstar_jax.plan.schedule import forward_accesses, step_accesses
from pstar_jax.cli.train import main
from tests.step_shapes import gpt_like_shape

OPTIM = OptimConfig(lr=3e-3, warmup_steps=1, total_steps=10, clip_norm=1.0)
CHUNK = 16384
SEQ = 32
BATCH = 2  # rows per device of a micro-batch


def mesh(n=1):
    return Mesh(np.array(jax.devices()[:n]), ("data",))


def small_model():
    """Wide enough that its chunks outweigh the forward's working memory (so an eval must move them)."""
    return StagedGPT(dataclasses.replace(preset("tiny"), d_model=64, n_layer=2, n_head=2, seq_len=SEQ))


def batch(rng, rows):
    tok = rng.integers(0, 256, (rows, SEQ + 1))
    return tok[:, :-1], tok[:, 1:]


def tight_budget(m, W):
    """The least device memory each moment of the step needs with Adam on the host (read from the
    trace), one item over: training fits, and the eval cannot keep every chunk on the device."""
    cfg = EngineConfig(chunk_numel=CHUNK, precision="fp32")
    shape = plan_model(m, cfg, mesh(W), (BATCH * W, SEQ), H200, 10**12, default_tx(OPTIM)).shape
    need = max(a.non_model_bytes + sum(map(shape.item_size, a.needs))
               for a in step_accesses(shape, [False] * shape.n_chunks))
    return need + max(shape.chunk_bytes)


def engines(W=1, budget="tight"):
    m = small_model()
    memory = tight_budget(m, W) if budget == "tight" else budget
    cfg = EngineConfig(chunk_numel=CHUNK, device_memory=memory, precision="fp32")
    chunked = chunked_engine(m, cfg, default_tx(OPTIM), mesh(W), (BATCH * W, SEQ), H200, clip_norm=OPTIM.clip_norm)
    plain = PlainEngine(m, "fp32", default_tx(OPTIM), 1, clip_norm=OPTIM.clip_norm, mesh=mesh(W))
    return chunked, plain


def slots_on_device(engine):
    return {key: engine.store.spaces(key) for key in engine.store.device_resident(("slot",))}


def assert_slots_at_step_start(engine):
    """Every slot where the training plan starts a step: resident ones on the device, dirty ones
    without a host copy, clean ones with one, the rest on the host only."""
    start = dict(engine.plan.initial_device)
    assert set(engine.store.device_resident(("slot",))) == set(start)
    for c in range(engine.layout.n_chunks):
        key = ("slot", c)
        spaces = set(engine.store.spaces(key))
        if key not in start:
            assert spaces == {Space.HOST}
        else:
            assert spaces == ({Space.DEVICE} if start[key] else {Space.DEVICE, Space.HOST})


@pytest.mark.slow
@pytest.mark.parametrize("W", [1, 2])
def test_chunked_eval_equals_plain_moves_the_plans_bytes_within_budget(W):
    """fp32: the chunked held-out loss equals the plain one (rtol 1e-5) before and after training,
    with chunks moving; the pass moves exactly the forward-only plan's bytes, never holds more than
    it plans, and leaves the slots where the next step starts."""
    chunked, plain = engines(W)
    rng = np.random.default_rng(0)
    held_out = [batch(rng, BATCH * W) for _ in range(3)]
    for _ in range(2):
        a, b = chunked.evaluate(held_out), plain.evaluate(held_out)
        np.testing.assert_allclose(a, b, rtol=1e-5)
        plan = chunked.eval_plan_for((BATCH * W, SEQ), 3)
        traffic = chunked.store.traffic
        assert traffic.h2d_bytes > 0, "a budget below the model must move chunks during the eval"
        assert (traffic.h2d_bytes, traffic.d2h_bytes) == (plan.h2d_bytes, plan.d2h_bytes)
        opt_device = plan.device_state_bytes
        assert chunked.store.peak_device_bytes <= max(m.capacity_bytes for m in plan.moments) + opt_device
        assert plan.peak_device_bytes <= chunked.device_budget_bytes
        assert_slots_at_step_start(chunked)
        step = [batch(rng, BATCH * W)]
        np.testing.assert_allclose(chunked.step(step).loss, plain.step(step).loss, rtol=1e-5)
    assert not any(m.phase in ("head", "bwd", "adam") for m in plan.moments)
    assert not any(item[0] == "slot" for m in plan.moments for item in m.evict + m.fetch)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["chunked", "plain"])
def test_eval_changes_nothing(kind):
    """Evaluating between steps (with an update pending) leaves the next steps' losses and the
    final params exactly as a run without evaluation."""
    rng = np.random.default_rng(1)
    steps = [[batch(rng, BATCH)] for _ in range(3)]
    held_out = [batch(rng, BATCH) for _ in range(2)]
    runs = []
    for evaluate in (False, True):
        engine = engines()[0 if kind == "chunked" else 1]
        losses = []
        for i, step in enumerate(steps):
            losses.append(engine.step(step).loss)
            if evaluate and i < 2:
                engine.evaluate(held_out)
        runs.append((losses, engine.params()))
    (la, pa), (lb, pb) = runs
    assert la == lb
    assert pa.keys() == pb.keys() and all(np.array_equal(pa[n], pb[n]) for n in pa)


def test_forward_plan_of_a_planner_shape_returns_to_the_step_start():
    """On a synthetic step: the forward-only plan fits each moment's capacity, names params only,
    and its last moment puts the device back as the training plan starts a step."""
    BUDGET = 900  # noqa: N806 - bytes: a block's backward (6 items of 100 beside 300) just fits
    shape = gpt_like_shape(n_blocks=6, chunks_per_block=2)
    n = shape.n_chunks
    training = plan_step(shape, BUDGET, 10**9, H200, [False] * n)
    assert training.fits and len(training.initial_device) < n
    forward = dataclasses.replace(shape, fwd_non_model=(150,) * len(shape.fwd_non_model), head_non_model=200,
                                  micro_batches=2)
    plan = plan_forward(forward, training, 10**9, H200)
    assert plan.fits and plan.h2d_bytes > 0
    accesses = forward_accesses(forward, [("param", c) for (_, c), _ in training.initial_device])
    assert [(m.phase, m.index, m.micro) for m in plan.moments] == [(a.phase, a.index, a.micro) for a in accesses]
    device = {("param", c) for (_, c), _ in training.initial_device}
    for m, a in zip(plan.moments, accesses):
        device = (device - set(m.evict)) | set(m.fetch)
        assert set(a.needs) <= device
        assert sum(map(shape.item_size, device)) <= m.capacity_bytes == BUDGET - a.non_model_bytes
    assert device == {("param", c) for (_, c), _ in training.initial_device}


def test_held_out_split_is_never_trained_on():
    """The training stream reads no token of the last 1%; the eval set reads only those."""
    tokens = np.random.default_rng(2).integers(0, 255, 20_000).astype(np.uint16)
    train, held = held_out_split(tokens)
    assert len(held) == 200 and len(train) + len(held) == len(tokens)
    assert np.shares_memory(train, tokens) and np.shares_memory(held, tokens)
    marked = tokens.copy()
    marked[len(train):] = 255  # a token training must never see
    batches = Batches(marked[:len(train)], 16, 64, seed=0)
    for _ in range(3 * batches.windows_per_epoch // 16):  # three epochs
        b = next(batches)
        assert b.tokens.max() < 255 and b.targets.max() < 255
    for b in eval_batches(marked[len(train):], 4, 64, 3):
        assert (b.tokens == 255).all() and (b.targets == 255).all()


@pytest.mark.slow
def test_run_holds_out_only_when_evaluating():
    """Without eval the stream is the one of today (every token); with it the last 1% is held out,
    and the engine planned the evaluation before training."""
    tokens = np.random.default_rng(3).integers(0, 255, 30_000).astype(np.uint16)
    base = ps.RunConfig(train=ps.TrainConfig(steps=2, batch_size=4), distributed=ps.DistributedConfig(data_parallel=1),
                        output=ps.OutputConfig(quiet=True))
    with ps.Run(base, tokens=tokens) as run:
        assert run.tokens is tokens and run.eval_set == []
    evaluating = dataclasses.replace(base, train=ps.TrainConfig(steps=2, batch_size=4, eval_every=1, eval_batches=2))
    with ps.Run(evaluating, tokens=tokens) as run:
        assert len(run.tokens) == 29_700 and np.array_equal(run.eval_tokens, tokens[29_700:])
        assert len(run.eval_set) == 2 and run.eval_set[0][0].shape == (4, run.model.seq_len)
        records = list(run.fit())
        assert all("eval_loss" in r for r in records)
        assert records[-1]["eval_loss"] == run.evaluate()


def test_eval_loss_lines_in_metrics_at_the_right_steps(tmp_path, capsys):
    """--eval-every 2 over 5 steps: eval_loss at steps 1 and 3, and at the end (4); the done line shows it."""
    data, out = tmp_path / "train.u16.bin", tmp_path / "m.jsonl"
    write_tokens(data, np.random.default_rng(4).integers(0, 256, 40_000), 256)
    assert main(["--data", str(data), "--steps", "5", "--batch-size", "8", "--eval-every", "2", "--eval-batches", "2",
                 "--quiet", "--metrics-out", str(out)]) == 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(5))
    assert [r["step"] for r in records if "eval_loss" in r] == [1, 3, 4]
    assert all(np.isfinite(r["eval_loss"]) and r["eval_s"] > 0 for r in records if "eval_loss" in r)
    done = capsys.readouterr().out.strip().splitlines()[-1]
    assert done.startswith("done:") and f"eval loss {records[-1]['eval_loss']:.4f}" in done


def test_eval_data_file_is_used_and_nothing_is_held_out(tmp_path):
    """--eval-data FILE: the held-out loss is the loss on that file; training keeps every token."""
    data, held = tmp_path / "train.u16.bin", tmp_path / "eval.u16.bin"
    rng = np.random.default_rng(5)
    train_tokens = rng.integers(0, 256, 20_000).astype(np.uint16)
    eval_tokens = np.tile(np.arange(64, dtype=np.uint16), 40)  # a different distribution
    write_tokens(data, train_tokens, 256)
    write_tokens(held, eval_tokens, 256)
    config = ps.RunConfig(train=ps.TrainConfig(steps=1, batch_size=4, eval_every=1, eval_batches=2),
                          data=ps.DataConfig(path=str(data), eval_path=str(held)),
                          engine=ps.EngineConfig(kind="plain"), distributed=ps.DistributedConfig(data_parallel=1),
                          output=ps.OutputConfig(quiet=True))
    with ps.Run(config) as run:
        assert len(run.tokens) == len(train_tokens)
        assert np.array_equal(run.eval_tokens, eval_tokens)
        (record,) = run.fit()
        expected = run.engine.evaluate(eval_batches(eval_tokens, 4, run.model.seq_len, 2))
        assert record["eval_loss"] == expected


@pytest.mark.parametrize("argv, words", [
    (["--eval-every", "-1"], "--eval-every must be a whole number of at least 0"),
    (["--eval-every", "2", "--eval-batches", "0"], "--eval-batches must be a whole number of at least 1"),
    (["--eval-data", "EVAL"], "--eval-data is set but --eval-every is 0"),
    (["--eval-every", "2", "--eval-data", "/nonexistent/eval.u16.bin"], "--eval-data /nonexistent/eval.u16.bin does not exist"),
    (["--eval-every", "2", "--eval-data", "SHORT"], "--eval-data holds 40 tokens, fewer than one window"),
    (["--eval-every", "2", "--eval-data", "WIDE"], "--eval-data: data holds token id 300"),
    (["--eval-every", "2", "--data", "SMALL"], "held-out last 1% of the training tokens (--eval-every without "
                                              "--eval-data) holds 30 tokens"),
])
def test_bad_eval_input_is_one_line_exit_2(tmp_path, capsys, argv, words):
    files = {"EVAL": ("eval.u16.bin", 1000, 256), "SHORT": ("short.u16.bin", 40, 256),
             "WIDE": ("wide.u16.bin", 1000, 301), "SMALL": ("small.u16.bin", 3000, 256)}
    argv = list(argv)
    for i, arg in enumerate(argv):
        if arg in files:
            name, n, vocab = files[arg]
            tokens = np.arange(n) % vocab
            write_tokens(tmp_path / name, tokens, 65536 if vocab > 256 else 256)
            argv[i] = str(tmp_path / name)
    out = tmp_path / "m.jsonl"
    assert main([*argv, "--steps", "1", "--quiet", "--metrics-out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("pstar-train: error:") and "\n" not in err and words in err, err
    assert not out.exists()


def test_config_errors_name_the_field():
    with pytest.raises(ConfigError, match="TrainConfig.eval_every"):
        ps.TrainConfig(eval_every=True)
    with pytest.raises(ConfigError, match="TrainConfig.eval_batches"):
        ps.TrainConfig(eval_batches=0)


def test_turning_the_held_out_split_on_changes_the_math_of_a_resume():
    from pstar_jax.config import math_differences
    off, on = ps.RunConfig(), ps.RunConfig(train=ps.TrainConfig(eval_every=10))
    assert any("held out" in d for d in math_differences(off, on))
    assert math_differences(on, dataclasses.replace(on, train=ps.TrainConfig(eval_every=20))) == []
    with_file = ps.RunConfig(train=ps.TrainConfig(eval_every=10), data=ps.DataConfig(eval_path="e.u16.bin"))
    assert math_differences(off, with_file) == []
