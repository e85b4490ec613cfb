"""A LoRA training step against peft's on transformers' model: the same base weights and adapter
values give the same loss and the same gradients for every adapter and for the base tensors trained
in full (peft's modules_to_save), in fp32; what a LoRA run freezes and trains by name.

The comparisons need torch, transformers and peft (test extras); the rest run without them.
"""

import copy

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pstar_jax.config.lora import LoraConfig
from pstar_jax.io.peft_io import PROJECTIONS, first_instance
from pstar_jax.model.lora import adapter_names, frozen_for_lora
from pstar_jax.model.staged import compose_loss
from pstar_models import build_from_hf, hf_tensors
from pstar_models.lora import LoraSpec
from test_hf_models import CHECKPOINTS, SEQ_LEN, hf_reference, to_pstar, tokens_BxL
from test_moe import MIXTRAL, QWEN3_MOE

EPS32 = float(np.finfo(np.float32).eps)
# checkpoint, LoRA settings, base modules trained in full (our names; peft's modules_to_save suffixes)
CASES = {
    "llama": ("llama3", dict(rank=4, alpha=8.0), {}),
    "qwen3_norms": ("qwen3_tied", dict(rank=4, alpha=8.0), {"blocks.*.attn.q_norm": "q_norm",
                                                           "blocks.*.attn.k_norm": "k_norm"}),
    "qwen3_rslora_head": ("qwen3_untied", dict(rank=3, alpha=5.0, rslora=True), {"head": "lm_head"}),
    # every expert's three matrices beside attention's projections (routing picks which train)
    "qwen3_moe": (QWEN3_MOE, dict(rank=4, alpha=8.0, targets=("attn.*", "mlp.experts.*")), {}),
    "mixtral": (MIXTRAL, dict(rank=2, alpha=4.0, rslora=True, targets=("attn.*", "mlp.experts.*")), {}),
}


def adapter_values(model, seed=0):
    """Our adapters with both halves nonzero (peft starts lora_b at zero, which leaves lora_a no gradient)."""
    rng = np.random.default_rng(seed)
    shapes = model.param_shapes()
    return {n: (0.3 * rng.standard_normal(shapes[n])).astype(np.float32) for n in adapter_names(model)}


def peft_name(model, name):
    """peft's parameter name for one of our adapter tensors or base tensors trained in full."""
    if name.endswith((".lora.lora_a", ".lora.lora_b")):
        module, half = name.rsplit(".lora.", 1)
        hf = hf_tensors(model)[module + ".kernel"].name.removesuffix(".weight")
        return f"base_model.model.{hf}.{'lora_A' if half == 'lora_a' else 'lora_B'}.default.weight"
    hf, _, _ = hf_tensors(model)[name]
    module, leaf = hf.rsplit(".", 1)
    return f"base_model.model.{module}.modules_to_save.default.{leaf}"


def peft_step(hf_model, model, lora_config, values, tokens, dtype):
    """peft's loss and its gradients of ``values`` (our names and layout) on ``tokens``, with the
    model in ``dtype``: every tensor peft trains is one of ours."""
    import peft
    import torch
    peft_model = peft.get_peft_model(copy.deepcopy(hf_model).to(dtype), lora_config)
    params = dict(peft_model.named_parameters())
    assert {n for n, p in params.items() if p.requires_grad} == {peft_name(model, n) for n in values}
    with torch.no_grad():
        for name, value in values.items():
            params[peft_name(model, name)].copy_(torch.from_numpy(np.array(value.T if value.ndim == 2 else value)))
    ids = torch.from_numpy(tokens).long()
    out = peft_model(ids, labels=ids)  # transformers shifts the labels itself
    out.loss.backward()
    grads = {n: params[peft_name(model, n)].grad.numpy() for n in values}
    return out.loss.item(), {n: g.T if g.ndim == 2 else g for n, g in grads.items()}


def fp32_drift(fp32, fp64):
    """How far torch's fp32 step lies from its float64 one, at worst over the tensors, relative to
    each tensor's scale: the rounding that summing the B*L token terms in another order may cost."""
    return max(float(np.abs(np.asarray(fp32[n], np.float64) - fp64[n]).max() / np.abs(fp64[n]).max()) for n in fp64)


# Our fp32 gradients' own spread from run to run, relative to a tensor's largest entry: up to 234
# eps measured on the llama case (a gradient sums B*L*D products much larger than itself, and XLA's
# CPU matmuls split those sums over threads differently from run to run), as is torch's drift (its
# 77 to 128 eps varied from run to run too). A wrong gradient is off by the entries' own size.
OWN_SPREAD = 512 * EPS32


