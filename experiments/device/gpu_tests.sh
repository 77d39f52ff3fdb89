#!/usr/bin/env bash
# The GPU-marked tests of the given files, one pytest per file under its own timeout (PER_FILE_S, default 240), so a
# slow file cannot hide the others' results (session 16: the whole suite in one pytest ran out 300 s after 35
# tests). Sourced env.sh's $OUT gets a junit XML per file; the summary line of each file is printed.
#   bash experiments/device/gpu_tests.sh tests/test_kv_write.py tests/test_paged_attention.py
source experiments/device/env.sh
for f in "$@"; do
  name=$(basename "$f" .py)
  echo "== GPU tests: $f"
  timeout "${PER_FILE_S:-240}" python -m pytest -q -m gpu "$f" -p no:cacheprovider -rfE --durations=5 \
    --junitxml="$OUT/gpu_$name.xml" 2>&1 | grep -v "^SKIPPED\|^$" | tail -25
  echo "rc($name)=${PIPESTATUS[0]} at ${SECONDS}s"
done
