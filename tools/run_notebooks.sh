#!/usr/bin/env bash
# Re-executes the notebooks in place, as they are committed:
#   tools/run_notebooks.sh [notebooks/NN_name.ipynb ...]   (default: all)
# They run against this checkout's graphgrad (PYTHONPATH), with Keras 3 behind
# tf.keras (notebook 05 picks tf-keras itself). TensorFlow's libraries write
# their C++ start-up lines (absl::InitializeLog, oneDNN, CUDA) to file
# descriptor 2 while they load, before TF_CPP_MIN_LOG_LEVEL is read; the
# kernel leaves that descriptor to this terminal (capture_fd_output=False),
# so those lines stay out of the saved outputs. Python's own stderr (warnings,
# graphgrad's log) is still saved.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python="${PYTHON:-python}"
if [ "$#" -eq 0 ]; then
  set -- "$root"/notebooks/*.ipynb
fi
unset TF_USE_LEGACY_KERAS
export TF_CPP_MIN_LOG_LEVEL=3
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
"$python" -m jupyter nbconvert --to notebook --execute --inplace \
  --ExecutePreprocessor.timeout=600 \
  --ExecutePreprocessor.kernel_name=python3 \
  --ExecutePreprocessor.record_timing=False \
  '--ExecutePreprocessor.extra_arguments=["--IPKernelApp.capture_fd_output=False"]' \
  "$@"
# A last check: no C++ log line was saved.
if grep -lE 'absl::InitializeLog|[IWE][0-9]{4} [0-9:.]+ +[0-9]+ [a-z_]+\.cc:' "$@"; then
  echo "TensorFlow's C++ log lines are in the notebooks above" >&2
  exit 1
fi
