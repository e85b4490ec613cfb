"""Preference losses (DPO, IPO, SimPO) on packed preference rows, on a few numbers per pair.

A preference row is a packed SFT row (pstar_jax.data.packing, sidecar ``"preference": true``)
whose examples come in pairs: segment 2k-1 is prompt + chosen, segment 2k prompt + rejected
(k = 1, 2, ... within the row; 0 is padding), and the loss mask is 1 exactly on the completion
targets. The head gives every position's target log-prob without whole logits
(pstar_jax.model.loss.linear_target_logps); summed per segment they are the completion
log-probs TRL sums. Everything after that is plain jnp on [B, S] arrays (S = L + 1 segment
slots per row, a bound no row reaches), so it costs nothing beside the head.

Sums, not means: ``preference_sums`` returns the sum over the batch's pairs of each pair's loss,
the SFT term's token sum and the metric sums; the engine adds them over micro-batches and
devices and divides once by the global number of pairs (and of chosen completion tokens, for the
SFT term), as it divides SFT sums by the global count of trained tokens (``step_loss`` is that
division; ``compose_preference`` the whole model on one batch, the engines' reference). A pair is
a chosen segment (odd id) that has completion tokens; its rejected segment is the next id.
``PreferenceModel`` hands the objective to the engines: the model with this head, and with LoRA
the reference carried through the step beside the policy.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pstar_jax.config.preference import PreferenceConfig
from pstar_jax.config.errors import DataError
from pstar_jax.model.staged import Stage, hidden, stage_seeds

# The metric sums the head returns, each divided by the step's pairs for its log line (TRL's names).
PAIR_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
                "logps/rejected")


def segment_sums(values_BxL: jax.Array, segment_ids_BxL: jax.Array) -> jax.Array:
    """[B, L + 1]: each row's values summed per segment id (id s in column s)."""
    B, L = segment_ids_BxL.shape
    index = (jnp.arange(B, dtype=jnp.int32)[:, None] * (L + 1) + segment_ids_BxL.astype(jnp.int32)).reshape(-1)
    sums = jax.ops.segment_sum(values_BxL.reshape(-1), index, num_segments=B * (L + 1))
    return sums.reshape(B, L + 1)


