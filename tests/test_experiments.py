"""Smoke tests: every experiment's main() runs end to end on a tiny config on the CPU."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from conftest import cpu_devices_env

from configs.models import tiny_qwen3 as _tiny_qwen3
from configs.models import tiny_qwen3_moe as _tiny_qwen3_moe
from fp8rl_jax.models import Fp8Mode

from conftest import load_experiment as _load

# The tiny presets with one decoder layer: each test below is a smoke test of an experiment's main(), whose
# cost on the CPU is XLA compiling its programs, which grows with the depth; every layer runs the same code.
tiny_qwen3 = dataclasses.replace(_tiny_qwen3, num_layers=1)
tiny_qwen3_moe = dataclasses.replace(_tiny_qwen3_moe, num_layers=1)


@pytest.fixture
def one_layer_presets(monkeypatch):
    """``--preset tiny_qwen3`` / ``tiny_qwen3_moe`` resolve to the one-layer variants above (for the mains that
    take a preset name on their command line)."""
    from configs.models import PRESETS

    monkeypatch.setitem(PRESETS, "tiny_qwen3", tiny_qwen3)
    monkeypatch.setitem(PRESETS, "tiny_qwen3_moe", tiny_qwen3_moe)


def test_score_demo(tmp_path):
    demo = _load("score_demo")
    summary = demo.main(demo.DemoConfig(model=tiny_qwen3, out=tmp_path))
    assert summary["cli_vs_inprocess_rel_err"] < 1e-5 and summary["logits_shape"][0] == 3


# The tiny engine of the bench_rollout tests: a pool of 256 pages (4096 tokens) for every mode. The
# kv-pool test below sizes its pools to the same page count, so both tests run the same compiled
# programs (compiling, not running, is what these tests cost on the CPU).
TINY_PAGES = 256


def _tiny_bench_engine(bench, **kw):
    return dataclasses.replace(bench.BenchConfig.engine, max_slots=4, max_seq_len=32, steps_per_call=4, dtype="float32",
                               **kw)


def test_bench_rollout_tiny(tmp_path):
    bench = _load("bench_rollout")
    engine = _tiny_bench_engine(bench, num_pages=TINY_PAGES)
    out = tmp_path / "rollout.json"
    res = bench.main(bench.BenchConfig(model=tiny_qwen3_moe, workload=bench.WORKLOADS["tiny"],
                                       modes=(Fp8Mode.NONE, Fp8Mode.ALL), engine=engine, out=out, repeats=3))
    assert out.exists() and [r["mode"] for r in res["runs"]] == ["none", "all"]
    for r in res["runs"]:
        assert r["generated_tokens"] > 0 and r["tokens_per_s"] > 0 and r["weight_sync_ms"] >= 0
        assert r["decode_step_ms"] > 0 and 0 < r["decode_batch_mean"] <= 4 and r["decode_hbm_fraction"] > 0
        # three timed generates on the warm engine; the row is the median one
        assert r["repeats"] == 3 and r["tokens_per_s"] == sorted(r["tokens_per_s_all"])[1]
        # the decode attention's config is recorded (the CPU's: no table entry, the default)
        assert r["paged_attention"]["config"]["pages_per_block"] >= 1 and r["paged_attention"]["table"]
        # the decode calls, in order: their device time adds up to decode_s, rows and contexts lie within the run's
        # slots and lengths, each launch took host time, and each ran a decode bucket holding its rows
        calls = np.asarray(r["decode_calls"], np.float64)
        assert calls.ndim == 2 and calls.shape[1] == 5 and len(calls) >= 1 and (calls[:, 3] > 0).all()
        assert r["decode_buckets"] == [4] and (calls[:, 4] == 4).all() and r["decode_rows_mean"] == 4
        assert r["swap_outs"] == r["swap_ins"] == r["swapped_tokens"] == 0  # swap preemption is off by default
        assert abs(calls[:, 0].sum() * engine.steps_per_call / 1e3 - r["decode_s"]) < 1e-5 * len(calls) + 1e-9
        assert ((calls[:, 1] >= 1) & (calls[:, 1] <= 4)).all() and ((calls[:, 2] >= 1) & (calls[:, 2] <= 32)).all()
    # the table's clock column: SM clock median and the share of samples under the power cap; n/a without samples
    assert bench.clocks_cell(res["runs"][0]["gpu_during_run"]) == "n/a" == bench.clocks_cell(None)
    sm = {"median": 1740.0, "min": 1530.0, "max": 1935.0}
    assert bench.clocks_cell({"sm_clock_mhz": sm, "clock_event_reasons": {"sw_power_cap": 0.992}}) == "1740 (99%)"
    assert bench.clocks_cell({"sm_clock_mhz": sm, "clock_event_reasons": None}) == "1740 (0%)"
    # tokens per joule from the mean board power (session 28, W1 none: 8368 tokens/s at 680.3 W); none without power
    assert bench.tokens_per_joule(8368.0, {"power_w": {"mean": 680.3, "max": 701.3}}) == pytest.approx(12.30, abs=5e-3)
    assert res["runs"][0]["tokens_per_joule"] is None is bench.tokens_per_joule(10.0, {"power_w": None})


def test_bench_rollout_kv_pool_like_vllm(tmp_path):
    """``kv_gib_like_vllm``: each mode's KV pool is the GiB given for its weight precision, and a mode
    whose engine keeps its own copy (FP8, or BF16 in the fused layout: the default on one device)
    frees the source copy, as vLLM holds no trainer copy."""
    bench = _load("bench_rollout")
    engine = _tiny_bench_engine(bench, num_pages=3)  # overridden
    model = tiny_qwen3_moe  # test_bench_rollout_tiny's model and engine: its compiled programs are reused
    page = 2 * model.num_layers * 16 * model.num_kv_heads * model.head_dim  # bytes per item
    # a different GiB per weight precision, each TINY_PAGES pages of its pool dtype (float32 / E4M3)
    gibs = (TINY_PAGES * page * 4 / 2**30, TINY_PAGES * page * 1 / 2**30)
    res = bench.main(bench.BenchConfig(model=model, workload=bench.WORKLOADS["tiny"],
                                       modes=(Fp8Mode.NONE, Fp8Mode.ALL), engine=engine, kv_gib_like_vllm=gibs))
    runs = {r["mode"]: r for r in res["runs"]}
    for mode, gib, itemsize in (("none", gibs[0], 4), ("all", gibs[1], 1)):
        assert runs[mode]["kv_pages"] == int(gib * 2**30 // (page * itemsize)) == TINY_PAGES, mode
        assert runs[mode]["kv_pool_gib"] <= gib and runs[mode]["generated_tokens"] > 0
    assert runs["none"]["fused_projections"] and runs["all"]["fused_projections"]
    assert [runs[m]["bf16_copy_freed"] for m in ("none", "all")] == [True, True]


def test_bench_rollout_vllm_backend_plumbing(tmp_path, monkeypatch):
    """--backend vllm: each mode writes the checkpoint vLLM starts from (block FP8 for W8A8 modes,
    BF16 otherwise; our loader reads it back), starts the generator with the matching settings,
    syncs weights (and our KV scales for FP8 KV) and times the same workload, then the further
    workloads on the same engine (one start per mode). vLLM itself needs a GPU: a stand-in
    generator records what the benchmark asks of it."""
    import numpy as np

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
    bench = _load("bench_rollout")
    engine = dataclasses.replace(bench.BenchConfig.engine, max_slots=4, kv_budget_gib=0.001, max_seq_len=32,
                                 steps_per_call=4, dtype="float32")
    template = vb.VLLMConfig(model_path="", gpu_memory_utilization=0.5, jax_memory_fraction=0.3)
    res = bench.main(bench.BenchConfig(model=tiny_qwen3, workload=bench.WORKLOADS["tiny"],
                                       modes=(Fp8Mode.NONE, Fp8Mode.ALL), engine=engine, backend=bench.Backend.VLLM,
                                       vllm=template, workdir=tmp_path / "ckpt", out=tmp_path / "r.json",
                                       sync_repeats=2, also_workloads=(("long", bench.Workload(3, 8, 30)),)))
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


def test_profile_decode_page_orders():
    """``--pages engine``: each row's first pages contiguous and rows one after another, then one page per row
    per later call, rows side by side (what JaxEngine hands out to W1's lockstep rows); ``shuffled``: a random
    draw. Either way every page of every row is distinct and in the pool, and nothing past a row's need is set."""
    prof = _load("profile_decode")
    rng = np.random.default_rng(0)
    need = np.array([5, 7, 7, 2])
    t = prof.page_table(need, 9, prof.PageOrder.ENGINE, rng, prompt_pages=3)
    assert t[0, :3].tolist() == [0, 1, 2] and t[1, :3].tolist() == [3, 4, 5] and t[3, :2].tolist() == [9, 10]
    assert t[:3, 3].tolist() == [11, 12, 13] and t[:3, 4].tolist() == [14, 15, 16] and t[1:3, 5].tolist() == [17, 18]
    for table in (t, prof.page_table(need, 9, prof.PageOrder.SHUFFLED, rng, num_pages=40)):
        used = np.concatenate([table[b, : need[b]] for b in range(4)])
        assert len(set(used.tolist())) == need.sum() and used.max() < 40
        assert all((table[b, need[b]:] == 0).all() for b in range(4))


def test_inspect_codegen_counts_the_innermost_loop_of_sass():
    """`inspect_triton_codegen`'s SASS reader: the loop is the longest backward branch's body (a forward
    branch and a shorter loop do not count), its opcodes counted without predicates or modifiers."""
    insp = _load("inspect_triton_codegen")
    sass = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   ISETP.GE.AND P0, PT, R2, 0x1, PT ;
        /*0020*/              @P0 BRA 0x90 ;
        /*0030*/                   LDS R4, [R3] ;
        /*0040*/                   HMMA.16816.F32 R8, R4, R6, R8 ;
        /*0050*/              @!P1 FADD R8, R8, R9 ;
        /*0060*/                   HMMA.16816.F32 R8, R4, R6, R8 ;
        /*0070*/              @P2 BRA 0x30 ;
        /*0080*/              @P3 BRA 0x60 ;
        /*0090*/                   EXIT ;
    """
    assert insp._sass_loop(sass) == {"instructions": 5, "ops": {"HMMA": 2, "LDS": 1, "FADD": 1, "BRA": 1}}
    assert insp._sass_loop("/*0000*/ EXIT ;") == {}


def test_inspect_codegen_dumps_the_dense_gemm_split_k_configs(tmp_path):
    """``--kernel gemm --phase dump``: the Triton IR of each split-K config of the dense FP8 GEMM, lowered for sm_90
    on the CPU (the compile phase needs the triton wheel and runs elsewhere)."""
    insp = _load("inspect_triton_codegen")
    assert insp.main(["--kernel", "gemm", "--phase", "dump", "--out", str(tmp_path), "--gemm-configs", "64,64,4,4,2",
                      "128,64,4,3,4", "--gemm-shape", "64", "256", "512"]) == 0
    jobs = __import__("json").loads((tmp_path / "jobs.json").read_text())
    names = [j["name"] for j in jobs]
    assert names == ["gemm_m64_n256_k512_bm64_bn64_w4_s4_k2", "gemm_m64_n256_k512_bm128_bn64_w4_s3_k4"]
    assert [j["programs"] for j in jobs] == [1 * 4 * 2, 1 * 4 * 4]  # M tiles x N tiles x K splits (4 K blocks)
    assert all("tt.dot" in (tmp_path / f"{n}.ttir").read_text() for n in names)
    # 5 K blocks asked in 4 splits run 3 splits of 2, 2, 1 blocks (none empty), as the kernel grids them
    assert insp.main(["--kernel", "gemm", "--phase", "dump", "--out", str(tmp_path), "--gemm-configs", "64,64,4,4,4",
                      "--gemm-shape", "64", "256", "640"]) == 0
    assert __import__("json").loads((tmp_path / "jobs.json").read_text())[0]["programs"] == 1 * 4 * 3
    # --kernel grouped_gemm: its configs dump too (the grouped grid is not counted)
    gg = tmp_path / "gg"
    assert insp.main(["--kernel", "grouped_gemm", "--phase", "dump", "--out", str(gg), "--gg-configs", "16,64,4,4",
                      "--gg-shape", "8", "256", "512"]) == 0
    [job] = __import__("json").loads((gg / "jobs.json").read_text())
    assert "programs" not in job and "tt.dot" in (gg / f"{job['name']}.ttir").read_text()


def test_bench_decode_gemms_tiny(tmp_path):
    """Every decode GEMM of the preset in each variant, with its error against float64 (on the CPU the timings
    are NaN: no GPU kernels to trace)."""
    bench = _load("bench_decode_gemms")
    out = tmp_path / "gemms.json"
    rows = bench.main(["--preset", "tiny_qwen3", "--m", "8", "--splits", "2", "--sets", "2",
                       "--shapes", "qkv", "o_proj", "gate_up", "down_proj", "lm_head", "--out", str(out)])
    assert out.exists()
    names = {(r["shape"], r["variant"]) for r in rows}
    for shape in ("qkv", "o_proj", "gate_up", "down_proj", "lm_head"):
        assert {(shape, "bf16"), (shape, "bf16_splitk2")} <= names
        assert ((shape, "fp8") in names) is (shape != "lm_head")
    # --triton: the split-K Triton kernel's decode configs (interpret mode here, one shape: each config runs
    # ~1 s) against the same reference
    table = tmp_path / "triton.json"
    more = bench.main(["--preset", "tiny_qwen3", "--m", "8", "--splits", "2", "--sets", "2", "--triton",
                       "--shapes", "o_proj", "--triton-table-out", str(table)])
    triton = [r for r in more if r["variant"].startswith("fp8_triton_")]
    assert len(triton) == len({r["variant"] for r in triton}) == len(bench.triton_gemm.DECODE_CONFIGS)
    assert all(r["config"]["k_splits"] >= 1 for r in triton)
    assert not table.exists()  # nothing timed off the GPU: no table (the policy test reads one)
    with pytest.raises(SystemExit):
        bench.main(["--preset", "tiny_qwen3", "--triton-table-out", str(table)])  # needs --triton
    # --triton-configs: these configs instead of DECODE_CONFIGS
    chosen = bench.main(["--preset", "tiny_qwen3", "--m", "8", "--splits", "2", "--sets", "2", "--triton",
                         "--shapes", "o_proj", "--triton-configs", "16,32,4,2,1,swap,prefetch"])
    assert [r["variant"] for r in chosen if r["variant"].startswith("fp8_triton_")] == [
        "fp8_triton_16x32w4s2k1_swap_prefetch"]
    for bad in (["--triton-configs", "16,32,4,2,1"], ["--triton", "--triton-configs", "16,32,4"]):
        with pytest.raises(SystemExit):
            bench.main(["--preset", "tiny_qwen3", *bad])
    rows += [r for r in chosen if r["variant"].startswith("fp8_triton_")]
    rows += more
    for r in rows:
        assert r["max_rel_err"] <= (2e-2 if r["variant"].startswith("bf16") else 6e-2), r
        assert np.isnan(r["gpu_ms"])


def test_profile_decode_tiny(tmp_path, one_layer_presets):
    """The profile runs the engine's decode loop on a tiny model on the CPU (no trace: no GPU kernels), from the
    W1-like state too (equal lengths, the engine's page order)."""
    prof = _load("profile_decode")
    out = tmp_path / "profile.json"
    # one timed call (--repeats 1): the run then sizes its cache for 3 calls, as --hold does below, so the
    # held run reuses this run's compiled kv decode program
    res = prof.main(["--preset", "tiny_qwen3", "--batch", "4", "--context", "40", "--steps", "4", "--repeats", "1",
                     "--modes", "none", "kv", "--dtype", "float32", "--lengths", "equal", "--pages", "engine",
                     "--prompt-len", "24", "--no-trace", "--out", str(out)])
    assert out.exists() and [r["mode"] for r in res["runs"]] == ["none", "kv"]
    for r in res["runs"]:
        assert r["step_ms"] > 0 and len(r["call_s"]) == 1 and r["kv_gb_per_step"] > 0 and "trace" not in r
        assert r["recompiled_in_timed_calls"] == 0  # the first call compiled the only program the timed ones ran
        assert r["gpu_during_calls"] is None  # no nvidia-smi here
    # --hold: every call from the same lengths, so the KV read per step is that of one call's state
    held = prof.main(["--preset", "tiny_qwen3", "--batch", "4", "--context", "40", "--steps", "4", "--repeats", "3",
                      "--modes", "kv", "--dtype", "float32", "--lengths", "equal", "--hold", "--no-trace"])["runs"][0]
    kv = res["runs"][1]
    assert len(held["call_s"]) == 3 and held["recompiled_in_timed_calls"] == 0
    # per row: context + steps / 2 tokens (held) against context + steps * (repeats + 1) / 2 (1 repeat, advancing)
    assert held["kv_gb_per_step"] / kv["kv_gb_per_step"] == pytest.approx((40 + 2) / (40 + 4))
    # --prefill: the prefill program, 3 prompts of 24 tokens per call
    pre = prof.main(["--preset", "tiny_qwen3", "--prefill", "3", "--prompt-len", "24", "--steps", "4", "--repeats", "2",
                     "--modes", "all", "--dtype", "float32", "--no-trace"])["runs"][0]
    assert pre["program"] == "prefill" and pre["prompts"] == 3 and len(pre["call_s"]) == 2
    assert pre["prompt_tokens_per_s"] == pytest.approx(3 * 24 / pre["call_ms"] * 1e3)


def test_tune_cublaslt_algos_candidates(monkeypatch):
    """The sweep's candidates: the heuristic's choice first, then each listed algorithm with its K splits pinned
    where cuBLASLt accepts it, a kernel configuration timed once; off the GPU it says what it needs."""
    tune = _load("tune_cublaslt_algos")
    with pytest.raises(SystemExit, match="needs cuBLASLt on a CUDA GPU"):
        tune.main([])

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


def test_bench_gemm_says_it_needs_a_gpu(capsys):
    bench = _load("bench_gemm")
    assert bench.main([]) == 0
    assert "needs a GPU" in capsys.readouterr().out


def test_bench_train_tiny(tmp_path):
    """BF16 vs FP8 training step timing runs end to end and reports a bounded gradient disagreement."""
    bench = _load("bench_train")
    out = tmp_path / "train.json"
    res = bench.main(bench.BenchConfig(model=dataclasses.replace(tiny_qwen3, num_layers=1), batch=2, seq_len=16, warmup=1, repeats=1, remat=False, out=out))
    assert out.exists() and set(res["runs"]) == {"bf16", "fp8"}
    assert all(r["step_ms_median"] > 0 for r in res["runs"].values())
    assert 0.0 < res["grad_rel_err_fp8_vs_bf16"] < 0.5  # FP8 differs from BF16, but not wildly


def test_fp8_grad_attribution_tiny(tmp_path):
    """The gradient-error attribution runs its arms against float32: BF16 is the floor, FP8 on one
    projection is above it (two arms here; the CPU result file has them all)."""
    exp = _load("fp8_grad_attribution")
    out = tmp_path / "attr.json"
    res = exp.main(["--preset", "tiny_qwen3", "--layers", "1", "--batch", "2", "--seq-len", "16",
                    "--arms", "bf16,only_v_proj", "--out", str(out)])
    e = res["rel_err_vs_float32"]
    assert out.exists() and out.with_suffix(".md").exists() and set(e) == {"bf16", "only_v_proj"}
    assert 0 < e["bf16"] < e["only_v_proj"] < 0.5


def test_bench_rl_step_tiny(tmp_path):
    """The end-to-end RL step benchmark runs real steps per arm and accounts for the step's time by stage."""
    bench = _load("bench_rl_step")
    cfg = bench.parse_args(["--preset", "tiny_qwen3", "--layers", "1", "--prompts", "2", "--samples", "2",
                            "--prompt-len", "6", "--max-new", "4", "--steps", "2", "--micro-batches", "2",
                            "--kv-gib", "0.0005", "--max-slots", "4", "--arms", "all:fp8",
                            "--out", str(tmp_path / "rl.json")])
    res = bench.main(cfg, runs_dir=tmp_path / "runs")
    assert [a["arm"] for a in res["arms"]] == ["all:fp8"] and (tmp_path / "rl.json").exists()
    for a in res["arms"]:
        assert len(a["steps"]) == 2 and 0 < a["generated_tokens_per_step"] <= 2 * 2 * 4
        stages = sum(a["steps"][1][k] for k in bench.STAGES)
        assert 0 < stages <= a["steps"][1]["time/step_s"] and 0 < a["rollout_share"] < 1
        assert len(a["reward_mean"]) == 2 and all(0.0 <= r <= 1.0 for r in a["reward_mean"])
    assert bench.parity_reward("2 4", "") == 1.0 and bench.parity_reward("2 3", "") == 0.0
    assert bench.parity_reward("", "") == 0.0
    assert bench.Arm.parse("kv:fp8") == bench.Arm(bench.Fp8Mode.KV, True)
    assert bench.Arm.parse("none") == bench.Arm(bench.Fp8Mode.NONE, False)
    with pytest.raises(ValueError, match="bf16 or fp8"):
        bench.Arm.parse("all:fp16")


def test_bench_scaling_tiny_on_two_cpu_devices(tmp_path):
    """The 1-vs-2-device benchmark (TP generator, FSDP train step, FSDP -> TP sync) runs end to end
    on two CPU devices (a child process: the device count is fixed when JAX starts)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    out = tmp_path / "scaling.json"
    env = cpu_devices_env(2)
    # the script's own command line, run with the one-layer tiny preset (tests/_a_one_layer_script.py)
    proc = subprocess.run([sys.executable, str(repo / "tests" / "_a_one_layer_script.py"),
                           str(repo / "experiments" / "bench_scaling.py"), "--preset", "tiny_qwen3",
                           "--tiny", "--out", str(out)], env=env, cwd=repo, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["environment"]["devices"] == 2 and res["model"]["num_layers"] == 1
    g = res["generator"]
    assert g["tp1"]["tokens_per_s"] > 0 and g["tp2"]["tokens_per_s"] > 0
    assert abs(g["tp2"]["kv_pages"] - 2 * g["tp1"]["kv_pages"]) <= 1  # the KV budget is per device
    assert res["train_1dev"]["step_s"] > 0 and res["train_fsdp2"]["step_s"] > 0
    assert set(res["sync_fsdp2_to_tp2"]) == {"reshard_ms", "quantize_ms"}


def test_stall_hunt_tiny_runs_configs_on_the_cpu(tmp_path):
    hunt = _load("paged_attention_stall_hunt")
    out = tmp_path / "hunt.json"
    assert hunt.main(["--tiny", "--out", str(out)]) == 0
    import json

    rows = json.loads(out.read_text())["results"]
    assert {r["pool"] for r in rows} == {"bfloat16", "float8_e4m3fn"}
    assert all(r["status"] == "ok" and r["calls"] > 0 and r["finite"] for r in rows)


def test_stall_hunt_reports_a_child_that_stops_progressing(tmp_path):
    """A child that reports progress, then hangs, is killed after stall_s and reported stalled with
    the calls it made; one that exits with an error is reported as an error, not as a stall."""
    import sys

    hunt = _load("paged_attention_stall_hunt")
    hang = tmp_path / "hang.py"
    hang.write_text("import sys, time\nprint('progress 7 calls 0.1 s', flush=True)\ntime.sleep(600)\n")
    crash = tmp_path / "crash.py"
    crash.write_text("import sys\nprint('boom', flush=True)\nsys.exit(3)\n")
    cfg = hunt.DEFAULT_CONFIG
    row = hunt.run_config("bfloat16", cfg, batch=1, context=16, seconds=1, stall_s=1.0, compile_s=30,
                          command=[sys.executable, str(hang)])
    assert row["status"] == "stalled" and row["calls_before"] == 7 and row["wall_s"] < 20
    row = hunt.run_config("bfloat16", cfg, batch=1, context=16, seconds=1, stall_s=1.0, compile_s=30,
                          command=[sys.executable, str(crash)])
    assert row["status"] == "error rc=3" and row["log_tail"] == ["boom"]


def test_bench_stream_overlap_tiny(tmp_path, monkeypatch):
    """The two-batch-overlap programs on the CPU: the two-stream program carries XLA's stream annotations and gives
    exactly the one-stream program's outputs, and both halve-row orders compute what the full-batch step does."""
    bench = _load("bench_stream_overlap")
    out = tmp_path / "overlap.json"
    halves = ["full", "halves_serial", "halves_streams", "halves_streams_write_on_main"]  # (the parts: no check)
    res = bench.main(["--preset", "tiny_qwen3", "--rows", "2", "--context", "32", "--layers", "2", "--repeats", "1",
                      "--weight-sets", "2", "--programs", *halves, "--out", str(out)])
    assert out.exists() and list(res["runs"]) == halves
    assert res["halves_streams_equal_serial"] is True and res["halves_streams_write_on_main_equal_serial"] is True
    assert res["runs"]["halves_streams"]["stream_annotations"] > 0
    assert res["runs"]["halves_streams_write_on_main"]["stream_annotations"] > 0
    assert res["runs"]["halves_serial"]["stream_annotations"] == 0
    # lowered for the H200 (native kernels) the stream regions hold their kernels' ops and no call of their own,
    # which XLA's stream assignment rejects (session 30); without the kernels' jits inlined they do
    from configs.models import PRESETS
    from pallas_kernels.common import triton_ir_for_h200

    args = bench._parser().parse_args(["--preset", "tiny_qwen3", "--rows", "2", "--context", "32", "--layers", "2",
                                       "--weight-sets", "2"])
    operands = bench.build(args, PRESETS["tiny_qwen3"])
    policy = bench.W8A8Policy("bfloat16", gemm=bench.GemmBackend.AUTO)

    def lowered(name):
        with triton_ir_for_h200(native_kernels=True):
            fn = bench.programs(args, PRESETS["tiny_qwen3"], policy)[name]
            return fn.trace(*operands).lower(lowering_platforms=("cuda",)).as_text()

    for name in ("halves_streams", "halves_streams_write_on_main"):
        text = lowered(name)
        assert "__gpu$xla.gpu.triton" in text and "@compute_on" in text and bench.nested_stream_calls(text) == 0
    monkeypatch.setattr(bench, "inline_jits", bench.jax.jit)
    assert bench.nested_stream_calls(lowered("halves_streams")) > 0
    # the halves compute the full batch's rows (row-independent ops; BF16 GEMMs of other M may round differently)
    assert res["halves_vs_full_max_rel_err"] < 1e-2
    # the donated pool goes from call to call without recompiling (the operands are committed, as outputs are)
    assert all(r["recompiled_in_timed_calls"] == 0 for r in res["runs"].values())
    assert bench.with_stream_flag("--a=1") == "--a=1 " + bench.STREAM_FLAG
    assert bench.with_stream_flag(bench.STREAM_FLAG) == bench.STREAM_FLAG
    with pytest.raises(SystemExit):
        bench.main(["--preset", "tiny_qwen3_moe"])
    with pytest.raises(SystemExit):
        bench.main(["--preset", "tiny_qwen3", "--programs", "nope"])
