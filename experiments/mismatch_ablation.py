"""The FP8-RL paper's key ablation on the quickstart task, plus a per-layer mismatch attribution.

Ablation. Four arms of the CPU quickstart (``experiments/quickstart.py``: tiny Qwen3, SFT warm-up,
then GRPO on multi-digit addition), each run for several seeds:

    bf16       rollout in BF16 (``Fp8Mode.NONE``), no correction (``Correction.NONE``)
    fp8_tis    rollout in FP8 W8A8 + FP8 KV (``Fp8Mode.ALL``), token TIS (the quickstart default)
    fp8_none   rollout in FP8, no correction: the mismatch is ignored
    fp8_mis    rollout in FP8, token MIS (IcePop masking, ratio kept inside [mis_low, mis_high])

Arms differ only in ``rl.precision.rollout`` and ``rl.algorithm.loss.correction`` (checked at
start); ``rl.seed`` seeds the initial params, the SFT and RL data stream, the sampling keys and the
evaluation set, so seed s is the same experiment in every arm. Each (arm, seed) runs
``quickstart.main`` into ``out/runs/<arm>_s<seed>/`` (a run whose ``summary.json`` exists with the
same config is reused), at most two at a time in spawned processes. The script plots reward, greedy
eval accuracy and mismatch KL (K3) against steps (mean +- std over seeds) and writes a table: final
reward (mean of the last ``final_window`` steps), final greedy eval accuracy and mean K3, each
mean +- std over seeds, and each FP8 arm's difference to BF16 against the seed noise
(standard error of the difference of two means).

Attribution. Trainer and generator share one model definition, so the mismatch of the FP8
rollout can be taken apart on one batch of rollouts: the trained ``fp8_tis`` model of the first
seed generates prompt + response tokens with the FP8 engine; those tokens are scored by the
trainer (BF16, full-sequence forward) and by the same model with FP8 in chosen places only:

    linears      W8A8 on every decoder layer (``quantize_params`` + ``W8A8Policy``)
    kv           E4M3 paged KV cache on every layer (the engine's read path, its calibrated scales)
    all          both (what the engine runs)
    linear_l     W8A8 on layer l only (``LayerPolicy(bf16_first_layers=l, bf16_last_layers=L-1-l)``)
    kv_l         E4M3 KV on layer l only (the other layers' pools in BF16)

For each, ``KL(pi_fp8 || pi_bf16)`` over response tokens: K1 and K3 of the sampled tokens'
logprobs (``algos.mismatch_metrics``) and the exact KL over the vocabulary (no sampling noise).
Controls: ``none`` (no FP8: exactly 0) and ``bf16_paged`` (the paged-cache read path with BF16
pools, the floor of the cache path itself). The tokens come from the full-FP8 engine, so the K1/K3
of a partial placement are estimates on off-policy samples; the exact KL is not.

    python experiments/mismatch_ablation.py [--out experiments/results] [--seeds 0,1,2] [--steps 150]
        [--workers 2] [--arms bf16,fp8_tis,fp8_none,fp8_mis] [--no-attribution] [--set section.field=value ...]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import dataclasses
import datetime
import enum
import functools
import json
import multiprocessing
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
for _p in (str(ROOT), str(HERE)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import quickstart  # noqa: E402
from flax import nnx  # noqa: E402

from fp8rl_jax.models import DensePolicy, Fp8Mode, ModelConfig, PagedKVCache, forward, init_params  # noqa: E402
from fp8rl_jax.quant.policy import LayerPolicy, W8A8Policy, quantize_params  # noqa: E402
from fp8rl_jax.rl import config as rlconfig  # noqa: E402
from fp8rl_jax.rl.algos import Correction, mismatch_metrics  # noqa: E402
from fp8rl_jax.rl.loop import build_batch, read_metrics, rollout  # noqa: E402
from fp8rl_jax.rollout.engine import JaxEngine  # noqa: E402
from fp8rl_jax.tasks import AdditionTask  # noqa: E402
from fp8rl_jax.tokenization import char_tokenizer  # noqa: E402


class Arm(enum.Enum):
    """One ablation arm: rollout precision x mismatch correction."""

    BF16 = "bf16"
    FP8_TIS = "fp8_tis"
    FP8_NONE = "fp8_none"
    FP8_MIS = "fp8_mis"

    @property
    def precision(self) -> Fp8Mode:
        return Fp8Mode.NONE if self is Arm.BF16 else Fp8Mode.ALL

    @property
    def correction(self) -> Correction:
        return {Arm.BF16: Correction.NONE, Arm.FP8_TIS: Correction.TOKEN_TIS, Arm.FP8_NONE: Correction.NONE,
                Arm.FP8_MIS: Correction.TOKEN_MIS}[self]

    @property
    def label(self) -> str:
        return {Arm.BF16: "BF16 rollout", Arm.FP8_TIS: "FP8 + token TIS", Arm.FP8_NONE: "FP8, no correction",
                Arm.FP8_MIS: "FP8 + token MIS"}[self]


# the only config paths allowed to differ between arms
ARM_FIELDS = ("rl.precision.rollout", "rl.algorithm.loss.correction")


def _quiet(q: quickstart.QuickstartConfig) -> quickstart.QuickstartConfig:
    log = dataclasses.replace(q.rl.logging, tensorboard=False, plot=False, progress=False)
    return dataclasses.replace(q, rl=dataclasses.replace(q.rl, logging=log))


@dataclasses.dataclass(frozen=True)
class AblationConfig:
    """The ablation: ``quickstart`` is the base run every arm and seed derives from.

    Attributes:
      quickstart: the task and RL config (``rl.data.steps`` sets the run length).
      arms: arms to run.
      seeds: values of ``rl.seed``.
      final_window: steps averaged for the final train reward.
      workers: runs at a time (1: in this process; 2: two spawned processes).
      attribution: run the mismatch attribution after the ablation.
      attribution_prompts, attribution_samples: the attribution's rollout batch (prompts x samples).
      out: results folder (``mismatch_ablation_<tag>.json/.md/.png``, ``mismatch_attribution_<tag>.*``).
      runs_dir: per-run folders (metrics.jsonl, summary.json); default ``out/runs``.
      tag: file-name suffix, e.g. the device.
    """

    quickstart: quickstart.QuickstartConfig = _quiet(quickstart.QuickstartConfig())
    arms: tuple[Arm, ...] = tuple(Arm)
    seeds: tuple[int, ...] = (0, 1, 2)
    final_window: int = 10
    workers: int = 1
    attribution: bool = True
    attribution_prompts: int = 128
    attribution_samples: int = 8
    out: Path = Path("runs/mismatch_ablation")
    runs_dir: Path | None = None
    tag: str = "cpu"

    def __post_init__(self) -> None:
        if not self.arms or not all(isinstance(a, Arm) for a in self.arms):
            raise rlconfig.ConfigError(f"arms must be a non-empty tuple of Arm, got {self.arms!r}")
        if not self.seeds or len(set(self.seeds)) != len(self.seeds):
            raise rlconfig.ConfigError(f"seeds must be distinct and non-empty, got {self.seeds!r}")
        if not 1 <= self.workers <= 2:
            raise rlconfig.ConfigError(f"workers must be 1 or 2 (shared CPU), got {self.workers}")
        if not 1 <= self.final_window <= self.quickstart.rl.data.steps:
            raise rlconfig.ConfigError(f"final_window must be in [1, rl.data.steps = {self.quickstart.rl.data.steps}]")
        if self.attribution_prompts < 1 or self.attribution_samples < 1:
            raise rlconfig.ConfigError("attribution_prompts and attribution_samples must be >= 1")

    @property
    def runs(self) -> Path:
        return self.runs_dir if self.runs_dir is not None else self.out / "runs"


def arm_config(base: quickstart.QuickstartConfig, arm: Arm, seed: int) -> quickstart.QuickstartConfig:
    """The quickstart config of one (arm, seed): the base with the arm's two fields and the seed."""
    grid = {ARM_FIELDS[0]: [arm.precision], ARM_FIELDS[1]: [arm.correction], "rl.seed": [seed]}
    (cfg,) = rlconfig.sweep(base, grid)
    return cfg