def assert_within(ours, fp64, drift, what):
    """``ours`` (fp32) within twice torch's fp32 drift (OWN_SPREAD at least) of the float64
    reference, at the values' scale."""
    ours, fp64 = np.asarray(ours, np.float64), np.asarray(fp64, np.float64)
    scale = float(np.abs(fp64).max())
    assert scale > 0, f"{what} has no gradient"
    np.testing.assert_allclose(ours, fp64, rtol=0, atol=max(2 * drift, OWN_SPREAD) * scale, err_msg=what)


@pytest.mark.hf_reference
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_a_lora_step_gives_pefts_loss_and_gradients(case):
    torch = pytest.importorskip("torch")
    peft = pytest.importorskip("peft")
    checkpoint, settings, saved = case
    config = CHECKPOINTS[checkpoint] if isinstance(checkpoint, str) else checkpoint  # a name, or a config.json
    model = build_from_hf(config, seq_len=SEQ_LEN, lora=LoraSpec(**settings))
    if model.config.n_experts:
        import transformers
        if int(transformers.__version__.split(".")[0]) >= 5:
            pytest.skip("transformers 5.x fuses the experts into 3-D tensors whose peft adapters are named apart "
                        "from ours; on 5.x tests/test_peft_io.py checks that peft loads our expert adapters")
        torch.manual_seed(0)  # a routing near-tie would flip between fp32 and fp64: seeded weights without one
    hf_model = hf_reference(config)
    base = to_pstar(model, {k: v.detach().numpy() for k, v in hf_model.state_dict().items()})
    trained = set(model.param_shapes()) - frozen_for_lora(
        model, LoraConfig(rank=settings["rank"], modules_to_save=",".join(saved) or None))
    values = {**adapter_values(model), **{n: np.asarray(base[n]) for n in trained if n in base}}
    assert set(values) == trained

    projections = [first_instance(p) for p in PROJECTIONS[model.config.family]
                   if model.config.lora.targets_path(first_instance(p))]
    targets = sorted({hf_tensors(model)[f"blocks.0.{p}.kernel"].name.split(".")[-2] for p in projections})
    lora_config = peft.LoraConfig(r=settings["rank"], lora_alpha=settings["alpha"],
                                  use_rslora=settings.get("rslora", False), target_modules=targets,
                                  modules_to_save=list(saved.values()) or None, lora_dropout=0.0,
                                  task_type="CAUSAL_LM")
    tokens = tokens_BxL(model.config.vocab_size, L=SEQ_LEN + 1)
    loss64, grads64 = peft_step(hf_model, model, lora_config, values, tokens, torch.float64)
    loss32, grads32 = peft_step(hf_model, model, lora_config, values, tokens, torch.float32)

    frozen = {n: jnp.asarray(v) for n, v in base.items() if n not in values}
    loss_fn = compose_loss(model.stages(jnp.float32))
    loss, grads = jax.value_and_grad(lambda t: loss_fn({**frozen, **t}, jnp.asarray(tokens[:, :-1]),
                                                       jnp.asarray(tokens[:, 1:])))(
        {n: jnp.asarray(v) for n, v in values.items()})
    drift = fp32_drift({"loss": loss32, **grads32}, {"loss": loss64, **grads64})
    assert drift < 1e3 * EPS32, "torch's own fp32 step should be close to its float64 one"
    assert_within(float(loss), loss64, drift, "loss")
    for name in sorted(trained):
        assert_within(grads[name], grads64[name], drift, name)


def test_a_qwen3_lora_run_freezes_the_qk_norms_unless_saved():
    """The q/k norms are base tensors: frozen beside the other norms, trained when modules_to_save names them."""
    model = build_from_hf(CHECKPOINTS["qwen3_tied"], seq_len=SEQ_LEN, lora=LoraSpec(rank=2, alpha=4.0))
    norms = {f"blocks.{i}.attn.{x}_norm.scale" for i in range(2) for x in "qk"}
    assert norms <= frozen_for_lora(model, LoraConfig(rank=2))
    saved = frozen_for_lora(model, LoraConfig(rank=2, modules_to_save="blocks.*.attn.q_norm,blocks.*.attn.k_norm"))
    assert not norms & saved and saved == frozen_for_lora(model, LoraConfig(rank=2)) - norms
    assert {n.split(".", 2)[2].rsplit(".lora.", 1)[0] for n in adapter_names(model)} == set(PROJECTIONS["qwen3"])
