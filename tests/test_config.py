import dataclasses

import pytest

from pstar_jax.config import (SECTIONS, CheckpointConfig, ConfigError, DataConfig, DistributedConfig, EngineConfig,
                              ModelConfig, OptimConfig, RunConfig, TrainConfig, format_bytes, from_dict,
                              math_differences, parse_bytes, parse_count, parse_device_memory, to_dict)


@pytest.mark.parametrize("text, size_bytes", [
    ("2GiB", 2 * 1024**3), ("512MiB", 512 * 1024**2), ("1.5GB", 1_500_000_000),
    ("1000000", 1_000_000), ("4k", 4096), ("4K", 4096), ("3kb", 3000), ("2 G", 2 * 1024**3),
    ("1TiB", 1024**4), ("7b", 7), ("1e3", 1000), (" 64MiB ", 64 * 1024**2), (12345, 12345)])
def test_parse_bytes(text, size_bytes):
    """Binary units (K, KiB, ...) are powers of 1024, decimal ones (KB, GB) powers of 1000."""
    assert parse_bytes(text, "--x") == size_bytes


@pytest.mark.parametrize("text", ["lots", "2XB", "GiB", "", "-1", "1.2.3GiB", "2 Gi B"])
def test_parse_bytes_rejects_non_sizes(text):
    """Anything that is not a number with a known unit is a ConfigError naming the flag."""
    with pytest.raises(ConfigError, match=r"^--host-memory: .* is not a size"):
        parse_bytes(text, "--host-memory")


@pytest.mark.parametrize("text", ["0", "0B", "-5", "0.0", "-0.5", "lots", "2XB"])
def test_device_memory_rejects_non_positive_and_non_sizes(text):
    """Zero, negative and non-numeric memory sizes are ConfigErrors, not a zero budget."""
    with pytest.raises(ConfigError):
        EngineConfig(device_memory=parse_device_memory(text))


@pytest.mark.parametrize("text, numel", [
    ("4M", 4 * 1024**2), ("4m", 4 * 1024**2), ("65536", 65536), ("64k", 65536), ("1G", 1024**3),
    ("1.5k", 1536), (4096, 4096)])
def test_parse_count(text, numel):
    """Element counts use binary multipliers: K=1024, M=1024**2, G=1024**3."""
    assert parse_count(text, "--chunk-size") == numel


@pytest.mark.parametrize("text", ["auto-ish", "lots", "4MB", "4MiB", "2XB", "", "-4"])
def test_parse_count_rejects_with_hint(text):
    """A bad count is a ConfigError that suggests 'auto'."""
    with pytest.raises(ConfigError, match=r"^--chunk-size: .* is not a count.*'auto'"):
        parse_count(text, "--chunk-size")


@pytest.mark.parametrize("n, text", [
    (0, "0 B"), (512, "512 B"), (1023, "1023 B"), (1024, "1.00 KiB"), (1536, "1.50 KiB"),
    (2 * 1024**3, "2.00 GiB"), (3.5 * 1024**4, "3.50 TiB"), (5 * 1024**5, "5120.00 TiB"),
    (-2048, "-2.00 KiB")])
def test_format_bytes(n, text):
    """Sizes print in the largest binary unit below 1024 of it, TiB at most."""
    assert format_bytes(n) == text


def test_format_bytes_parses_back():
    """What format_bytes prints for whole units, parse_bytes reads back to the same bytes."""
    for size in (512, 3 * 1024, 5 * 1024**2, 7 * 1024**3, 2 * 1024**4):
        assert parse_bytes(format_bytes(size).replace(".00", ""), "x") == size


