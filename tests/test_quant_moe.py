"""A quantized frozen base under a mixture of experts (issue 31 part 3 x issue 32 part 6): a tiny
Qwen3-MoE's and Mixtral's LoRA runs with every expert kernel in nf4 (or int8) chunks equal, in
fp32 within rounding, the plain LoRA runs over a base that holds those kernels dequantized in
full, with adapters on attention only or on the experts too; the router stays unquantized; the
plan counts the quantized experts' bytes and their share; bad sizes are one line; the merged
export over the dequantized base loads in transformers."""

import jax.numpy as jnp
import numpy as np
import pytest

from pstar_jax.config import ConfigError
from pstar_jax.config.lora import LoraConfig
from pstar_jax.model.freeze import trainable
from pstar_jax.model.lora import frozen_for_lora
from pstar_jax.model.quant_bytes import dequantized, quant_rule, slot_bytes, to_bytes
from pstar_models import build_from_hf
from pstar_models.lora import LoraSpec
import test_hf_models as hf_models
import test_quant_engine as qe  # (a module: its tests imported by name would be collected here too)
from test_moe import MIXTRAL, QWEN3_MOE

SEQ = qe.SEQ
# nf4 needs every frozen kernel in whole blocks of 64: Mixtral at width 32 (test_moe's 36 x 28 is not).
QWEN = {**QWEN3_MOE, "vocab_size": 256, "max_position_embeddings": SEQ}
MIX = {**MIXTRAL, "vocab_size": 256, "hidden_size": 32, "num_attention_heads": 4, "intermediate_size": 24,
       "max_position_embeddings": SEQ}
ROUTER = "blocks.0.mlp.router.kernel"


def lora_moe(config, targets=None):
    """The LoRA model of ``config`` (rank 4, alpha 16), its initial tensors and frozen set."""
    m = build_from_hf(config, seq_len=SEQ, lora=LoraSpec(rank=4, alpha=16.0, targets=tuple(
        (targets or "").split(",")) if targets else ()))
    init = {n: np.asarray(m.init_tensor(n, 7), np.float32) for n in m.param_shapes()}
    return m, init, frozen_for_lora(m, LoraConfig(rank=4, alpha=16.0, targets=targets))


@pytest.mark.slow  # two tiny-MoE engines traced and trained per case: 25-45 s on 2 cores
@pytest.mark.parametrize("config,targets,kind", [(QWEN, None, "nf4"), (MIX, "attn.*,mlp.experts.*", "nf4"),
                                                 (QWEN, "attn.*,mlp.experts.*", "int8")],
                         ids=["qwen3_moe-attn-nf4", "mixtral-experts-nf4", "qwen3_moe-experts-int8"])
def test_lora_over_quantized_experts_trains_as_lora_over_their_dequantized_kernels(config, targets, kind):
    m, init, frozen = lora_moe(config, targets)
    shapes = m.param_shapes()
    rule = quant_rule(kind, shapes, trainable(frozen))
    chosen = [n for n in shapes if rule(n)]
    experts = [n for n in chosen if ".mlp.experts." in n]
    assert len(experts) == 2 * 3 * m.config.n_experts and not rule(ROUTER) and ROUTER in frozen
    reference = dict(init)
    for n in chosen:
        reference[n] = dequantized(to_bytes(init[n], kind), shapes[n], kind, np.float32)
    quantized, plain = qe.tight(m, init, frozen, kind), qe.tight(m, reference, frozen)
    layout = quantized.layout
    assert {layout.kinds[layout.slot(n).chunk] for n in experts} == {kind}
    assert sum(layout.slot(n).numel for n in experts) == sum(slot_bytes(shapes[n], kind) for n in experts)
    assert quantized.plan.h2d_bytes > 0, "the budget must move chunks every step"
    qe.train_alike(plain, quantized, 4)
    got, want = quantized.params(), plain.params()
    for n in chosen:
        np.testing.assert_array_equal(got[n], reference[n], err_msg=n)
    np.testing.assert_array_equal(got[ROUTER], init[ROUTER])  # unquantized, frozen
    adapters = [n for n in shapes if ".lora." in n]
    assert any(".mlp.experts." in n for n in adapters) == bool(targets)
    for n in adapters:
        np.testing.assert_allclose(got[n], want[n], rtol=1e-4, atol=1e-6, err_msg=n)


def test_the_plan_counts_the_quantized_experts_and_their_share():
    """pstar-plan's report over an nf4 Mixtral: the experts' chunks hold their nf4 bytes (4.127
    bits a value), the report's model data counts them so, and the experts' line their share."""
    import pstar_jax as ps
    from pstar_jax.plan.machine import H200
    m, _, frozen = lora_moe(MIX)
    report = ps.plan_report(m, ps.EngineConfig(device_memory=2**30, base_quant="nf4"), 2, qe.mesh(), H200, 2**30,
                            lora=LoraConfig(rank=4, alpha=16.0))
    slots = {s.name: s for s in report.planned.layout.slots}
    experts = [n for n in slots if ".mlp.experts." in n]
    nf4_bytes = sum(slot_bytes(slots[n].shape, "nf4") for n in experts)
    assert all(slots[n].quant == "nf4" for n in experts) and not slots[ROUTER].quant
    assert nf4_bytes <= report.group_bytes("experts") < nf4_bytes + max(report.planned.layout.numels)
    quant_params, quant_bytes = report.quantized
    assert quant_params == sum(slots[n].n_params for n in slots if slots[n].quant) and quant_bytes >= nf4_bytes
    line = next(line for line in report.lines() if line.startswith("experts: "))
    assert "chunks of their own" in line
    assert "frozen in nf4 at 0.5" in "\n".join(report.lines())


