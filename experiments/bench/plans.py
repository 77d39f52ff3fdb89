"""One plan per GPU kind: every suite invocation behind a published number, sized for that GPU's memory.

Each step is one suite run that fits one device call of at most 10 minutes, named as its result file
(``experiments/results/<device>/<step>.json``):

    python -m experiments.bench --plan h100 --list                  # the steps and their commands
    python -m experiments.bench --plan h100 --step rollout_W1_all   # one step
    python -m experiments.bench --plan h100                         # every step, one after another

Sizing. The rollout workloads run with the KV pool vLLM's ``gpu_memory_utilization=0.85`` leaves on
the same GPU beside weights of each precision (``--kv-gib-like-vllm BF16 FP8``; its log line
"Available KV cache memory"), so both engines hold the same KV budget: Qwen3-8B on the H100 80GB
49.5 / 56.16 GiB, on the H200 101.74 / 107.52 GiB; Qwen3-30B-A3B on the H200 60 / 87 GiB (on the
H100 its BF16 weights leave too little KV for a meaningful W1 run, so it is H200-only). BF16 runs
keep 24 GiB of pinned host memory for swap preemption. Decode profiles use the shapes the W1 step
runs at (256 rows on the H200; 128 on the H100, where 256 x 2048 BF16 KV does not fit beside the
weights). The vLLM peer steps run vLLM in the same process (``--backend vllm``), one mode each.
Steps with ``devices=2`` need a two-GPU machine.
"""

from __future__ import annotations

import dataclasses
import shlex


@dataclasses.dataclass(frozen=True)
class Step:
    name: str  # the step and its result file's name
    suite: str
    flags: tuple[str, ...]
    devices: int = 1

    def command(self) -> str:
        """The runner command of this step alone (what ``--plan GPU --step NAME`` runs)."""
        return shlex.join(["python", "-m", "experiments.bench", self.suite, *self.flags, "--name", self.name])


ROLLOUT_8B = ("--preset", "qwen3_8b", "--max-slots", "256", "--steps-per-call", "16", "--prefill-batch", "4",
              "--stall-dump-s", "90")
SWAP = ("--swap-space-gib", "24")


def _rollout(name: str, kv: tuple[float, float], workload: str, mode: str, *extra: str, base=ROLLOUT_8B) -> Step:
    flags = (*base, "--workload", workload, "--modes", mode, "--kv-gib-like-vllm", str(kv[0]), str(kv[1]),
             *(SWAP if mode == "none" else ()), *extra)
    return Step(name, "rollout", flags)


def _vllm(name: str, workload: str, mode: str, memory: float) -> Step:
    return Step(name, "rollout", ("--preset", "qwen3_8b", "--backend", "vllm", "--workload", workload, "--modes", mode,
                                  "--vllm-memory", str(memory), "--jax-memory", str(round(0.9 - memory, 2))))


def _decode(name: str, batch: int, context: int, *modes: str) -> Step:
    return Step(name, "decode", ("--preset", "qwen3_8b", "--batch", str(batch), "--context", str(context),
                                 "--lengths", "equal", "--modes", *modes))


def _common(kv8b: tuple[float, float], rows: int, vllm_memory: float) -> list[Step]:
    return [
        *(_rollout(f"rollout_W1_{m}", kv8b, "W1", m) for m in ("none", "w8a8", "kv", "all")),
        _rollout("rollout_W2_none", kv8b, "W2", "none"),
        _rollout("rollout_W2_all", kv8b, "W2", "all"),
        _rollout("rollout_RL_all", kv8b, "RL", "all"),
        _vllm("rollout_W1_vllm_none", "W1", "none", vllm_memory),
        _vllm("rollout_W1_vllm_all", "W1", "all", vllm_memory),
        _vllm("rollout_W2_vllm_none", "W2", "none", vllm_memory),
        _vllm("rollout_W2_vllm_all", "W2", "all", vllm_memory),
        Step("weight_sync", "weight_sync", ("--preset", "qwen3_8b", "--modes", "none", "all")),
        _decode(f"decode_{rows}x2048", rows, 2048, "none", "all"),
        _decode("decode_64x4096_all", 64, 4096, "all"),
        _decode("decode_16x4096_all", 16, 4096, "all"),
        Step("prefill_4x1024_all", "decode", ("--preset", "qwen3_8b", "--prefill", "4", "--prompt-len", "1024",
                                              "--modes", "all")),
        Step("fa3_decode", "fa3_decode", ("--batch", "104", "128", "256", "--context", "2048", "5120", "7168",
                                          "--equal")),
        Step("gemm", "gemm", ()),
        Step("paged_attention", "paged_attention", ("--batch", "256", "--context", "2048", "--table-only",
                                                    "--orders", "rows", "heads")),
        Step("prefill_attention", "prefill_attention", ("--max-seconds", "35")),
        Step("kv_write", "kv_write", ("--rows", "64", "256")),
        Step("quant_kernels", "quant_kernels", ()),
        Step("grouped_gemm", "grouped_gemm", ()),
        Step("decode_gemms_triton", "decode_gemms", ("--preset", "qwen3_8b", "--m", "64", "128", "256", "--triton")),
        Step("train_step", "train_step", ("--preset", "qwen3_8b", "--layers", "8", "--batch", "8",
                                          "--seq-len", "2048")),
        Step("rl_step_all", "rl_step", ("--preset", "qwen3_1_7b", "--arms", "all:bf16")),
        Step("rl_step_none", "rl_step", ("--preset", "qwen3_1_7b", "--arms", "none:bf16")),
        Step("scaling", "scaling", ("--preset", "qwen3_8b", "--train-layers", "8"), devices=2),
    ]


def h100() -> list[Step]:
    """The H100 80GB: Qwen3-8B workloads and profiles (no 30B-A3B: see the module's note)."""
    return _common(kv8b=(49.5, 56.16), rows=128, vllm_memory=0.6)


def h200() -> list[Step]:
    """The H200 141GB: the H100's steps at the H200's sizes, plus Qwen3-30B-A3B W1."""
    moe = ("--preset", "qwen3_30b_a3b", *ROLLOUT_8B[2:])
    return [*_common(kv8b=(101.74, 107.52), rows=256, vllm_memory=0.6),
            _rollout("rollout_30b_a3b_W1_none", (60.0, 87.0), "W1", "none", base=moe),
            _rollout("rollout_30b_a3b_W1_all", (60.0, 87.0), "W1", "all", base=moe)]


PLANS = {"h100": h100, "h200": h200}


def plan(gpu: str) -> list[Step]:
    """The steps of ``gpu``'s plan; ValueError naming the plans for another name."""
    if gpu not in PLANS:
        raise ValueError(f"no plan for {gpu!r}; plans: {', '.join(sorted(PLANS))}")
    return PLANS[gpu]()
