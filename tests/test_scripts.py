"""The benchmark scripts still run (tiny settings; figures are not judged here)."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}


def script(name, *args, timeout=300):
    return subprocess.run([sys.executable, os.path.join(ROOT, "scripts", name), *args], cwd=ROOT, env=ENV,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow  # over 20 s on 2 cores
def test_bench_compare_writes_table_and_plots(tmp_path):
    out = tmp_path / "cmp"
    r = script("bench_compare.py", "--sizes", "tiny,small", "--methods", "plain-none,xla-offload,pstar",
               "--device-memory", "48MiB", "--steps", "3", "--warmup", "1", "--out", str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    table = (out / "results.md").read_text()
    assert "| tiny |" in table and "| pstar | yes |" in table and "predicted OOM" in table
    assert (out / "throughput.png").stat().st_size > 0 and (out / "largest.png").stat().st_size > 0


def test_bandwidth_without_an_accelerator_says_to_use_small_in_one_line():
    r = script("bandwidth.py", timeout=60)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "--small" in r.stderr


@pytest.mark.slow
def test_bandwidth_and_flops_calibration_report_their_figures(tmp_path):
    import json
    r = script("bandwidth.py", "--small", "--out", str(tmp_path / "bw.json"))
    assert r.returncode == 0, r.stderr[-3000:]
    figures = json.loads((tmp_path / "bw.json").read_text())
    assert figures["pinned_h2d_GiB_s"] > 0 and figures["pinned_each_way_at_once_GiB_s"] > 0
    assert isinstance(figures["duplex"], bool) and figures["pstar_step_h2d_GiB"] > 0
    r = script("calibrate_flops.py", "--model", "tiny", "--n-layer", "2", "--batch-size", "2", "--step-s", "0.5")
    assert r.returncode == 0, r.stderr[-3000:]
    counted = float(r.stdout.split("counted FLOPs per step ")[1].split(",")[0])
    rate = float(r.stdout.split("flops_per_s = ")[1].split()[0])
    assert counted > 0 and abs(rate * 0.5 / counted - 1) < 1e-3


@pytest.mark.slow  # over 20 s on 2 cores
def test_bench_engine_and_bench_plan_report_their_tables():
    r = script("bench_engine.py", "--model", "tiny", "--batch-size", "4", "--steps", "3", "--warmup", "1")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "chunked (all resident)" in r.stdout and "plain (remat full)" in r.stdout
    assert "chunked / plain (remat none) = " in r.stdout
    r = script("bench_plan.py", "--model", "tiny", "--batch-size", "4")
    assert r.returncode == 0, r.stderr[-3000:]
    rows = {line[:40].strip(): line[40:].split() for line in r.stdout.splitlines()[2:]}
    # the bytes a real step moved are the plan's prediction (h2d, d2h, total: three sizes with units)
    plan = next(name for name in rows if name.startswith("plan (") and name.endswith(", predicted"))[:-len(", predicted")]
    assert rows[f"{plan}, measured step 2"] == rows[f"{plan}, predicted"][:6]
    assert "streaming every chunk at every use" in rows


@pytest.mark.slow  # over 20 s on 2 cores
def test_pstar_largest_plans_then_trains_the_deepest_model(tmp_path):
    out = tmp_path / "largest.txt"
    r = script("pstar_largest.py", "--model", "tiny", "--batch-size", "2", "--steps", "1", "--device-memory", "4MiB",
               "--host-memory", "8MiB", "--out", str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    text = out.read_text()
    assert "largest depth at d_model 32:" in text and "step 0: loss" in text
    step = text.split("step 0: ")[1]
    h2d, d2h = step.split("h2d ")[1].split(", d2h ")[0], step.split("d2h ")[1].split(" (planned")[0]
    assert f"(planned {h2d}, {d2h})" in step


@pytest.mark.slow
def test_plan_presets_answers_as_pstar_plan():
    import json
    r = script("plan_presets.py", "--presets", "qwen2.5-0.5b", "--seq-len", "128", "--batch-size", "2",
               "--micro-batches", "2", "--device-memory", "3GiB", "--host-memory", "8GiB", "--json")
    assert r.returncode == 0, r.stderr[-3000:]
    mine = json.loads(r.stdout)
    cli = subprocess.run([sys.executable, "-m", "pstar_jax.cli.plan", "--model", "qwen2.5-0.5b", "--seq-len", "128",
                          "--batch-size", "2", "--micro-batches", "2", "--device-memory", "3GiB", "--host-memory",
                          "8GiB", "--no-search", "--json"], cwd=ROOT, env=ENV, capture_output=True, text=True,
                         timeout=300)
    plan = json.loads(cli.stdout)["plan"]
    assert mine["fits"] == plan["fits"] and mine["n_chunks"] == json.loads(cli.stdout)["n_chunks"]
    assert (mine["h2d_bytes"], mine["d2h_bytes"]) == (plan["h2d_bytes"], plan["d2h_bytes"])
    assert mine["predicted_step_s"] == plan["predicted_step_s"]
    bad = script("plan_presets.py", "--presets", "nope")
    assert bad.returncode == 2 and "nope" in bad.stderr and "Traceback" not in bad.stderr


def test_plan_presets_lora_rows_answer_as_pstar_plan(capsys):
    """--lora-rank: the row counts frozen chunks at 2 B/param (no optimizer state) and answers as
    pstar-plan --lora-rank does (in process: both trace on this CPU backend)."""
    import json
    from scripts import plan_presets
    from pstar_jax.cli.plan import main as plan_main
    flags = ["--seq-len", "128", "--batch-size", "2", "--micro-batches", "2", "--device-memory", "6GiB",
             "--host-memory", "8GiB"]
    assert plan_presets.main(["--presets", "qwen2.5-0.5b", *flags, "--lora-rank", "4", "--json"]) == 0
    mine = json.loads(capsys.readouterr().out)
    assert plan_main(["--model", "qwen2.5-0.5b", *flags, "--lora-rank", "4", "--no-search", "--json"]) == 0
    cli = json.loads(capsys.readouterr().out)
    assert mine["fits"] and (mine["h2d_bytes"], mine["d2h_bytes"]) == (cli["plan"]["h2d_bytes"], cli["plan"]["d2h_bytes"])
    assert mine["predicted_step_s"] == cli["plan"]["predicted_step_s"] and mine["n_chunks"] == cli["n_chunks"]
    trained_chunks = mine["adam_chunks_device"] + mine["adam_chunks_host"] + mine["adam_chunks_streamed"]
    assert 1 <= trained_chunks < mine["n_chunks"]  # the adapters' chunks; the base's are frozen
    # the adapters' chunks and the base's have sizes of their own; every trainable chunk one state
    assert mine["model_data_bytes"] == sum(cli["plan"]["chunk_bytes"]) + trained_chunks * cli["plan"]["opt_state_bytes"]


def test_build_engine_refuses_plain_settings_for_the_chunked_engine_and_names_its_machine():
    import pstar_models

    import pstar_jax as ps
    from pstar_jax.plan.machine import H200
    from pstar_jax.planner.build import default_mesh, resolve_machine
    model, mesh = pstar_models.build_model("tiny"), default_mesh(1)
    assert resolve_machine(ps.EngineConfig(machine="h200"), mesh) == H200
    for option in ({"scan_layers": False}, {"opt_on_host": True}):
        with pytest.raises(ps.ConfigError, match="plain-engine settings"):
            ps.build_engine(model, ps.EngineConfig(machine="h200"), ps.OptimConfig(), (2, 64), mesh=mesh, **option)
    plain = ps.build_engine(model, ps.EngineConfig(kind="plain"), ps.OptimConfig(), (2, 64), mesh=mesh,
                            scan_layers=False, opt_on_host=True)
    assert plain.kind == "plain"


def test_bench_sft_data_prints_the_summary():
    r = script("bench_sft_data.py", "--conversations", "200", "--seq-len", "512")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "200 examples read" in r.stdout and "packing efficiency" in r.stdout and "load average" in r.stdout


@pytest.mark.slow  # about 12 s of compilation on 2 cores
def test_bench_long_seq_ops_prints_one_row_per_length():
    r = script("bench_long_seq_ops.py", "--lengths", "256,512", "--vocab", "1024", "--d-model", "32")
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [line.split() for line in r.stdout.splitlines() if line.split()[:1] in (["256"], ["512"])]
    assert len(rows) == 2 and all(len(row) == 9 for row in rows), r.stdout


def test_bench_moe_prints_the_three_ways_for_each_expert_count():
    r = script("bench_moe.py", "--tokens", "128", "--experts", "4,8", "--d-model", "32", "--width", "16",
               "--repeats", "1")
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [line.split() for line in r.stdout.splitlines() if line.split()[:1] in (["4"], ["8"])]
    assert len(rows) == 6 and all(float(row[-3]) >= 1.0 for row in rows), r.stdout
    tiled = [float(row[-3]) for row in rows if "tiled" in row]
    assert len(tiled) == 2 and max(tiled) < 1.7  # the models' grouped matmul stays near the pairs' FLOPs


def test_bench_compare_says_the_largest_size_tried_bounds_the_ratio(tmp_path, capsys):
    """When pstar trains even the largest size tried, its ratio to the best baseline is a lower
    bound: the table, the printout and the plot say so; the plots are written from the points."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("bench_compare", os.path.join(ROOT, "scripts", "bench_compare.py"))
    bench = importlib.util.module_from_spec(spec)
    sys.modules["bench_compare"] = bench  # its dataclasses look their module up
    spec.loader.exec_module(bench)
    P = bench.Point
    points = [P("a", 200_000, 8, "plain-full", True, step_s=0.1, tokens_per_s=5000.0),
              P("b", 3_200_000, 8, "plain-full", False, why="predicted OOM"),
              P("a", 200_000, 8, "pstar", True, step_s=0.1, tokens_per_s=4000.0),
              P("b", 3_200_000, 8, "pstar", True, step_s=0.3, tokens_per_s=1500.0)]
    bench.write_outputs(points, str(tmp_path), "header")
    table = (tmp_path / "results.md").read_text()
    printed = capsys.readouterr().out
    for text in (table, printed):
        assert "at least 16.00x the parameters" in text and "the largest size tried" in text
    assert (tmp_path / "largest.png").stat().st_size > 0 and (tmp_path / "throughput.png").stat().st_size > 0
    points[-1] = P("c", 6_400_000, 8, "pstar", False, why="does not fit")
    points.insert(2, P("c", 6_400_000, 8, "plain-full", False, why="predicted OOM"))
    assert "at least" not in bench.ratio_line(points, {"plain-full": 200_000, "pstar": 3_200_000})