@pytest.mark.parametrize("kwargs, message", [
    (dict(lr=0.0), "OptimConfig.lr must be a finite number in"), (dict(lr=-1e-3), "OptimConfig.lr"),
    (dict(lr=float("nan")), "OptimConfig.lr"), (dict(lr=float("inf")), "OptimConfig.lr"),
    (dict(total_steps=0), "OptimConfig.total_steps"), (dict(warmup_steps=-1), "OptimConfig.warmup_steps"),
    (dict(clip_norm=0.0), "OptimConfig.clip_norm"), (dict(clip_norm=-1.0), "OptimConfig.clip_norm"),
    (dict(weight_decay=float("nan")), "OptimConfig.weight_decay"), (dict(weight_decay=-1.0), "weight_decay"),
    (dict(b1=1.0), "OptimConfig.b1"), (dict(b2=-0.1), "OptimConfig.b2"), (dict(eps=0.0), "OptimConfig.eps"),
    (dict(final_lr_fraction=1.5), "final_lr_fraction")])
def test_optim_config_rejects(kwargs, message):
    """Invalid optimizer settings fail at construction naming the field."""
    with pytest.raises(ConfigError, match=message):
        OptimConfig(**kwargs)


def test_optim_config_is_frozen_and_validated_on_replace():
    cfg = OptimConfig()
    assert OptimConfig(clip_norm=None).clip_norm is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.lr = 1.0  # type: ignore[misc]
    with pytest.raises(ConfigError, match="OptimConfig.lr"):
        dataclasses.replace(cfg, lr=0.0)


@pytest.mark.parametrize("kwargs, message", [
    (dict(precision="fp16"), "EngineConfig.precision must be one of bf16, fp32, got 'fp16'"),
    (dict(micro_batches=0), "EngineConfig.micro_batches must be a whole number of at least 1"),
    (dict(chunk_numel=0), "EngineConfig.chunk_numel must be a whole number of at least 1"),
    (dict(device_memory=0), "EngineConfig.device_memory must be a whole number of at least 1"),
    (dict(device_memory=1.5), "EngineConfig.device_memory must be a finite number in"),
    (dict(kind="fast"), "EngineConfig.kind must be one of chunked, plain")])
def test_engine_config_rejects(kwargs, message):
    """Invalid engine settings fail at construction naming the field."""
    base = dict(chunk_numel=1024, device_memory=1 << 20)
    with pytest.raises(ConfigError, match=message):
        EngineConfig(**{**base, **kwargs})


def test_engine_config_compute_dtype():
    """precision maps to the compute dtype; a None budget (the CPU demo default) is valid."""
    import jax.numpy as jnp
    assert EngineConfig(1024, None).compute_dtype == jnp.bfloat16
    assert EngineConfig(1024, 1, precision="fp32").compute_dtype == jnp.float32


@pytest.mark.parametrize("text, value", [
    ("auto", None), ("0.8", 0.8), ("1", 1.0), ("1000000", 1_000_000), ("1e9", 10**9), ("2GiB", 2 * 2**30)])
def test_device_memory_fraction_or_bytes(text, value):
    """A plain number in (0, 1] is a fraction of the device; above 1 it is bytes (1e9 too)."""
    parsed = parse_device_memory(text)
    assert parsed == value and type(parsed) is type(value)


@pytest.mark.parametrize("section, kwargs, field", [
    (TrainConfig, dict(steps=10**12), "TrainConfig.steps"), (TrainConfig, dict(steps=0), "TrainConfig.steps"),
    (TrainConfig, dict(seed=10**23), "TrainConfig.seed"), (TrainConfig, dict(seed=-1), "TrainConfig.seed"),
    (TrainConfig, dict(batch_size=0), "TrainConfig.batch_size"),
    (CheckpointConfig, dict(keep=0), "CheckpointConfig.keep"), (CheckpointConfig, dict(keep=-1), "keep"),
    (CheckpointConfig, dict(every=-1), "CheckpointConfig.every"),
    (CheckpointConfig, dict(stop_after=0), "CheckpointConfig.stop_after"),
    (DistributedConfig, dict(data_parallel=0), "DistributedConfig.data_parallel"),
    (DistributedConfig, dict(data_parallel=-1), "DistributedConfig.data_parallel"),
    (DistributedConfig, dict(local_devices=0), "DistributedConfig.local_devices"),
    (DistributedConfig, dict(heartbeat_timeout=0), "DistributedConfig.heartbeat_timeout"),
    (DistributedConfig, dict(step_timeout=-1.0), "DistributedConfig.step_timeout"),
    (DistributedConfig, dict(step_timeout=float("nan")), "DistributedConfig.step_timeout"),
    (DistributedConfig, dict(num_processes=0), "DistributedConfig.num_processes"),
    (DistributedConfig, dict(num_processes=2, process_id=2), "DistributedConfig.process_id"),
    (DistributedConfig, dict(coordinator="nohost"), "DistributedConfig.coordinator"),
    (ModelConfig, dict(n_layer=0), "ModelConfig.n_layer")])
