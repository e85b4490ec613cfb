"""DPO over the newer model families (issues 32 and 33): on a tiny Gemma 3 (sliding and global
layers, the final logit soft-cap in every log-prob) and a tiny Qwen3-MoE (experts adapted or not),
LoRA's step-0 DPO loss, TRL's metrics and every adapter's gradient equal TRL's DPOTrainer's over a
peft model with ``ref_model=None`` (the reference is the base with the adapters off), fp32; the
chunked engine, chunks moving, gives the same step. Full fine-tuning against a reference copy:
test_preference_loss.py's CASES; its stored reference, computed by the chunked engine's forward-only
pass with chunks streaming, equals a direct forward's here; and pstar-train on checkpoints of both
families (LoRA over the experts, Gemma's full fine-tuning). The MoE configs keep ``output_router_logits`` false: with it true
TRL adds ``router_aux_loss_coef`` x the router's load-balancing loss of its concatenated
chosen + rejected forward to the loss (and logs ``aux_loss``), which pstar_jax's DPO does not yet.
torch/transformers/peft/trl are references only (test extra)."""

import copy
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pstar_jax.config.preference import PreferenceConfig
from pstar_jax.model.staged import hidden, stage_seeds
from pstar_models import build_from_hf, hf_tensors
from pstar_models.lora import LoraSpec
from test_hf_models import hf_reference, to_pstar
from test_moe import QWEN3_MOE
from test_preference_loss import (GEMMA_SOFTCAP, ROWS, SEQ_LEN, assert_metrics_match, pack, random_pairs, require_trl,
                                  trl_trainer)

EXPERTS = ("attn.*", "mlp.experts.*")
# id: (config.json, LoRA targets (() every projection but the experts), our preference settings)
CASES = {
    "gemma3_softcap_sigmoid": (GEMMA_SOFTCAP, (), dict(loss="sigmoid", beta=0.1)),
    "qwen3_moe_experts_ipo_rpo": (QWEN3_MOE, EXPERTS, dict(loss="ipo", beta=0.5, sft_weight=0.3)),
    "qwen3_moe_attention_sigmoid": (QWEN3_MOE, (), dict(loss="sigmoid", beta=0.2, label_smoothing=0.1)),
}
SLOW = ("qwen3_moe_attention_sigmoid",)


def lora_setup(config, targets):
    """Our LoRA model, transformers' model of the same random weights, and adapter values with
    both halves nonzero (so the policy is not the reference at step 0)."""
    from test_lora_peft import adapter_values
    import torch
    torch.manual_seed(0)  # the MoE's routing: seeded weights without a near-tie between torch and XLA
    model = build_from_hf(config, seq_len=SEQ_LEN, lora=LoraSpec(rank=4, alpha=8.0, targets=targets))
    hf_model = hf_reference(config)
    base = to_pstar(model, {k: v.detach().numpy() for k, v in hf_model.state_dict().items()})
    return model, hf_model, base, adapter_values(model, seed=3)


