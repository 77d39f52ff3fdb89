# Sourced by the device scripts (session 7 on): the environment every run needs, $OUT, and a log
# filter (line-buffered, so a call cut at its limit still returns what was printed) that drops
# XLA's W/I log lines and warnings; extra patterns as arguments, e.g. filt "Capturing CUDA graphs".
export PYTHONPATH=. XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 PYTHONUNBUFFERED=1
# one compilation cache per machine: runs after the first reuse the random init's and shared programs
export JAX_COMPILATION_CACHE_DIR=/tmp/jax_cache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=2
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
filt() {
  local pat="^W1[12]\|^I1[12]\|DeprecationWarning\|return rule"
  for p in "$@"; do pat="$pat\|$p"; done
  grep --line-buffered -v "$pat"
}
# Session 11 on: part_a on GPU 0 and part_b on GPU 1 side by side, each given the seconds into the call it may run
# to ($1); on a machine of one GPU, the command $2 instead (e.g. "part_b 300; part_a 545").
two_gpus_or() {
  if [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then
    (export CUDA_VISIBLE_DEVICES=0; part_a "$1") &
    (export CUDA_VISIBLE_DEVICES=1; part_b "$1") &
    wait
  else
    eval "$2"
  fi
}
# Seconds left until second $1 of the call, at least 5 (a negative count is no `timeout` argument: session 11).
left() { local t=$(($1 - SECONDS)); [ "$t" -lt 5 ] && t=5; echo "$t"; }
# Session 27 on: vLLM 0.26 from the carried bundle (carry [".vllm-h200"]) running .vllm-h200/bench.py until second
# $1 of the call, with the rest of the arguments, e.g. vllm_bench 590 --configs bf16 --num-prompts 128 ...
vllm_bench() {
  local until=$1; shift
  bash .vllm-h200/install.sh >/dev/null && export PYTHONPATH=/tmp/vllm_site:$PYTHONPATH VLLM_USE_FLASHINFER_SAMPLER=0
  echo "== vLLM $*"; timeout $(left "$until") python3 .vllm-h200/bench.py "$@" --deadline-s $(left $((until - 5)))
  echo "rc=$?"
}
