"""The model layer: what a model is to pstar_jax (``staged``: a chain of stages, each a pure function
of its parameters), and the pieces a stageable model is built from: attention that never holds
L x L scores (``attention``), the tiled loss head (``loss``), sequence tiles (``tiling``), FLOP
counts of compiled stages (``flops``), frozen tensors (``freeze``) and LoRA's adapters (``lora``).

Model families (pstar_models, or a user's own module) import from here and from the layers below
(config, data), never from the engines or the planner. The names below are the model writer's API
(``from pstar_jax.model import StagedModel, causal_attention``); each is imported on first use.
"""

from pstar_jax._moved import lazy_attributes

# name -> the module of this package that defines it, imported when the name is first used
_LAZY = {
    **dict.fromkeys(("Stage", "StagedModel", "NNXStaged", "decays", "n_params", "flops_per_token", "init_params",
                     "validate_stages", "compose_loss", "stage_seeds", "cast_params", "token_cross_entropy",
                     "cross_entropy", "masked_loss_sum"), "staged"),
    "causal_attention": "attention", "linear_cross_entropy_sum": "loss",
    **dict.fromkeys(("TileBudget", "map_tiles", "tiled_over_sequence", "mlp_tile", "kept_projection"), "tiling"),
}


__getattr__, __dir__ = lazy_attributes(__name__, _LAZY)

__all__ = sorted(_LAZY)
