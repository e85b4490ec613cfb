"""Preference losses (pstar_jax.model.preference; the data half's tests are test_preference.py) on
packed preference rows: the per-position log-prob head against plain autodiff, the pair sums, the
config's one-line errors; the step-0 loss, gradients and logged metrics against TRL 0.27's
DPOTrainer (sigmoid, label smoothing, IPO, rpo_alpha) and CPOTrainer (SimPO) on tiny random Llama,
Qwen2, Gemma 3 and Qwen3-MoE models made with transformers, in fp32 (LoRA's in-step reference over
Gemma 3 and the experts: test_preference_families.py). Training on them: test_preference_training.py.
torch/transformers/peft/trl are references only (test extra)."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pstar_jax.config import ConfigError
from pstar_jax.config.preference import PreferenceConfig
from pstar_jax.data.batch import from_rows
from pstar_jax.model.loss import linear_target_logps
from pstar_jax.model.preference import compose_logps, compose_preference, pair_count, preference_sums, step_metrics
from pstar_models import build_from_hf
from test_gemma import GEMMA
from test_hf_models import CHECKPOINTS, hf_reference, to_pstar
from test_moe import QWEN3_MOE

SEQ_LEN = 24
# A soft-cap well inside these random models' logits (about 1): without it the completions' log-probs
# move by about 3e-3 of their size, 300 times the comparisons' tolerance (3.0 moved them 1e-4).
GEMMA_SOFTCAP = {**GEMMA, "final_logit_softcapping": 0.5}


@pytest.mark.parametrize("tied", [False, True])
def test_target_logps_equal_log_softmax_and_its_gradient_in_tiles(tied):
    rng = np.random.default_rng(0)
    N, D, V = 13, 8, 11
    h = jnp.asarray(rng.standard_normal((N, D)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((V, D) if tied else (D, V)), jnp.float32)
    targets = jnp.asarray(rng.integers(0, V, N).astype(np.int32)).at[3].set(-1)  # masked: any target
    mask = jnp.asarray(rng.random(N) < 0.7).at[3].set(False)
    g = jnp.asarray(rng.standard_normal(N), jnp.float32)

    def plain(h, w):
        logp = jax.nn.log_softmax(h @ (w.T if tied else w), axis=-1)
        picked = jnp.take_along_axis(logp, jnp.clip(targets, 0, V - 1)[:, None], axis=-1)[:, 0]
        return jnp.where(mask, picked, 0.0)
    ours = lambda h, w: linear_target_logps(h, w, targets, mask, tied=tied, tile_n=4)  # noqa: E731
    np.testing.assert_allclose(ours(h, w), plain(h, w), rtol=0, atol=1e-6)
    assert float(ours(h, w)[3]) == 0.0
    for a, b in zip(jax.grad(lambda h, w: jnp.sum(g * ours(h, w)), (0, 1))(h, w),
                    jax.grad(lambda h, w: jnp.sum(g * plain(h, w)), (0, 1))(h, w)):
        np.testing.assert_allclose(a, b, rtol=0, atol=2e-6 * float(jnp.abs(b).max()))


def pack(pairs, rows, R):
    """The batch of ``pack_rows``."""
    return from_rows(*pack_rows(pairs, rows, R))


def pack_rows(pairs, rows, R):
    """Preference rows as the data engineer's file holds them (tokens, segments, labels [rows, R]):
    pair k of a row is segments 2k-1 (prompt + chosen) and 2k (prompt + rejected), labels 1 on the
    completion tokens."""
    tokens, segments, labels = (np.zeros((len(rows), R), np.int32) for _ in range(3))
    for r, members in enumerate(rows):
        at, seg = 0, 0
        for k in members:
            prompt, chosen, rejected = pairs[k]
            for completion in (chosen, rejected):
                seg += 1
                seq = prompt + completion
                tokens[r, at:at + len(seq)] = seq
                segments[r, at:at + len(seq)] = seg
                labels[r, at + len(prompt):at + len(seq)] = 1
                at += len(seq)
        assert at <= R
    return tokens, segments, labels


def random_pairs(vocab_size, seed=0):
    """Prompts and completions of several lengths; completion ids avoid 0, which TRL's DPO NLL
    (rpo_alpha) ignores as its dummy label."""
    rng = np.random.default_rng(seed)
    draw = lambda n: [int(x) for x in rng.integers(1, vocab_size, n)]  # noqa: E731
    return [(draw(p), draw(c), draw(r)) for p, c, r in ((3, 2, 3), (2, 4, 1), (4, 3, 3), (5, 6, 2))]


ROWS = [[0, 1], [2], [3]]  # two pairs in the first row, one in each of the others


def test_sums_count_each_pair_once_and_padding_never():
    pairs = random_pairs(50)
    batch = pack(pairs, ROWS, SEQ_LEN + 1)
    assert list(pair_count(batch.segment_ids, batch.loss_mask)) == [2, 1, 1]
    logp = jnp.asarray(-np.arange(1, 1 + SEQ_LEN * 3, dtype=np.float32).reshape(3, SEQ_LEN) / 10) * batch.loss_mask
    cfg = PreferenceConfig(loss="simpo", simpo_gamma=0.0, beta=1.0)
    sums = preference_sums(cfg, logp, None, jnp.asarray(batch.loss_mask), jnp.asarray(batch.segment_ids))
    assert float(sums["pairs"]) == 4.0
    assert float(sums["chosen_tokens"]) == sum(len(c) for _, c, _ in pairs)
    # SimPO's chosen reward is beta x the completion's mean log-prob: the row's values by hand
    means = []
    for r, members in enumerate(ROWS):
        seg = np.asarray(batch.segment_ids[r])
        for j in range(len(members)):
            m = (seg == 2 * j + 1) & (np.asarray(batch.loss_mask[r]) > 0)
            means.append(float(np.asarray(logp[r])[m].mean()))
    np.testing.assert_allclose(step_metrics(sums)["rewards/chosen"], np.mean(means), rtol=1e-6)


@pytest.mark.parametrize("fields, match", [
    (dict(loss="dpo"), "loss must be one of sigmoid, ipo, simpo"),
    (dict(beta=0.0), "beta must be a positive number"),
    (dict(beta=float("nan")), "beta must be a positive number"),
    (dict(label_smoothing=0.5), r"label_smoothing must lie in \[0, 0.5\)"),
    (dict(loss="ipo", label_smoothing=0.1), "IPO has none"),
    (dict(simpo_gamma=1.0), "set PreferenceConfig.loss to simpo"),
    (dict(sft_weight=-1.0), "sft_weight must be 0"),
])
def test_bad_settings_are_one_line(fields, match):
    with pytest.raises(ConfigError, match=match) as info:
        PreferenceConfig(**fields)
    assert "\n" not in str(info.value)


def assert_metrics_match(ours, theirs, cfg, atol, where=""):
    """TRL's logged metrics, each within ``atol`` relative to the scale its rounding comes from: a
    reward or margin is beta times a difference of log-probs, so it is rounded at beta x their size."""
    reward_scale = cfg.beta * max(abs(theirs["logps/chosen"]), abs(theirs["logps/rejected"]))
    for name in ("rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected",
                 "rewards/accuracies", *(("nll_loss",) if cfg.sft_weight else ())):
        scale = reward_scale if name.startswith("rewards/") and name != "rewards/accuracies" else abs(theirs[name])
        np.testing.assert_allclose(ours[name], theirs[name], rtol=0, atol=atol * max(scale, 1e-2),
                                   err_msg=f"{name}{where}")


# -- against TRL ---------------------------------------------------------------------------------

CASES = {  # id: (checkpoint, our settings)
    "llama_sigmoid": ("llama3", dict(loss="sigmoid", beta=0.1)),
    "qwen2_sigmoid_smoothed": ("qwen2_tied", dict(loss="sigmoid", beta=0.3, label_smoothing=0.2)),
    "llama_ipo": ("llama3", dict(loss="ipo", beta=0.1)),
    "qwen2_sigmoid_rpo": ("qwen2_tied", dict(loss="sigmoid", beta=0.1, sft_weight=0.7)),
    "llama_simpo": ("llama3", dict(loss="simpo", beta=2.0, simpo_gamma=0.8)),
    "qwen2_simpo_sft_smoothed": ("qwen2_tied", dict(loss="simpo", beta=2.0, simpo_gamma=0.5, sft_weight=0.5,
                                                    label_smoothing=0.1)),
    # the newer families (config.json dicts): Gemma 3's final soft-cap in every log-prob and its sliding
    # window of 5 over two packed pairs; Qwen3-MoE's routing (output_router_logits false: no aux loss)
    "gemma3_softcap_sigmoid": (GEMMA_SOFTCAP, dict(loss="sigmoid", beta=0.1)),
    "qwen3_moe_ipo_rpo": (QWEN3_MOE, dict(loss="ipo", beta=0.1, sft_weight=0.5)),
    "gpt2_sigmoid": ("gpt2", dict(loss="sigmoid", beta=0.1)),  # TRL turns its dropout off (disable_dropout)
}


def require_trl():
    """(transformers, trl, datasets), or the test skips: TRL 0.27 (the last release with these
    losses) does not import beside transformers 5.x."""
    transformers = pytest.importorskip("transformers")
    trl = pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    try:
        trl.DPOTrainer
    except (ImportError, RuntimeError) as err:
        pytest.skip(f"trl {trl.__version__} does not load beside transformers {transformers.__version__} "
                    f"({str(err).splitlines()[-1]})")
    return transformers, trl, datasets


def trl_trainer(settings, policy, ref, tmp_path):
    """TRL's trainer for ``settings`` (SimPO: CPOTrainer, reference-free), fp32 on the CPU."""
    transformers, trl, datasets = require_trl()
    from chat_fixtures import tokenizer_dir
    tok = transformers.AutoTokenizer.from_pretrained(str(tokenizer_dir(tmp_path, "qwen25")))
    data = datasets.Dataset.from_list([{"prompt": "a", "chosen": "b", "rejected": "c"}])
    common = dict(output_dir=str(tmp_path / "out"), beta=settings["beta"], report_to="none", bf16=False,
                  use_cpu=True, label_smoothing=settings.get("label_smoothing", 0.0))
    if settings["loss"] == "simpo":
        from trl.experimental.cpo import CPOConfig, CPOTrainer
        args = CPOConfig(loss_type="simpo", simpo_gamma=settings["simpo_gamma"],
                         cpo_alpha=settings.get("sft_weight", 0.0), padding_value=0, **common)
        return CPOTrainer(model=policy, args=args, train_dataset=data, processing_class=tok)
    args = trl.DPOConfig(loss_type=settings["loss"], rpo_alpha=settings.get("sft_weight") or None, **common)
    return trl.DPOTrainer(model=policy, ref_model=ref, args=args, train_dataset=data, processing_class=tok)