def config_differences(a: Any, b: Any, prefix: str = "") -> list[str]:
    """Dotted paths where two config trees differ."""
    da, db = rlconfig.to_dict(a), rlconfig.to_dict(b)

    def walk(x, y, path):
        if isinstance(x, dict) and isinstance(y, dict):
            out = []
            for k in sorted(set(x) | set(y)):
                out += walk(x.get(k), y.get(k), f"{path}.{k}" if path else k)
            return out
        return [] if x == y else [path]

    return walk(da, db, prefix)


def check_arms(config: AblationConfig) -> None:
    """Arms of one seed differ in ``ARM_FIELDS`` only; seeds of one arm in ``rl.seed`` only."""
    s0, a0 = config.seeds[0], config.arms[0]
    ref = arm_config(config.quickstart, a0, s0)
    for arm in config.arms:
        extra = set(config_differences(ref, arm_config(config.quickstart, arm, s0))) - set(ARM_FIELDS)
        if extra:
            raise AssertionError(f"arm {arm.value} differs from {a0.value} beyond {ARM_FIELDS}: {sorted(extra)}")
    for s in config.seeds:
        extra = set(config_differences(ref, arm_config(config.quickstart, a0, s))) - {"rl.seed"}
        if extra:
            raise AssertionError(f"seed {s} differs beyond rl.seed: {sorted(extra)}")


