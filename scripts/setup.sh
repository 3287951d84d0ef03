#!/usr/bin/env bash
# Creates .venv (unless one is active), installs the pinned toolchain and the
# packages named as arguments (versions in scripts/constraints.txt), and builds
# and installs the circle_loss package into it. Sourced by the other scripts;
# safe to run again.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

if [ -z "${VIRTUAL_ENV:-}" ]; then
  [ -d .venv ] || python3 -m venv .venv
  # shellcheck disable=SC1091
  . .venv/bin/activate
fi

# Every version comes from scripts/constraints.txt.
pip_install() { python -m pip install --quiet --disable-pip-version-check -c "$root/scripts/constraints.txt" "$@"; }
pip_install torch scikit-build-core ninja "$@"
command -v cmake >/dev/null || pip_install cmake

# Against a CPU torch with nvcc present, the CUDA sources are still compiled
# (not linked), so that a CUDA compile error fails here, as in CI: for 9.0
# (Hopper's wgmma tiles) and 8.0 (the mma.sync tiles every other GPU takes).
build_args=()
if command -v nvcc >/dev/null && python -c "import sys, torch; sys.exit(torch.version.cuda is not None)"; then
  build_args+=(-C cmake.define.CIRCLE_LOSS_CUDA_COMPILE_CHECK=ON -C "cmake.define.TORCH_CUDA_ARCH_LIST=8.0;9.0")
fi
# --no-build-isolation: the library must be built against the torch it runs with.
pip_install --no-build-isolation "${build_args[@]}" .
