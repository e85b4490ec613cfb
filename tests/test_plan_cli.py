"""pstar-plan: answers without model data, exit 0/1/2, JSON and a plot; bounded searches."""

import dataclasses
import json

import pytest

from pstar_jax.machine import H200, save_machine
from pstar_jax.plan_cli import main
from pstar_jax.planner import MAX_SEARCH_CHUNKS, largest

TINY = ["--model", "tiny", "--batch-size", "4"]


def test_tiny_fits_and_reports_everything(capsys):
    assert main([*TINY, "--device-memory", "4MiB", "--host-memory", "1GiB"]) == 0
    out = capsys.readouterr().out
    for words in ("fits: peak device", "resident:", "adam: on the device for", "moved per step:",
                  "predicted:", "largest depth that fits", "largest batch that fits"):
        assert words in out, words


def test_does_not_fit_is_exit_1_with_one_sentence(capsys):
    assert main([*TINY, "--device-memory", "64KiB", "--no-search"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("pstar-plan: does not fit: device memory runs out at") and "\n" not in err


def test_json_is_the_plan(capsys):
    assert main([*TINY, "--device-memory", "4MiB", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["plan"]["fits"] is True and data["n_chunks"] >= 2
    assert len(data["plan"]["moments"]) > 0 and "h2d_bytes" in data["plan"]


def test_plot_writes_a_png(tmp_path):
    path = tmp_path / "timeline.png"
    assert main([*TINY, "--device-memory", "4MiB", "--no-search", "--plot", str(path)]) == 0
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_gpt3_175b_answers_without_allocating(capsys):
    """The largest preset is planned from shapes alone: one H200's host memory is far too small."""
    assert main(["--model", "GPT3_175B", "--no-search"]) == 1
    assert "host memory runs out by" in capsys.readouterr().err


def test_bad_input_exit_2(capsys):
    assert main(["--model", "nope"]) == 2
    assert main(["--device-memory", "lots"]) == 2
    err = capsys.readouterr().err
    assert "unknown model preset" in err and "is not a size" in err


@pytest.mark.parametrize("flags, words", [(["--micro-batches", "0"], "--micro-batches must be a whole number of at least 1"),
                                          (["--devices-per-host", "-1"], "--devices-per-host must be at least 1"),
                                          (["--plot", "{tmp}"], "must name an image file"),
                                          (["--plot", "{tmp}/timeline"], "must name an image file"),
                                          (["--plot", "{tmp}/absent/t.png"], "is not a directory"),
                                          (["--machine", "{tmp}/absent.json"], "neither one of h200")])
def test_bad_values_are_one_line_exit_2(capsys, tmp_path, flags, words):
    flags = [f.format(tmp=tmp_path) for f in flags]
    assert main([*TINY, "--no-search", *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("pstar-plan: error:") and words in err and "\n" not in err
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_same_machine_file_same_plan(capsys, tmp_path):
    """Rates from a saved machine file: two runs print the very same plan."""
    path = tmp_path / "m.json"
    save_machine(dataclasses.replace(H200, name="saved", host_adam_params_per_s=3.3e8, flops_per_s=1.1e11), path)
    flags = [*TINY, "--device-memory", "2MiB", "--json", "--machine", str(path)]
    outs = []
    for _ in range(2):
        assert main(flags) == 0
        outs.append(capsys.readouterr().out)
    assert outs[0] == outs[1] and json.loads(outs[0])["plan"]["fits"]


def test_the_model_is_named_by_its_shape(capsys):
    assert main(["--model", "GPT2_1B", "--d-model", "64", "--n-head", "2", "--n-layer", "2", "--seq-len", "32",
                 "--vocab-size", "128", "--no-search"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith("model GPT2_1B with n_layer 2, d_model 64, n_head 2, vocab_size 128, seq_len 32 (")
    assert "d_model 64, n_layer 2, n_head 2" in first.split("(", 1)[1]


def test_searches_are_capped_and_say_so(capsys):
    """tiny's layers are so small that memory allows about a million of them: the depth search
    stops at MAX_SEARCH_CHUNKS chunks and says so, the batch search at its own limit."""
    assert main([*TINY, "--device-memory", "64GiB", "--host-memory", "64GiB"]) == 0
    out = capsys.readouterr().out
    assert "at least" in out and f"the search stops at {MAX_SEARCH_CHUNKS} chunks" in out
    assert "largest batch that fits at this depth: at least 65536 sequences" in out


def test_largest_is_a_monotone_search():
    assert largest(lambda n: n <= 37, 8) == 37
    assert largest(lambda n: n <= 1, 8) == 1
    assert largest(lambda n: False, 8) == 0
    assert largest(lambda n: True, 8, limit=100) == 100 and largest(lambda n: True, 500, limit=100) == 100
    probes = []
    assert largest(lambda n: probes.append(n) or n <= 1000, 12, limit=5000) == 1000
    assert max(probes) <= 5000 and len(probes) <= 2 * 13


def test_data_parallel_plan_is_per_device(capsys):
    """W=8 shards the model data: the same device memory then holds everything."""
    assert main([*TINY, "--batch-size", "8", "--device-memory", "1MiB", "--no-search"]) == 1
    capsys.readouterr()
    assert main([*TINY, "--batch-size", "8", "--device-memory", "1MiB", "--no-search", "--data-parallel", "8"]) == 0
    assert "8 data-parallel device(s)" in capsys.readouterr().out


def test_plot_without_matplotlib_says_how_to_install_it(tmp_path, monkeypatch, capsys):
    """matplotlib is the optional extra pstar_jax[plot]: without it --plot is one line, before planning."""
    import sys
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # what an install without the extra sees
    assert main([*TINY, "--plot", str(tmp_path / "t.png")]) == 2
    assert capsys.readouterr().err == "pstar-plan: error: --plot needs matplotlib: pip install 'pstar_jax[plot]'\n"
    assert not (tmp_path / "t.png").exists()