def trl_batch(trainer, pairs, simpo):
    """The pairs as TRL's trainer takes them (its own collator for DPO; CPO's tensors by hand)."""
    import torch
    if not simpo:
        return trainer.data_collator([{"prompt_input_ids": p, "chosen_input_ids": c, "rejected_input_ids": r}
                                      for p, c, r in pairs])
    out = {}
    for side, i in (("chosen", 1), ("rejected", 2)):
        seqs = [pair[0] + pair[i] for pair in pairs]
        width = max(map(len, seqs))
        ids = torch.zeros((len(pairs), width), dtype=torch.long)
        mask = torch.zeros_like(ids)
        labels = torch.full_like(ids, -100)
        for b, (pair, seq) in enumerate(zip(pairs, seqs)):
            ids[b, :len(seq)] = torch.tensor(seq)
            mask[b, :len(seq)] = 1
            labels[b, len(pair[0]):len(seq)] = torch.tensor(pair[i])
        out.update({f"{side}_input_ids": ids, f"{side}_attention_mask": mask, f"{side}_labels": labels})
    return out


def stored_ref_logp(model, ref_params, rows_arrays, tmp_path):
    """The rows' ``ref_logp`` as a full-fine-tuning run reads it: the reference's pair sums written
    to a NAME.ref.f32 file (pstar_jax.data.ref_logps), read back and attached to the rows in order."""
    from pstar_jax.data.ref_logps import load_ref_logps, reference_values, write_ref_logps
    from pstar_jax.data.rows import Rows
    rows = Rows(*rows_arrays)
    logps = jax.jit(compose_logps(model))
    def forward(batches):
        return [np.asarray(logps(ref_params, jax.tree.map(jnp.asarray, b))) for b in batches]
    path, fingerprint = tmp_path / "pairs.ref.f32", {"data": {}, "base": {}, "model": {}}
    write_ref_logps(path, np.concatenate(list(reference_values(rows, forward, 2))), fingerprint)
    index = np.arange(len(rows.tokens))
    return load_ref_logps(path, rows, fingerprint).attach(from_rows(*rows), index).ref_logp