def test_sections_reject_bad_values_naming_the_field(section, kwargs, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        section(**kwargs)


def test_run_config_cross_checks_and_fills_the_schedule():
    run = RunConfig(train=TrainConfig(steps=40))
    assert run.optim.total_steps == 40 and run.optim.schedule_steps() == (2, 40)
    assert OptimConfig().schedule_steps() == (0, None)
    with pytest.raises(ConfigError, match="multiple of EngineConfig.micro_batches"):
        RunConfig(train=TrainConfig(batch_size=6), engine=EngineConfig(micro_batches=4))
    with pytest.raises(ConfigError, match="resume needs"):
        RunConfig(checkpoint=CheckpointConfig(resume=True))
    with pytest.raises(ConfigError, match="init_from_flax and CheckpointConfig.resume conflict"):
        RunConfig(model=ModelConfig(init_from_flax="x"), checkpoint=CheckpointConfig(directory="d", resume=True))


def test_config_round_trips_through_json_and_names_math_changes():
    import json
    run = RunConfig(optim=OptimConfig(lr=2e-3), engine=EngineConfig(device_memory=0.5))
    back = from_dict(RunConfig, json.loads(json.dumps(to_dict(run))))
    assert back == run
    free = dataclasses.replace(run, engine=EngineConfig(device_memory=2**30, chunk_numel=4096))
    assert math_differences(run, free) == []
    changed = dataclasses.replace(run, optim=OptimConfig(lr=1e-3), engine=EngineConfig(precision="fp32"))
    assert math_differences(run, changed) == ["OptimConfig.lr was 0.002, now 0.001",
                                              "EngineConfig.precision was 'bf16', now 'fp32'"]


def test_every_flag_has_help_and_errors_name_flags():
    """The CLI is derived from the config: each field one flag with help; field names map to flags."""
    from pstar_jax.cli import flags as cli
    from pstar_jax.cli.train import build_parser, parse_config
    parser = build_parser()
    actions = [a for a in parser._actions if a.option_strings and a.dest != "help"]
    assert actions and all(a.help for a in actions)
    flags = {s for a in actions for s in a.option_strings}
    assert {"--lr", "--adam-b1", "--adam-b2", "--adam-eps", "--final-lr-fraction", "--device-memory",
            "--chunk-size", "--engine", "--checkpoint-dir", "--keep-checkpoints", "--tensorboard",
            "--allow-config-change", "--model-module"} <= flags
    config = parse_config(["--lr", "0.01", "--device-memory", "0.5", "--clip-norm", "0", "--chunk-size", "4M"])
    assert config.optim.lr == 0.01 and config.engine.device_memory == 0.5
    assert config.optim.clip_norm is None and config.engine.chunk_numel == 4 * 2**20
    assert parse_config([]) == RunConfig()
    err = ConfigError("OptimConfig.lr must be positive; EngineConfig.micro_batches too")
    assert cli.error_line("x", err) == "x: error: --lr must be positive; --micro-batches too"


def test_each_flag_states_its_default_once_and_quiet_says_what_it_hides():
    """A help text that says its own default ('--host-memory ... default: 85% of ...') gets no second
    '(default: auto)'; --quiet names the start-up lines it hides beside the bar."""
    from pstar_jax.cli.train import build_parser
    actions = {a.option_strings[-1]: a.help for a in build_parser()._actions if a.option_strings}
    assert [flag for flag, text in actions.items() if text.count("default:") > 1] == []
    assert actions["--host-memory"].count("default") == 1 and "85%" in actions["--host-memory"]
    assert "start-up lines" in actions["--quiet"] and "progress bar" in actions["--quiet"]


def _wrong_values(allowed: tuple) -> list:
    """Values of a type the annotation ``allowed`` does not take (an int is a number to a float field;
    a bool is never a number)."""
    takes = {True: bool in allowed, 3: int in allowed or float in allowed, 2.5: float in allowed,
             "false": str in allowed, None: type(None) in allowed}
    return [v for v, ok in takes.items() if not ok] + [{"a": 1}, b"x", [1]]


SECTION_FIELDS = [(cls, f) for cls in (*SECTIONS.values(), RunConfig) for f in dataclasses.fields(cls)]


@pytest.mark.parametrize("cls, field", SECTION_FIELDS, ids=[f"{c.__name__}.{f.name}" for c, f in SECTION_FIELDS])
def test_every_field_refuses_a_value_of_the_wrong_type_naming_it(cls, field):
    """Each field of each section (and each section of RunConfig) refuses a value its annotation does
    not allow with a ConfigError naming it: never a string 'false' taken as true, a dict for a section
    ending in an AttributeError later, or an int path in a TypeError at open time."""
    import typing
    hint = typing.get_type_hints(cls)[field.name]
    allowed = tuple(SECTIONS.values()) if cls is RunConfig else (typing.get_args(hint) or (hint,))
    wrong = _wrong_values(allowed) + ([OptimConfig() if hint is not OptimConfig else TrainConfig()]
                                      if cls is RunConfig else [])
    for value in wrong:
        with pytest.raises(ConfigError, match=rf"^{cls.__name__}\.{field.name} must be .*, got "):
            cls(**{field.name: value})


def test_wrong_types_read_as_one_line_naming_what_to_write():
    with pytest.raises(ConfigError, match=r"^CheckpointConfig\.resume must be True or False, got 'false'$"):
        CheckpointConfig(directory="ck", resume="false")
    with pytest.raises(ConfigError, match=r"^RunConfig\.train must be a TrainConfig, got a dict; write "
                                          r"TrainConfig\(\*\*\.\.\.\) instead$"):
        RunConfig(train={"steps": 3})
    with pytest.raises(ConfigError, match=r"^RunConfig\.optim must be an OptimConfig, got a TrainConfig$"):
        RunConfig(optim=TrainConfig())
    with pytest.raises(ConfigError, match=r"^DataConfig\.path must be a path \(str or os\.PathLike\) or None, got 3$"):
        DataConfig(path=3)
    with pytest.raises(ConfigError, match=r"^TrainConfig\.steps must be a whole number \(int\), got True$"):
        TrainConfig(steps=True)
    with pytest.raises(ConfigError, match=r"^OptimConfig\.lr must be a number, got '1e-3'$"):
        OptimConfig(lr="1e-3")


def test_numbers_and_paths_are_normalised_so_configs_stay_json_able(tmp_path):
    """An int in a float field becomes a float, a numpy number a Python one, a PathLike its str; a
    bool or an int in an int-or-float field keeps its type (device_memory: bytes vs. a fraction)."""
    import json
    import pathlib

    import numpy as np
    run = RunConfig(train=TrainConfig(steps=np.int64(7), seed=np.uint32(3)),
                    optim=OptimConfig(lr=1, b1=np.float32(0.5)), data=DataConfig(path=pathlib.Path(tmp_path / "t.bin")),
                    engine=EngineConfig(device_memory=4096),
                    checkpoint=CheckpointConfig(directory=tmp_path, resume=True))
    kinds = (type(run.train.steps), type(run.train.seed), type(run.optim.lr), type(run.optim.b1))
    assert kinds == (int, int, float, float)
    assert run.data.path == str(tmp_path / "t.bin") and run.checkpoint.directory == str(tmp_path)
    assert type(run.engine.device_memory) is int and EngineConfig(device_memory=0.5).device_memory == 0.5
    assert from_dict(RunConfig, json.loads(json.dumps(to_dict(run)))) == run