# ------------------------------------------------------------------------------------ runs


@contextlib.contextmanager
def _capture_final_params(sink: dict):
    """Keeps the params ``quickstart.main`` trains (it returns only a summary): wraps the
    ``run`` stage it calls for the duration of one run."""
    original = quickstart.run

    def run(*args, **kwargs):
        state = original(*args, **kwargs)
        sink["params"] = state.params
        return state

    quickstart.run = run
    try:
        yield sink
    finally:
        quickstart.run = original


def save_params(params: nnx.State, path: Path) -> None:
    arrays = {"/".join(map(str, p)): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(params)}
    np.savez(path, **arrays)


def load_params(path: Path, model_config: ModelConfig) -> nnx.State:
    """Params saved by :func:`save_params`, into the structure of ``init_params`` (float32)."""
    template = init_params(model_config, jax.random.key(0), jnp.float32)
    with np.load(path) as saved:
        flat = [(p, v.replace(jnp.asarray(saved["/".join(map(str, p))]))) for p, v in nnx.to_flat_state(template)]
    return nnx.from_flat_state(flat)


def _run_one(cfg: quickstart.QuickstartConfig, out: Path, keep_params: bool) -> dict:
    """One quickstart run (in a worker process or in this one); reuses a finished identical run."""
    summary_path, config_path = out / "summary.json", out / "config.json"
    want = json.dumps(rlconfig.to_dict(cfg), indent=1) + "\n"
    if (summary_path.exists() and config_path.exists() and config_path.read_text() == want
            and (not keep_params or (out / "params.npz").exists())):
        return {**json.loads(summary_path.read_text()), "reused": True}
    sink: dict = {}
    with _capture_final_params(sink):
        summary = quickstart.main(cfg, out)
    if keep_params:
        save_params(sink["params"], out / "params.npz")
    return {**summary, "reused": False}


def run_name(arm: Arm, seed: int) -> str:
    return f"{arm.value}_s{seed}"


def run_all(config: AblationConfig) -> dict[tuple[Arm, int], dict]:
    """Every (arm, seed) run; ``workers`` at a time."""
    jobs = {(a, s): (arm_config(config.quickstart, a, s), config.runs / run_name(a, s),
                     config.attribution and (a, s) == attribution_source(config))
            for s in config.seeds for a in config.arms}
    results = {}
    t0 = time.perf_counter()
    if config.workers == 1:
        for key, job in jobs.items():
            results[key] = _run_one(*job)
            _report(key, results[key], t0, len(results), len(jobs))
    else:
        ctx = multiprocessing.get_context("spawn")  # JAX is not fork-safe
        with concurrent.futures.ProcessPoolExecutor(config.workers, mp_context=ctx) as pool:
            futures = {pool.submit(_run_one, *job): key for key, job in jobs.items()}
            for f in concurrent.futures.as_completed(futures):
                results[futures[f]] = f.result()
                _report(futures[f], results[futures[f]], t0, len(results), len(jobs))
    return {k: results[k] for k in jobs}


def _report(key, summary, t0, done, total) -> None:
    arm, seed = key
    f = lambda x, spec: "n/a" if x is None else format(x, spec)  # noqa: E731
    print(f"[{done}/{total}] {arm.value} seed {seed}: eval {f(summary['eval_accuracy_before_rl'], '.3f')} -> "
          f"{f(summary['eval_accuracy_after_rl'], '.3f')}, K3 {f(summary['mismatch_kl_k3_mean'], '.2e')}, "
          f"{summary['seconds']:.0f}s{' (reused)' if summary['reused'] else ''}; {time.perf_counter() - t0:.0f}s elapsed",
          flush=True)


# ------------------------------------------------------------------------------------ statistics


def _mean_std(xs) -> dict:
    xs = np.asarray(xs, np.float64)
    return {"mean": float(xs.mean()), "std": float(xs.std(ddof=1)) if len(xs) > 1 else 0.0, "n": int(len(xs)),
            "values": [float(x) for x in xs]}


