#!/usr/bin/env bash
# Installs everything (scripts/setup.sh) and runs the main example: metric
# learning on handwritten digits (examples/train_digits.py).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck disable=SC1091
source "$root/scripts/setup.sh" scikit-learn tqdm matplotlib
cd "$root"
python examples/train_digits.py "$@"