def pairs_of(per_segment_BxS: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(chosen, rejected), [B, P] each: odd segment ids and the even ids after them."""
    chosen = per_segment_BxS[:, 1::2]
    rejected = per_segment_BxS[:, 2::2]
    if rejected.shape[1] < chosen.shape[1]:  # an odd id in the last slot has no partner: no pair
        rejected = jnp.pad(rejected, ((0, 0), (0, chosen.shape[1] - rejected.shape[1])))
    return chosen, rejected


def pair_count(segment_ids_BxL: np.ndarray, loss_mask_BxL: np.ndarray) -> np.ndarray:
    """[B] pairs per row (host numpy, for the step's global count): chosen segments with trained targets."""
    seg = np.asarray(segment_ids_BxL)
    trained = np.asarray(loss_mask_BxL) != 0
    return np.array([len(np.unique(row[m & (row % 2 == 1)])) for row, m in zip(seg, trained)], np.int64)


def pair_terms(cfg: PreferenceConfig, policy_logp_BxL: jax.Array, ref_logp_BxL: jax.Array | None,
               loss_mask_BxL: jax.Array, segment_ids_BxL: jax.Array) -> dict[str, jax.Array]:
    """Per pair ([B, P] each): ``loss``, TRL's rewards and logps, ``valid`` (1.0 for a real pair),
    and per batch the chosen completions' NLL sum ``nll`` and token count ``chosen_tokens``.

    ``ref_logp_BxL`` is the reference's per-position target log-probs (None for SimPO, which has
    none); both are 0 off the loss mask."""
    mask = loss_mask_BxL.astype(jnp.float32)
    logp, count = (pairs_of(segment_sums(x, segment_ids_BxL)) for x in (policy_logp_BxL * mask, mask))
    (chosen, rejected), (n_chosen, n_rejected) = logp, count
    valid = (n_chosen > 0).astype(jnp.float32)
    def normalised(c: jax.Array, r: jax.Array) -> tuple[jax.Array, jax.Array]:
        if not cfg.length_normalised:
            return c, r
        # TRL averages the sums over each completion's tokens (ipo, simpo), the reference's too
        return c / jnp.maximum(n_chosen, 1.0), r / jnp.maximum(n_rejected, 1.0)
    chosen, rejected = normalised(chosen, rejected)
    if cfg.uses_reference:
        ref_chosen, ref_rejected = normalised(*pairs_of(segment_sums(ref_logp_BxL * mask, segment_ids_BxL)))
        margin = (chosen - rejected) - (ref_chosen - ref_rejected)
        reward_chosen, reward_rejected = cfg.beta * (chosen - ref_chosen), cfg.beta * (rejected - ref_rejected)
    else:  # SimPO: the rewards are the scaled average log-probs themselves
        margin = chosen - rejected - cfg.simpo_gamma / cfg.beta
        reward_chosen, reward_rejected = cfg.beta * chosen, cfg.beta * rejected
    if cfg.loss == "ipo":
        loss = (margin - 1.0 / (2.0 * cfg.beta)) ** 2
    else:  # sigmoid and simpo, with label smoothing
        eps = cfg.label_smoothing
        loss = -jax.nn.log_sigmoid(cfg.beta * margin) * (1.0 - eps) - jax.nn.log_sigmoid(-cfg.beta * margin) * eps
    reward_chosen, reward_rejected = jax.lax.stop_gradient((reward_chosen, reward_rejected))
    in_chosen = (segment_ids_BxL % 2 == 1).astype(jnp.float32) * mask
    return {"loss": loss * valid, "valid": valid,
            "rewards/chosen": reward_chosen, "rewards/rejected": reward_rejected,
            "rewards/accuracies": (reward_chosen > reward_rejected).astype(jnp.float32),
            "rewards/margins": reward_chosen - reward_rejected,
            "logps/chosen": jax.lax.stop_gradient(chosen), "logps/rejected": jax.lax.stop_gradient(rejected),
            "nll": -jnp.sum(policy_logp_BxL * in_chosen), "chosen_tokens": jnp.sum(in_chosen)}


def preference_sums(cfg: PreferenceConfig, policy_logp_BxL: jax.Array, ref_logp_BxL: jax.Array | None,
                    loss_mask_BxL: jax.Array, segment_ids_BxL: jax.Array) -> dict[str, jax.Array]:
    """The batch's sums: ``loss`` (over pairs), ``nll`` and ``chosen_tokens`` (the SFT term's),
    ``pairs``, and each of PAIR_METRICS summed over the real pairs."""
    terms = pair_terms(cfg, policy_logp_BxL, ref_logp_BxL, loss_mask_BxL, segment_ids_BxL)
    valid = terms["valid"]
    out = {name: jnp.sum(terms[name] * valid) for name in PAIR_METRICS}
    out.update(loss=jnp.sum(terms["loss"]), pairs=jnp.sum(valid), nll=terms["nll"],
               chosen_tokens=terms["chosen_tokens"])
    return out


def step_loss(cfg: PreferenceConfig, sums: dict[str, Any], pairs: Any, chosen_tokens: Any) -> Any:
    """The objective from sums and the step's global counts: the mean pair loss, plus ``sft_weight``
    times the mean NLL of the chosen completions' tokens (TRL's rpo_alpha term)."""
    loss = sums["loss"] / jnp.maximum(pairs, 1.0)
    if cfg.sft_weight:
        loss = loss + cfg.sft_weight * sums["nll"] / jnp.maximum(chosen_tokens, 1.0)
    return loss


def step_metrics(sums: dict[str, Any]) -> dict[str, float]:
    """TRL's logged metrics from the step's summed ones: means over its pairs (``nll_loss`` the
    chosen tokens' mean NLL)."""
    pairs = max(float(sums["pairs"]), 1.0)
    out = {name: float(sums[name]) / pairs for name in PAIR_METRICS}
    out["nll_loss"] = float(sums["nll"]) / max(float(sums["chosen_tokens"]), 1.0)
    return out


def compose_preference(model: Any, cfg: PreferenceConfig, compute_dtype: Any = jnp.float32) -> Any:
    """The whole model as one function ``fn(params, batch, ref_logp_BxL) -> (loss, sums)`` of a
    name->tensor mapping, for a step on one batch of preference rows (the reference for the
    engines; ``ref_logp_BxL`` None for SimPO): the model's stages with its ``logps_stage`` head."""
    logps = compose_logps(model, compute_dtype)

    def fn(params: Any, batch: Any, ref_logp_BxL: Any = None) -> tuple[jax.Array, dict[str, jax.Array]]:
        logp = logps(params, batch)
        sums = preference_sums(cfg, logp, ref_logp_BxL, batch.loss_mask, batch.segment_ids)
        return step_loss(cfg, sums, sums["pairs"], sums["chosen_tokens"]), sums
    return fn


def compose_logps(model: Any, compute_dtype: Any = jnp.float32) -> Any:
    """``fn(params, batch) -> logp_BxL``: the model's per-position target log-probs (0 off the loss
    mask), what a reference contributes."""
    stages = list(model.stages(compute_dtype))
    head = model.logps_stage()

    def fn(params: Any, batch: Any) -> jax.Array:
        h = hidden(stages, params, batch)
        return head.apply(tuple(params[n] for n in head.param_names), h, stage_seeds(batch, len(stages) - 1))
    return fn


class PreferenceModel:
    """``model`` under a preference objective, for the engines: the same tensors and stages, the
    head replaced by one that returns the objective's K = 3 sums (the pairs' losses, the SFT
    term's weighted NLL, and 0 for the trained tokens, which are counted only to be reported)
    with TRL's metric sums; ``row_counts`` gives each row's pairs, chosen completion tokens and
    trained tokens, the divisors the engine adds over the step (pstar_jax.data.batch.row_counts).
    Every other attribute is the model's.

    The reference (sigmoid, ipo; SimPO has none) is either in each batch as ``ref_logp`` (full
    fine-tuning: computed once before training), or with ``adapters_off`` the model itself with
    its LoRA adapters zeroed, in the same step (TRL with a peft model and no ref_model): every
    stage then carries the pair (h, h_ref), h_ref going through the same frozen tensors, already
    fetched for h, under stop_gradient (so no backward recomputes it), and the head reads both."""
    n_counts = 3

    def __init__(self, model: Any, cfg: PreferenceConfig, adapters_off: bool = False):
        self.base, self.cfg = model, cfg
        self.paired = adapters_off and cfg.uses_reference  # stages carry (h, h_ref)
        self.reads_ref_logp = cfg.uses_reference and not adapters_off
        self._stages: dict[Any, list[Stage]] = {}
        self._wrapped: dict[Any, Any] = {}

    def __getattr__(self, name: str) -> Any:  # seq_len, vocab_size, param_shapes, init_tensor, ...
        if name in ("base", "cfg", "paired", "_stages", "_wrapped"):
            raise AttributeError(name)
        return getattr(self.base, name)

    def stages(self, compute_dtype: Any) -> list[Stage]:
        dtype = jnp.dtype(compute_dtype)
        if dtype not in self._stages:  # the same Stage objects each time: their compilations are shared
            stages = list(self.base.stages(compute_dtype))
            self._stages[dtype] = [*(self._paired(s, i == 0) for i, s in enumerate(stages[:-1])), self._head()]
        return self._stages[dtype]

    def _off(self, stage: Stage) -> tuple[bool, ...]:
        return tuple(n.endswith((".lora.lora_a", ".lora.lora_b")) for n in stage.param_names)

    def _paired(self, stage: Stage, first: bool) -> Stage:
        """A stage mapping (h, h_ref) to its outputs with and without the adapters (the first: tokens)."""
        if not self.paired:
            return stage
        off, apply = self._off(stage), stage.apply
        key = (apply, off, first)
        if key not in self._wrapped:  # identical blocks keep sharing one apply object
            def paired(params: tuple[jax.Array, ...], x: Any, batch: Any) -> tuple[jax.Array, jax.Array]:
                h, h_ref = (x, x) if first else x
                base = tuple(jnp.zeros_like(p) if o else p for p, o in zip(params, off))
                out = apply(params, h, batch)
                # no adapters in the first stage: both branches are one computation
                ref = out if first and not any(off) else apply(base, h_ref, batch)
                return out, jax.lax.stop_gradient(ref)
            self._wrapped[key] = paired
        return Stage(stage.name, stage.param_names, self._wrapped[key])

    def _head(self) -> Stage:
        logps, cfg, paired = self.base.logps_stage(), self.cfg, self.paired
        off = self._off(logps)

        def apply(params: tuple[jax.Array, ...], x: Any, batch: Any) -> tuple[jax.Array, dict]:
            h, h_ref = x if paired else (x, None)
            logp = logps.apply(params, h, batch)
            if paired:
                base = tuple(jnp.zeros_like(p) if o else p for p, o in zip(params, off))
                ref = jax.lax.stop_gradient(logps.apply(base, h_ref, batch))
            else:
                ref = batch.ref_logp if cfg.uses_reference else None
            sums = preference_sums(cfg, logp, ref, batch.loss_mask, batch.segment_ids)
            terms = jnp.stack([sums["loss"], cfg.sft_weight * sums["nll"], jnp.zeros((), jnp.float32)])
            return terms, {**{name: sums[name] for name in PAIR_METRICS}, "nll": sums["nll"]}
        return Stage("head", logps.param_names, apply)

    def row_counts(self, batch: Any) -> np.ndarray:
        """[B, 3] per row: pairs, chosen completion tokens, trained tokens (host numpy)."""
        if self.reads_ref_logp and batch.ref_logp is None:
            raise DataError(f"the {self.cfg.loss} loss needs the reference's log-probs beside each batch (a LoRA "
                            "run's base, or a --ref-logps file); these rows have none")
        mask = np.asarray(batch.loss_mask, np.float32)
        chosen = mask * (np.asarray(batch.segment_ids) % 2 == 1)
        return np.stack([pair_count(batch.segment_ids, mask).astype(np.float32), chosen.sum(axis=1),
                         mask.sum(axis=1)], axis=1)

    def step_metrics(self, sums: dict[str, float], counts: np.ndarray) -> dict[str, float]:
        """TRL's logged metrics of a step from its summed ones and its global counts."""
        return step_metrics({**sums, "pairs": counts[0], "chosen_tokens": counts[1]})