def curves(rows: list[dict], steps: int) -> dict[str, list]:
    """Per-step train reward and K3 (index = step - 1) and the eval points of one run."""
    reward, k3 = [None] * steps, [None] * steps
    evals = []
    for r in rows:
        if "reward/mean" in r and 1 <= r["step"] <= steps:
            reward[r["step"] - 1] = r["reward/mean"]
            k3[r["step"] - 1] = r.get("mismatch/kl_k3")
        if "eval/accuracy" in r:
            evals.append((r["step"], r["eval/accuracy"]))
    return {"reward": reward, "kl_k3": k3, "eval": evals}


def arm_statistics(config: AblationConfig, summaries: dict, run_curves: dict) -> dict:
    w = config.final_window
    stats = {}
    for arm in config.arms:
        per_seed = []
        for s in config.seeds:
            c, summ = run_curves[(arm, s)], summaries[(arm, s)]
            k3 = np.array([x for x in c["kl_k3"] if x is not None])
            per_seed.append({"seed": s, "final_reward": float(np.mean(c["reward"][-w:])),
                             "eval_before": summ["eval_accuracy_before_rl"], "eval_after": summ["eval_accuracy_after_rl"],
                             "kl_k3_mean": float(k3.mean()), "kl_k3_final": float(np.mean([x for x in c["kl_k3"][-w:] if x is not None])),
                             "seconds": summ["seconds"]})
        stats[arm.value] = {key: _mean_std([p[key] for p in per_seed])
                            for key in ("final_reward", "eval_before", "eval_after", "kl_k3_mean", "kl_k3_final", "seconds")}
        stats[arm.value]["per_seed"] = per_seed
    return stats


def compare_to_bf16(stats: dict) -> dict:
    """Each arm minus BF16, with the standard error of a difference of two means over seeds;
    ``within_noise``: |difference| <= 2 standard errors."""
    if Arm.BF16.value not in stats:
        return {}
    base = stats[Arm.BF16.value]
    out = {}
    for arm, st in stats.items():
        if arm == Arm.BF16.value:
            continue
        out[arm] = {}
        for key in ("final_reward", "eval_after"):
            a, b = st[key], base[key]
            diff = a["mean"] - b["mean"]
            se = float(np.sqrt(a["std"] ** 2 / a["n"] + b["std"] ** 2 / b["n"]))
            out[arm][key] = {"diff": diff, "se": se, "within_noise": bool(abs(diff) <= 2 * se)}
    return out


# ------------------------------------------------------------------------------------ plot


def plot(config: AblationConfig, run_curves: dict, png: Path, smooth: int = 5) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("note: matplotlib is not installed; no plot written")
        return None
    steps = config.quickstart.rl.data.steps
    smooth = max(1, min(smooth, steps))
    x = np.arange(1, steps + 1)
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.2))
    colors = dict(zip(Arm, ["black", "tab:blue", "tab:red", "tab:green"]))

    def band(ax, arm, ys, xs, positive=False):
        ys = np.asarray(ys, np.float64)
        m, s = ys.mean(0), ys.std(0, ddof=1) if len(ys) > 1 else np.zeros(ys.shape[1])
        lo = np.maximum(m - s, 0.1 * m) if positive else m - s  # a log axis cannot show mean - std <= 0
        ax.plot(xs, m, color=colors[arm], label=arm.label, lw=1.4)
        ax.fill_between(xs, lo, m + s, color=colors[arm], alpha=0.15)

    kernel = np.ones(smooth) / smooth
    for arm in config.arms:
        rew = [np.convolve(np.asarray(run_curves[(arm, s)]["reward"], float), kernel, mode="valid") for s in config.seeds]
        band(axes[0], arm, rew, x[smooth - 1:])
        ev = [[a for _, a in run_curves[(arm, s)]["eval"]] for s in config.seeds]
        n = min(len(e) for e in ev)
        band(axes[1], arm, [e[:n] for e in ev], [st for st, _ in run_curves[(arm, config.seeds[0])]["eval"]][:n])
        k3 = [np.asarray([np.nan if v is None else v for v in run_curves[(arm, s)]["kl_k3"]], float) for s in config.seeds]
        k3 = [np.convolve(np.nan_to_num(k, nan=0.0), kernel, mode="valid") for k in k3]
        band(axes[2], arm, k3, x[smooth - 1:], positive=True)
    axes[0].set_title(f"train reward (exact match), {smooth}-step running mean")
    axes[1].set_title("eval accuracy (greedy, held-out prompts)")
    axes[2].set_title(f"mismatch KL(rollout || trainer), K3, {smooth}-step running mean\n"
                      "(band floored at 0.1 x mean on the log axis)", fontsize=10)
    axes[2].set_yscale("log")
    for ax in axes:
        ax.set_xlabel("RL step")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"quickstart mismatch ablation: mean +- std over seeds {list(config.seeds)}", fontsize=10)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return png


