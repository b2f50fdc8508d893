#!/usr/bin/env bash
# Runs the test suite on the oldest supported TensorFlow, 2.15, with the
# Keras 2 it bundles (no tf-keras), in a fresh virtualenv.
#
#   tools/test_oldest_tf.sh            # venv in .venv-tf215, then pytest
#   tools/test_oldest_tf.sh -m "not slow"   # extra arguments go to pytest
#   VENV=/tmp/tf215 tools/test_oldest_tf.sh
set -euo pipefail
cd "$(dirname "$0")/.."

VENV="${VENV:-.venv-tf215}"
PY="${PYTHON:-python3.11}"
command -v "$PY" >/dev/null 2>&1 || PY=python3
rm -rf "$VENV"
"$PY" -m venv "$VENV"
# shellcheck disable=SC1091
. "$VENV/bin/activate"
python -m pip install --quiet --upgrade pip
python -m pip install --quiet "tensorflow==2.15.*" ".[test-base]"
python - <<'PY'
import importlib.metadata as md, importlib.util
print("tensorflow", md.version("tensorflow"), "| keras", md.version("keras"),
      "| tf-keras installed:", importlib.util.find_spec("tf_keras") is not None)
PY

set +e
python -m pytest "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests: failing the run" >&2
  exit 1
fi
exit "$rc"
