"""The routers' load-balancing loss (pstar_jax/model/router_aux.py): its value against
transformers' load_balancing_loss_func (shares over devices adding up; packed rows over the
attention mask), the RouterStats the stages carry counted by the trace, and the pstar-train flag
with the aux_loss metric."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pstar_models import build_from_hf
from pstar_jax.model.router_aux import layer_stats, load_balancing_loss, no_stats, add_stats
from test_hf_models import SEQ_LEN
from test_moe import MIXTRAL, QWEN3_MOE, steps_agree


@pytest.mark.hf_reference
def test_the_summed_stats_give_load_balancing_loss_func_and_device_shares_add_up():
    """Three sparse layers of 10 tokens, 2 of them masked, E=5, k=2: the sums of layer_stats give
    transformers' value; split over two devices (tokens 0-4, 5-9), each device's share with the
    totals adds up to it, and the gradient by the probabilities is E C / rows^2."""
    torch = pytest.importorskip("torch")
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func
    logits_LxNxE = jax.random.normal(jax.random.key(0), (3, 10, 5))
    mask_N = np.array([1, 1, 1, 0, 1, 1, 1, 1, 0, 1], np.float32)

    def totals(part):
        stats = no_stats(5)
        for layer in logits_LxNxE:
            stats = add_stats(stats, layer_stats(layer[part], 2, mask_N[part]))
        return stats
    whole = totals(slice(None))
    ours = load_balancing_loss(whole, whole.counts_1xE[0], whole.rows_1[0])
    theirs = load_balancing_loss_func(tuple(torch.from_numpy(np.array(x)) for x in logits_LxNxE), 5, 2,
                                      torch.from_numpy(mask_N[None]))
    np.testing.assert_allclose(float(ours), float(theirs), rtol=1e-6)
    assert float(whole.rows_1[0]) == 3 * 8 and float(jnp.sum(whole.counts_1xE)) == 3 * 8 * 2
    halves = [totals(slice(0, 5)), totals(slice(5, 10))]
    shares = [load_balancing_loss(h, whole.counts_1xE[0], whole.rows_1[0]) for h in halves]
    np.testing.assert_allclose(float(sum(shares)), float(ours), rtol=1e-6)
    grad = jax.grad(lambda p: load_balancing_loss(whole._replace(probs_1xE=p), whole.counts_1xE[0],
                                                  whole.rows_1[0]))(whole.probs_1xE)
    np.testing.assert_allclose(grad[0], 5 * whole.counts_1xE[0] / 24.0 ** 2, rtol=1e-6)


def test_the_router_loss_flag_turns_it_on_and_metrics_carry_aux_loss(tmp_path, capsys):
    """pstar-train --output-router-logits on a checkpoint whose config.json has it false: every
    step's JSON line and TensorBoard carry aux_loss (near k for a barely trained router), the
    progress bar shows it; on a GPT-2 preset the flag is one line."""
    from pstar_jax.cli.train import main as train_main
    from pstar_jax.run.metrics import Progress
    from test_hf import write_family_checkpoint
    from test_metrics import scalars
    src = tmp_path / "moe"
    write_family_checkpoint(str(src), build_from_hf(QWEN3_MOE, seq_len=SEQ_LEN))
    np.random.default_rng(0).integers(0, 109, 4000).astype(np.uint16).tofile(tmp_path / "d.u16.bin")
    code = train_main(["--init-from-hf", str(src), "--data", str(tmp_path / "d.u16.bin"), "--steps", "2",
                       "--batch-size", "4", "--data-parallel", "1", "--seq-len", "16", "--quiet", "--output-router-logits",
                       "--metrics-out", str(tmp_path / "m.jsonl"), "--tensorboard", str(tmp_path / "tb"),
                       "--checkpoint-dir", str(tmp_path / "run")])
    assert code == 0, capsys.readouterr().err
    records = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert len(records) == 2 and all(1.5 < r["aux_loss"] < 2.5 for r in records)  # k = 2 when balanced
    assert {tag for tag, _ in scalars(tmp_path / "tb")} >= {"train/loss", "train/aux_loss"}
    bar = Progress(1, enabled=False)
    bar.update({**records[0], "tokens_per_s": 1.0})
    assert f"aux {records[0]['aux_loss']:.4f}" in bar._bar.postfix
    bar.close()
    assert train_main(["--steps", "1", "--quiet", "--output-router-logits"]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "GPT-2 has no experts" in err[0]


@pytest.mark.hf_reference
@pytest.mark.parametrize("source", [QWEN3_MOE, MIXTRAL], ids=["qwen3_moe", "mixtral"])
def test_the_router_loss_of_packed_rows_is_transformers_over_its_attention_mask(source):
    """Packed rows (row 0: examples of 4 and 3 tokens and a padding position; row 1: one example
    of 8) against transformers given each example as a row of its own, padded, with the
    attention mask marking its tokens: aux_loss equals its load_balancing_loss_func value, over
    the non-padding positions only."""
    torch = pytest.importorskip("torch")
    from frozen_engines import chunked
    from pstar_jax.data.batch import Batch
    from test_hf_models import hf_reference, saved_state, to_pstar
    config = {**source, "output_router_logits": True}
    hf_model = hf_reference(config)
    model = build_from_hf(config, seq_len=8)
    engine = chunked(model, frozenset(), batch=2, seq=8, chunk=None, init_params=to_pstar(model, saved_state(hf_model)))
    rng = np.random.default_rng(5)
    examples = [rng.integers(0, config["vocab_size"], n) for n in (4, 3, 8)]
    tokens = np.zeros((2, 8), np.int32)
    tokens[0, :4], tokens[0, 4:7], tokens[1] = examples
    segments = np.array([[1, 1, 1, 1, 2, 2, 2, 0], [1] * 8], np.int32)
    positions = np.array([[0, 1, 2, 3, 0, 1, 2, 0], list(range(8))], np.int32)
    batch = Batch(tokens, np.roll(tokens, -1, axis=1), (segments > 0).astype(np.float32), segments, positions)
    ours = engine.step([batch]).metrics["aux_loss"]
    rows, mask = np.zeros((3, 8), np.int64), np.zeros((3, 8), np.int64)
    for r, ex in enumerate(examples):
        rows[r, :len(ex)], mask[r, :len(ex)] = ex, 1
    with torch.no_grad():
        out = hf_model(torch.from_numpy(rows), attention_mask=torch.from_numpy(mask), output_router_logits=True)
        unmasked = hf_model(torch.from_numpy(rows), output_router_logits=True).aux_loss  # the padding counted
    np.testing.assert_allclose(ours, float(out.aux_loss), rtol=2e-6)
    assert abs(float(unmasked) - ours) > 1e-4


@pytest.mark.parametrize("W", [1, 2])
def test_the_router_stats_the_stages_carry_are_counted_with_their_inputs(W):
    """With the load-balancing loss every stage input past the first carries RouterStats beside h:
    per device E counts, E probability sums and one row count (float32), which the trace adds to
    the stage inputs the plan places (Mixtral, E=4, a dense-free chain)."""
    from jax.sharding import Mesh
    from pstar_jax.engine.chunks import build_layout
    from pstar_jax.engine.memory import Placement
    from pstar_jax.engine.stages import StageFunctions, bind
    from pstar_jax.planner.trace import trace_step
    if len(jax.devices()) < W:
        pytest.skip("needs conftest's fake devices")
    mesh = Mesh(np.array(jax.devices()[:W]), ("data",))
    shapes = []
    for aux in (False, True):
        model = build_from_hf({**MIXTRAL, "output_router_logits": aux}, seq_len=8)
        layout = build_layout(model.param_shapes(), model.decays, 4096)
        bound = [bind(s, layout, i) for i, s in enumerate(model.stages(jnp.float32))]
        shapes.append(trace_step(bound, StageFunctions(mesh), Placement(mesh), layout.numels, jnp.float32, 4, 8,
                                 (0,) * layout.n_chunks))
    plain, carried = shapes
    assert plain.input_bytes[1:] == (4 * 8 * 36 * 4 // W,) * 3  # h: rows x positions x width, float32
    assert carried.input_bytes == (0, *(b + (4 + 4 + 1) * 4 for b in plain.input_bytes[1:]))


def test_the_plain_engine_adds_the_router_loss_as_the_chunked_one_does():
    """Qwen3-MoE of 5 layers, layer 0 dense and the others sparse (the plain engine scans layers
    1-4 as one run), two micro-batches each adding its own loss: the plain engine's losses,
    aux_loss values and params equal the chunked engine's, and the held-out loss leaves the
    router loss out."""
    from frozen_engines import chunked, plain
    model = build_from_hf({**QWEN3_MOE, "num_hidden_layers": 5, "mlp_only_layers": [0], "output_router_logits": True,
                           "router_aux_loss_coef": 0.3}, seq_len=8)
    a, b = chunked(model, frozenset(), batch=4, seq=8, chunk=None, micro_batches=2), plain(model, frozenset(), 2)
    x, batches = steps_agree(a, b, QWEN3_MOE["vocab_size"], (2, 4, 9), 2, 2, 1e-6)
    assert x.loss > 2 * 0.3 * 1.5  # two micro-batches' coef * aux (near k = 2) inside the loss
    for name, value in a.params().items():
        np.testing.assert_allclose(b.params()[name], value, rtol=0, atol=1e-6, err_msg=name)
    held_out = a.evaluate(batches)
    np.testing.assert_allclose(b.evaluate(batches), held_out, rtol=1e-6)
    assert held_out < x.loss - 2 * 0.3 * 1.5


def test_preference_tuning_refuses_the_router_loss_in_one_line():
    """DPO over a mixture of experts trains without the router loss (TRL's DPOTrainer adds it; not
    built here): asked for both, the run stops in one line naming the flag, before any work."""
    from pstar_jax.config import ConfigError
    from pstar_jax.config.preference import PreferenceConfig
    from pstar_jax.config.run import RunConfig
    from pstar_jax.run.objective import trained_model
    config = RunConfig(preference=PreferenceConfig(objective="dpo"))
    with pytest.raises(ConfigError, match="--no-output-router-logits") as err:
        trained_model(config, build_from_hf({**MIXTRAL, "output_router_logits": True}, seq_len=SEQ_LEN))
    assert "\n" not in str(err.value)
    assert trained_model(config, build_from_hf(MIXTRAL, seq_len=SEQ_LEN)).base is not None  # without it: trained
