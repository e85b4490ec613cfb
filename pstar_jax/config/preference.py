"""Preference tuning: the ``PreferenceConfig`` section (``--dpo-*`` flags); the losses are
pstar_jax.model.preference.

The objective follows TRL 0.27 (DPOTrainer's ``dpo_loss`` and ``rpo_alpha``, CPOTrainer's SimPO):
  * ``sigmoid``: DPO, -log sigmoid(beta * margin) on the summed completion log-probs of policy
    and reference, with label smoothing eps: (1 - eps) of it plus eps of -log sigmoid(-beta * margin);
  * ``ipo``: IPO, (margin - 1 / (2 beta))^2 on per-token averaged log-probs (TRL divides both the
    policy's and the reference's sums by the completion length);
  * ``simpo``: SimPO, reference-free: -log sigmoid(beta * (avg logp chosen - avg logp rejected) -
    gamma), label smoothing as sigmoid; TRL's CPOTrainer with ``loss_type="simpo"``.
``sft_weight`` adds TRL's ``rpo_alpha`` term (CPO's ``cpo_alpha`` for SimPO): that weight times the
mean negative log-likelihood of the chosen completions' tokens over the whole step.
"""

from __future__ import annotations

import dataclasses
import math

from pstar_jax.config.errors import ConfigError
from pstar_jax.config.fields import option, section

LOSS_TYPES = ("sigmoid", "ipo", "simpo")
OBJECTIVES = ("sft", "dpo")


@section
class PreferenceConfig:
    """The objective (SFT or preference tuning), the preference loss (TRL's definitions) and its parameters."""
    objective: str = option("sft", "what to train: sft (the loss over the trained tokens) or dpo (preference "
                            "tuning on a preference file from pstar-tokens --preference: --dpo-loss picks DPO, "
                            "IPO or SimPO)", flag="--objective", choices=OBJECTIVES, math_changing=True)
    loss: str = option("sigmoid", "preference loss: sigmoid (DPO), ipo (per-token averaged log-probs) or simpo "
                       "(reference-free, length-normalised)", flag="--dpo-loss", choices=LOSS_TYPES,
                       math_changing=True)
    beta: float = option(0.1, "beta: the strength of the pull toward the reference (TRL's default 0.1); for SimPO "
                         "the reward scale", flag="--dpo-beta", math_changing=True)
    label_smoothing: float = option(0.0, "label smoothing: the share of pairs assumed mislabelled, in [0, 0.5) "
                                    "(sigmoid and simpo)", flag="--dpo-label-smoothing", metavar="EPS",
                                    math_changing=True)
    simpo_gamma: float = option(0.5, "SimPO's target reward margin gamma (TRL's default 0.5)",
                                flag="--simpo-gamma", metavar="GAMMA", math_changing=True)
    sft_weight: float = option(0.0, "weight of an SFT term on the chosen completions (TRL's rpo_alpha): the "
                               "step's mean token NLL of the chosen answers", flag="--dpo-sft-weight",
                               metavar="W", math_changing=True)
    ref_logps: str | None = option(None, "the stored reference of full fine-tuning with sigmoid or ipo (each pair's "
                                   "log-probs under the initial weights; pstar_jax.data.ref_logps); left out, "
                                   "NAME.ref.f32 beside the preference file, computed before training when absent",
                                   flag="--ref-logps", metavar="FILE")

    def __post_init__(self) -> None:
        if self.objective not in OBJECTIVES:
            raise ConfigError(f"PreferenceConfig.objective must be one of {', '.join(OBJECTIVES)}, got "
                              f"{self.objective!r}")
        if self.loss not in LOSS_TYPES:
            raise ConfigError(f"PreferenceConfig.loss must be one of {', '.join(LOSS_TYPES)}, got {self.loss!r}")
        for name, low in (("beta", 0.0), ("simpo_gamma", -math.inf), ("sft_weight", -math.inf)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or not value > low:
                bound = "a positive number" if low == 0.0 else "a finite number"
                raise ConfigError(f"PreferenceConfig.{name} must be {bound}, got {value!r}")
        if self.sft_weight < 0:
            raise ConfigError(f"PreferenceConfig.sft_weight must be 0 (no SFT term) or positive, got "
                              f"{self.sft_weight!r}")
        ls = self.label_smoothing
        if isinstance(ls, bool) or not isinstance(ls, (int, float)) or not 0.0 <= ls < 0.5:
            raise ConfigError(f"PreferenceConfig.label_smoothing must lie in [0, 0.5), got {ls!r}")
        if ls and self.loss == "ipo":
            raise ConfigError("PreferenceConfig.label_smoothing applies to the sigmoid and simpo losses; IPO has "
                              "none (TRL ignores it): leave it at 0 or pick another loss")
        if self.simpo_gamma != 0.5 and self.loss != "simpo":
            raise ConfigError(f"PreferenceConfig.simpo_gamma is SimPO's margin; set PreferenceConfig.loss to simpo "
                              f"to use it (the loss is {self.loss})")
        if self.ref_logps is not None and not self.uses_reference:
            raise ConfigError("PreferenceConfig.ref_logps names a reference, but the simpo loss has none; drop "
                              "--ref-logps or pick the sigmoid or ipo loss")
        # Only a file pstar-train wrote: the errors about a stale one tell the user to delete it.
        if self.ref_logps is not None and not str(self.ref_logps).endswith(".ref.f32"):
            raise ConfigError(f"PreferenceConfig.ref_logps must name a NAME.ref.f32 file, the reference pstar-train "
                              f"writes beside a preference file, got {self.ref_logps!r}")

    def given(self) -> list[str]:
        """The preference settings that differ from their defaults (an SFT run refuses them)."""
        return [f.name for f in dataclasses.fields(self) if f.name != "objective"
                and getattr(self, f.name) != f.default]

    @property
    def uses_reference(self) -> bool:
        """Whether the loss reads a reference model's log-probs (SimPO does not)."""
        return self.loss != "simpo"

    @property
    def length_normalised(self) -> bool:
        """Whether sequence log-probs are averaged over their completion tokens (TRL: ipo, simpo)."""
        return self.loss in ("ipo", "simpo")
