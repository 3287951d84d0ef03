#!/usr/bin/env bash
# Installs everything (scripts/setup.sh) and runs the main example.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck disable=SC1091
source "$root/scripts/setup.sh"
cd "$root"
python examples/quickstart.py "$@"