# ------------------------------------------------------------------------------------ attribution


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where FP8 is applied when scoring: W8A8 on ``linear_layers`` (a contiguous range), an E4M3 KV
    pool on ``kv_layers``; ``paged`` forces the paged-cache read path even with no FP8 KV layer."""

    name: str
    linear_layers: frozenset[int] = frozenset()
    kv_layers: frozenset[int] = frozenset()
    paged: bool = False

    def layer_policy(self, num_layers: int) -> LayerPolicy | None:
        if not self.linear_layers:
            return None
        lo, hi = min(self.linear_layers), max(self.linear_layers)
        if set(range(lo, hi + 1)) != set(self.linear_layers):
            raise ValueError(f"placement {self.name}: FP8 linear layers must be contiguous, got {sorted(self.linear_layers)}")
        return LayerPolicy(bf16_first_layers=lo, bf16_last_layers=num_layers - 1 - hi)


def placements(num_layers: int) -> list[Placement]:
    every = frozenset(range(num_layers))
    out = [Placement("none"), Placement("bf16_paged", paged=True), Placement("linears", linear_layers=every),
           Placement("kv", kv_layers=every), Placement("all", every, every)]
    out += [Placement(f"linear_{l}", linear_layers=frozenset({l})) for l in range(num_layers)]
    out += [Placement(f"kv_{l}", kv_layers=frozenset({l})) for l in range(num_layers)]
    return out


def _mixed_paged_cache(config: ModelConfig, B: int, T: int, kv_layers: frozenset[int], k_scale, v_scale,
                       dtype, page_size: int = 8) -> PagedKVCache:
    """A paged cache with an E4M3 pool on ``kv_layers`` and ``dtype`` pools elsewhere (each layer
    reads and writes by its own pool's dtype); one private run of pages per row."""
    pages = -(-T // page_size)
    cache = PagedKVCache.init(config.num_layers, B * pages, page_size, config.num_kv_heads, config.head_dim, B, pages,
                              dtype)
    pool = lambda l: jnp.zeros_like(cache.k_pages[l], jnp.float8_e4m3fn if l in kv_layers else dtype)  # noqa: E731
    return cache.replace(k_pages=tuple(pool(l) for l in range(config.num_layers)),
                         v_pages=tuple(pool(l) for l in range(config.num_layers)),
                         page_table=jnp.arange(B * pages, dtype=jnp.int32).reshape(B, pages),
                         k_scale=jnp.asarray(k_scale, jnp.float32), v_scale=jnp.asarray(v_scale, jnp.float32))


def _logprobs_and_logsm(logits, tokens):
    z = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32), axis=-1)  # position t-1 predicts token t
    lp = jnp.take_along_axis(z, tokens[:, 1:, None], axis=-1)[..., 0]
    return jnp.pad(lp, ((0, 0), (1, 0))), jnp.pad(z, ((0, 0), (1, 0), (0, 0)))


@functools.partial(jax.jit, static_argnames=("config", "placement", "dtype"))
def placement_scores(params, tokens, k_scale, v_scale, *, config: ModelConfig, placement: Placement, dtype: str = "bfloat16"):
    """Logprobs [B, T] of ``tokens`` and log-softmax [B, T, V] (position t predicts token t; 0 at
    t = 0) under the placement; ``params`` in the compute dtype, as the engine receives them."""
    lp_policy = placement.layer_policy(config.num_layers)
    if lp_policy is not None:
        params = quantize_params(params, config, lp_policy)
        policy = W8A8Policy(dtype)
    else:
        policy = DensePolicy(dtype)
    cache = None
    if placement.kv_layers or placement.paged:
        B, T = tokens.shape
        cache = _mixed_paged_cache(config, B, T, placement.kv_layers, k_scale, v_scale, jnp.dtype(dtype))
    logits, _ = forward(params, tokens, config=config, policy=policy, cache=cache)
    return _logprobs_and_logsm(logits, tokens)


