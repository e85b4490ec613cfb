"""A frozen base stored quantized (EngineConfig.base_quant, issue 31 part 5(b)): a tiny Llama's
LoRA run from a Hugging Face directory with its projection kernels in nf4 or int8 chunks equals,
in fp32 within rounding, the plain LoRA run over a base that holds those kernels dequantized in
full; the chunks hold the quantized bytes the plan counts, the stages compile nothing the trace
did not, and params() and exports read the dequantized kernels."""

import dataclasses

import jax
import numpy as np
import pytest

from pstar_jax.config import ConfigError, EngineConfig
from pstar_jax.engine.memory import Space
from pstar_jax.engine.optim import default_tx
from pstar_jax.model.freeze import trainable
from pstar_jax.model.lora import WithAdapters
from pstar_jax.model.quant_bytes import dequantized, quant_rule, slot_bytes, to_bytes
from pstar_jax.plan.machine import H200
from pstar_jax.planner.build import chunked_engine
from pstar_models import hf as mhf
from frozen_engines import OPTIM, hf_lora_llama, mesh
from sft_batches import batches

SEQ = 64


def base(tmp_path):
    """A tiny Llama's HF directory (fp32), its LoRA model, the tensors to start from and the frozen set."""
    _, m, hf, frozen = hf_lora_llama(tmp_path, d_ff=192, seq=SEQ)
    return m, WithAdapters(hf, m, 0), frozen


def build(m, init, frozen, quant=None, budget=None):
    cfg = EngineConfig(device_memory=budget, precision="fp32", base_quant=quant)
    return chunked_engine(m, cfg, default_tx(OPTIM), mesh(), (4, SEQ), H200, clip_norm=1e6, host_bytes=10**9,
                          init_params=init, trainable=trainable(frozen))


def tight(m, init, frozen, quant=None):
    """An engine whose chunks move every step: room for the busiest moment and two stages' reads."""
    shape = build(m, init, frozen, quant).plan_for((4, SEQ)).shape
    reads = max(sum(shape.chunk_bytes[c] for c in cs) for cs in shape.stage_chunks)
    return build(m, init, frozen, quant, shape.busiest_non_model_bytes + 2 * reads + max(shape.chunk_bytes))


def train_alike(plain, quantized, n_steps):
    """``n_steps`` steps of both engines: equal losses and grad norms in fp32, the quantized one
    moving the bytes it predicted and compiling nothing its trace did not."""
    traced = {key for key in quantized.fns._cache if isinstance(key, tuple)}
    for i, step in enumerate(batches(n_steps, seed=3)):
        a, b = plain.step(step), quantized.step(step)
        # fp32 sums over one tile of output channels at a time (model/quant.quant_matmul, and the
        # grouped experts' model/quant_grouped.py) against whole matmuls: the losses agree to a few
        # float32 roundings at their scale (~5.5).
        assert abs(a.loss - b.loss) <= 1e-6 * abs(a.loss), (i, a.loss, b.loss)
        assert abs(a.grad_norm - b.grad_norm) <= 1e-5 * a.grad_norm, (i, a.grad_norm, b.grad_norm)
        assert b.h2d_bytes == b.predicted_h2d_bytes, i
    assert {key for key in quantized.fns._cache if isinstance(key, tuple)} == traced


