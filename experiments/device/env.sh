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
