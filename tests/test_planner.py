"""The planner as a library: pstar-plan's answers as a PlanReport, for any staged model."""

import dataclasses

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

import pstar_jax as ps
from pstar_models.gpt import build_model
from pstar_jax.plan.machine import H200

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


def test_largest_mixed_searches_cheaply_then_goes_past_with_mixes():
    """The cheap question (no mixes) answers the search; the full one (mixes too) is asked only
    past that answer: a single probe when mixes fit no further, a gallop when they do."""
    from pstar_jax.planner.search import largest_mixed
    for pure, mixed in ((10, 10), (10, 13), (0, 3), (0, 0), (40, 40)):
        asked = []

        def fits(n, mixes, pure=pure, mixed=mixed):
            asked.append((n, mixes))
            return n <= (mixed if mixes else pure)
        assert largest_mixed(fits, 4, 40) == mixed
        full = [n for n, mixes in asked if mixes]
        assert len(full) <= (1 if mixed == pure else 2 + 2 * (mixed - pure).bit_length())
        assert all(n > pure for n in full)


def test_no_placement_fits_when_the_two_memories_cannot_hold_the_model_data():
    from pstar_jax.plan.bounds import could_fit
    from pstar_jax.plan.placement import make_plan
    from step_shapes import gpt_like_shape
    shape = gpt_like_shape(3, 2)
    data = sum(shape.chunk_bytes) + sum(shape.opt_state_bytes)
    assert could_fit(shape, 300 + data, 0) and not could_fit(shape, 300 + data - 1, 0)
    assert could_fit(shape, 300, data) and not could_fit(shape, 300, data - 1)
    assert not make_plan(shape, 300, data - 1, H200, first_fit=True).fits


def test_depth_search_plans_with_the_runs_frozen_set():
    """With EngineConfig.freeze, the depth search's deeper models freeze what the run would (2 B
    per frozen parameter, no optimizer state): its answer is the depth at which the frozen plan
    still fits and one more layer does not, deeper than full training reaches."""
    def report(n_layer, freeze, search=True):
        cfg = ps.EngineConfig(device_memory=3 * MiB, chunk_numel=8192, freeze=freeze)
        return ps.plan_report(build_model("tiny", n_layer=n_layer), cfg, 4, mesh(), H200, 2 * MiB, search=search,
                              model_at=lambda n: build_model("tiny", n_layer=n))
    full, frozen = report(2, None).depth.value, report(2, "blocks.*").depth.value
    assert frozen > full > 2
    assert report(frozen, "blocks.*", search=False).fits and not report(frozen + 1, "blocks.*", search=False).fits


def test_longest_within_brackets_the_answer_and_probes_few_lengths():
    """The longest-sequence search's bisection: its answer fits, a length within the tolerance (or
    one granule) above does not, every probe is a granule multiple, and it asks about
    log2(answer / start) + log2(1 / tolerance) lengths."""
    import math
    from pstar_jax.planner.search import longest_within
    g, tol, cap = 64, 0.03, 1 << 23
    for answer in (0, 63, 64, 100, 1000, 4096, 77_777, 540_000, 1 << 23):
        for start in (64, 4096, 131072):
            asked = []

            def fits(n, answer=answer):
                asked.append(n)
                return n <= answer
            n, capped = longest_within(fits, start, g, tol, cap)
            assert all(a % g == 0 for a in asked) and n % g == 0 and fits(n) or n == 0
            assert capped == (answer >= cap)
            if not capped:
                step = math.ceil((n + max(g, tol * n)) / g) * g
                assert not fits(max(step, g)), (answer, start, n)
                assert n >= answer // g * g / (1 + tol) - g, (answer, start, n)
            distinct = len(set(asked))
            assert distinct <= abs(math.log2(max(answer, g) / start)) + math.log2(1 / tol) + 4, (answer, start, asked)


