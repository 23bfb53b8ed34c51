#!/usr/bin/env bash
# The quick run (python -m pytest -q -m "not slow") under each supported Python, one after another,
# each in a fresh venv of its own (.venv-py3.X, git-ignored) with the README's install.
#
#   bash tools/pythons.sh                  # Python 3.10, 3.11, 3.12 and 3.13
#   bash tools/pythons.sh 3.10 3.13        # those alone
#   bash tools/pythons.sh --uv 3.12        # installed by `uv pip` (PyPI alone; its cache keeps one copy
#                                          # of torch's CUDA libraries for every version)
#
# An interpreter is python3.X on the PATH, or pyenv's newest 3.X. One line per version: its pytest
# summary and the install's and the tests' minutes; exit status 1 if a version failed or is missing.
set -uo pipefail
cd "$(dirname "$0")/.."
install=(python -m pip install -q)
if [[ ${1:-} == --uv ]]; then
  install=(uv pip install -q)
  shift
fi
versions=("$@")
[[ ${#versions[@]} -gt 0 ]] || versions=(3.10 3.11 3.12 3.13)

interpreter() {   # the python executable of version $1, or nothing
  local found
  if found=$(command -v "python$1") && "$found" -c "" 2>/dev/null; then
    echo "$found"
  else
    ls -d "$(pyenv root 2>/dev/null)/versions/$1".*/bin/python 2>/dev/null | sort -V | tail -1
  fi
}

took() { echo "$(( $1 / 60 )) min $(( $1 % 60 )) s"; }

summary=()
status=0
for v in "${versions[@]}"; do
  py=$(interpreter "$v")
  if [[ -z $py ]]; then
    summary+=("Python $v: not found (python$v on the PATH, or pyenv install $v)")
    status=1
    continue
  fi
  venv=".venv-py$v"
  rm -rf "$venv"
  start=$SECONDS
  "$py" -m venv "$venv"
  if ! (. "$venv/bin/activate" && "${install[@]}" -r requirements.txt -r requirements-test.txt); then
    summary+=("Python $v ($py): the install failed")
    status=1
    continue
  fi
  installed=$SECONDS
  stack=$("$venv/bin/python" -c 'import platform, torch; print(platform.python_version(), torch.__version__)')
  stack=${stack/ / + torch }
  echo "== Python $stack"
  log="$venv/quick-run.log"
  (. "$venv/bin/activate" && python -m pytest -q -m "not slow" -n auto --dist loadfile) 2>&1 | tee "$log"
  code=${PIPESTATUS[0]}
  [[ $code -eq 0 ]] || status=1
  result=$(tail -1 "$log" | tr -d '=' | sed 's/^ *//; s/ *$//')
  times="install $(took $((installed - start))), tests $(took $((SECONDS - installed)))"
  summary+=("Python $stack: $result ($times)")
done
printf '%s\n' "${summary[@]}"
exit $status