def kl_rows(ref_lp, ref_logsm, lp, logsm, mask) -> dict[str, float]:
    """K1/K3 of the sampled tokens (``mismatch_metrics`` with the trainer as ``trainer_logp``) and
    the exact ``KL(pi_fp8 || pi_bf16)`` per response position, averaged over response tokens."""
    mm = mismatch_metrics(ref_lp, lp, mask)
    exact = jnp.sum(jnp.exp(logsm) * (logsm - ref_logsm), axis=-1)
    m = mask.astype(jnp.float32)
    return {"kl_k1": float(mm["kl_k1"]), "kl_k3": float(mm["kl_k3"]),
            "kl_exact": float(jnp.sum(exact * m) / jnp.maximum(jnp.sum(m), 1)),
            "max_abs_log_ratio": float(max(abs(float(mm["log_ratio_max"])), abs(float(mm["log_ratio_min"]))))}


def attribute(params_bf16, tokens, mask, k_scale, v_scale, *, config: ModelConfig,
              placement_list: list[Placement] | None = None, dtype: str = "bfloat16") -> dict[str, dict]:
    """The KL of every placement against the trainer's BF16 scoring of the same tokens."""
    zero = jnp.zeros((config.num_layers,), jnp.float32)
    ref_lp, ref_logsm = placement_scores(params_bf16, tokens, zero, zero, config=config, placement=Placement("none"),
                                         dtype=dtype)
    rows = {}
    for pl in placement_list or placements(config.num_layers):
        lp, logsm = placement_scores(params_bf16, tokens, k_scale, v_scale, config=config, placement=pl, dtype=dtype)
        rows[pl.name] = {"linear_layers": sorted(pl.linear_layers), "kv_layers": sorted(pl.kv_layers),
                         **kl_rows(ref_lp, ref_logsm, lp, logsm, mask)}
    return rows


def attribution_source(config: AblationConfig) -> tuple[Arm, int]:
    arm = Arm.FP8_TIS if Arm.FP8_TIS in config.arms else config.arms[0]
    return arm, config.seeds[0]


def model_config_of(q: quickstart.QuickstartConfig) -> ModelConfig:
    tok = char_tokenizer(quickstart.ALPHABET)
    return dataclasses.replace(q.rl.model, vocab_size=tok.get_vocab_size(), eos_token_ids=(tok.token_to_id("<eos>"),))


def run_attribution(config: AblationConfig) -> dict:
    """Rollouts of the trained source model with the FP8 engine, then :func:`attribute`."""
    arm, seed = attribution_source(config)
    q = arm_config(config.quickstart, arm, seed)
    model_cfg = model_config_of(q)
    params_path = config.runs / run_name(arm, seed) / "params.npz"
    params = load_params(params_path, model_cfg)
    dtype = q.rl.trainer.compute_dtype.value
    cast = jax.tree.map(lambda p: p.astype(dtype), params)
    engine_cfg = dataclasses.replace(q.rl.engine_config(), precision=Fp8Mode.ALL)
    engine = JaxEngine(model_cfg, cast, engine_cfg)
    tok = char_tokenizer(quickstart.ALPHABET)
    examples = AdditionTask(q.digits).sample(np.random.default_rng(seed + 777), config.attribution_prompts)
    ro = rollout(engine, [tok.encode(e.prompt).ids for e in examples], n_samples=config.attribution_samples,
                 sampling=q.rl.rollout.sampling, step=0, seed=seed + 777)
    batch = build_batch(ro, np.zeros(len(ro.prompts), np.float32), pad_multiple=8)
    k_scale, v_scale = np.asarray(engine.cache.k_scale), np.asarray(engine.cache.v_scale)
    t0 = time.perf_counter()
    rows = attribute(cast, batch.tokens, batch.loss_mask, k_scale, v_scale, config=model_cfg, dtype=dtype)
    # what the RL loop logs: the engine's own (decode-path) logprobs vs the trainer's
    ref_lp, _ = placement_scores(cast, batch.tokens, k_scale * 0, v_scale * 0, config=model_cfg,
                                 placement=Placement("none"), dtype=dtype)
    engine_mm = mismatch_metrics(ref_lp, batch.rollout_logprobs, batch.loss_mask)
    return {"source_run": run_name(arm, seed), "params": str(params_path),
            "sequences": int(batch.tokens.shape[0]), "response_tokens": int(np.asarray(batch.loss_mask).sum()),
            "k_scale": k_scale.tolist(), "v_scale": v_scale.tolist(), "num_layers": model_cfg.num_layers,
            "engine_measured": {"kl_k1": float(engine_mm["kl_k1"]), "kl_k3": float(engine_mm["kl_k3"])},
            "rows": rows, "seconds": time.perf_counter() - t0}


# ------------------------------------------------------------------------------------ reports


