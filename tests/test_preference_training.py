"""Preference tuning in training (pstar_jax.model.preference.PreferenceModel): both engines on
the objective, LoRA's in-step reference against peft + TRL under torch AdamW (and what it costs the
plan), pstar-train and pstar-plan --objective dpo, scripts/bench_dpo.py. torch/transformers/peft/trl
are references only (test extra)."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pstar_jax.config.preference import PreferenceConfig
from pstar_jax.model.preference import compose_logps, compose_preference, step_metrics
from pstar_models import build_from_hf
from test_hf_models import CHECKPOINTS, hf_reference, to_pstar
from test_preference_loss import SEQ_LEN, assert_metrics_match, pack, pack_rows, random_pairs, require_trl, trl_trainer


# -- in the engines ------------------------------------------------------------------------------

def engine_steps(model, ref_params, n_steps, seed=0):
    """Steps of two micro-batches of two preference rows each, with the reference's log-probs."""
    logps = jax.jit(compose_logps(model))
    steps = []
    for s in range(n_steps):
        pairs = random_pairs(model.vocab_size, seed=seed + s) + random_pairs(model.vocab_size, seed=seed + 50 + s)[:3]
        rows = [[0, 1], [3], [2, 5], [4, 6]]  # 1 or 2 pairs a row, so micro-batches hold 3 and 4
        batch = pack(pairs, rows, SEQ_LEN + 1)
        batch = batch._replace(ref_logp=np.asarray(logps(ref_params, jax.tree.map(jnp.asarray, batch))))
        steps.append([jax.tree.map(lambda x: x[:2], batch), jax.tree.map(lambda x: x[2:], batch)])
    return steps


SETTINGS = {"sigmoid_sft": dict(loss="sigmoid", beta=0.2, sft_weight=0.5), "simpo": dict(loss="simpo", beta=2.0)}


def engine_setup(settings):
    """A tiny Llama under the objective, its init params, and three steps with a reference's log-probs."""
    from pstar_jax.model.preference import PreferenceModel
    from pstar_models.llama import LlamaConfig, StagedLlama
    base = StagedLlama(LlamaConfig(vocab_size=61, d_model=32, n_layer=2, n_head=4, n_kv_head=2, d_ff=64,
                                   seq_len=SEQ_LEN, max_position_embeddings=64))
    params = base.init_params(0)
    ref_params = {n: p + 0.02 * jax.random.normal(jax.random.key(i), p.shape) for i, (n, p) in enumerate(params.items())}
    return base, PreferenceModel(base, PreferenceConfig(**settings)), params, engine_steps(base, ref_params, 3)


def plain_engine(model, params):
    from pstar_jax.config import OptimConfig
    from pstar_jax.engine.optim import default_tx
    from pstar_jax.engine.plain import PlainEngine
    optim = OptimConfig(lr=3e-3, warmup_steps=0, total_steps=10, weight_decay=0.0, clip_norm=None)
    return PlainEngine(model, "fp32", default_tx(optim), 2, clip_norm=None, init_params=params), optim


@pytest.mark.parametrize("settings", SETTINGS.values(), ids=SETTINGS.keys())
def test_micro_batches_add_up_to_the_steps_mean_over_pairs(settings):
    """Two micro-batches of 3 and 4 pairs: the plain engine's step-0 loss and metrics equal the
    whole batch's (its mean over pairs, and over chosen tokens for the SFT term)."""
    base, model, params, steps = engine_setup(settings)
    whole = jax.tree.map(lambda a, b: jnp.concatenate([jnp.asarray(a), jnp.asarray(b)]), *steps[0])
    loss0, sums = compose_preference(base, model.cfg)(params, whole, whole.ref_logp)
    expected = step_metrics(jax.device_get(sums))
    first = plain_engine(model, params)[0].step(steps[0])
    np.testing.assert_allclose(first.loss, float(loss0), rtol=1e-6)
    assert set(first.metrics) == set(expected)
    for name, value in expected.items():
        np.testing.assert_allclose(first.metrics[name], value, rtol=1e-5, atol=1e-6, err_msg=name)
    assert first.trained_tokens == int(np.sum(whole.loss_mask))


