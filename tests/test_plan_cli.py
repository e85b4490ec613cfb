"""pstar-plan: answers without model data, exit 0/1/2, JSON and a plot."""

import json

from pstar_jax.plan_cli import largest, main

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


def test_largest_is_a_monotone_search():
    assert largest(lambda n: n <= 37, 8) == 37
    assert largest(lambda n: n <= 1, 8) == 1
    assert largest(lambda n: False, 8) == 0


def test_data_parallel_plan_is_per_device(capsys):
    """W=8 shards the model data: the same device memory then holds everything."""
    assert main([*TINY, "--batch-size", "8", "--device-memory", "1MiB", "--no-search"]) == 1
    capsys.readouterr()
    assert main([*TINY, "--batch-size", "8", "--device-memory", "1MiB", "--no-search", "--data-parallel", "8"]) == 0
    assert "8 data-parallel device(s)" in capsys.readouterr().out
