#!/usr/bin/env bash
# Runs the test suite on the next TensorFlow: a pinned tf-nightly with the
# matching tf-keras-nightly, in a fresh virtualenv.
#
#   tools/test_newest_tf.sh                  # venv in .venv-tf-nightly, then pytest
#   tools/test_newest_tf.sh -m "not slow"    # extra arguments go to pytest
#   TF_NIGHTLY=2.23.0.dev20261026 TF_KERAS_NIGHTLY=2.23.0.dev2026102618 tools/test_newest_tf.sh
#
# setup.cfg caps tensorflow below the next release, and tf-nightly is another
# distribution name than tensorflow, so graphgrad is installed with --no-deps
# and its other requirements and the test tools are installed by name here.
# The result of the last run is recorded in docs/versions.md.
set -euo pipefail
cd "$(dirname "$0")/.."

# shellcheck source=tools/_venv.sh
. tools/_venv.sh

TF_NIGHTLY="${TF_NIGHTLY:-2.23.0.dev20261026}"
TF_KERAS_NIGHTLY="${TF_KERAS_NIGHTLY:-2.23.0.dev2026102618}"
fresh_venv "${VENV:-.venv-tf-nightly}"
python -m pip install --quiet "tf-nightly==$TF_NIGHTLY" "tf-keras-nightly==$TF_KERAS_NIGHTLY"
python -m pip install --quiet --no-deps .
# graphgrad's own requirements besides tensorflow, and the [test] tools.
python -m pip install --quiet "numpy>=1.23" "networkx>=2.8" "pytest>=7" "pytest-xdist>=3.8" \
  "hypothesis>=6" "matplotlib>=3.5" "pydot>=1.4" "nbclient>=0.7" "nbformat>=5.7" "ipykernel>=6" "scikit-learn>=1.2"
# tf-slim 1.1.0 declares no usable requirements for TF 2.x: install it alone.
python -m pip install --quiet --no-deps "tf-slim==1.1.0"
python - <<'PY'
import importlib.metadata as md

def version(name):
  try:
    return md.version(name)
  except md.PackageNotFoundError:
    return "not installed"

import tensorflow as tf
print("tensorflow", tf.__version__, "| tf-nightly", version("tf-nightly"),
      "| tf-keras-nightly", version("tf-keras-nightly"), "| keras-nightly",
      version("keras-nightly"))
PY

run_pytest "$@"