@pytest.mark.parametrize("kind", ["nf4", "int8"])
def test_an_expert_off_the_nf4_block_is_one_line_naming_it(kind, tmp_path, capsys):
    """pstar-plan --base-quant over a Mixtral whose experts are 32 x 19 (608 values, 9.5 blocks):
    nf4 refuses an expert kernel by name in one line; int8 (no block) plans it."""
    from pstar_jax.cli.plan import main as plan_main
    from test_hf import write_family_checkpoint
    src = tmp_path / "moe"
    write_family_checkpoint(str(src), build_from_hf({**MIX, "intermediate_size": 19}, seq_len=SEQ))
    code = plan_main(["--init-from-hf", str(src), "--lora-rank", "4", "--base-quant", kind, "--seq-len", "16",
                      "--batch-size", "2", "--no-search", "--device-memory", "1GiB", "--host-memory", "4GiB"])
    captured = capsys.readouterr()
    if kind == "int8":
        assert code == 0, captured.err
        assert "frozen in int8" in captured.out
        return
    err = captured.err.strip().splitlines()
    assert code != 0 and len(err) == 1 and "Traceback" not in err[0], captured.err
    assert "nf4 quantizes whole blocks of 64" in err[0] and ".mlp.experts." in err[0] and "(19, 32)" in err[0]
    assert "use int8" in err[0] and "drop --base-quant" in err[0]


def test_quant_rule_keeps_the_router_and_needs_a_frozen_kernel():
    m, _, frozen = lora_moe(QWEN)
    shapes = m.param_shapes()
    rule = quant_rule("nf4", shapes, trainable(frozen))
    assert {n for n in shapes if rule(n)} == {n for n in frozen if n.startswith("blocks.") and n.endswith(".kernel")
                                               and ".router." not in n}
    with pytest.raises(ConfigError, match="no block kernel is frozen"):
        quant_rule("nf4", shapes, trainable(frozenset()))


@pytest.mark.slow  # a tiny-Mixtral run traced, trained and exported: about 20 s on 2 cores
@pytest.mark.hf_reference
def test_export_hf_over_an_nf4_mixture_of_experts_merges_into_the_dequantized_base(tmp_path, capsys):
    """pstar-train --base-quant nf4 --lora-targets attn.*,mlp.experts.* on a Mixtral checkpoint:
    --export-hf holds each expert kernel dequantized plus its adapter's product (fp32), the
    router as the source had it, and transformers loads it with no missing or unexpected tensor."""
    transformers = pytest.importorskip("transformers")
    from safetensors.numpy import load_file
    from pstar_models import hf_tensors
    from test_hf import lora_run_exports
    source, config = lora_run_exports(tmp_path, MIX, capsys, extra=("--lora-targets", "attn.*,mlp.experts.*",
                                                                    "--base-quant", "nf4"))
    assert "w1" in config["target_modules"] and "gate" not in config["target_modules"]
    merged, adapter = load_file(tmp_path / "merged" / "model.safetensors"), load_file(
        tmp_path / "adapter" / "adapter_model.safetensors")
    names = hf_tensors(build_from_hf(MIX, seq_len=16))
    for n in ("blocks.1.mlp.experts.2.down.kernel", "blocks.0.attn.q.kernel"):
        hf_name = names[n].name
        kernel = dequantized(to_bytes(source[hf_name].T, "nf4"), source[hf_name].T.shape, "nf4", np.float32)
        a = adapter[f"base_model.model.{hf_name[:-len('.weight')]}.lora_A.weight"]  # [rank, in]
        b = adapter[f"base_model.model.{hf_name[:-len('.weight')]}.lora_B.weight"]  # [out, rank]
        np.testing.assert_array_equal(merged[hf_name], kernel.T + 4.0 * (b @ a), err_msg=n)  # alpha 16 / rank 4
        assert np.abs(b).max() > 0, n  # trained
    router = names["blocks.1.mlp.router.kernel"].name
    np.testing.assert_array_equal(merged[router], source[router])
    hf_model, info = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path / "merged"), attn_implementation="eager", output_loading_info=True)
    assert not any(info.values()), info
    model = build_from_hf(MIX, seq_len=16)  # ours over the merged tensors gives transformers' logits
    params = {n: jnp.asarray(merged[hf].T if t else merged[hf]) for n, (hf, t, _) in hf_tensors(model).items()}
    tokens = hf_models.tokens_BxL(MIX["vocab_size"], L=16)
    ours = np.asarray(hf_models.module_of(model, params)(jnp.asarray(tokens)))
    theirs = hf_models.hf_logits(hf_model.float().eval(), tokens)
    scale = float(np.abs(theirs).max())  # (the tiny init's logits are small, but not zero)
    assert scale > 0.1
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=2e-6 * scale)
