"""Full fine-tuning's stored DPO reference in a run (pstar_jax.run.reference): pstar-train computes
it before step 0 and says so, reuses it without the pass, and refuses one made for another base."""

import json

import numpy as np
import pytest

from test_preference_training import preference_file


def train(tmp_path, data, *flags, steps=2):
    from pstar_jax.cli.train import main as train_main
    metrics = tmp_path / "m.jsonl"
    code = train_main(["--objective", "dpo", "--data", str(data), "--steps", str(steps), "--batch-size", "8",
                       "--lr", "1e-2", "--metrics-out", str(metrics), *flags])
    return code, [json.loads(line) for line in metrics.read_text().splitlines()] if code == 0 else []


@pytest.mark.parametrize("engine", ["chunked", "plain"])
def test_pstar_train_stores_the_reference_then_reuses_it_without_the_pass(tmp_path, capsys, monkeypatch, engine):
    """Step 0's policy is the reference, so its loss is log 2 and its rewards 0; a second run reads
    the file (the pass is never called) and starts from the same loss."""
    from pstar_jax.engine.executor import ChunkedEngine
    from pstar_jax.engine.plain import PlainEngine
    data = preference_file(tmp_path / "pairs.sft.u16.bin", n_rows=8)
    flags = ["--engine", engine, "--precision", "fp32"]
    code, rows = train(tmp_path, data, *flags)
    err = capsys.readouterr().err
    assert code == 0, err
    assert "reference log-probs: computed 16 pairs over 8 rows in" in err and "pairs.ref.f32" in err
    assert (tmp_path / "pairs.ref.f32").stat().st_size == 16 * 8
    np.testing.assert_allclose(rows[0]["loss"], np.log(2.0), rtol=1e-6)
    assert abs(rows[0]["rewards/margins"]) < 1e-6 and rows[-1]["loss"] != rows[0]["loss"]

    def never(*_):
        raise AssertionError("the reference pass ran again")
    monkeypatch.setattr(ChunkedEngine, "reference_logps", never)
    monkeypatch.setattr(PlainEngine, "reference_logps", never)
    for named in ([], ["--ref-logps", str(tmp_path / "pairs.ref.f32")]):  # found beside the data, or named
        code, again = train(tmp_path, data, *flags, *named)
        err = capsys.readouterr().err
        assert code == 0, err
        assert "reference log-probs: reusing" in err
        np.testing.assert_allclose(again[0]["loss"], rows[0]["loss"], rtol=1e-6)


def test_a_reference_made_for_another_base_or_precision_is_refused_in_one_line(tmp_path, capsys):
    data = preference_file(tmp_path / "pairs.sft.u16.bin", n_rows=8)
    assert train(tmp_path, data, "--precision", "fp32", "--quiet", steps=1)[0] == 0
    capsys.readouterr()
    for flags, what in ((["--seed", "7"], "another base (fingerprint.base."),
                        (["--precision", "bf16"], "another model (fingerprint.model.precision differs)")):
        assert train(tmp_path, data, *flags, "--quiet", steps=1)[0] == 2
        err = capsys.readouterr().err
        assert what in err and len(err.strip().splitlines()) == 1, err
    assert train(tmp_path, data, "--ref-logps", str(tmp_path / "none.ref.f32"), "--quiet", steps=1)[0] == 2
    assert "none.ref.f32 does not exist" in capsys.readouterr().err


@pytest.mark.parametrize("flags, match", [
    (["--dpo-loss", "simpo", "--ref-logps", "x.ref.f32"], "the simpo loss has none"),
    (["--lora-rank", "4", "--ref-logps", "x.ref.f32"], "drop --ref-logps"),
    # the data file itself (whose sidecar a stale-reference error would tell the user to delete)
    (["--ref-logps", "pairs.sft.u16.bin"], "--ref-logps must name a NAME.ref.f32 file"),
])
def test_flags_a_stored_reference_does_not_go_with_are_one_line(tmp_path, capsys, flags, match):
    data = preference_file(tmp_path / "pairs.sft.u16.bin", n_rows=4)
    assert train(tmp_path, data, *flags, "--quiet", steps=1)[0] == 2
    err = capsys.readouterr().err
    assert match in err and len(err.strip().splitlines()) == 1, err


def test_pstar_plan_says_what_the_stored_reference_costs(capsys):
    from pstar_jax.cli.plan import main as plan_main
    assert plan_main(["tiny", "--objective", "dpo", "--no-search", "--json", "--device-memory", "1GiB",
                      "--host-memory", "2GiB"]) == 0
    label = json.loads(capsys.readouterr().out.splitlines()[-1])["label"]
    assert "DPO (sigmoid loss; the reference: stored before step 0 by one forward-only pass over the data" in label


@pytest.mark.parametrize("eval_file", [False, True])
def test_the_held_out_loss_reads_the_reference_of_its_rows(tmp_path, capsys, eval_file):
    """At a learning rate of 1e-12 the policy stays the reference, so the held-out pairs' loss is log 2: the
    last rows of the training file read its stored values, a --eval-data file its own."""
    data = preference_file(tmp_path / "pairs.sft.u16.bin", n_rows=8)
    flags = ["--eval-every", "1", "--lr", "1e-12", "--precision", "fp32"]
    if eval_file:
        flags += ["--eval-data", str(preference_file(tmp_path / "held.sft.u16.bin", n_rows=3, seed=5))]
    code, rows = train(tmp_path, data, *flags, steps=1)
    err = capsys.readouterr().err
    assert code == 0, err
    np.testing.assert_allclose(rows[-1]["eval_loss"], np.log(2.0), rtol=1e-6)
    assert ("held.ref.f32" in err) == eval_file and (tmp_path / "held.ref.f32").exists() == eval_file
