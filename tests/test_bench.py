"""The benchmark runner: every registered suite's CPU smoke run through ``python -m experiments.bench``'s entry
point (the written JSON's environment and the payload's key fields), the suites' own pieces, and the plans.

On the CPU a smoke run's cost is XLA compiling its programs, so the suites' SMOKE flags use one-layer tiny
presets, and the tests below that run a suite again use the smoke run's shapes (its programs are reused).
"""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import cpu_devices_env

from configs.models import tiny_qwen3 as _tiny_qwen3
from configs.models import tiny_qwen3_moe as _tiny_qwen3_moe
from experiments.bench import plans
from experiments.bench.__main__ import load_suite, main, run_suite, suite_parser
from experiments.bench.ceiling import hbm_copy_bps
from experiments.bench.suites import SUITES, decode, decode_gemms, rl_step, rollout
from fp8rl_jax.models import Fp8Mode

REPO = Path(__file__).resolve().parents[1]
tiny_qwen3 = dataclasses.replace(_tiny_qwen3, num_layers=1)  # the SMOKE flags' --layers 1
tiny_qwen3_moe = dataclasses.replace(_tiny_qwen3_moe, num_layers=1)


def _extra_flags(name: str, tmp_path: Path) -> list[str]:
    """Flags a smoke run needs beside SMOKE in a test: where the run's side files go."""
    return ["--runs-dir", str(tmp_path / "runs")] if name == "rl_step" else []


