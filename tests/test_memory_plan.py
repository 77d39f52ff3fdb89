"""The memory plan (`fp8rl_jax.rl.memory`) and ``fp8rl plan``: byte counts against hand-computed ones from the
published Qwen3 architectures, the error that names the dominant term, bad input, the command-line contract and
the benchmarks' own checks. CPU only, nothing compiled or allocated."""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from pathlib import Path

import pytest

from configs.models import qwen3_8b, qwen3_30b_a3b
from configs.rl import AIME24_QWEN3_8B, AIME24_QWEN3_30B_A3B, QUICKSTART
from conftest import run_cli, run_cli_here
from fp8rl_jax.rl.config import ConfigError, override
from fp8rl_jax.rl.memory import (GIB, generator_weight_bytes, kv_page_bytes, load_preset, plan_memory,
                                 train_activation_bytes)

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

# Published architectures (the Qwen/Qwen3-8B and Qwen/Qwen3-30B-A3B config.json files), written out here
# rather than read from the presets, so that the planner is checked against independent numbers.
V = 151_936
Q8 = dict(L=36, D=4096, N=32, K=8, H=128, F=12_288)
Q30 = dict(L=48, D=2048, N=32, K=4, H=128, E=128, I=768, k=8)


def blocks(n: int, k: int) -> int:
    """128 x 128 FP8 blocks (one float32 scale each) of an [n, k] weight."""
    return math.ceil(n / 128) * math.ceil(k / 128)


def dense_8b() -> dict[str, int]:
    """Qwen3-8B's parameters: linear weights, FP8 scale blocks and the rest (BF16 in the generator)."""
    L, D, N, K, H, F = (Q8[x] for x in "L D N K H F".split())
    linear = L * (2 * N * H * D + 2 * K * H * D + 3 * F * D)  # q, o; k, v; gate, up, down
    scales = L * (2 * blocks(N * H, D) + 2 * blocks(K * H, D) + 2 * blocks(F, D) + blocks(D, F))
    other = 2 * V * D + D + L * (2 * D + 2 * H)  # embed, untied lm_head, final norm; layer norms, q/k norms
    return {"linear": linear, "scales": scales, "other": other, "total": linear + other}


def moe_30b() -> dict[str, int]:
    L, D, N, K, H, E, I = (Q30[x] for x in "L D N K H E I".split())
    linear = L * (2 * N * H * D + 2 * K * H * D + 3 * E * I * D)  # attention; every expert's gate, up, down
    scales = L * (2 * blocks(N * H, D) + 2 * blocks(K * H, D) + 3 * E * blocks(I, D))
    other = 2 * V * D + D + L * (2 * D + 2 * H + E * D)  # ... + the router, which stays BF16
    return {"linear": linear, "scales": scales, "other": other, "total": linear + other}


def test_parameter_counts_are_the_published_ones():
    assert dense_8b()["total"] == 8_190_735_360  # "8.2B"
    assert moe_30b()["total"] == 30_532_122_624  # "30.5B"


@pytest.mark.parametrize("preset,count", [(AIME24_QWEN3_8B, dense_8b), (AIME24_QWEN3_30B_A3B, moe_30b)],
                         ids=["8b", "30b_a3b"])
def test_state_and_generator_bytes_on_fsdp8(preset, count):
    """8 devices, fsdp 8: every parameter has a dimension divisible by 8, so each device holds exactly an eighth."""
    c = count()
    plan = plan_memory(preset, 8, 80 * GIB)
    assert (plan.mesh.fsdp, plan.params) == (8, c["total"])
    rollout = plan.phases["rollout"]
    assert rollout["masters"] == 4 * c["total"] // 8
    assert rollout["optimizer"] == 2 * 4 * c["total"] // 8  # mu, nu
    assert plan.phases["update"]["gradients"] == 2 * 4 * c["total"] // 8
    assert plan.phases["update"]["compute_copy"] == 2 * c["total"] // 8
    # the generator's FP8 copy (one device per replica): E4M3 codes + float32 block scales + BF16 rest
    assert rollout["generator"] == c["linear"] + 4 * c["scales"] + 2 * c["other"]
    assert plan.sleep and "generator" not in plan.phases["update"]  # asleep while the trainer steps