@pytest.mark.parametrize("settings", SETTINGS.values(), ids=SETTINGS.keys())
def test_the_chunked_engine_follows_the_plain_one(settings):
    """Chunks moving, the chunked engine's losses, metrics and params follow the plain engine's
    over three preference steps."""
    from pstar_jax.config import EngineConfig
    from pstar_jax.engine.optim import default_tx
    from pstar_jax.plan.machine import H200
    from pstar_jax.planner.build import chunked_engine
    _, model, params, steps = engine_setup(settings)
    plain, optim = plain_engine(model, params)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
    chunked = chunked_engine(model, EngineConfig(chunk_numel=4096, precision="fp32", micro_batches=2), default_tx(optim),
                             mesh, (2, SEQ_LEN), H200, clip_norm=None, init_params=params)
    results = [(plain.step(step), chunked.step(step)) for step in steps]
    for a, b in results:
        np.testing.assert_allclose(b.loss, a.loss, rtol=1e-5)
        for name in a.metrics:
            np.testing.assert_allclose(b.metrics[name], a.metrics[name], rtol=1e-5, atol=1e-6, err_msg=name)
    assert sum(b.h2d_bytes for _, b in results) > 0, "the chunks should move"
    ours, theirs = chunked.params(), plain.params()
    for name in theirs:
        np.testing.assert_allclose(ours[name], theirs[name], rtol=1e-5, atol=1e-6, err_msg=name)


# -- LoRA: the reference is the base with the adapters off, in the same step ----------------------

LORA_CASES = {
    "llama_sigmoid": ("llama3", dict(loss="sigmoid", beta=0.1)),
    "qwen2_ipo_rpo": ("qwen2_tied", dict(loss="ipo", beta=0.5, sft_weight=0.3)),
}


@pytest.mark.hf_reference
@pytest.mark.parametrize("case", [pytest.param(c, marks=[pytest.mark.slow] if i else []) for i, c in
                                  enumerate(LORA_CASES.values())], ids=LORA_CASES.keys())