@pytest.mark.slow  # two tiny-Llama engines traced and trained per kind: about 15 s on 2 cores
@pytest.mark.parametrize("kind", ["nf4", "int8"])
def test_a_quantized_base_trains_as_lora_over_its_dequantized_kernels(tmp_path, kind):
    m, init, frozen = base(tmp_path)
    shapes = m.param_shapes()
    rule = quant_rule(kind, shapes, trainable(frozen))
    chosen = [n for n in shapes if rule(n)]
    assert chosen and all(n.startswith("blocks.") and n.endswith(".kernel") for n in chosen)
    assert not any(rule(n) for n in shapes if "norm" in n or "embed" in n or n.startswith("head"))
    # The reference: the same kernels quantized and dequantized in full, as a plain fp32 frozen base.
    reference = {n: np.asarray(init[n], np.float32) for n in shapes}
    for n in chosen:
        reference[n] = dequantized(to_bytes(reference[n], kind), shapes[n], kind, np.float32)
    quantized, plain = tight(m, init, frozen, kind), tight(m, reference, frozen)
    layout = quantized.layout
    assert {layout.kinds[layout.slot(n).chunk] for n in chosen} == {kind}
    for c in (c for c, k in enumerate(layout.kinds) if k == kind):  # uint8 chunks of the quantized bytes
        held = [quantized.store.peek(key) for key in (("param", c),) if key in quantized.store]
        assert all(h.dtype == np.uint8 and h.size == layout.numel_of(c) for h in held)
        assert quantized.plan.chunk_bytes[c] == layout.numel_of(c)
    assert sum(layout.slot(n).numel for n in chosen) == sum(slot_bytes(shapes[n], kind) for n in chosen)
    moved = quantized.plan.h2d_bytes > 0 and plain.plan.h2d_bytes > 0
    assert moved, "the budgets must move chunks every step"

    compiled = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, secs, **kw: compiled.append(kw.get("fun_name", event))
        if event == "/jax/core/compile/backend_compile_duration" else None)
    try:
        train_alike(plain, quantized, 5)
    finally:
        jax.monitoring.clear_event_listeners()
    held_out = batches(1, seed=9)[0]
    assert abs(plain.evaluate(held_out) - quantized.evaluate(held_out)) <= 1e-6 * abs(plain.evaluate(held_out))
    # params(): the kernels dequantized (exactly the reference's), the adapters trained alike.
    got, want = quantized.params(), plain.params()
    for n in chosen:
        np.testing.assert_array_equal(got[n], reference[n], err_msg=n)
    for n in (n for n in shapes if ".lora." in n):
        np.testing.assert_allclose(got[n], want[n], rtol=1e-4, atol=1e-6, err_msg=n)
    assert quantized.store.bytes[Space.HOST] <= quantized.plan.peak_host_bytes


def test_a_quantization_without_a_frozen_base_or_beside_a_disk_is_one_line():
    from pstar_models.gpt import StagedGPT, preset
    m = StagedGPT(preset("tiny"))
    with pytest.raises(ConfigError) as err:  # nothing frozen: nothing to quantize
        chunked_engine(m, EngineConfig(base_quant="nf4", precision="fp32"), default_tx(OPTIM), mesh(), (4, 64), H200)
    assert "no block kernel is frozen" in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="must be one of nf4, int8"):
        EngineConfig(base_quant="nf3")
    with pytest.raises(ConfigError, match="drop EngineConfig.disk_memory or EngineConfig.base_quant"):
        EngineConfig(base_quant="nf4", disk_memory=10**9)


def test_nf4_of_a_kernel_off_the_block_is_one_line_before_anything_is_allocated():
    """A frozen kernel whose size is not a multiple of nf4's block of 64 is refused by name while
    the layout is built, before any chunk exists."""
    from pstar_models.gpt import StagedGPT, preset
    m = StagedGPT(dataclasses.replace(preset("tiny"), d_model=36, n_head=2))  # 36 x 108 = 3888 = 60.75 blocks
    frozen = {n for n in m.param_shapes() if n.startswith("blocks.")}
    with pytest.raises(ConfigError) as err:
        chunked_engine(m, EngineConfig(base_quant="nf4", precision="fp32"), default_tx(OPTIM), mesh(), (4, 64), H200,
                       trainable=trainable(frozen))
    assert "nf4 quantizes whole blocks of 64" in str(err.value) and "blocks.0." in str(err.value)
    assert "\n" not in str(err.value)


@pytest.mark.hf_reference
def test_the_nf4_base_is_bitsandbytes_qlora_base_of_the_hugging_face_weights(tmp_path):
    """Each quantized kernel of a tiny Llama read from its HF directory holds bitsandbytes'
    quantize_4bit (nf4, blocks of 64, compress_statistics) of the torch weight [out, in]: the
    4-bit codes bit for bit, and the dequantized kernel equal to bitsandbytes' dequantize_4bit
    within the last bit of the scales' mean on every block whose 8-bit scale code agrees
    (tests/test_quant.py: bitsandbytes' CPU kernel rounds that code through a lookup table, one
    step off for under 1% of blocks)."""
    torch = pytest.importorskip("torch")
    F = pytest.importorskip("bitsandbytes.functional")
    from safetensors.numpy import load_file
    from pstar_jax.model.quant_bytes import from_bytes
    m, init, frozen = base(tmp_path)
    weights, names = load_file(str(tmp_path / "base" / "model.safetensors")), mhf.hf_tensors(m)
    rule = quant_rule("nf4", m.param_shapes(), trainable(frozen))
    agree = blocks = 0
    for n in (n for n in m.param_shapes() if rule(n)):
        w = weights[names[n].name]  # [out, in], as transformers and bitsandbytes hold it
        ours_bytes = to_bytes(np.asarray(init[n], np.float32), "nf4")
        packed, state = F.quantize_4bit(torch.from_numpy(np.ascontiguousarray(w)), blocksize=64,
                                        compress_statistics=True, quant_type="nf4")
        q = from_bytes(jax.numpy.asarray(ours_bytes), m.param_shapes()[n], "nf4", np.float32)
        np.testing.assert_array_equal(np.asarray(q.codes), packed.numpy().reshape(-1), err_msg=n)
        same = np.asarray(q.absmax) == state.absmax.numpy()
        theirs = F.dequantize_4bit(packed, state).float().numpy().reshape(-1, 64)
        ours = dequantized(ours_bytes, m.param_shapes()[n], "nf4", np.float32).T.reshape(-1, 64)
        # The offset, the block scales' mean: ours in float64 rounded once, torch's a float32 sum of
        # positive values, within (n - 1) u of the exact one in any order (Higham, section 4.2). A
        # value is its code (|code| <= 1) times its block's scale, which holds the offset, so it
        # differs by at most that much, and a rounding of the product.
        eps = np.finfo(np.float32).eps
        off = (same.size - 1) * eps / 2 * state.offset.item() + np.spacing(np.float32(state.offset.item()))
        assert abs(float(q.offset) - state.offset.item()) <= off, n
        np.testing.assert_allclose(ours[same], theirs[same], rtol=2 * eps, atol=off, err_msg=n)
        agree, blocks = agree + same.sum(), blocks + same.size
    assert agree >= 0.99 * blocks, (agree, blocks)


