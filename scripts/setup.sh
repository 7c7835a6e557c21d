#!/usr/bin/env bash
# Creates .venv with Python 3.12+ and installs jax_dsa with its test tools, pinned by
# constraints.txt. Idempotent: re-running only re-installs when pyproject.toml or
# constraints.txt changed.
set -euo pipefail
cd "$(dirname "$0")/.."

find_python() {
  local cand
  for cand in "${PYTHON:-}" python3.13 python3.12 python3; do
    [ -n "$cand" ] || continue
    if command -v "$cand" >/dev/null 2>&1 &&
       "$cand" -c 'import sys; sys.exit(sys.version_info < (3, 12))' >/dev/null 2>&1; then
      command -v "$cand"; return 0
    fi
  done
  # pyenv keeps versions that its shims may not expose while another version is global.
  local root
  root=$(pyenv root 2>/dev/null || echo "$HOME/.pyenv")
  for cand in $(ls -d "$root"/versions/3.13* "$root"/versions/3.12* 2>/dev/null | sort -rV); do
    if [ -x "$cand/bin/python3" ]; then echo "$cand/bin/python3"; return 0; fi
  done
  return 1
}

if [ ! -x .venv/bin/python ]; then
  if ! py=$(find_python); then
    echo "setup: jax_dsa needs Python >= 3.12; none found on PATH (python3.13, python3.12," >&2
    echo "setup: python3) or under pyenv. Install one, or set PYTHON=/path/to/python3.12." >&2
    exit 1
  fi
  echo "setup: creating .venv with $py ($("$py" --version))"
  "$py" -m venv .venv
fi

stamp=.venv/.jax_dsa-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ constraints.txt -nt "$stamp" ]; then
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q -c constraints.txt -e ".[test]"
  touch "$stamp"
fi