def test_five_lora_dpo_steps_equal_peft_trl_and_torch_adamw(case, tmp_path):
    """The chunked engine, chunks moving, the reference being the base with the adapters off inside
    the step, against TRL's DPOTrainer over a peft model (ref_model None: adapters disabled) whose
    adapters torch.optim.AdamW trains on the same pairs: equal losses and metrics every step,
    equal adapters after five."""
    import copy
    torch = pytest.importorskip("torch")
    peft = pytest.importorskip("peft")
    require_trl()
    import optax
    from frozen_engines import chunked
    from pstar_jax.config import OptimConfig
    from pstar_jax.config.lora import LoraConfig
    from pstar_jax.io.peft_io import PROJECTIONS
    from pstar_jax.model.lora import frozen_for_lora
    from pstar_jax.model.preference import PreferenceModel
    from pstar_models import hf_tensors
    from pstar_models.lora import LoraSpec
    from test_lora_peft import adapter_values, peft_name
    checkpoint, settings = case
    config = CHECKPOINTS[checkpoint]
    cfg = PreferenceConfig(**settings)
    model = build_from_hf(config, seq_len=SEQ_LEN, lora=LoraSpec(rank=4, alpha=8.0))
    hf_model = hf_reference(config)
    values = adapter_values(model)
    params = {**to_pstar(model, {k: v.detach().numpy() for k, v in hf_model.state_dict().items()}),
              **{n: jnp.asarray(v) for n, v in values.items()}}
    optim = OptimConfig(lr=1e-2, warmup_steps=2, total_steps=5, weight_decay=0.1, clip_norm=None)
    engine = chunked(PreferenceModel(model, cfg, adapters_off=True), frozen_for_lora(model, LoraConfig(rank=4)),
                     batch=4, seq=SEQ_LEN, optim=optim, chunk=None, init_params=params)

    targets = sorted({hf_tensors(model)[f"blocks.0.{p}.kernel"].name.split(".")[-2]
                      for p in PROJECTIONS[model.config.family]})
    peft_model = peft.get_peft_model(copy.deepcopy(hf_model), peft.LoraConfig(
        r=4, lora_alpha=8.0, target_modules=targets, lora_dropout=0.0, task_type="CAUSAL_LM"))
    named = dict(peft_model.named_parameters())
    with torch.no_grad():
        for name, value in values.items():
            named[peft_name(model, name)].copy_(torch.from_numpy(np.array(value.T)))
    trained = [named[peft_name(model, n)] for n in values]
    opt = torch.optim.AdamW(trained, lr=optim.lr, betas=(optim.b1, optim.b2), eps=optim.eps,
                            weight_decay=optim.weight_decay)
    warmup, total = optim.schedule_steps()
    schedule = optax.warmup_cosine_decay_schedule(0.0, optim.lr, warmup, max(total, warmup + 1),
                                                  optim.lr * optim.final_lr_fraction)
    lr_at = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: float(schedule(step)) / optim.lr)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = trl_trainer(settings, peft_model, None, tmp_path)
    peft_model.train()
    for step in range(5):
        pairs = random_pairs(config["vocab_size"], seed=step) + random_pairs(config["vocab_size"], seed=50 + step)[:3]
        ours = engine.step([pack(pairs, [[0, 1], [3], [2, 5], [4, 6]], SEQ_LEN + 1)])
        opt.zero_grad(set_to_none=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            loss, metrics = trainer.get_batch_loss_metrics(peft_model, trainer.data_collator(
                [{"prompt_input_ids": p, "chosen_input_ids": c, "rejected_input_ids": r} for p, c, r in pairs]))
        loss.backward()
        opt.step()
        lr_at.step()
        assert ours.h2d_bytes > 0  # the chunks moved
        np.testing.assert_allclose(ours.loss, loss.item(), rtol=2e-5, err_msg=f"step {step}")
        assert_metrics_match(ours.metrics, metrics, cfg, 2e-5, f" at step {step}")
    mine = engine.params()
    for name in values:
        theirs = named[peft_name(model, name)].detach().numpy().T
        np.testing.assert_allclose(mine[name], theirs, rtol=0, atol=2e-5 * float(np.abs(theirs).max()), err_msg=name)


def test_the_in_step_reference_costs_one_forward_and_its_activations_not_a_backward():
    """What the planner's trace counts for the adapters-off reference: each block's forward twice
    (with and without the adapters, whose zeroed matmuls XLA drops), each stage input twice (h and h_ref), and a backward that
    does not recompute the reference branch (stop_gradient: XLA drops it), against the same
    LoRA model under SimPO, which has no reference."""
    from frozen_engines import chunked
    from pstar_jax.config.lora import LoraConfig
    from pstar_jax.model.lora import frozen_for_lora
    from pstar_jax.model.preference import PreferenceModel
    from pstar_models.llama import LlamaConfig, StagedLlama
    from pstar_models.lora import LoraSpec
    lora = StagedLlama(LlamaConfig(vocab_size=61, d_model=32, n_layer=2, n_head=4, n_kv_head=2, d_ff=64,
                                   seq_len=SEQ_LEN, max_position_embeddings=64, lora=LoraSpec(rank=4, alpha=8.0)))
    frozen = frozen_for_lora(lora, LoraConfig(rank=4))
    shapes = {}
    for name, cfg, off in (("dpo", PreferenceConfig(), True), ("simpo", PreferenceConfig(loss="simpo"), False)):
        engine = chunked(PreferenceModel(lora, cfg, adapters_off=off), frozen, budget=None, batch=2, seq=SEQ_LEN,
                         chunk=None)
        shapes[name] = engine.plan_for((2, SEQ_LEN)).shape
    dpo, simpo = shapes["dpo"], shapes["simpo"]
    blocks = range(1, len(dpo.fwd_flops))
    for i in blocks:
        # at most twice: XLA folds the zeroed adapters' matmuls away in the reference branch
        assert 1.9 * simpo.fwd_flops[i] <= dpo.fwd_flops[i] <= 2 * simpo.fwd_flops[i]
        np.testing.assert_allclose(dpo.bwd_flops[i], simpo.bwd_flops[i], rtol=0.02)
        assert dpo.input_bytes[i + 1] == 2 * simpo.input_bytes[i + 1]


# -- pstar-train --objective dpo ----------------------------------------------------------------

def preference_file(path, n_rows=24, seq=64, vocab=256, preference=True, seed=0):
    """A preference file as the data half writes it: packed rows (pack() above), the sidecar's
    "preference": true and "pairs"."""
    from pstar_jax.data.packing import PackedRows, write_packed
    rng = np.random.default_rng(seed)
    draw = lambda n: [int(x) for x in rng.integers(1, vocab, n)]  # noqa: E731
    pairs, rows = [], []
    for _ in range(n_rows):
        rows.append([len(pairs), len(pairs) + 1])
        pairs += [(draw(4), draw(int(rng.integers(3, 8))), draw(int(rng.integers(3, 8)))) for _ in range(2)]
    tokens, segments, labels = pack_rows(pairs, rows, seq + 1)
    info = {"vocab_size": vocab, **({"preference": True, "pairs": len(pairs)} if preference else {})}
    write_packed(path, PackedRows(tokens.astype(np.uint16), segments.astype(np.uint16), labels.astype(np.uint8)), info)
    return path


@pytest.mark.slow
def test_pstar_train_tunes_lora_on_pairs_and_logs_trls_metrics(tmp_path, capsys):
    """A LoRA DPO run from the flags: step 0's policy is the base (peft's lora_b starts at zero), so
    its loss is log 2 and its rewards 0; the metrics go to the JSONL as TRL names them."""
    import json
    from pstar_jax.cli.train import main as train_main
    data = preference_file(tmp_path / "pairs.sft.u16.bin")
    metrics = tmp_path / "m.jsonl"
    code = train_main(["--objective", "dpo", "--data", str(data), "--lora-rank", "4", "--steps", "3",
                       "--batch-size", "8", "--lr", "1e-2", "--metrics-out", str(metrics), "--quiet"])
    assert code == 0, capsys.readouterr().err
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert len(rows) == 3
    np.testing.assert_allclose(rows[0]["loss"], np.log(2.0), rtol=1e-5)
    assert rows[0]["rewards/chosen"] == 0.0 and rows[0]["rewards/margins"] == 0.0
    for name in ("rewards/accuracies", "logps/chosen", "logps/rejected", "nll_loss"):
        assert all(np.isfinite(r[name]) for r in rows), name
    assert rows[-1]["loss"] != rows[0]["loss"]


@pytest.mark.parametrize("flags, preference, match", [
    (["--objective", "dpo", "--lora-rank", "4"], False, "is not a preference file"),
    ([], True, "is a preference file"),
])
def test_the_wrong_kind_of_file_is_one_line(tmp_path, capsys, flags, preference, match):
    from pstar_jax.cli.train import main as train_main
    data = preference_file(tmp_path / "d.sft.u16.bin", n_rows=4, preference=preference)
    assert train_main([*flags, "--data", str(data), "--steps", "1", "--batch-size", "8", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert match in err and "--data" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("objective, data, eval_data, match", [
    ("dpo", "pairs", "sft", "--eval-data is not a preference file"),
    ("sft", "sft", "pairs", "--eval-data is a preference file"),
    ("dpo", None, None, "without --data the data is the built-in corpus, which holds none"),
])
def test_the_wrong_kind_of_eval_file_or_no_file_is_one_line(tmp_path, capsys, objective, data, eval_data, match):
    from pstar_jax.cli.train import main as train_main
    files = {"pairs": preference_file(tmp_path / "p.sft.u16.bin", n_rows=4),
             "sft": preference_file(tmp_path / "s.sft.u16.bin", n_rows=4, preference=False)}
    flags = ["--objective", objective, *(["--data", str(files[data])] if data else []),
             *(["--eval-every", "1", "--eval-data", str(files[eval_data])] if eval_data else [])]
    assert train_main([*flags, "--steps", "1", "--batch-size", "8", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert match in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.slow
def test_pstar_plan_counts_the_reference_forward_and_its_activations(capsys):
    """pstar-plan --objective dpo on a LoRA model: the label says where the reference comes from,
    the stage inputs kept for the backward are twice SFT's (h and h_ref), the step takes longer."""
    import json
    from pstar_jax.cli.plan import main as plan_main
    plans = {}
    for name, extra in (("sft", []), ("dpo", ["--objective", "dpo"])):
        assert plan_main(["tiny", "--lora-rank", "4", "--no-search", "--json", "--device-memory", "1GiB",
                          "--host-memory", "2GiB", *extra]) == 0
        plans[name] = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert "DPO (sigmoid loss; the reference: the base with the adapters off" in plans["dpo"]["label"]
    sft, dpo = plans["sft"]["plan"], plans["dpo"]["plan"]
    assert dpo["input_bytes"] == 2 * sft["input_bytes"] > 0
    assert dpo["predicted_step_s"] > sft["predicted_step_s"]


@pytest.mark.slow
def test_bench_dpo_prints_both_steps_and_their_ratio():
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, os.path.join(root, "scripts", "bench_dpo.py"), "--d-model", "32", "--layers",
                        "2", "--vocab", "256", "--seq-len", "64", "--batch", "2", "--steps", "1", "--rank", "4"],
                       cwd=root, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "SFT (the same rows)" in r.stdout and "DPO sigmoid (reference in-step)" in r.stdout
    assert "DPO / SFT step time:" in r.stdout
