#!/usr/bin/env bash
# Installs everything (scripts/setup.sh) and runs the whole test suite.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck disable=SC1091
source "$root/scripts/setup.sh" pytest expecttest numpy scikit-learn tqdm matplotlib pytorch-metric-learning
cd "$root"
python -m pytest -q "$@"
