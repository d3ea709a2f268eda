"""``--prefill-chunk auto`` (``ninfer.engine.chunk_size``): the chooser's rule on given fixed and
per-token costs and memory bounds, the memory bound's search, the line fit, resolution on the
NumPy backend (512, unmeasured), and the measurement itself on tiny models (NumPy backend),
which must leave the cache it borrows as it found it. No wall-clock thresholds: only signs."""
from __future__ import annotations

import argparse

import numpy as np
import pytest

from ninfer.engine.chunk_size import (
    ChunkChoice,
    PrefillFit,
    choose_chunk,
    fit_line,
    measure_prefill,
    memory_max_tokens,
    resolve_prefill_chunk,
)


# --- the rule -------------------------------------------------------------------------------

def test_a_dominating_fixed_cost_takes_a_larger_chunk():
    c = 1e-4   # s a token
    # T >= 9 F / c: F = 10 ms -> 900 -> 960 (next multiple of 64); F = 30 ms -> 2700 -> 2752
    assert choose_chunk(0.010, c) == 960
    assert choose_chunk(0.030, c) == 2752
    assert choose_chunk(0.010, c) < choose_chunk(0.030, c) < choose_chunk(0.060, c)
    # the fixed cost is then at most a tenth of the chunk's time, and not at 64 tokens fewer
    for f in (0.010, 0.030, 0.0777):
        t = choose_chunk(f, c, max_chunk_s=20.0)
        assert f <= 0.1 * (f + c * t) + 1e-12 and f > 0.1 * (f + c * (t - 64))
    # another share: F <= 1/2 (F + c T) -> T >= F / c
    assert choose_chunk(0.1, 1e-4, fixed_share=0.5) == 1024


def test_the_27b_measurements_pick_the_longest_chunk_of_half_a_second():
    """H200, 27B hybrid: 2,657 tok/s at 512, 5,382 at 2,048 -> F ~ 130 ms, c ~ 0.122 ms a
    token: 9 F / c ~ 9,600 tokens, past the 8,192 ceiling; a chunk of at most 0.5 s holds
    (0.5 - F) / c ~ 3,026 tokens -> 3,008."""
    t512, t2048 = 512 / 2657, 2048 / 5382
    f, c = fit_line([512, 2048], [t512, t2048])
    assert f == pytest.approx(0.1301, abs=1e-3) and c == pytest.approx(1.2227e-4, rel=1e-3)
    assert choose_chunk(f, c) == 3008
    assert f + c * 3008 <= 0.5 < f + c * (3008 + 64)
    assert choose_chunk(f, c, max_chunk_s=2.0) == 8192
    assert choose_chunk(f, c, 2000, max_chunk_s=2.0) == 1984   # bounded by memory, down to 64
    assert choose_chunk(0.6, 1e-4) == 512   # a fixed cost past the time cap: the floor


def test_min_and_max_clamps_and_multiples_of_64():
    assert choose_chunk(0.0, 1e-4) == 512      # no fixed cost: the floor
    assert choose_chunk(-0.5, 1e-4) == 512     # (a negative fit is no cost)
    assert choose_chunk(1e-5, 1e-4) == 512
    assert choose_chunk(10.0, 1e-4, max_chunk_s=20.0) == 8192   # fixed cost everywhere
    assert choose_chunk(0.01, 0.0) == 8192     # no cost per token: the ceiling
    for f in np.linspace(0.001, 0.2, 37):
        t = choose_chunk(float(f), 1e-4)
        assert t % 64 == 0 and 512 <= t <= 8192
    assert choose_chunk(10.0, 1e-4, lo=64, hi=1024, max_chunk_s=20.0) == 1024
    assert choose_chunk(0.0, 1e-4, lo=64, hi=1024) == 64


def test_the_memory_bound_clamps_but_never_below_the_floor():
    long = dict(max_chunk_s=20.0)
    assert choose_chunk(10.0, 1e-4, 5000, **long) == 4992
    assert choose_chunk(10.0, 1e-4, 4992, **long) == 4992
    assert choose_chunk(0.01, 1e-4, 5000) == 960    # below the bound: the rule's own
    assert choose_chunk(10.0, 1e-4, 100, **long) == 512   # lo does not fit: its plan check
    assert choose_chunk(10.0, 1e-4, None, **long) == 8192


@pytest.mark.parametrize("kw", [dict(lo=500), dict(hi=1000), dict(lo=1024, hi=512), dict(lo=0),
                                dict(fixed_share=0.0), dict(fixed_share=1.0)])
def test_bad_bounds_are_refused(kw):
    with pytest.raises(ValueError):
        choose_chunk(0.1, 1e-4, **kw)


