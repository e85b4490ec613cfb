"""The disk tier in pstar-train's engine: a plan's disk homes need the disk's read rate."""

import dataclasses

import pytest

from pstar_jax.config import ConfigError, EngineConfig
from pstar_jax.engine.optim import default_tx
from pstar_jax.plan.machine import H200
from pstar_jax.planner.build import chunked_engine
from pstar_models.gpt import StagedGPT, preset
from frozen_engines import OPTIM, mesh


def test_a_disk_without_its_read_rate_is_one_line_before_planning():
    m = StagedGPT(preset("tiny"))
    cfg = EngineConfig(chunk_numel=8192, disk_memory=2**30, precision="fp32")
    with pytest.raises(ConfigError) as err:
        chunked_engine(m, cfg, default_tx(OPTIM), mesh(), (4, 64), H200, trainable=lambda name: True)
    assert "EngineConfig.disk_memory needs the disk's read rate: measure it with pstar-machine --disk" in str(err.value)
    assert "\n" not in str(err.value)
    chunked_engine(m, dataclasses.replace(cfg, disk_memory=None), default_tx(OPTIM), mesh(), (4, 64), H200)