def _load_script(name):
    import importlib.util
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "scripts", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_bench_lora_refuses_figures_that_would_be_wrong():
    """The LoRA benchmark's checks: a loss not finite and falling, frozen chunks copied
    device->host, or a byte split that does not add up to the step's counts fail the run."""
    bench = _load_script("bench_lora")
    good = bench.Run("lora", 4, 1000, 10, losses=[5.0, 4.0], h2d_bytes=30, d2h_bytes=5,
                     moved={"frozen": [20, 0], "trainable": [10, 5], "optimizer": [0, 0], "inputs": [0, 0]})
    assert bench.problems(good) == []
    for change, says in (({"losses": [5.0, 5.0]}, "not finite and falling"),
                         ({"losses": [5.0, float("nan")]}, "not finite and falling"),
                         ({"moved": {"frozen": [20, 4], "trainable": [10, 1], "optimizer": [0, 0], "inputs": [0, 0]}}, "device->host"),
                         ({"h2d_bytes": 31}, "do not add up")):
        found = bench.problems(bench.dataclasses.replace(good, **change))
        assert len(found) == 1 and says in found[0], (change, found)
    full = bench.Run("full", 2, 500, 500, losses=[5.0, 4.5], moved={k: [0, 0] for k in bench.KINDS})
    lines = bench.table([full, good], "header")
    assert lines[-1].endswith("2.00x the parameters") and "| lora | 4 | 1,000 | 10 |" in "\n".join(lines)


