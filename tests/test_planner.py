"""The planner as a library: pstar-plan's answers as a PlanReport, for any staged model."""

import jax
import numpy as np
from jax.sharding import Mesh

import pstar_jax as ps
from models.gpt import build_model
from pstar_jax.machine import H200

MiB = 2**20


def mesh(W=1):
    return Mesh(np.array(jax.devices()[:W]), ("data",))


def test_report_answers_fit_placement_and_searches():
    model = build_model("tiny")
    report = ps.plan_report(model, ps.EngineConfig(device_memory=4 * MiB), 4, mesh(), H200, 2**30,
                            model_at=lambda n: build_model("tiny", n_layer=n))
    assert report.fits and report.plan.h2d_bytes >= 0 and report.model_tflops > 0
    assert report.depth.value >= model.config.n_layer and report.batch.value >= 4
    assert report.to_json()["plan"]["fits"] and report.to_json()["largest_depth"]["value"] == report.depth.value
    text = "\n".join(report.lines())
    assert "fits: peak device" in text and "largest depth that fits" in text


def test_report_for_a_model_without_depth_search_and_one_that_does_not_fit():
    from examples.my_model import build_model as mine
    report = ps.plan_report(mine("mine", n_layer=2, d_model=32, n_head=2, seq_len=16), ps.EngineConfig(
        device_memory=64 * 1024), 4, mesh(), H200, 2**30)
    assert not report.fits and "device memory runs out" in report.plan.problem
    assert report.depth is None and report.batch is not None