def _run_smoke(name: str, tmp_path: Path) -> dict:
    """Runs suite ``name`` with its SMOKE flags through the runner (in a child process with the CPU device
    count it needs, if any) and returns the one result file it wrote, checking its environment."""
    suite = load_suite(name)
    argv = [name, "--out-dir", str(tmp_path), *suite.SMOKE, *_extra_flags(name, tmp_path)]
    devices = getattr(suite, "SMOKE_DEVICES", 1)
    if devices > 1:
        proc = subprocess.run([sys.executable, "-m", "experiments.bench", *argv], env=cpu_devices_env(devices),
                              cwd=REPO, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
    else:
        assert main(argv) == 0
    [path] = list(tmp_path.glob("*/*.json"))
    result = getattr(suite, "result_name", lambda a: name)(suite_parser(name).parse_args(suite.SMOKE))
    assert path == tmp_path / "cpu" / f"{result}.json"
    data = json.loads(path.read_text())
    env = data["environment"]
    assert env["device"] and env["backend"] == "cpu" and env["devices"] == devices
    assert env["commit"] and env["date"] and env["jax"]
    return data


def _check_rollout(res: dict) -> None:
    assert [r["mode"] for r in res["runs"]] == ["none", "all"] and res["backend"] == "jax"
    assert res["hbm_copy_gbps"] > 0
    for r in res["runs"]:
        assert r["generated_tokens"] > 0 and r["tokens_per_s"] > 0 and r["weight_sync_ms"] >= 0
        assert r["decode_step_ms"] > 0 and 0 < r["decode_batch_mean"] <= 4 and r["decode_hbm_fraction"] > 0
        # three timed generates on the warm engine; the row is the median one
        assert r["repeats"] == 3 and r["tokens_per_s"] == sorted(r["tokens_per_s_all"])[1]
        # the decode attention's config is recorded (the CPU's: no table entry, the default)
        assert r["paged_attention"]["config"]["pages_per_block"] >= 1 and r["paged_attention"]["table"]
        assert r["kv_pages"] == 256  # --kv-tokens 4096 in pages of 16
        # the decode calls, in order: their device time adds up to decode_s, rows and contexts lie within the run's
        # slots and lengths, each launch took host time, and each ran a decode bucket holding its rows
        calls = np.asarray(r["decode_calls"], np.float64)
        assert calls.ndim == 2 and calls.shape[1] == 5 and len(calls) >= 1 and (calls[:, 3] > 0).all()
        assert r["decode_buckets"] == [4] and (calls[:, 4] == 4).all() and r["decode_rows_mean"] == 4
        assert r["swap_outs"] == r["swap_ins"] == r["swapped_tokens"] == 0  # swap preemption is off by default
        steps_per_call = 4  # the tiny workload's engine
        assert abs(calls[:, 0].sum() * steps_per_call / 1e3 - r["decode_s"]) < 1e-5 * len(calls) + 1e-9
        assert ((calls[:, 1] >= 1) & (calls[:, 1] <= 4)).all() and ((calls[:, 2] >= 1) & (calls[:, 2] <= 32)).all()
        assert r["gpu_during_run"] is None and r["tokens_per_joule"] is None  # no nvidia-smi here


def _check_weight_sync(res: dict) -> None:
    runs = {r["mode"]: r for r in res["runs"]}
    assert set(runs) == {"none", "all"} and res["trainer_weight_gb"] > 0
    for r in runs.values():
        assert r["weight_sync_ms"] > 0 and len(r["weight_sync_ms_all"]) == 2 and r["floor_ms"] > 0
        assert r["weight_sync_ms"] == pytest.approx(float(np.median(r["weight_sync_ms_all"])))
    assert runs["all"]["last_sync_ms"] == {}  # one device: no reshard to split the sync's time by
    # FP8 weights (one byte and a scale per 128 x 128 block) are smaller than the float32 copy
    assert runs["all"]["engine_weight_gb"] < runs["none"]["engine_weight_gb"]


def _check_decode(res: dict) -> None:
    assert [r["mode"] for r in res["runs"]] == ["none", "kv"] and res["model"]["num_layers"] == 1
    for r in res["runs"]:
        assert r["step_ms"] > 0 and len(r["call_s"]) == 1 and r["kv_gb_per_step"] > 0 and "trace" not in r
        assert r["recompiled_in_timed_calls"] == 0  # the first call compiled the only program the timed ones ran
        assert r["gpu_during_calls"] is None  # no nvidia-smi here
        assert r["hbm_fraction"] > 0 and r["roofline_step_ms"] > 0


def _check_decode_gemms(res: dict) -> None:
    rows = res["rows"]
    names = {(r["shape"], r["variant"]) for r in rows}
    for shape in ("qkv", "o_proj", "gate_up", "down_proj", "lm_head"):
        assert {(shape, "bf16"), (shape, "bf16_splitk2")} <= names
        assert ((shape, "fp8") in names) is (shape != "lm_head")
    for r in rows:  # errors against float64; on the CPU the timings are NaN (no GPU kernels to trace)
        assert r["max_rel_err"] <= (2e-2 if r["variant"].startswith("bf16") else 6e-2), r
        assert np.isnan(r["gpu_ms"])


def _check_train_step(res: dict) -> None:
    assert set(res["runs"]) == {"bf16", "fp8"} and res["model"]["num_layers"] == 1
    assert all(r["step_ms_median"] > 0 for r in res["runs"].values())
    assert 0.0 < res["grad_rel_err_fp8_vs_bf16"] < 0.5  # FP8 differs from BF16, but not wildly


def _check_rl_step(res: dict) -> None:
    assert [a["arm"] for a in res["arms"]] == ["all:fp8"]
    for a in res["arms"]:
        assert len(a["steps"]) == 2 and 0 < a["generated_tokens_per_step"] <= 2 * 2 * 4
        stages = sum(a["steps"][1][k] for k in rl_step.STAGES)
        assert 0 < stages <= a["steps"][1]["time/step_s"] and 0 < a["rollout_share"] < 1
        assert len(a["reward_mean"]) == 2 and all(0.0 <= r <= 1.0 for r in a["reward_mean"])


def _check_scaling(res: dict) -> None:
    assert res["model"]["num_layers"] == 1
    g = res["generator"]
    assert g["tp1"]["tokens_per_s"] > 0 and g["tp2"]["tokens_per_s"] > 0
    assert abs(g["tp2"]["kv_pages"] - 2 * g["tp1"]["kv_pages"]) <= 1  # the KV budget is per device
    assert res["train_1dev"]["step_s"] > 0 and res["train_fsdp2"]["step_s"] > 0
    assert set(res["sync_fsdp2_to_tp2"]) == {"reshard_ms", "quantize_ms"}


CHECKS = {"rollout": _check_rollout, "weight_sync": _check_weight_sync, "decode": _check_decode,
          "decode_gemms": _check_decode_gemms, "train_step": _check_train_step, "rl_step": _check_rl_step,
          "scaling": _check_scaling}


@pytest.mark.parametrize("name", sorted(SUITES))
def test_suite_smoke_run_writes_its_result(name, tmp_path):
    """Each suite's SMOKE run through the runner writes ``<out>/cpu/<result name>.json`` with the environment
    and the payload's key fields; a GPU-only suite (``SMOKE = None``) is skipped."""
    suite = load_suite(name)
    if suite.SMOKE is None:
        pytest.skip(f"{name} needs a GPU ({(suite.__doc__ or '').strip().splitlines()[0]})")
    data = _run_smoke(name, tmp_path)
    CHECKS.get(name, lambda d: None)(data)


def test_every_suite_has_the_runner_interface():
    for name in SUITES:
        suite = load_suite(name)
        assert callable(suite.add_arguments) and callable(suite.run) and suite.__doc__, name
        assert suite.SMOKE is None or isinstance(suite.SMOKE, list), name
        if suite.SMOKE is not None:
            suite_parser(name).parse_args(suite.SMOKE)  # the smoke flags are the suite's own


def test_rollout_kv_pool_like_vllm():
    """``kv_gib_like_vllm``: each mode's KV pool is the GiB given for its weight precision, and a mode
    whose engine keeps its own copy (FP8, or BF16 in the fused layout: the default on one device)
    frees the source copy, as vLLM holds no trainer copy. (The smoke run's model and engine: its
    compiled programs are reused.)"""
    args = suite_parser("rollout").parse_args(rollout.SMOKE)
    cfg = rollout.config(args)
    model = cfg.model
    assert model == tiny_qwen3_moe
    pages = cfg.engine.num_pages
    page = 2 * model.num_layers * 16 * model.num_kv_heads * model.head_dim  # bytes per item
    # a different GiB per weight precision, each `pages` pages of its pool dtype (float32 / E4M3)
    gibs = (pages * page * 4 / 2**30, pages * page * 1 / 2**30)
    res = rollout.measure(dataclasses.replace(cfg, repeats=1, kv_gib_like_vllm=gibs,
                                              engine=dataclasses.replace(cfg.engine, num_pages=3)))  # overridden
    runs = {r["mode"]: r for r in res["runs"]}
    for mode, gib, itemsize in (("none", gibs[0], 4), ("all", gibs[1], 1)):
        assert runs[mode]["kv_pages"] == int(gib * 2**30 // (page * itemsize)) == pages, mode
        assert runs[mode]["kv_pool_gib"] <= gib and runs[mode]["generated_tokens"] > 0
    assert runs["none"]["fused_projections"] and runs["all"]["fused_projections"]
    assert [runs[m]["bf16_copy_freed"] for m in ("none", "all")] == [True, True]


def test_rollout_vllm_backend_plumbing(tmp_path, monkeypatch):
    """--backend vllm: each mode writes the checkpoint vLLM starts from (block FP8 for W8A8 modes,
    BF16 otherwise; our loader reads it back), starts the generator with the matching settings,
    syncs weights (and our KV scales for FP8 KV) and times the same workload, then the further
    workloads on the same engine (one start per mode). vLLM itself needs a GPU: a stand-in
    generator records what the benchmark asks of it."""
    from fp8rl_jax.checkpoint import load_checkpoint
    from fp8rl_jax.rollout import vllm_backend as vb
    from fp8rl_jax.rollout.base import FinishReason, RolloutBatch

    calls = []

    class FakeGenerator:
        def __init__(self, model_config, config):
            calls.append(("start", config.start_format, config.kv_cache_dtype, load_checkpoint(config.model_path),
                          config.max_model_len))
            self.last_sync = {}
            self.weight_update_path = vb.WeightUpdate.DIRECT

        def generate(self, prompts, sampling):
            n = [s.max_tokens for s in sampling]
            return RolloutBatch(np.zeros((len(prompts), max(n)), np.int32), np.zeros((len(prompts), max(n)), np.float32),
                                np.array(n, np.int32), [FinishReason.LENGTH] * len(prompts), 0)

        def update_weights(self, params):
            calls.append(("update",))
            self.last_sync = {"quantize_s": 0.0, "reload_s": 0.0}

        def set_kv_scales(self, k, v):
            calls.append(("kv", np.asarray(k).shape))

    monkeypatch.setattr(vb, "VLLMGenerator", FakeGenerator)
    engine = dataclasses.replace(rollout.BenchConfig.engine, max_slots=4, kv_budget_gib=0.001, max_seq_len=32,
                                 steps_per_call=4, dtype="float32")
    template = vb.VLLMConfig(model_path="", gpu_memory_utilization=0.5, jax_memory_fraction=0.3)
    res = rollout.measure(rollout.BenchConfig(
        model=tiny_qwen3, workload=rollout.WORKLOADS["tiny"], modes=(Fp8Mode.NONE, Fp8Mode.ALL), engine=engine,
        backend=rollout.Backend.VLLM, vllm=template, workdir=tmp_path / "ckpt", sync_repeats=2,
        also_workloads=(("long", rollout.Workload(3, 8, 30)),)))
    assert [(r["mode"], r["workload"]) for r in res["runs"]] == [
        ("none", "tiny"), ("none", "long"), ("all", "tiny"), ("all", "long")] and res["backend"] == "vllm"
    starts = [c for c in calls if c[0] == "start"]
    assert [(c[1], c[2]) for c in starts] == [(vb.StartFormat.BF16, "auto"), (vb.StartFormat.FP8_CHECKPOINT, "fp8")]
    assert starts[0][3].hf_config.get("quantization_config") is None
    assert starts[1][3].hf_config["quantization_config"]["weight_block_size"] == [128, 128]
    assert all(c[4] == 38 for c in starts)  # max_model_len covers the longest workload
    # per mode: one untimed sync (the quantizer's compile) + 2 timed, each followed by the KV scales (FP8 KV)
    assert calls.count(("kv", (tiny_qwen3.num_layers,))) == 3 and calls.count(("update",)) == 6
    for r in res["runs"]:
        assert r["generated_tokens"] > 0 and r["tokens_per_s"] > 0 and r["backend"] == "vllm"
        assert len(r["weight_sync_runs_ms"]) == 3
    # the vllm backend's memory split is set before JAX starts (the runner applies process_env first)
    args = suite_parser("rollout").parse_args(["--backend", "vllm", "--vllm-memory", "0.5", "--jax-memory", "0.3"])
    assert rollout.process_env(args) == rollout.config(args).vllm.memory_env() != {}
    assert rollout.process_env(suite_parser("rollout").parse_args([])) == {}


def test_rollout_table_cells():
    """The table's clock column (SM clock median and the share of samples under the power cap; n/a without
    samples) and tokens per joule from the mean board power (none without power)."""
    assert rollout.clocks_cell(None) == "n/a" == rollout.clocks_cell({"sm_clock_mhz": None})
    sm = {"median": 1740.0, "min": 1530.0, "max": 1935.0}
    assert rollout.clocks_cell({"sm_clock_mhz": sm, "clock_event_reasons": {"sw_power_cap": 0.992}}) == "1740 (99%)"
    assert rollout.clocks_cell({"sm_clock_mhz": sm, "clock_event_reasons": None}) == "1740 (0%)"
    # W1 none at 8368 tokens/s drawing 680.3 W on average: 12.30 tokens per joule
    assert rollout.tokens_per_joule(8368.0, {"power_w": {"mean": 680.3, "max": 701.3}}) == pytest.approx(12.30,
                                                                                                          abs=5e-3)
    assert rollout.tokens_per_joule(10.0, {"power_w": None}) is None


def test_rollout_result_names():
    def name(*argv):
        return rollout.result_name(suite_parser("rollout").parse_args(list(argv)))

    assert name("--workload", "W1", "--modes", "all") == "rollout_W1_jax_all"
    assert name("--workload", "W2", "--modes", "none", "all", "--backend", "vllm") == "rollout_W2_vllm_none-all"
    assert name("--preset", "qwen3_30b_a3b", "--modes", "kv") == "rollout_qwen3_30b_a3b_W1_jax_kv"


def test_decode_page_orders():
    """``--pages engine``: each row's first pages contiguous and rows one after another, then one page per row
    per later call, rows side by side (what JaxEngine hands out to W1's lockstep rows); ``shuffled``: a random
    draw. Either way every page of every row is distinct and in the pool, and nothing past a row's need is set."""
    rng = np.random.default_rng(0)
    need = np.array([5, 7, 7, 2])
    t = decode.page_table(need, 9, decode.PageOrder.ENGINE, rng, prompt_pages=3)
    assert t[0, :3].tolist() == [0, 1, 2] and t[1, :3].tolist() == [3, 4, 5] and t[3, :2].tolist() == [9, 10]
    assert t[:3, 3].tolist() == [11, 12, 13] and t[:3, 4].tolist() == [14, 15, 16] and t[1:3, 5].tolist() == [17, 18]
    for table in (t, decode.page_table(need, 9, decode.PageOrder.SHUFFLED, rng, num_pages=40)):
        used = np.concatenate([table[b, : need[b]] for b in range(4)])
        assert len(set(used.tolist())) == need.sum() and used.max() < 40
        assert all((table[b, need[b]:] == 0).all() for b in range(4))


def test_decode_hold_and_prefill():
    """``--hold``: every call from the same lengths, so the KV read per step is that of one call's state (the
    smoke run's kv program, reused); ``--prefill``: the prefill program, 3 prompts of 24 tokens per call."""
    base = ["--preset", "tiny_qwen3", "--layers", "1", "--batch", "4", "--context", "40", "--steps", "4",
            "--dtype", "float32", "--lengths", "equal", "--no-trace"]
    advancing = run_suite("decode", [*base, "--repeats", "1", "--modes", "kv", "--pages", "engine",
                                     "--prompt-len", "24"], write=False)["runs"][0]
    held = run_suite("decode", [*base, "--repeats", "3", "--modes", "kv", "--hold"], write=False)["runs"][0]
    assert len(held["call_s"]) == 3 and held["recompiled_in_timed_calls"] == 0
    # per row: context + steps / 2 tokens (held) against context + steps * (repeats + 1) / 2 (1 repeat, advancing)
    assert held["kv_gb_per_step"] / advancing["kv_gb_per_step"] == pytest.approx((40 + 2) / (40 + 4))
    pre = run_suite("decode", ["--preset", "tiny_qwen3", "--layers", "1", "--prefill", "3", "--prompt-len", "24",
                               "--steps", "4", "--repeats", "2", "--modes", "all", "--dtype", "float32",
                               "--no-trace"], write=False)["runs"][0]
    assert pre["program"] == "prefill" and pre["prompts"] == 3 and len(pre["call_s"]) == 2
    assert pre["prompt_tokens_per_s"] == pytest.approx(3 * 24 / pre["call_ms"] * 1e3)
    args = suite_parser("decode").parse_args(["--prefill", "4", "--prompt-len", "1024"])
    assert decode.result_name(args) == "prefill_4x1024"


def test_decode_gemms_triton_configs(tmp_path, monkeypatch):
    """--triton: the split-K Triton kernel's decode configs (two of them here, interpret mode, one shape: each
    config runs ~1 s; tests/test_pallas_kernels.py checks every one) against the same reference; --triton-configs:
    these configs instead; the table and config flags need --triton; off the GPU nothing is timed, so no table is
    written."""
    monkeypatch.setattr(decode_gemms.triton_gemm, "DECODE_CONFIGS", decode_gemms.triton_gemm.DECODE_CONFIGS[-2:])
    base = ["--preset", "tiny_qwen3", "--m", "8", "--splits", "2", "--sets", "2", "--shapes", "o_proj"]
    table = tmp_path / "triton.json"
    more = run_suite("decode_gemms", [*base, "--triton", "--triton-table-out", str(table)], write=False)["rows"]
    triton = [r for r in more if r["variant"].startswith("fp8_triton_")]
    assert len(triton) == len({r["variant"] for r in triton}) == len(decode_gemms.triton_gemm.DECODE_CONFIGS)
    assert all(r["config"]["k_splits"] >= 1 for r in triton)
    assert not table.exists()  # nothing timed off the GPU: no table (the policy test reads one)
    chosen = run_suite("decode_gemms", [*base, "--triton", "--triton-configs", "16,32,4,2,1,swap,prefetch"],
                       write=False)["rows"]
    assert [r["variant"] for r in chosen if r["variant"].startswith("fp8_triton_")] == [
        "fp8_triton_16x32w4s2k1_swap_prefetch"]
    for r in [*more, *chosen]:
        assert r["max_rel_err"] <= (2e-2 if r["variant"].startswith("bf16") else 6e-2), r
        assert np.isnan(r["gpu_ms"])
    assert main(["decode_gemms", "--preset", "tiny_qwen3", "--triton-table-out", str(table)]) == 2  # needs --triton
    for bad in (["--triton-configs", "16,32,4,2,1"], ["--triton", "--triton-configs", "16,32,4"]):
        assert main(["decode_gemms", "--preset", "tiny_qwen3", "--no-write", *bad]) == 2


def test_gpu_suites_say_they_need_a_gpu(capsys):
    """Off the GPU the runner refuses a suite without a CPU smoke run, naming what it needs; cublaslt_tune's
    own check names cuBLASLt."""
    for name in ("gemm", "cublaslt_tune", "fa3_decode"):
        assert main([name]) == 2
        assert f"suite {name} needs a GPU" in capsys.readouterr().err
    tune = load_suite("cublaslt_tune")
    with pytest.raises(ValueError, match="needs cuBLASLt on a CUDA GPU"):
        tune.run(suite_parser("cublaslt_tune").parse_args([]))


def test_cublaslt_tune_candidates(monkeypatch):
    """The sweep's candidates: the heuristic's choice first, then each listed algorithm with its K splits pinned
    where cuBLASLt accepts it, a kernel configuration timed once."""
    tune = load_suite("cublaslt_tune")

    def listed(m, n, k, out_dtype, split_k=0):
        assert (m, n, k) == (128, 4096, 4096)
        rows = []
        for i, tile in enumerate((20, 20, 19)):  # two algorithms of one tile, different stages
            split = split_k if split_k and i != 2 else 1  # the third refuses pinned splits
            rows.append({"index": i, "tile_id": tile, "stages_id": 5 + i, "split_k": split,
                         "reduction_scheme": 2 if split > 1 else 0, "cluster_shape_id": 0, "workspace_bytes": 0,
                         "waves_count": 0.25, "accepted": not split_k or i != 2})
        return rows

    monkeypatch.setattr(tune.cublaslt, "list_algos", listed)
    got = [(c["algo"], c["split_k"]) for c in tune.candidates(128, 4096, 4096, [1, 4])]
    # split 1 pins what the heuristic already runs (tile and splits equal): those pairs are the (i, 0) ones again
    assert got == [(0, 0), (1, 0), (2, 0), (0, 4), (1, 4)]


def test_rl_step_arms_and_reward():
    assert rl_step.parity_reward("2 4", "") == 1.0 and rl_step.parity_reward("2 3", "") == 0.0
    assert rl_step.parity_reward("", "") == 0.0
    assert rl_step.Arm.parse("kv:fp8") == rl_step.Arm(Fp8Mode.KV, True)
    assert rl_step.Arm.parse("none") == rl_step.Arm(Fp8Mode.NONE, False)
    with pytest.raises(ValueError, match="bf16 or fp8"):
        rl_step.Arm.parse("all:fp16")


def test_runner_name_and_no_write(tmp_path, capsys):
    """``--name`` replaces the suite's result name; ``--no-write`` prints the payload and writes nothing; an
    unknown suite is an error naming the suites."""
    argv = ["weight_sync", *load_suite("weight_sync").SMOKE]
    assert main(["--out-dir", str(tmp_path), "--name", "mine", *argv]) == 0
    assert [p.name for p in tmp_path.glob("*/*.json")] == ["mine.json"]
    assert main(["--no-write", "--out-dir", str(tmp_path / "none"), *argv]) == 0
    assert not (tmp_path / "none").exists() and '"runs"' in capsys.readouterr().out
    assert main(["nope"]) == 2 and "suites: " in capsys.readouterr().err


def test_help_after_a_suite_lists_the_suites_flags(capsys):
    assert main(["kv_write", "--help"]) == 0
    text = capsys.readouterr().out
    assert "experiments.bench kv_write" in text and "--rows" in text
    assert main(["--help"]) == 0 and "--plan" in capsys.readouterr().out


def test_hbm_copy_bandwidth_is_measured_once():
    bps = hbm_copy_bps()
    assert math.isfinite(bps) and bps > 1e8 and hbm_copy_bps() == bps  # cached for the process


@pytest.mark.parametrize("gpu", sorted(plans.PLANS))
def test_plans_run_registered_suites_with_their_own_flags(gpu, capsys):
    """Every step of a plan names a registered suite whose parser takes its flags, the step names (the result
    files) are distinct, and the rollout steps size the KV pool for the GPU's memory."""
    steps = plans.plan(gpu)
    assert len({s.name for s in steps}) == len(steps)
    for s in steps:
        suite_parser(s.suite).parse_args(list(s.flags))
        assert s.command().startswith(f"python -m experiments.bench {s.suite} ") or not s.flags
    kv = {"h100": ["49.5", "56.16"], "h200": ["101.74", "107.52"]}[gpu]
    w1 = {s.name: list(s.flags) for s in steps if s.name.startswith("rollout_W1_") and "vllm" not in s.name}
    assert sorted(w1) == ["rollout_W1_all", "rollout_W1_kv", "rollout_W1_none", "rollout_W1_w8a8"]
    for flags in w1.values():
        i = flags.index("--kv-gib-like-vllm")
        assert flags[i + 1: i + 3] == kv
    assert main(["--plan", gpu, "--list"]) == 0
    out = capsys.readouterr().out
    assert all(s.name in out for s in steps)
    assert main(["--plan", gpu, "--step", "nope"]) == 2
    with pytest.raises(ValueError, match="plans: h100, h200"):
        plans.plan("a100")


def test_plan_runs_each_step_in_its_own_process(tmp_path, monkeypatch):
    """``--plan GPU --step NAME`` runs the step's suite command in a child process and writes the result under
    the step's name; a failing step makes the plan's exit status nonzero."""
    smoke = tuple(load_suite("weight_sync").SMOKE)
    steps = [plans.Step("ws_step", "weight_sync", smoke), plans.Step("bad_step", "weight_sync", ("--modes", "nope"))]
    monkeypatch.setitem(plans.PLANS, "h100", lambda: steps)
    assert main(["--plan", "h100", "--step", "ws_step", "--out-dir", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "cpu" / "ws_step.json").read_text())
    assert [r["mode"] for r in data["runs"]] == ["none", "all"] and data["environment"]["backend"] == "cpu"
    assert main(["--plan", "h100", "--step", "bad_step", "--out-dir", str(tmp_path)]) == 1
    assert sorted(p.name for p in tmp_path.glob("*/*.json")) == ["ws_step.json"]