@pytest.mark.slow  # minutes on 2 shared cores: two depth searches and three engines
def test_bench_lora_trains_lora_deeper_than_full_fine_tuning(tmp_path):
    r = script("bench_lora.py", "--model", "tiny", "--device-memory", "1MiB", "--host-memory", "1536KiB",
               "--lora-rank", "1", "--batch-size", "2", "--steps", "3", "--max-layers", "12", "--out", str(tmp_path),
               timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    import json
    runs = {run["name"]: run for run in json.loads((tmp_path / "results.json").read_text())["runs"]}
    assert runs["lora"]["layers"] > runs["full"]["layers"] == runs["lora-same"]["layers"]
    for run in runs.values():  # measured = planned, and frozen chunks never go device->host
        assert (run["h2d_bytes"], run["d2h_bytes"]) == (run["planned_h2d_bytes"], run["planned_d2h_bytes"])
        assert run["moved"]["frozen"][1] == 0 and run["losses"][-1] < run["losses"][0]
    assert runs["full"]["moved"]["frozen"] == [0, 0]


def test_readme_results_table_is_the_one_benchmarks_rows_give(tmp_path):
    assert script("readme_results.py", "--check", timeout=60).returncode == 0
    readme, bench = tmp_path / "README.md", tmp_path / "BENCHMARKS.md"
    readme.write_text(open(os.path.join(ROOT, "README.md"), encoding="utf-8").read(), encoding="utf-8")
    text = open(os.path.join(ROOT, "docs", "BENCHMARKS.md"), encoding="utf-8").read()
    bench.write_text(text + "\nREADME row: a new figure | 42 s\n", encoding="utf-8")
    paths = ("--readme", str(readme), "--benchmarks", str(bench))
    stale = script("readme_results.py", "--check", *paths, timeout=60)
    assert stale.returncode == 1 and "run python scripts/readme_results.py" in stale.stderr
    assert script("readme_results.py", *paths, timeout=60).returncode == 0
    assert "| a new figure | 42 s |" in readme.read_text(encoding="utf-8")
    assert script("readme_results.py", "--check", *paths, timeout=60).returncode == 0
    bench.write_text(text + "\nREADME row: no figure here\n", encoding="utf-8")
    broken = script("readme_results.py", "--check", *paths, timeout=60)
    assert broken.returncode == 2 and len(broken.stderr.strip().splitlines()) == 1


def test_bench_delta_rule_memory_prints_both_directions():
    r = script("bench_delta_rule_memory.py", "--lengths", "128,256", "--heads", "4,2,8,8")
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stdout.splitlines()
    assert [line.split(":")[0] for line in lines[1:]] == ["inputs", "forward", "backward"], r.stdout
    assert all(float(line.split()[1]) > 0 for line in lines[2:]), r.stdout
    bad = script("bench_delta_rule_memory.py", "--lengths", "256,128")
    assert bad.returncode == 2 and "--lengths must grow" in bad.stderr
