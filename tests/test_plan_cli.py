"""pstar-plan: answers without model data, exit 0/1/2, JSON and a plot; bounded searches."""

import dataclasses
import hashlib
import json
import re
from pathlib import Path

import jax

import numpy as np
import pytest

from pstar_jax.plan.machine import H200, save_machine
from pstar_jax.cli.plan import main
from pstar_jax.planner.search import MAX_SEARCH_CHUNKS, largest

TINY = ["--model", "tiny", "--batch-size", "4"]


def test_tiny_fits_and_reports_everything(capsys):
    assert main([*TINY, "--device-memory", "4MiB", "--host-memory", "1GiB"]) == 0
    out = capsys.readouterr().out
    for words in ("fits: peak device", "resident:", "adam: on the device for", "moved per step:",
                  "stage inputs: ", "predicted:", "largest depth that fits", "largest batch that fits"):
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
    assert data["plan"]["input_bytes"] > 0 and 0 <= data["plan"]["input_offload_bytes"] <= data["plan"]["d2h_bytes"]


def test_plot_writes_a_png_and_says_where(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main([*TINY, "--device-memory", "4MiB", "--no-search", "--plot", "timeline.png"]) == 0
    assert (tmp_path / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"pstar-plan: memory timeline written to {tmp_path / 'timeline.png'}\n" in capsys.readouterr().err


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
                                          (["--machine", "{tmp}/absent.json"], "neither one of h200"),
                                          (["--disk-memory", "1TB"], "needs the disk's read rate: pass --disk-rate"),
                                          (["--disk-memory", "1TB", "--disk-rate", "fast"], "is not a read rate"),
                                          (["--disk-memory", "1TB", "--disk-rate", "0GB/s"], "is not a read rate"),
                                          (["--disk-memory", "-5"], "is not a size")])
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
    first = capsys.readouterr().out.splitlines()[1]
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