@pytest.mark.slow  # about ten traces of a tiny Llama (seven compiles each) and two steps: 2-3 minutes on 2 cores
def test_longest_seq_len_trains_and_a_little_longer_does_not():
    # The longest sequence under a fixed 5 MiB device budget (the model tiled at small budgets)
    # trains there, chunks moving as planned, and its fp32 losses equal the plain engine's with
    # the model untiled; a little longer does not fit.
    from pstar_models.llama import LlamaConfig, StagedLlama
    from pstar_jax.config import OptimConfig
    from pstar_jax.engine.optim import default_tx
    from pstar_jax.engine.plain import PlainEngine
    from pstar_jax.planner.search import SEQ_LEN_GRANULE, SEQ_LEN_TOLERANCE
    from pstar_jax.planner.build import chunked_engine
    from pstar_jax.model.tiling import TileBudget
    base = LlamaConfig(vocab_size=128, d_model=32, n_layer=2, n_head=4, n_kv_head=2, d_ff=64, seq_len=256)
    small = TileBudget(logits_bytes=64 * 1024, scores_bytes=256 * 1024, mlp_bytes=64 * 1024)

    def at(seq_len):
        return StagedLlama(dataclasses.replace(base, seq_len=seq_len), small)
    cfg = ps.EngineConfig(device_memory=5 * MiB, precision="fp32")
    report = ps.plan_report(at(256), cfg, 1, mesh(), H200, 2**30, search=False, seq_len_at=at)
    n = report.seq_len_search.value
    assert n > 1024 and report.longest.fits and report.longest.seq_len == n
    longer = -(-int(n + max(SEQ_LEN_GRANULE, SEQ_LEN_TOLERANCE * n)) // SEQ_LEN_GRANULE) * SEQ_LEN_GRANULE
    cfg_at = dataclasses.replace(cfg, chunk_numel=report.longest.planned.layout.chunk_numels["trainable"])
    assert not ps.plan_report(at(longer), cfg_at, 1, mesh(), H200, 2**30, search=False).fits
    data = report.to_json()["largest_seq_len"]
    assert data["value"] == n and data["plan"]["fits"] and data["tokens_per_s"] > 0
    assert "longest sequence that trains at 1 sequence:" in "\n".join(report.lines())

    optim = OptimConfig(lr=1e-3, warmup_steps=0, total_steps=10, weight_decay=0.1, clip_norm=1.0)
    chunked = chunked_engine(at(n), cfg_at, default_tx(optim), mesh(), (1, n), H200, clip_norm=optim.clip_norm)
    untiled = PlainEngine(StagedLlama(dataclasses.replace(base, seq_len=n)), "fp32", default_tx(optim), 1,
                          clip_norm=optim.clip_norm, mesh=mesh())
    rng = np.random.default_rng(0)
    for _ in range(2):
        tokens = rng.integers(0, base.vocab_size, (1, n + 1))
        got, want = (e.step([(tokens[:, :-1], tokens[:, 1:])]) for e in (chunked, untiled))
        assert got.h2d_bytes == got.predicted_h2d_bytes > 0 and got.d2h_bytes == got.predicted_d2h_bytes
        assert abs(got.loss - want.loss) <= 64 * np.finfo(np.float32).eps * abs(want.loss), (got.loss, want.loss)


def test_longest_within_with_a_guess_probes_as_few_lengths_however_long_the_answer():
    """Given a guess of the answer (what memory allows, from the longest trace that fit), the
    search probes about log2(1 / tolerance) lengths past it whether the answer is 4k or 8M tokens,
    and a wild guess still brackets the answer, the bracket halved geometrically."""
    import math
    from pstar_jax.planner.search import longest_within
    g, tol, cap = 64, 0.03, 1 << 23
    for answer in (0, 64, 4096, 77_777, 540_000, (1 << 23) - 1000, 1 << 23):
        for guess, slack in ((lambda n, a=answer: 1.2 * a, 0), (lambda n: cap, 4 + math.log2(math.log2(cap / g))),
                             (lambda n, a=answer: (n + a) / 2, 4)):  # a short guess, nearer from a longer trace
            asked = []

            def fits(n, answer=answer):
                asked.append(n)
                return n <= answer
            n, capped = longest_within(fits, 64, g, tol, cap, guess=guess)
            assert all(a % g == 0 for a in asked) and (n == 0 or fits(n) and n % g == 0)
            assert capped == (answer >= cap)
            if not capped and n:
                step = math.ceil((n + max(g, tol * n)) / g) * g
                assert not fits(step) and n >= answer // g * g / (1 + tol) - g, (answer, n)
            assert len(set(asked)) <= math.log2(1 / tol) + slack + 4, (answer, asked)


def test_progress_is_silent_for_its_quiet_seconds_then_one_line_per_probe():
    from pstar_jax.planner.search import Progress, announced, largest
    now, lines = [0.0], []
    progress = Progress("pstar-plan", quiet_s=3.0, write=lines.append, clock=lambda: now[0])

    def fits(n):
        now[0] += 1.0  # each probe takes a second
        return n <= 40
    assert largest(announced(fits, "depth", "layers", progress), 8, 100) == 40
    assert lines[0] == "pstar-plan: searching depth: 16 layers fit, trying 32 ..."  # the first 3 s are quiet
    assert lines[1] == "pstar-plan: searching depth: 32 layers fit, trying 64 ..."
    assert len(lines) == len(set(lines)) and all(line.endswith(" ...") for line in lines)


@pytest.mark.slow
def test_depth_bound_counts_the_stage_inputs_and_holds():
    """The depth search's bound counts each layer's kept stage input beside its parameters: tighter
    than the parameters alone, and never below the depth that fits."""
    from pstar_jax.planner.search import default_tx_for_shapes, depth_memory_bound, largest_depth
    model, one_more = build_model("tiny"), build_model("tiny", n_layer=3)
    report = ps.plan_report(model, ps.EngineConfig(device_memory=4 * MiB), 8, mesh(), H200, 8 * MiB, search=False)
    planned, shape = report.planned, report.planned.shape
    assert report.fits
    cfg = dataclasses.replace(ps.EngineConfig(device_memory=4 * MiB),
                              chunk_numel=planned.layout.chunk_numels["trainable"])
    bound = depth_memory_bound(model, one_more, shape, cfg, None, 1, 2, 12 * MiB)
    per_param = sum(shape.bytes_per_element(0))
    params_only = 2 + int((12 * MiB - model.n_params() * per_param) // ((one_more.n_params() - model.n_params())
                                                                      * per_param))
    assert bound < params_only
    found = largest_depth(model, lambda n: build_model("tiny", n_layer=n), planned, cfg, mesh(), H200, 8 * MiB,
                          default_tx_for_shapes(), {}, 2)
    assert 2 < found.value <= bound == found.memory_bound