def test_generator_bytes_by_precision_and_tensor():
    c = dense_8b()
    assert generator_weight_bytes(qwen3_8b, False) == 2 * c["total"]
    # tensor 8 splits heads, FFN and vocabulary: everything but the norms
    L, D, H = Q8["L"], Q8["D"], Q8["H"]
    norms = D + L * (2 * D + 2 * H)
    assert generator_weight_bytes(qwen3_8b, False, tensor=8) == 2 * ((c["total"] - norms) // 8 + norms)


def test_kv_page_bytes_and_pool():
    L, K, H = Q8["L"], Q8["K"], Q8["H"]
    assert kv_page_bytes(qwen3_8b, 16, fp8_kv=True) == 2 * L * 16 * K * H  # K and V, one byte each
    assert kv_page_bytes(qwen3_8b, 16, fp8_kv=False) == 2 * L * 16 * K * H * 2
    assert kv_page_bytes(qwen3_30b_a3b, 16, fp8_kv=True) == 2 * Q30["L"] * 16 * Q30["K"] * Q30["H"]
    fixed = override(AIME24_QWEN3_8B, ["rollout.engine.kv_budget_fraction=0", "rollout.engine.kv_budget_gib=60"])
    plan = plan_memory(fixed, 8, 80 * GIB)  # FP8 KV
    page = 2 * L * 16 * K * H
    assert plan.kv_pages == 60 * GIB // page
    # the preset's pool: 85% of what the rollout phase leaves on each device
    share = plan_memory(AIME24_QWEN3_8B, 8, 80 * GIB)
    assert share.kv_pages == int(0.85 * share.kv_room_bytes // page) > 0
    assert plan.kv_sequences == plan.kv_pages // math.ceil(22_528 / 16)
    assert plan.kv_pages * page <= plan.phases["rollout"]["kv_pool"] < plan.kv_pages * page + 4 * 2**20


def test_activation_model_as_documented():
    """Remat, one row of T tokens: L T D c saved + one layer recomputed with one query block's scores (T x 1024
    per head) + hidden + mask; a sequence within one block keeps its T^2 scores."""
    L, D, N, K, H, F = (Q8[x] for x in "L D N K H F".split())
    T, c = 22_528, 2
    A = c * (4 * D + 3 * (N + K) * H + 3 * F)
    want = L * T * D * c + T * (A + 16 * N * 1024) + T * (D * (c + 4) + 1024)
    assert train_activation_bytes(qwen3_8b, 1, T, remat=True, logits_chunk=1024) == want
    T = 1000  # one block; the unchunked LM head's three [T, V] float32 blocks outweigh the layer here
    want = L * T * D * c + max(T * (A + 16 * N * T), T * V * 4 * 3) + T * (D * (c + 4) + T)
    assert train_activation_bytes(qwen3_8b, 1, T, remat=True, logits_chunk=1024) == want


def test_rollout_terms_match_the_measured_h100_runs():
    """experiments/results/h100/rollout_W1_{none,all}.json: device bytes in use once the engine's weights and
    KV pool are placed (W1: 256 x (1024 + 2048) tokens), and the peak of the generate beside weights + pool +
    the plan's workspace."""
    from fp8rl_jax.rl.memory import _layer_token_bytes

    for mode, fp8 in (("none", False), ("all", True)):
        rec = json.loads((REPO / "experiments/results/h100" / f"rollout_W1_{mode}.json").read_text())
        run = rec["runs"][0]
        weights = generator_weight_bytes(qwen3_8b, fp8)
        kv = run["kv_pages"] * kv_page_bytes(qwen3_8b, 16, fp8)
        assert abs(weights + kv - run["memory_gb"]["bytes_in_use"] * 1e9) < 0.01 * (weights + kv)
        workspace = 3 * 256 * V * 4 + 8 * 1024 * (_layer_token_bytes(qwen3_8b, 0, 1, 2) + 2 * Q8["D"] * 2)
        peak = run["memory_gb"]["peak_bytes_in_use"] * 1e9
        assert abs(weights + kv + workspace - peak) < 0.10 * peak


def test_choice_is_the_largest_micro_batch_that_fits():
    cfg = override(AIME24_QWEN3_8B, ["parallel.tensor=8"])
    plan = plan_memory(cfg, 8, 80 * GIB)
    assert plan.fits and plan.problem() is None
    assert plan.batch_per_device == 512 and plan.batch_per_device % plan.update_rows == 0
    assert plan.micro_batches * plan.update_rows == 512
    bigger = min(r for r in range(plan.update_rows + 1, 513) if 512 % r == 0)  # the next divisor does not fit
    fixed = override(cfg, [f"trainer.micro_batches={512 // bigger}"])
    over = plan_memory(fixed, 8, 80 * GIB, choose_micro_batches=False)
    assert over.update_rows == bigger and over.total("update") > over.hbm_bytes
    assert plan.logprob_rows >= plan.update_rows  # the forward keeps less
    table = plan.table()
    for text in ("float32 master weights", "KV pool", "trainer.micro_batches", "fits", "rollout", "update"):
        assert text in table


@pytest.mark.parametrize("sets,words", [
    (["rollout.engine.kv_budget_fraction=0", "rollout.engine.kv_budget_gib=60"],
     ["rollout phase", "KV pool", "rollout.engine.kv_budget_gib to 4"]),
    (["trainer.remat=false"], ["update phase", "activations", "trainer.remat=true"]),
])
def test_error_names_the_dominant_term(sets, words):
    plan = plan_memory(override(AIME24_QWEN3_8B, sets), 8, 80 * GIB)
    assert not plan.fits
    line = plan.problem()
    assert "\n" not in line and all(w in line for w in words), line


def test_state_dominant_and_offload():
    short = ["rollout.engine.max_seq_len=2048", "rollout.max_new_tokens=1024", "algorithm.overlong_buffer=256",
             "rollout.engine.kv_budget_gib=1"]
    cfg = override(AIME24_QWEN3_8B, short)
    line = plan_memory(cfg, 1, 80 * GIB).problem()
    assert "AdamW mu + nu" in line and "trainer.offload_optimizer=true" in line and "parallel.fsdp" in line
    on_host = plan_memory(override(cfg, ["trainer.offload_optimizer=true"]), 1, 80 * GIB)
    assert on_host.phases["rollout"]["optimizer"] == 0 and on_host.host_bytes == 2 * 4 * dense_8b()["total"]
    # two groups' mu + nu in float32: the largest group is the embedding (or the lm_head), V x D
    assert on_host.phases["update"]["offload_stream"] == 2 * 2 * 151_936 * 4096 * 4
    assert "offload_optimizer" not in plan_memory(cfg, 8, 10 * GIB).problem()  # one device only


@pytest.mark.parametrize("cfg,devices,match", [
    (override(AIME24_QWEN3_8B, ["parallel.tensor=3"]), 3, "does not divide the 32 query heads"),
    (override(AIME24_QWEN3_30B_A3B, ["parallel.expert=3"]), 3, "does not divide the 128 experts"),
    (AIME24_QWEN3_8B, 3, "does not split over data x fsdp x expert"),
    (override(AIME24_QWEN3_8B, ["parallel.generator_tensor=16"]), 16, "generator_tensor = 16 must divide"),
    (override(AIME24_QWEN3_8B, ["parallel.data=3"]), 8, "does not fit 8 devices"),
    (AIME24_QWEN3_8B, 0, "devices must be an int >= 1"),
])
def test_bad_input_is_a_config_error(cfg, devices, match):
    with pytest.raises(ConfigError, match=match):
        plan_memory(cfg, devices, 80 * GIB)
    with pytest.raises(ConfigError, match="HBM"):
        plan_memory(QUICKSTART, 1, 0)


def test_presets_resolve_through_entry_points():
    assert load_preset("aime24_qwen3_8b") is AIME24_QWEN3_8B
    with pytest.raises(ConfigError, match="presets: aime24_qwen3_30b_a3b, aime24_qwen3_8b, quickstart"):
        load_preset("nope")


def test_cli_plan_fits():
    ok = run_cli("plan", "--preset", "aime24_qwen3_8b", "--devices", "8", "--hbm-gib", "80")
    assert ok.returncode == 0, ok.stderr
    assert "per device (GiB)" in ok.stdout and "trainer.micro_batches" in ok.stdout and ok.stderr == ""


def test_cli_plan_does_not_fit():
    bad = run_cli("plan", "--preset", "aime24_qwen3_8b", "--devices", "1", "--hbm-gib", "80")
    assert bad.returncode == 2 and bad.stdout == ""
    lines = bad.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "largest term is" in lines[0], bad.stderr


@pytest.mark.parametrize("argv,match", [
    (["--preset", "nope", "--devices", "8", "--hbm-gib", "80"], "unknown preset 'nope'; presets: "),
    (["--preset", "aime24_qwen3_8b", "--devices", "3", "--hbm-gib", "80"], "does not split over"),
    (["--preset", "aime24_qwen3_8b", "--devices", "8", "--hbm-gib", "0"], "HBM"),
    (["--preset", "aime24_qwen3_8b", "--devices", "8", "--hbm-gib", "80", "--set", "parallel.tensr=8"],
     "unknown key"),
])
def test_cli_plan_bad_input(capsys, argv, match):
    rc, err = run_cli_here(capsys, "plan", *argv)
    assert rc == 2 and err.startswith("error: ") and match in err and len(err.strip().splitlines()) == 1, err


def test_benchmarks_check_before_allocating():
    """The decode benchmark at 256 x 2048 with a BF16 KV pool does not fit an 80 GB H100 and says so in one line."""
    from experiments.bench.__main__ import suite_parser
    from experiments.bench.suites import decode, rl_step, rollout, train_step

    limit = int(80.77e9)  # an H100's allocator limit at XLA_PYTHON_CLIENT_MEM_FRACTION=0.95
    args = suite_parser("decode").parse_args(["--batch", "256", "--context", "2048", "--modes", "none"])
    with pytest.raises(ValueError, match=r"largest is the KV pool: lower --batch") as e:
        decode.check_memory(args, limit)
    assert "\n" not in str(e.value)
    decode.check_memory(suite_parser("decode").parse_args(["--batch", "64", "--modes", "all"]), limit)
    decode.check_memory(args, None)  # no limit reported (the CPU): no check
    plan_w1 = ["--workload", "W1", "--modes", "none", "all", "--kv-gib-like-vllm", "49.5", "56.16"]
    rollout.check_memory(rollout.config(suite_parser("rollout").parse_args(plan_w1)), limit)
    with pytest.raises(ValueError, match="KV pool"):
        rollout.check_memory(rollout.config(suite_parser("rollout").parse_args(["--modes", "none"])), limit)
    rl_step.check_memory(rl_step.config(suite_parser("rl_step").parse_args([])), limit)
    with pytest.raises(ValueError, match="lower --kv-gib"):
        rl_step.check_memory(rl_step.config(suite_parser("rl_step").parse_args([])), 30 * GIB)
    with pytest.raises(ValueError, match="AdamW moments"):
        train_step.check_memory(dataclasses.replace(train_step.BenchConfig(), model=qwen3_8b), limit)


def test_a_run_prints_its_plan_and_stops_when_it_does_not_fit(tmp_path, monkeypatch, capsys):
    """On a GPU (faked: an allocator limit of 64 MiB) the AIME24 recipe prints the per-device plan and stops
    with the plan's one-line problem before any weight is built; ``memory_check=false`` would go on."""
    from conftest import load_experiment

    exp = load_experiment("aime24_qwen3_8b")
    aime24 = sys.modules["aime24"]
    monkeypatch.setattr(aime24, "device_bytes_limit", lambda: 64 * 2**20)
    monkeypatch.setattr(aime24, "init_params", lambda *a, **k: pytest.fail("built weights past a failed plan"))
    train = tmp_path / "train.jsonl"
    train.write_text(json.dumps({"question": "What is 1 + 1?", "answer": "2"}) + "\n")
    config = aime24.AimeConfig(rl=override(exp.TINY, [f"logging.out_dir={tmp_path / 'run'}", f"data.train_path={train}",
                                                      "data.eval_every=0"]),
                               random_init=True, overflow=aime24.Overflow.TRUNCATE)
    with pytest.raises(aime24.UsageError, match="largest term is .*memory_check=false runs anyway"):
        aime24.main(config)
    out = capsys.readouterr().out
    assert "per device (GiB)" in out and "does not fit" in out