@pytest.mark.slow  # a tiny-Llama run traced, trained and exported twice: about 10 s on 2 cores
def test_pstar_train_with_an_nf4_base_exports_the_adapters_and_a_merge_into_the_dequantized_base(tmp_path, capsys):
    """pstar-train --init-from-hf --lora-rank --base-quant nf4: trains, --export-lora writes the
    adapters as a plain LoRA run's export does (peft loads them over the bf16 base), and
    --export-hf holds each quantized kernel dequantized plus its adapter's product, in fp32 then
    cast once to the export dtype, saying so; pstar-export writes the same from the checkpoint."""
    from safetensors.numpy import load_file
    from pstar_jax.cli.export import main as export_main
    from pstar_jax.cli.train import main as train_main
    from pstar_jax.plan.machine import save_machine
    m, init, frozen = base(tmp_path)
    tokens = np.random.default_rng(0).integers(0, 256, 20_000).astype(np.uint16)
    np.save(tmp_path / "tokens.npy", tokens)
    tokens.tofile(tmp_path / "tokens.u16.bin")
    save_machine(dataclasses.replace(H200, name="h200-file"), tmp_path / "machine.json")
    argv = ["--init-from-hf", str(tmp_path / "base"), "--lora-rank", "4", "--lora-alpha", "16", "--base-quant", "nf4",
            "--steps", "2", "--batch-size", "4", "--data-parallel", "1", "--precision", "fp32", "--data", str(tmp_path / "tokens.u16.bin"),
            "--machine", str(tmp_path / "machine.json"), "--checkpoint-dir", str(tmp_path / "ck"),
            "--export-hf", str(tmp_path / "hf"), "--export-lora", str(tmp_path / "lora"), "--quiet"]
    assert train_main(argv) == 0
    out = capsys.readouterr().out
    assert "the nf4 base's kernels dequantized" in out, out
    merged, adapter = load_file(str(tmp_path / "hf" / "model.safetensors")), load_file(
        str(tmp_path / "lora" / "adapter_model.safetensors"))
    names = mhf.hf_tensors(m)
    n = "blocks.1.mlp.down.kernel"
    kernel = dequantized(to_bytes(np.asarray(init[n], np.float32), "nf4"), m.param_shapes()[n], "nf4", np.float32)
    a = adapter[f"base_model.model.{names[n].name[:-len('.weight')]}.lora_A.weight"]  # [rank, in]
    b = adapter[f"base_model.model.{names[n].name[:-len('.weight')]}.lora_B.weight"]  # [out, rank]
    want = kernel.T + 4.0 * (b @ a)  # lora scale alpha / rank; the export casts it once to its dtype
    got = merged[names[n].name]
    np.testing.assert_array_equal(got.astype(np.float32), want.astype(got.dtype).astype(np.float32))
    assert export_main(["--checkpoint-dir", str(tmp_path / "ck"), "--hf", str(tmp_path / "again")]) == 0
    assert "the nf4 base's kernels dequantized" in capsys.readouterr().out
    again = load_file(str(tmp_path / "again" / "model.safetensors"))
    assert set(again) == set(merged) and all(np.array_equal(again[k], merged[k]) for k in merged)
