#!/usr/bin/env bash
# Runs the test suite on the oldest supported TensorFlow, 2.15, with the
# Keras 2 it bundles (no tf-keras), in a fresh virtualenv.
#
#   tools/test_oldest_tf.sh            # venv in .venv-tf215, then pytest
#   tools/test_oldest_tf.sh -m "not slow"   # extra arguments go to pytest
#   VENV=/tmp/tf215 tools/test_oldest_tf.sh
set -euo pipefail
cd "$(dirname "$0")/.."

# shellcheck source=tools/_venv.sh
. tools/_venv.sh

fresh_venv "${VENV:-.venv-tf215}"
python -m pip install --quiet "tensorflow==2.15.*" ".[test-base,dp]"
python - <<'PY'
import importlib.metadata as md, importlib.util
print("tensorflow", md.version("tensorflow"), "| keras", md.version("keras"),
      "| tf-keras installed:", importlib.util.find_spec("tf_keras") is not None)
PY

run_pytest "$@"
