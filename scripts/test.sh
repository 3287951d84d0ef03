#!/usr/bin/env bash
# Installs everything (scripts/setup.sh) and runs the whole test suite.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck disable=SC1091
source "$root/scripts/setup.sh" pytest==9.0.3 expecttest==0.3.0 numpy==2.4.6 \
  scikit-learn==1.9.1 tqdm==4.70.1 matplotlib==3.10.9 pytorch-metric-learning==2.9.0
cd "$root"
python -m pytest -q "$@"