def test_first_line_names_the_rates_and_the_capacities(capsys):
    assert main([*TINY, "--device-memory", "4MiB", "--host-memory", "1GiB", "--no-search"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "planned for h200 rates (preset): device 4.00 MiB and host 1.00 GiB per device, 1 data-parallel device(s)"
    assert lines[2].startswith("chunks: ") and " chunks of " in lines[2]  # not "N of M elements"


def test_help_says_what_the_defaults_are(capsys):
    """pstar-plan plans for an H200 by default: its help says so, not 'this machine's' or '85%'."""
    with pytest.raises(SystemExit):
        main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    machine = text[text.rindex("--machine NAME_OR_FILE"):]
    machine = machine[:machine.index(")", machine.index("(default:")) + 1]
    host = text[text.rindex("--host-memory HOST_MEMORY"):]
    host = host[:host.index(")", host.index("(default:")) + 1]
    assert "(default: h200)" in machine and "this machine's, measured" not in machine
    assert "(default: 110GiB)" in host and "85%" not in host


def test_a_positional_model_name_is_the_model(capsys):
    """What the README's results table writes: pstar-plan GPT3_12B --batch-size 32."""
    assert main(["tiny", "--batch-size", "4", "--device-memory", "4MiB", "--no-search"]) == 0
    assert capsys.readouterr().out.splitlines()[1].startswith("model tiny ")
    assert main(["tiny", "--model", "small", "--no-search"]) == 2
    assert "named twice" in capsys.readouterr().err


def _documented_commands():
    import os
    import re
    import shlex
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    commands = []
    for doc in ("README.md", "docs/BENCHMARKS.md"):
        text = open(os.path.join(root, doc)).read().replace("\\\n", " ")
        for found in re.findall(r"`(pstar-plan [^`]+)`", text) + re.findall(r"^(pstar-plan .+)$", text, re.M):
            argv = shlex.split(found)[1:]
            if not any(re.fullmatch(r"\[.*|[A-Z]+", a) for a in argv):  # not a usage line (PRESET, FILE, [MODEL])
                commands.append((doc, argv))
    return commands


def test_every_documented_pstar_plan_command_parses():
    from pstar_jax.cli.plan import parse_args
    commands = _documented_commands()
    assert len(commands) >= 8
    for doc, argv in commands:
        try:
            parse_args(argv)
        except Exception as err:  # noqa: BLE001 - the test names the command that fails
            raise AssertionError(f"{doc}: pstar-plan {' '.join(argv)}: {err}") from None


@pytest.mark.slow  # plans each documented model (up to 175B) from shapes: minutes on 2 cores
def test_every_documented_pstar_plan_command_answers(tmp_path):
    """As written (searches skipped, --largest-seq-len too), each in its own process: --data-parallel 32
    needs 32 fake devices. They run in a scratch directory: `--plot FILE.png` writes its file."""
    import os
    import subprocess
    import sys
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    # this checkout's pstar_jax, not whatever copy pip installed (the subprocess runs elsewhere)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[1]), env.get("PYTHONPATH")]))
    for doc, argv in _documented_commands():
        argv = [a for a in argv if a not in ("--no-search", "--largest-seq-len")] + ["--no-search"]
        if "--seq-len" in argv and int(argv[argv.index("--seq-len") + 1]) > 65536:
            # an 8B stage traced at 256k+ tokens takes minutes on 2 cores; these parse above, and
            # test_planner's longest-sequence test plans and trains the long-sequence path
            continue
        proc = subprocess.run([sys.executable, "-m", "pstar_jax.cli.plan", *argv], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode in (0, 1) and "Traceback" not in proc.stderr, \
            f"{doc}: pstar-plan {' '.join(argv)}: {proc.stderr[-2000:]}"


def test_imported_checkpoint_is_searched(tmp_path, capsys):
    """--init-from-hf with the searches: the depth search varies the checkpoint's own shape (its
    config.json fixes n_layer, which a --n-layer would contradict), the batch search runs as usual."""
    from pstar_models.gpt import GPTConfig, StagedGPT
    from pstar_models.hf import hf_config
    model = StagedGPT(GPTConfig(vocab_size=256, d_model=32, n_layer=2, n_head=2, seq_len=64))
    (tmp_path / "config.json").write_text(json.dumps(hf_config(model)))
    assert main(["--init-from-hf", str(tmp_path), "--batch-size", "4", "--device-memory", "4MiB",
                 "--host-memory", "1GiB"]) == 0
    out = capsys.readouterr().out
    assert "largest depth that fits with this batch" in out and "largest batch that fits at this depth" in out


def test_data_parallel_beyond_the_batch_is_refused_at_once_with_a_working_suggestion(capsys):
    """--data-parallel 100000 used to start 100,000 fake devices; now one line, and following the
    suggestion of a too-large degree answers."""
    import re
    import time
    start = time.perf_counter()
    assert main(["--model", "tiny", "--batch-size", "8", "--data-parallel", "100000"]) == 2
    assert time.perf_counter() - start < 5 and "--data-parallel must be in [1, 1024]" in capsys.readouterr().err
    assert main(["--model", "tiny", "--batch-size", "4", "--data-parallel", "8"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err
    suggested = re.search(r"use --data-parallel (\d+) or --batch-size (\d+)", err)
    for flags in (["--batch-size", "4", "--data-parallel", suggested[1]],
                  ["--batch-size", suggested[2], "--data-parallel", "8"]):
        assert main(["--model", "tiny", "--device-memory", "4MiB", "--no-search", *flags]) == 0


@pytest.mark.parametrize("cap, value, flags, flag", [
    ("MAX_PLAN_CHUNKS", 3, [], "--chunk-size"),
    ("MAX_PLAN_MOMENTS", 16, ["--micro-batches", "4"], "--micro-batches"),
])
def test_a_step_too_long_to_plan_is_refused_and_the_suggestion_answers(monkeypatch, capsys, cap, value, flags, flag):
    import re

    from pstar_jax.planner import report as planner
    monkeypatch.setattr(planner, cap, value)  # tiny's 5 chunks and 4 stages stand in for a huge model
    argv = [*TINY, "--device-memory", "4MiB", "--no-search", *flags]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "more than pstar-plan" in err and "\n" not in err
    suggested = re.search(re.escape(flag) + r" (\d+)", err)[1]
    assert main([*argv, flag, suggested]) == 0, capsys.readouterr().err
    if cap == "MAX_PLAN_CHUNKS":
        assert int(capsys.readouterr().out.split("chunks: ")[1].split()[0]) <= value


def test_plot_of_a_plan_that_does_not_fit(tmp_path):
    path = tmp_path / "nofit.png"
    assert main([*TINY, "--device-memory", "64KiB", "--no-search", "--plot", str(path)]) == 1
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_units_and_phase_labels():
    from pstar_jax.planner.plot import byte_unit, phase_runs
    assert byte_unit(30 * 2**20) == ("MiB", 2**20) and byte_unit(500) == ("B", 1)
    assert byte_unit(3 * 2**30) == ("GiB", 2**30) and byte_unit(2**20 - 1) == ("KiB", 1024)
    assert phase_runs(["adam", "fwd", "adam", "fwd", "head", "bwd", "bwd"], [0] * 7) == [
        (0, 3, "forward"), (4, 6, "backward")]
    assert [r[2] for r in phase_runs(["fwd", "head", "bwd", "fwd", "head", "bwd"], [0, 0, 0, 1, 1, 1])] == [
        "forward 0", "backward 0", "forward 1", "backward 1"]


@pytest.mark.parametrize("flags", [["--device-memory", "150KiB"], ["--device-memory", "400KiB", "--host-memory", "100KiB"]])
def test_does_not_fit_suggests_a_device_memory_that_fits(capsys, flags):
    """The 'by X' of a shortfall is one moment's; the suggestion is the least device memory that
    fits (with this host memory), and following it fits."""
    import re
    assert main([*TINY, "--no-search", *flags]) == 1
    err = capsys.readouterr().err.strip()
    suggested = re.search(r"it fits with --device-memory (\S+)$", err)[1]
    follow = [*flags]
    follow[1] = suggested
    assert main([*TINY, "--no-search", *follow]) == 0, capsys.readouterr().err


LORA_FLAGS = ["llama-tiny", "--batch-size", "4", "--device-memory", "8MiB", "--host-memory", "8MiB"]


def test_lora_plans_adapters_trained_and_the_base_frozen(capsys):
    """--lora-rank: the model gets its adapters, only they train (14 B/param), the base is frozen
    chunks (2 B/param)."""
    from pstar_jax.config import ModelConfig, RunConfig
    from pstar_jax.config.lora import LoraConfig
    from pstar_jax.model.lora import adapter_names
    from pstar_jax.io.models import load_model
    assert main([*LORA_FLAGS, "--lora-rank", "4", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    model = load_model(RunConfig(model=ModelConfig(name="llama-tiny"), lora=LoraConfig(rank=4)))
    shapes = model.param_shapes()
    adapters = sum(int(np.prod(shapes[n])) for n in adapter_names(model))
    assert adapters > 0 and data["n_trainable"] == adapters and data["n_params"] == model.n_params()
    assert data["model_data_bytes"] == 14 * adapters + 2 * (model.n_params() - adapters)
    assert data["plan"]["d2h_bytes"] == 0  # everything fits on the device; frozen chunks are never written back
    assert main([*LORA_FLAGS, "--lora-rank", "4", "--no-search"]) == 0
    text = capsys.readouterr().out
    assert "LoRA rank 4" in text and f"{adapters:,} trained at 14 B/param" in text and "frozen chunks have none" in text


def test_a_lora_answer_names_each_kinds_chunk_size_and_waste(capsys):
    """Adapters and base in chunks of their own sizes: the answer names both sizes, their counts,
    their padding in bytes (at 14 and 2 B/elem), the tensors in chunks of their own, and says when
    --chunk-size forced one size on both."""
    from pstar_jax.config import EngineConfig, ModelConfig, RunConfig
    from pstar_jax.config.lora import LoraConfig
    from pstar_jax.io.models import load_model
    from pstar_jax.model.freeze import trainable
    from pstar_jax.model.lora import frozen_for_lora
    from pstar_jax.planner.build import default_mesh, layout_for
    model = load_model(RunConfig(model=ModelConfig(name="llama-tiny"), lora=LoraConfig(rank=4)))
    layout = layout_for(model, EngineConfig(), default_mesh(1), trainable(frozen_for_lora(model, LoraConfig(rank=4))))
    sizes, waste = layout.chunk_numels, layout.waste_numels()
    assert main([*LORA_FLAGS, "--lora-rank", "4", "--no-search", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["chunk_numels"] == sizes and "chunk_numel" not in data and not data["chunk_size_forced"]
    assert data["n_chunks_by_kind"] == {k: layout.kinds.count(k) for k in sizes} and data["n_chunks"] == layout.n_chunks
    assert data["waste_bytes"] == {"trainable": 14 * waste["trainable"], "frozen": 2 * waste["frozen"]}
    assert data["own_chunks"] == ["embed.embedding", "head.kernel"]
    assert main([*LORA_FLAGS, "--lora-rank", "4", "--no-search"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("chunks: "))
    n = {k: layout.kinds.count(k) - sum(layout.kinds[c] == k for c in layout.own_chunks) for k in sizes}
    assert line.startswith(f"chunks: trainable {n['trainable']} of {sizes['trainable']:,} elements (")
    assert f"; frozen {n['frozen']} of {sizes['frozen']:,} (" in line and line.count("waste ") == 2
    assert "at 14 B/elem" in line and "at 2 B/elem" in line
    assert line.endswith("; 2 of their own (embed.embedding, head.kernel)")
    assert main([*LORA_FLAGS, "--lora-rank", "4", "--no-search", "--chunk-size", "12288", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["chunk_numel"] == 12288 and data["chunk_numels"] == {"trainable": 12288, "frozen": 12288}
    assert data["chunk_size_forced"] and data["own_chunks"] == []
    assert main([*LORA_FLAGS, "--lora-rank", "4", "--no-search", "--chunk-size", "12288"]) == 0
    assert "; sizes set by --chunk-size" in capsys.readouterr().out


@pytest.mark.slow  # two depth searches of up to 512 chunks: a minute or more on 2 cores
def test_lora_depth_search_rebuilds_adapters_and_goes_deeper(capsys):
    """The depth search's deeper models have adapters and the same frozen base, so LoRA reaches
    deeper than full training in the same memory."""
    def depth(flags):
        assert main(flags) == 0
        text = capsys.readouterr().out
        return int(re.search(r"largest depth that fits with this batch: (?:at least )?(\d+)", text).group(1))
    assert depth([*LORA_FLAGS, "--lora-rank", "4"]) > depth(LORA_FLAGS)


def test_model_line_counts_the_runs_precision_and_times_have_a_fitting_unit(capsys):
    """fp32 params and grads take 4 B, so a trained param is 16 B (bf16: 14); a tiny model's
    predicted step is in ns or µs, never '0.000 s'."""
    for precision, per_param in (("bf16", 14), ("fp32", 16)):
        assert main([*TINY, "--device-memory", "4MiB", "--no-search", "--precision", precision]) == 0
        out = capsys.readouterr().out
        assert f"model data at {per_param} B/param" in out and out.split("\n")[1].endswith(precision)
        step = re.search(r"predicted: ([\d.]+) (\w+)/step", out)
        assert step and step.group(2) in ("ns", "µs", "ms", "s") and float(step.group(1)) >= 1


def test_help_says_what_the_default_device_memory_is(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "128GiB is 92% of an H200's 139.8 GiB" in text and "pstar-train itself takes 0.9 of an accelerator" in text


def test_long_searches_say_what_they_try_on_stderr(capsys, monkeypatch):
    """A search past its quiet seconds writes one line per probe ('searching depth: N layers fit,
    trying M ...'); stdout keeps the answer alone."""
    from pstar_jax.planner import search
    monkeypatch.setattr(search, "QUIET_S", 0.0)
    assert main([*TINY, "--device-memory", "4MiB", "--host-memory", "1GiB"]) == 0
    captured = capsys.readouterr()
    lines = captured.err.strip().split("\n")
    assert lines and all(line.startswith("pstar-plan: searching ") and line.endswith(" ...") for line in lines)
    assert any(re.match(r"pstar-plan: searching depth: [\d,]+ layers fit, trying [\d,]+ \.\.\.", line) for line in lines)
    assert any(line.startswith("pstar-plan: searching batch: ") for line in lines)
    assert "searching" not in captured.out


CLI_GOLDENS = Path(__file__).parent / "data" / "plan_cli_goldens.json"


@pytest.mark.parametrize("args", sorted(json.loads(CLI_GOLDENS.read_text())["jax 0.10"]))
def test_json_answers_are_those_recorded(args, capsys):
    """pstar-plan's JSON answers for a GPT2_1B and a llama-3.2-1b LoRA preset that move chunks are
    byte for byte those recorded, but for the model's config they echo (digests, per JAX version:
    the trace is the compiler's)."""
    want = json.loads(CLI_GOLDENS.read_text()).get(f"jax {'.'.join(jax.__version__.split('.')[:2])}")
    if want is None:
        pytest.skip(f"no answers recorded for jax {jax.__version__}")
    main(args.split())
    answer = json.loads(capsys.readouterr().out)
    del answer["model"]  # (a new model setting adds a field here)
    assert hashlib.sha256(json.dumps(answer).encode()).hexdigest() == want[args]


@pytest.mark.slow  # a 70B trace: about 30 s on 2 cores
def test_a_70b_lora_fits_a_24gib_gpu_with_its_base_on_nvme(capsys):
    """llama-3.1-70b LoRA on a 24 GiB GPU and 64 GiB host fits once the frozen chunks the host
    cannot hold live on a 6 GB/s disk: the answer names the disk, its reads and the base's homes;
    without the disk it does not fit."""
    flags = ["llama-3.1-70b", "--lora-rank", "16", "--device-memory", "22GiB", "--host-memory", "64GiB",
             "--seq-len", "4096", "--batch-size", "8", "--micro-batches", "8", "--no-search"]
    assert main([*flags, "--disk-memory", "2TB", "--disk-rate", "6GB/s"]) == 0
    out = capsys.readouterr().out
    assert "and disk 1.82 TiB (read at 5.59 GiB/s) per device" in out
    assert re.search(r"frozen base: .* chunks on disk; [0-9.]+ TiB read from disk per step", out), out
    assert re.search(r"predicted: .*/step, [0-9,]+ tokens/s", out)
    assert main(flags) == 1
    assert "host memory runs out" in capsys.readouterr().err
