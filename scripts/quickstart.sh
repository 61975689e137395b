#!/usr/bin/env bash
# Set everything up on a fresh machine and serve the default model over the OpenAI API
# (prints how to send a request). Extra arguments go to `kvbaton serve`.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
bash "$root/scripts/setup.sh"
"$root/.venv/bin/kvbaton" model pull >/dev/null
exec "$root/.venv/bin/kvbaton" serve "$@"