def trl_step(hf_model, model, settings, values, pairs, tmp_path):
    """TRL's step-0 loss, metrics and adapter gradients (our names and layout) over a peft model
    holding ``values``, the reference being that model with its adapters disabled."""
    import peft
    import torch
    from pstar_jax.io.peft_io import PROJECTIONS, first_instance
    from test_lora_peft import peft_name
    projections = [first_instance(p) for p in PROJECTIONS[model.config.family]
                   if model.config.lora.targets_path(first_instance(p))]
    targets = sorted({hf_tensors(model)[f"blocks.0.{p}.kernel"].name.split(".")[-2] for p in projections})
    peft_model = peft.get_peft_model(copy.deepcopy(hf_model), peft.LoraConfig(
        r=4, lora_alpha=8.0, target_modules=targets, lora_dropout=0.0, task_type="CAUSAL_LM"))
    named = dict(peft_model.named_parameters())
    assert {n for n, p in named.items() if p.requires_grad} == {peft_name(model, n) for n in values}
    with torch.no_grad():
        for name, value in values.items():
            named[peft_name(model, name)].copy_(torch.from_numpy(np.array(value.T)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TRL's and datasets' own notices
        trainer = trl_trainer(settings, peft_model, None, tmp_path)
        peft_model.train()  # no dropout here; TRL logs train metrics
        loss, metrics = trainer.get_batch_loss_metrics(peft_model, trainer.data_collator(
            [{"prompt_input_ids": p, "chosen_input_ids": c, "rejected_input_ids": r} for p, c, r in pairs]))
    loss.backward()
    return loss.item(), metrics, {n: named[peft_name(model, n)].grad.numpy().T for n in values}


def paired_step(objective, params, trained, batch):
    """The objective's loss and metrics on one batch, and the gradients of the ``trained`` tensors:
    its stages (h and h_ref through every block) and its head of K sums, each divided by its
    count over the batch, as the engines do."""
    stages = objective.stages(jnp.float32)
    counts = jnp.asarray(objective.row_counts(batch).sum(axis=0))
    head = stages[-1]

    def loss_fn(t):
        p = {**params, **t}
        h = hidden(stages, p, batch)
        terms, sums = head.apply(tuple(p[n] for n in head.param_names), h, stage_seeds(batch, len(stages) - 1))
        return jnp.sum(terms / jnp.maximum(counts, 1.0)), sums
    (loss, sums), grads = jax.value_and_grad(loss_fn, has_aux=True)({n: params[n] for n in trained})
    return float(loss), objective.step_metrics(jax.device_get(sums), np.asarray(counts)), grads


@pytest.mark.hf_reference
@pytest.mark.parametrize("case", [pytest.param(c, marks=[pytest.mark.slow] if n in SLOW else []) for n, c in
                                  CASES.items()], ids=CASES.keys())
def test_lora_step_zero_equals_trl_over_peft_with_the_adapters_off_as_reference(case, tmp_path):
    """Pairs packed two to a row (the first row's second pair meets Gemma's sliding window of 5
    past its first): our loss, TRL's logged metrics and every adapter's gradient, experts'
    included where targeted, equal TRL + peft's; the step is not the reference's (rewards differ)."""
    pytest.importorskip("torch")
    pytest.importorskip("peft")
    require_trl()
    from pstar_jax.model.preference import PreferenceModel
    from test_lora_peft import OWN_SPREAD
    config, targets, settings = case
    cfg = PreferenceConfig(**settings)
    model, hf_model, base, values = lora_setup(config, targets)
    assert any(".experts." in n for n in values) == (targets == EXPERTS)
    pairs = random_pairs(config["vocab_size"])
    loss_t, metrics_t, grads_t = trl_step(hf_model, model, settings, values, pairs, tmp_path)

    params = {**base, **{n: jnp.asarray(v) for n, v in values.items()}}
    batch = jax.tree.map(jnp.asarray, pack(pairs, ROWS, SEQ_LEN + 1))
    loss, metrics, grads = paired_step(PreferenceModel(model, cfg, adapters_off=True), params, values, batch)
    np.testing.assert_allclose(loss, loss_t, rtol=1e-5, atol=1e-6)
    assert_metrics_match(metrics, metrics_t, cfg, 1e-5)
    assert abs(metrics_t["rewards/margins"]) > 1e-3, "the adapters should move the policy off the reference"
    # Gradients within OWN_SPREAD of the tensor's largest entry: our fp32 gradients' own spread from run
    # to run (tests/test_lora_peft.py measured it). Not against a float64 TRL as test_lora_peft does:
    # transformers' eager Gemma 3 in float64 turns a padded query whose sliding window holds only
    # padding into NaN (finfo.min overflows), which then reaches every padded row's log-probs.
    for name, g in grads.items():
        scale = float(np.abs(grads_t[name]).max())
        assert scale > 0, f"{name} has no gradient"
        np.testing.assert_allclose(np.asarray(g), grads_t[name], rtol=0, atol=OWN_SPREAD * scale, err_msg=name)


@pytest.mark.parametrize("case", ["gemma3_softcap_sigmoid",
                                  pytest.param("qwen3_moe_experts_ipo_rpo", marks=pytest.mark.slow)])
def test_the_chunked_engine_gives_the_same_lora_step_with_chunks_moving(case):
    """The engine's first step (the reference: h_ref carried through every block beside h, the
    experts' adapters zeroed in it) gives the loss and metrics of the whole-model step above."""
    from frozen_engines import chunked
    from pstar_jax.config.lora import LoraConfig
    from pstar_jax.model.lora import frozen_for_lora
    from pstar_jax.model.preference import PreferenceModel
    from test_lora_peft import adapter_values
    config, targets, settings = CASES[case]
    cfg = PreferenceConfig(**settings)
    model = build_from_hf(config, seq_len=SEQ_LEN, lora=LoraSpec(rank=4, alpha=8.0, targets=targets))
    params = {**model.init_params(0), **{n: jnp.asarray(v) for n, v in adapter_values(model, seed=3).items()}}
    objective = PreferenceModel(model, cfg, adapters_off=True)
    rows = pack(random_pairs(config["vocab_size"]), ROWS, SEQ_LEN + 1)
    loss, metrics, _ = paired_step(objective, params, [], jax.tree.map(jnp.asarray, rows))
    engine = chunked(objective, frozen_for_lora(model, LoraConfig(rank=4, targets=",".join(targets) or None)),
                     batch=len(ROWS), seq=SEQ_LEN, chunk=None, init_params=params)
    first = engine.step([rows])
    assert first.h2d_bytes > 0, "the chunks should move"
    np.testing.assert_allclose(first.loss, loss, rtol=1e-5)
    for name, value in metrics.items():
        np.testing.assert_allclose(first.metrics[name], value, rtol=1e-5, atol=1e-6, err_msg=name)
    assert metrics["rewards/margins"] != 0.0


@pytest.mark.parametrize("config", [GEMMA_SOFTCAP, QWEN3_MOE], ids=["gemma3_softcap", "qwen3_moe"])
def test_full_fine_tunings_stored_reference_pass_streams_chunks_and_gives_the_direct_values(config):
    """The forward-only pass before step 0 (pstar_jax.data.ref_logps), the experts' chunks streamed
    as the rest: each pair's sums equal a direct forward's of the same rows."""
    from pstar_jax.config import EngineConfig, OptimConfig
    from pstar_jax.data.ref_logps import reference_values
    from pstar_jax.data.rows import Rows
    from pstar_jax.engine.optim import default_tx
    from pstar_jax.model.preference import PreferenceModel, compose_logps
    from pstar_jax.plan.machine import H200
    from pstar_jax.planner.build import chunked_engine
    from test_preference_loss import pack_rows
    model = build_from_hf(config, seq_len=SEQ_LEN)
    params = model.init_params(0)
    pairs = random_pairs(config["vocab_size"]) + random_pairs(config["vocab_size"], seed=1)[:3]
    rows = Rows(*pack_rows(pairs, [[0, 1], [3], [2, 5], [4, 6]], SEQ_LEN + 1))
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
    engine = chunked_engine(PreferenceModel(model, PreferenceConfig(objective="dpo")),
                            EngineConfig(chunk_numel=4096, precision="fp32", micro_batches=2),
                            default_tx(OptimConfig(lr=1e-3)), mesh, (2, SEQ_LEN), H200, clip_norm=None,
                            init_params=params)
    values = np.concatenate(list(reference_values(rows, engine.reference_logps, 2, 2)))
    assert engine.store.traffic.h2d_bytes > 0, "the chunks should stream"
    logps = jax.jit(compose_logps(model))
    expected = np.concatenate(list(reference_values(
        rows, lambda batches: [np.asarray(logps(params, jax.tree.map(jnp.asarray, b))) for b in batches], 4)))
    assert values.shape == (len(pairs), 2)
    np.testing.assert_allclose(values, expected, rtol=0, atol=1e-5 * float(np.abs(expected).max()))


@pytest.mark.slow
@pytest.mark.parametrize("config, flags", [
    (QWEN3_MOE, ("--lora-rank", "4", "--lora-targets", "attn.*,mlp.experts.*", "--export-lora", "adapter")),
    (GEMMA_SOFTCAP, ()),  # full fine-tuning: the stored reference, computed before step 0
], ids=["qwen3_moe_lora_experts", "gemma3_full"])
def test_pstar_train_tunes_a_checkpoint_of_the_family_on_pairs(tmp_path, capsys, config, flags):
    """From a checkpoint on disk: step 0's policy is the reference (LoRA's adapters start at zero; full
    fine-tuning's reference is the initial model), so its loss is log 2 and its margin 0; the loss
    then moves, and a LoRA run exports adapters on every expert."""
    import json
    from pstar_jax.cli.train import main as train_main
    from test_hf import write_family_checkpoint
    from test_preference_training import preference_file
    write_family_checkpoint(str(tmp_path / "src"), build_from_hf(config, seq_len=64))
    data = preference_file(tmp_path / "pairs.sft.u16.bin", n_rows=8, seq=64, vocab=config["vocab_size"])
    code = train_main(["--init-from-hf", str(tmp_path / "src"), "--objective", "dpo", "--data", str(data),
                       "--seq-len", "64", "--steps", "3", "--batch-size", "8", "--lr", "1e-2", "--precision", "fp32",
                       "--metrics-out", str(tmp_path / "m.jsonl"), "--quiet",
                       *(str(tmp_path / f) if f == "adapter" else f for f in flags)])
    assert code == 0, capsys.readouterr().err
    rows = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    np.testing.assert_allclose(rows[0]["loss"], np.log(2.0), rtol=1e-6)
    assert abs(rows[0]["rewards/margins"]) < 1e-6 and rows[-1]["loss"] != rows[0]["loss"]
    if flags:
        adapter = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
        assert {"gate_proj", "up_proj", "down_proj", "q_proj"} <= set(adapter["target_modules"])
    else:
        assert (tmp_path / "pairs.ref.f32").stat().st_size == 16 * 8  # 16 pairs, chosen and rejected