@pytest.mark.hf_reference
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_step_zero_loss_gradients_and_metrics_equal_trls(case, tmp_path):
    """Full fine-tuning against a reference model (TRL with ``ref_model``; SimPO has none): the
    same pairs give TRL's loss, its logged metrics and torch's gradients of every tensor."""
    torch = pytest.importorskip("torch")
    require_trl()
    checkpoint, settings = case
    config = CHECKPOINTS[checkpoint] if isinstance(checkpoint, str) else checkpoint  # a name, or a config.json
    cfg = PreferenceConfig(**settings)
    model = build_from_hf(config, seq_len=SEQ_LEN)
    torch.manual_seed(0)  # the MoE's routing: seeded weights without a near-tie between torch and XLA
    policy, ref = hf_reference(config, seed=0), hf_reference(config, seed=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TRL's and datasets' own notices
        trainer = trl_trainer(settings, policy, ref, tmp_path)
        batch_t = trl_batch(trainer, random_pairs(config["vocab_size"]), cfg.loss == "simpo")
        policy.train()  # no dropout in these configs; TRL logs train metrics
        loss_t, metrics_t = trainer.get_batch_loss_metrics(policy, batch_t)
        loss_t.backward()

    state = lambda m: {k: v.detach().numpy() for k, v in m.state_dict().items()}  # noqa: E731
    params, ref_params = to_pstar(model, state(policy)), to_pstar(model, state(ref))
    batch = jax.tree.map(jnp.asarray, pack(random_pairs(config["vocab_size"]), ROWS, SEQ_LEN + 1))
    ref_logp = compose_logps(model)(ref_params, batch) if cfg.uses_reference else None
    (loss, sums), grads = jax.value_and_grad(lambda p: compose_preference(model, cfg)(p, batch, ref_logp),
                                             has_aux=True)(params)
    np.testing.assert_allclose(float(loss), loss_t.item(), rtol=1e-5, atol=1e-6)
    assert_metrics_match(step_metrics(jax.device_get(sums)), metrics_t, cfg, 1e-5)
    if cfg.uses_reference:  # the same through the stored reference of full fine-tuning, written and read back
        stored = stored_ref_logp(model, ref_params, pack_rows(random_pairs(config["vocab_size"]), ROWS, SEQ_LEN + 1),
                                 tmp_path)
        loss_s, sums_s = compose_preference(model, cfg)(params, batch, jnp.asarray(stored))
        np.testing.assert_allclose(float(loss_s), loss_t.item(), rtol=1e-5, atol=1e-6)
        assert_metrics_match(step_metrics(jax.device_get(sums_s)), metrics_t, cfg, 1e-5, "stored: ")
    theirs = to_pstar(model, {k: p.grad.numpy() for k, p in policy.named_parameters()}
                      | {k: np.zeros_like(v) for k, v in state(policy).items() if k not in dict(policy.named_parameters())})
    for name, g in grads.items():
        scale = float(np.abs(theirs[name]).max())
        np.testing.assert_allclose(np.asarray(g), theirs[name], rtol=0, atol=1e-5 * max(scale, 1e-6), err_msg=name)
