# Shared by tools/test_*_tf.sh (sourced, not run): a fresh virtualenv, and
# pytest with exit code 5 ("no tests collected") counted as a failure.

# fresh_venv DIR: makes DIR a new virtualenv of $PYTHON (python3.11, else
# python3), activates it and upgrades pip.
fresh_venv() {
  local py="${PYTHON:-python3.11}"
  command -v "$py" >/dev/null 2>&1 || py=python3
  rm -rf "$1"
  "$py" -m venv "$1"
  # shellcheck disable=SC1091
  . "$1/bin/activate"
  python -m pip install --quiet --upgrade pip
}

# run_pytest ARGS...: runs pytest, then exits with its code (5 becomes 1).
run_pytest() {
  set +e
  python -m pytest "$@"
  local rc=$?
  set -e
  if [ "$rc" -eq 5 ]; then
    echo "pytest collected no tests: failing the run" >&2
    exit 1
  fi
  exit "$rc"
}
