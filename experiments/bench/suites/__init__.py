"""The runner's suites, by name. A suite module defines:

- ``add_arguments(parser)``: its command-line flags;
- ``run(args) -> dict``: measures and returns the JSON-able payload;
- ``result_name(args) -> str`` (optional): the result file's name, default the suite's name;
- ``SMOKE``: the flags of a tiny CPU run (the CI smoke suite runs each suite with them), or None for a
  suite that needs a GPU (the runner refuses it elsewhere); ``SMOKE_DEVICES`` (optional): the CPU
  devices that run needs;
- ``process_env(args) -> dict`` (optional): environment variables to set before JAX starts.
"""

SUITES: dict[str, str] = {
    "rollout": "experiments.bench.suites.rollout",
    "weight_sync": "experiments.bench.suites.weight_sync",
    "decode": "experiments.bench.suites.decode",
    "gemm": "experiments.bench.suites.gemm",
    "paged_attention": "experiments.bench.suites.paged_attention",
    "prefill_attention": "experiments.bench.suites.prefill_attention",
    "kv_write": "experiments.bench.suites.kv_write",
    "decode_gemms": "experiments.bench.suites.decode_gemms",
    "cublaslt_tune": "experiments.bench.suites.cublaslt_tune",
    "train_step": "experiments.bench.suites.train_step",
    "rl_step": "experiments.bench.suites.rl_step",
    "scaling": "experiments.bench.suites.scaling",
    "fa3_decode": "experiments.bench.suites.fa3_decode",
    "gemm_tune": "experiments.bench.suites.gemm_tune",
    "grouped_gemm": "experiments.bench.suites.grouped_gemm",
    "quant_kernels": "experiments.bench.suites.quant_kernels",
}
