#!/usr/bin/env bash
# Set everything up on a fresh machine and run the main job on the default model.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
bash "$root/scripts/setup.sh"
"$root/.venv/bin/kvbaton" model pull >/dev/null
exec "$root/.venv/bin/kvbaton" generate "$@"