def test_memory_max_tokens_is_the_largest_chunk_whose_plan_fits():
    total = lambda t: 1_000_000 + 1000 * t    # bytes of the plan at chunk t
    assert memory_max_tokens(total, None) is None
    assert memory_max_tokens(total, total(3000)) == 2944
    assert memory_max_tokens(total, total(3008)) == 3008
    assert memory_max_tokens(total, total(512)) == 512
    assert memory_max_tokens(total, total(100_000)) == 8192
    assert memory_max_tokens(total, total(512) - 1) == 512     # nothing fits: the floor
    # a step function (the GDN scratch grows a chunk of 64 at a time) is searched exactly
    step = lambda t: -(-t // 64) * 7_000_000
    assert memory_max_tokens(step, step(1984) + 1, lo=64, hi=4096) == 1984


def test_fit_line():
    assert fit_line([100, 300], [0.3, 0.7]) == pytest.approx((0.1, 0.002))
    assert fit_line([100, 200, 300], [0.3, 0.5, 0.7]) == pytest.approx((0.1, 0.002))
    assert fit_line([100, 300], [0.3, 0.3])[1] == 0.0   # flat: no cost per token
    assert fit_line([100, 300], [0.1, 0.5])[0] == 0.0   # negative intercept: clamped
    with pytest.raises(ValueError):
        fit_line([100, 100], [0.1, 0.2])


def test_choice_record():
    assert ChunkChoice(512, "default").to_dict() == {"tokens": 512, "source": "default"}
    fit = PrefillFit(0.13, 1.2e-4, (256, 2048), (0.16, 0.38))
    d = ChunkChoice(4096, "measured", fit, 8192, 4096).to_dict()
    assert d == {"tokens": 4096, "source": "measured", "fixed_ms": 130.0,
                 "per_token_us": 120.0, "measured_tokens": [256, 2048],
                 "measured_ms": [160.0, 380.0], "wanted_tokens": 8192,
                 "memory_max_tokens": 4096}


# --- resolution -----------------------------------------------------------------------------

class _Unmeasurable:
    """A model on the NumPy backend that must not be run."""
    class ops:
        name = "numpy"
    is_recurrent = False

    def forward(self, *_):
        raise AssertionError("auto on numpy must not measure")

    def new_kv_cache(self, *_, **__):
        raise AssertionError("auto on numpy must not allocate")


def test_auto_is_512_on_numpy_and_an_int_is_kept():
    kw = dict(max_context=8192, total_bytes_at=lambda t: t, capacity_bytes=None)
    assert resolve_prefill_chunk("auto", _Unmeasurable(), **kw) == ChunkChoice(512, "default")
    assert resolve_prefill_chunk(7, _Unmeasurable(), **kw) == ChunkChoice(7, "given")
    assert resolve_prefill_chunk(4096, _Unmeasurable(), **kw) == ChunkChoice(4096, "given")


@pytest.fixture(scope="module")
def tiny_llama():
    from test_memory import TINY, _weights   # same folder
    from ninfer.engine.models.llama import LlamaConfig, LlamaModel
    from ninfer.kernels import get_ops
    cfg = dict(TINY, tie_word_embeddings=False)
    return LlamaModel(LlamaConfig.from_dict(cfg), _weights(np.random.default_rng(3), cfg, False),
                      get_ops("numpy"))


def test_measured_resolution_on_a_tiny_model_is_bounded_by_memory(tiny_llama):
    """Forced to measure (as on the GPU): a multiple of 64 in [512, 8192], within what the
    capacity allows; max_context caps the ceiling."""
    total = lambda t: 10_000 + 100 * t
    got = resolve_prefill_chunk("auto", tiny_llama, max_context=8192, total_bytes_at=total,
                                capacity_bytes=total(1000), measure=True)
    assert got.source == "measured" and got.memory_max_tokens == 960
    assert got.tokens % 64 == 0 and 512 <= got.tokens <= 960
    assert got.tokens == min(got.wanted_tokens, 960)
    f = got.fit
    assert f.sizes_tokens == (256, 2048) and all(t > 0 for t in f.times_s)
    assert f.fixed_s >= 0 and f.per_token_s >= 0
    small = resolve_prefill_chunk("auto", tiny_llama, max_context=300, total_bytes_at=total,
                                  capacity_bytes=None, measure=True)
    assert small.tokens == 320 and small.memory_max_tokens is None   # 300 -> one 320 chunk
    # a capacity that cannot hold even the floor: not measured, the floor (the plan refuses it)
    assert resolve_prefill_chunk("auto", tiny_llama, max_context=8192, total_bytes_at=total,
                                 capacity_bytes=total(512) - 1, measure=True) == \
        ChunkChoice(512, "default")


def test_a_failed_measurement_takes_the_floor_with_a_warning(tiny_llama):
    """A start-up measurement that raises (a kernel error, memory) must not stop the server:
    the floor, and the reason for ``server.started``'s warnings."""
    class Failing:   # the tiny model, whose forward pass fails
        def __getattr__(self, name):
            return getattr(tiny_llama, name)

        def forward(self, *a, **kw):
            raise RuntimeError("out of memory")

    got = resolve_prefill_chunk("auto", Failing(), max_context=8192,
                                total_bytes_at=lambda t: t, capacity_bytes=None, measure=True)
    assert (got.tokens, got.source, got.fit) == (512, "default", None)
    assert "RuntimeError: out of memory" in got.warning and got.to_dict()["warning"] == got.warning


# --- the measurement in an engine's cache (tiny hybrid: state slots) --------------------------

@pytest.mark.slow
def test_measuring_in_an_idle_engines_cache_leaves_it_as_it_was(tmp_path):
    """Measured on a lane's state slot and free pages of an idle engine: every lane stays free,
    every page in the pool, the slot's state zero at frontier 0; the engine then serves the same
    greedy tokens as one that was never measured in."""
    from test_engine_hybrid import run   # same folder
    from test_qwen35_vs_transformers import byte_level_tokenizer, make_checkpoint

    from ninfer.engine.engine import Engine, EngineConfig, FinalOutput, Request, TokenOutput
    from ninfer.engine.models import load_model
    from ninfer.engine.sampling import SamplingParams
    from ninfer.events.bus import EventBus
    from ninfer.kernels import get_ops
    from ninfer.store.artifact import load_model_file
    make_checkpoint(tmp_path, "l4_gqa2_hv2x", seed=5)
    model = load_model(load_model_file(tmp_path), get_ops("numpy"))
    tok = byte_level_tokenizer()
    ecfg = EngineConfig(max_context=512, max_concurrency=2)
    engine = Engine(model, tok, EventBus(), ecfg)
    kv = engine.kv
    free = engine.pool.num_free
    assert free == ecfg.num_pages
    pages = list(range(ecfg.num_pages))[-(128 // ecfg.page_size):]   # free pages, 128 tokens
    fit = measure_prefill(model, kv, sizes=(8, 128), reps=2, slot=1, pages=pages)
    assert fit.sizes_tokens == (8, 128) and all(t > 0 for t in fit.times_s)
    assert fit.per_token_s > 0 and fit.fixed_s >= 0
    assert all(ln.req is None for ln in engine.lanes)
    assert engine.pool.num_free == free and engine.idle()
    engine.check_integrity()
    assert int(kv.lengths[1]) == 0
    assert all(not np.any(a[1]) for a in kv.conv + kv.ssm)

    prompts = [np.random.default_rng(1).integers(0, 256, n).tolist() for n in (37, 90)]
    outs = []
    for i, p in enumerate(prompts):
        outs.append([])
        engine.submit(Request(f"r{i}", p, SamplingParams(temperature=0.0), 12, outs[-1].append,
                              ignore_eos=True))
    while engine.step():
        pass
    assert all(isinstance(o[-1], FinalOutput) for o in outs)
    got = [[t.token_id for t in o if isinstance(t, TokenOutput)] for o in outs]
    assert got == run((model, tok), prompts, max_tokens=12, max_concurrency=2)


def test_measure_refuses_too_few_pages(tiny_llama):
    kv = tiny_llama.new_kv_cache(4, 16)
    with pytest.raises(ValueError, match="cannot hold 128 tokens"):
        measure_prefill(tiny_llama, kv, sizes=(16, 128))


# --- the flag -------------------------------------------------------------------------------

def test_the_serve_flag_takes_auto_or_a_size():
    from ninfer.config import ServeConfig, add_serve_arguments, config_from_args
    assert ServeConfig().prefill_chunk == "auto"
    p = argparse.ArgumentParser()
    add_serve_arguments(p)
    parse = lambda *a: config_from_args(p.parse_args(list(a)))
    assert parse().prefill_chunk == "auto"
    assert parse("--prefill-chunk", "auto").prefill_chunk == "auto"
    assert parse("--prefill-chunk", "1024").prefill_chunk == 1024
    with pytest.raises(ValueError, match="--prefill-chunk must be >= 1 or auto, got 0"):
        parse("--prefill-chunk", "0")
    for bad in ("fast", 0, -3, "512"):   # (a string other than auto is not a size here)
        with pytest.raises(ValueError, match="--prefill-chunk"):
            ServeConfig(prefill_chunk=bad)
    with pytest.raises(SystemExit):
        p.parse_args(["--prefill-chunk", "lots"])
    # --continuation-cache-l2-mib takes auto (the default) or MiB the same way
    assert parse().continuation_cache_l2_mib == "auto"
    assert parse("--continuation-cache-l2-mib", "512").continuation_cache_l2_mib == 512
    with pytest.raises(ValueError, match="--continuation-cache-l2-mib must be >= 1 or auto"):
        parse("--continuation-cache-l2-mib", "0")
    with pytest.raises(SystemExit):
        p.parse_args(["--continuation-cache-l2-mib", "2GiB"])
