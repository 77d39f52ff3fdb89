"""The stall watchdog, alone and in the engine (EngineConfig.stall_timeout_s)."""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs.models import tiny_qwen3
from fp8rl_jax.models import init_params
from fp8rl_jax.rollout.engine import EngineConfig, JaxEngine
from fp8rl_jax.rollout.sampling import SamplingConfig
from fp8rl_jax.rollout.watchdog import StallWatchdog


def test_fires_once_only_without_progress(capsys):
    """No call while beats keep coming; one call, naming the last progress, once they stop."""
    calls = []
    with StallWatchdog(0.4, name="w", on_stall=calls.append, hint="do X") as watch:
        for i in range(8):  # a beat every 0.1 s for 0.8 s
            watch.beat({"step": i})
            time.sleep(0.1)
        assert calls == []
        time.sleep(1.5)
    assert len(calls) == 1 and watch.fired
    assert calls[0].startswith("w: no progress for") and '"step": 7' in calls[0] and calls[0].endswith("do X")
    err = capsys.readouterr().err
    assert calls[0] in err and "test_fires_once_only_without_progress" in err  # the stacks
    with pytest.raises(ValueError, match="seconds > 0"):
        StallWatchdog(0)


def test_stopped_watchdog_never_fires():
    calls = []
    watch = StallWatchdog(0.2, on_stall=calls.append)
    watch.stop()
    time.sleep(0.6)
    assert calls == [] and not watch.fired


def test_engine_reports_a_decode_that_stops_finishing():
    """A host loop blocked past stall_timeout_s after its first decode chunk (a progress callback that
    sleeps stands in for a device program that stopped finishing) is reported once, with the generate's
    counters, while it blocks; the generate itself still completes unchanged when it resumes.
    Without the option no watchdog runs. (One decoder layer: the watchdog wraps the engine's host loop,
    whatever the model; XLA's CPU compile of the engine's programs grows with the depth.)"""
    cfg = dataclasses.replace(tiny_qwen3, num_layers=1)
    params = init_params(cfg, jax.random.key(0), jnp.float32)
    ec = EngineConfig(max_slots=2, page_size=4, num_pages=32, max_seq_len=32, steps_per_call=2, prefill_batch=2,
                      prefill_buckets=(8, 16, 32), dtype="float32")
    prompts = [np.arange(2, 7).tolist(), np.arange(3, 11).tolist()]
    sampling = SamplingConfig(temperature=0.0, max_tokens=6, ignore_eos=True)
    want = JaxEngine(cfg, params, ec).generate(prompts, sampling)

    eng = JaxEngine(cfg, params, dataclasses.replace(ec, stall_timeout_s=1.0))
    eng.warmup(min_prompt_len=5, max_prompt_len=8)  # no compile inside the watched generate
    stalls = []
    eng.on_stall = stalls.append
    reports = []

    def slow_after_first_chunk(snapshot):  # the host loop calls it after every device call it reads
        reports.append(snapshot)
        if snapshot["decode_calls"] == 1 and sum(r["decode_calls"] == 1 for r in reports) == 1:
            time.sleep(3.0)  # stands in for a device program that stopped finishing

    eng.progress = slow_after_first_chunk
    got = eng.generate(prompts, sampling)
    assert len(stalls) == 1 and "JaxEngine.generate: no progress" in stalls[0] and '"decode_calls": 1' in stalls[0]
    assert got.token_lists() == want.token_lists()
    assert eng._watch is None  # the watchdog ends with the generate
    with pytest.raises(ValueError, match="stall_timeout_s"):
        dataclasses.replace(ec, stall_timeout_s=-1.0)