def environment() -> dict:
    import flax
    import jaxlib
    import optax

    try:
        commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
        dirty = bool(subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain"], capture_output=True,
                                    text=True).stdout.strip())
    except OSError:
        commit, dirty = None, None
    dev = jax.devices()[0]
    return {"device": f"{dev.platform}: {dev.device_kind}", "cpu_count": os.cpu_count(),
            "load_avg_at_end": list(os.getloadavg()), "python": platform.python_version(),
            "jax": jax.__version__, "jaxlib": jaxlib.__version__,
            "flax": flax.__version__, "optax": optax.__version__, "numpy": np.__version__,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "git_commit": commit, "git_dirty": dirty}


def _pm(st: dict, fmt: str = ".3f") -> str:
    return f"{st['mean']:{fmt}} ± {st['std']:{fmt}}"


def ablation_markdown(config: AblationConfig, stats: dict, comparison: dict, env: dict, command: str,
                      png: Path | None) -> str:
    q = config.quickstart
    lines = [f"# Mismatch ablation on the quickstart task ({config.tag})", "",
             f"Command: `{command}`", "",
             f"Environment: {env['device']}, {env['cpu_count']} cores (shared), jax {env['jax']}, {env['date']}, "
             f"commit {env['git_commit']}{' (dirty tree)' if env['git_dirty'] else ''}.", "",
             f"Task: {q.digits}-digit addition, SFT warm-up {q.sft_steps} steps, then {q.rl.data.steps} GRPO steps of "
             f"{q.rl.data.prompts_per_step} prompts x {q.rl.rollout.n_samples} samples; seeds {list(config.seeds)} "
             f"(`rl.seed`: params init, data, sampling, eval set). Arms differ only in {', '.join(f'`{f}`' for f in ARM_FIELDS)}.", "",
             f"| arm | final train reward (last {config.final_window} steps) | greedy eval acc. before RL | "
             "greedy eval acc. after RL | mean K3 KL (all steps) | K3 KL (last steps) | s / run |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for arm in config.arms:
        st = stats[arm.value]
        lines.append(f"| {arm.label} | {_pm(st['final_reward'])} | {_pm(st['eval_before'])} | {_pm(st['eval_after'])} | "
                     f"{_pm(st['kl_k3_mean'], '.2e')} | {_pm(st['kl_k3_final'], '.2e')} | {st['seconds']['mean']:.0f} |")
    lines += ["", "mean ± std over seeds (sample std, ddof 1). Per seed:", "",
              "| arm | seed | final train reward | eval before | eval after | mean K3 |", "| --- | --- | --- | --- | --- | --- |"]
    for arm in config.arms:
        for p in stats[arm.value]["per_seed"]:
            lines.append(f"| {arm.value} | {p['seed']} | {p['final_reward']:.3f} | {p['eval_before']:.3f} | "
                         f"{p['eval_after']:.3f} | {p['kl_k3_mean']:.2e} |")
    if comparison:
        lines += ["", "Difference to BF16 (se: standard error of a difference of two means over seeds; "
                  "'within noise': |diff| <= 2 se):", "",
                  "| arm | final reward diff | eval acc. diff |", "| --- | --- | --- |"]
        for arm, c in comparison.items():
            cell = lambda d: f"{d['diff']:+.3f} (se {d['se']:.3f}, {'within noise' if d['within_noise'] else 'OUTSIDE noise'})"  # noqa: E731
            lines.append(f"| {arm} | {cell(c['final_reward'])} | {cell(c['eval_after'])} |")
    if png is not None:
        lines += ["", f"![ablation]({png.name})"]
    return "\n".join(lines) + "\n"


def attribution_markdown(att: dict, command: str) -> str:
    rows = att["rows"]
    total = rows["all"]["kl_exact"]
    lines = ["# Mismatch attribution: which FP8 component causes the rollout/trainer KL", "",
             f"Command: `{command}`", "",
             f"Tokens: {att['sequences']} sequences ({att['response_tokens']} response tokens) sampled by the FP8 "
             f"engine (W8A8 + FP8 KV) from the trained model of run `{att['source_run']}`, scored by the trainer "
             "(BF16, full-sequence forward) and by the same model with FP8 only where the row says. "
             f"KV scales (engine-calibrated): k {np.round(att['k_scale'], 5).tolist()}, v {np.round(att['v_scale'], 5).tolist()}.", "",
             "| placement | FP8 linears on layers | FP8 KV on layers | K1 | K3 | exact KL | share of 'all' (exact) | max abs log-ratio |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, r in rows.items():
        share = r["kl_exact"] / total if total > 0 else float("nan")
        lines.append(f"| {name} | {r['linear_layers'] or '-'} | {r['kv_layers'] or '-'} | {r['kl_k1']:.3e} | {r['kl_k3']:.3e} | "
                     f"{r['kl_exact']:.3e} | {share:.2f} | {r['max_abs_log_ratio']:.3e} |")
    em = att["engine_measured"]
    L = att["num_layers"]
    parts = sum(rows[f"linear_{l}"]["kl_exact"] + rows[f"kv_{l}"]["kl_exact"] for l in range(L))
    lines += ["", f"Engine-measured (decode-path rollout logprobs vs trainer, what `mismatch/*` logs): "
              f"K1 {em['kl_k1']:.3e}, K3 {em['kl_k3']:.3e}.",
              f"Sum of the per-layer exact KLs: {parts:.3e} vs 'all' {total:.3e} "
              f"(KL is not additive; the ratio shows how much the parts interact).",
              "K1/K3 of a partial placement are estimated on tokens sampled by the full-FP8 engine (off-policy for "
              "that placement); the exact KL sums over the vocabulary at every response position and has no sampling noise."]
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------ main


def main(config: AblationConfig = AblationConfig(), command: str = "") -> dict:
    t0 = time.perf_counter()
    check_arms(config)
    config.out.mkdir(parents=True, exist_ok=True)
    command = command or f"main({config!r})"
    summaries = run_all(config)
    run_curves = {k: curves(read_metrics(config.runs / run_name(*k) / "metrics.jsonl"), config.quickstart.rl.data.steps)
                  for k in summaries}
    stats = arm_statistics(config, summaries, run_curves)
    comparison = compare_to_bf16(stats)
    png = plot(config, run_curves, config.out / f"mismatch_ablation_{config.tag}.png")
    env = environment()
    result = {"environment": env, "command": command, "config": rlconfig.to_dict(config.quickstart),
              "arms": {a.value: {"precision": a.precision.value, "correction": a.correction.value} for a in config.arms},
              "seeds": list(config.seeds), "final_window": config.final_window, "stats": stats,
              "comparison_to_bf16": comparison,
              "runs": {run_name(*k): {"summary": {kk: vv for kk, vv in summaries[k].items()}, "curves": run_curves[k]}
                       for k in summaries},
              "plot": str(png) if png else None}
    (config.out / f"mismatch_ablation_{config.tag}.json").write_text(json.dumps(result, indent=1) + "\n")
    md = ablation_markdown(config, stats, comparison, env, command, png)
    (config.out / f"mismatch_ablation_{config.tag}.md").write_text(md)
    print("\n" + md)
    if config.attribution:
        att = run_attribution(config)
        att_result = {"environment": environment(), "command": command, **att}
        (config.out / f"mismatch_attribution_{config.tag}.json").write_text(json.dumps(att_result, indent=1) + "\n")
        amd = attribution_markdown(att, command)
        (config.out / f"mismatch_attribution_{config.tag}.md").write_text(amd)
        print(amd)
        result["attribution"] = att
    result["seconds"] = time.perf_counter() - t0
    print(f"mismatch ablation done in {result['seconds']:.0f}s")
    return result


def parse_args(argv: list[str] | None = None) -> AblationConfig:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=AblationConfig.out)
    ap.add_argument("--runs-dir", type=Path, default=None, help="per-run folders (default OUT/runs)")
    ap.add_argument("--tag", default=AblationConfig.tag)
    ap.add_argument("--arms", default=",".join(a.value for a in Arm))
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--steps", type=int, default=None, help="RL steps per run (default: the quickstart's)")
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--final-window", type=int, default=AblationConfig.final_window)
    ap.add_argument("--no-attribution", action="store_true")
    ap.add_argument("--set", action="append", default=[], metavar="PATH=VALUE",
                    help="override a config field as the quickstart takes it, e.g. rollout.temperature=0.8")
    args = ap.parse_args(argv)
    try:
        q = rlconfig.override(AblationConfig.quickstart, args.set + ([f"data.steps={args.steps}"] if args.steps else []))
        arms = tuple(Arm(a.strip()) for a in args.arms.split(",") if a.strip())
        seeds = tuple(int(s) for s in args.seeds.split(",") if s.strip())
        return AblationConfig(quickstart=q, arms=arms, seeds=seeds, final_window=args.final_window, workers=args.workers,
                              attribution=not args.no_attribution, out=args.out, runs_dir=args.runs_dir, tag=args.tag)
    except (rlconfig.ConfigError, ValueError) as e:
        ap.error(str(e))


if __name__ == "__main__":
    main(parse_args(), command="python " + " ".join([os.path.relpath(sys.argv[0], ROOT)] + sys.argv[1:]))
