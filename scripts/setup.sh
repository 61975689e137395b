#!/usr/bin/env bash
# Create .venv with kvbaton and its pinned dependencies (idempotent; safe to re-run).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
py=${PYTHON:-python3}

# System packages the KV transports need: redis-server (redis transport) and the shared libraries
# the Mooncake engine links even for TCP (libibverbs1 above all). Installed only when missing;
# without apt-get or root they stay missing, and the tests that need them fail saying what is absent.
libs=$(ldconfig -p 2>/dev/null || /sbin/ldconfig -p 2>/dev/null || true)
need=()
command -v redis-server >/dev/null 2>&1 || need+=(redis-server)
for pair in libibverbs.so.1:libibverbs1 libnuma.so.1:libnuma1 libcurl.so.4:libcurl4; do
  [[ $libs == *"${pair%%:*}"* ]] || need+=("${pair#*:}")
done
if [ ${#need[@]} -gt 0 ]; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    echo "setup.sh: apt-get install ${need[*]}" >&2
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}"; } >/dev/null \
      || echo "setup.sh: could not install ${need[*]}; the tests that need them will fail" >&2
  else
    echo "setup.sh: missing ${need[*]} (no apt-get, or not root); the tests that need them will fail" >&2
  fi
fi

if [ ! -x .venv/bin/python ]; then
  "$py" -m venv .venv
fi
stamp=.venv/.kvbaton-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  .venv/bin/python -m pip install -q --upgrade pip
  # torch first, pinned: the CPU wheel (an unpinned torch would pull a multi-GB CUDA build)
  .venv/bin/python -m pip install -q "torch==2.13.0"
  .venv/bin/python -m pip install -q -e ".[test]"
  touch "$stamp"
fi
