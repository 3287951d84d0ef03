#!/usr/bin/env bash
# Creates .venv (unless one is active), installs the pinned toolchain and the
# packages named as arguments (versions in scripts/constraints.txt), and builds
# and installs the circle_loss package into it, saying what it is doing.
# Sourced by the other scripts; safe to run again (a second run takes seconds).
#
# CIRCLE_LOSS_CUDA_COMPILE_CHECK=1 (what CI sets): against a CPU torch with
# nvcc present, also compile the CUDA sources, without linking them, for
# sm_75, sm_80, sm_90a and sm_120, so that a CUDA compile error fails here.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

started=$SECONDS
step() { printf '[setup %3ds] %s\n' "$((SECONDS - started))" "$*"; }

if [ -z "${VIRTUAL_ENV:-}" ]; then
  if [ ! -d .venv ]; then
    step "creating the virtual environment .venv"
    python3 -m venv .venv
  fi
  # shellcheck disable=SC1091
  . .venv/bin/activate
fi

# Every version comes from scripts/constraints.txt.
pip_install() { python -m pip install --quiet --disable-pip-version-check -c "$root/scripts/constraints.txt" "$@"; }
step "installing torch, the build tools and: ${*:-nothing else} (pip; the first time about a minute)"
pip_install torch scikit-build-core ninja "$@"
command -v cmake >/dev/null || pip_install cmake

build_args=()
if [ "${CIRCLE_LOSS_CUDA_COMPILE_CHECK:-0}" = 1 ] && command -v nvcc >/dev/null &&
  python -c "import sys, torch; sys.exit(torch.version.cuda is not None)"; then
  build_args+=(-C cmake.define.CIRCLE_LOSS_CUDA_COMPILE_CHECK=ON -C "cmake.define.TORCH_CUDA_ARCH_LIST=7.5;8.0;9.0;12.0")
  step "building circle_loss with the CUDA compile check for sm_75, sm_80, sm_90a, sm_120 (about 3 minutes on 2 cores)"
else
  build_args+=(-C cmake.define.CIRCLE_LOSS_CUDA_COMPILE_CHECK=OFF)
  step "building circle_loss (CMake and the C++ compiler; the first time about a minute, then seconds)"
fi
# --no-build-isolation: the library must be built against the torch it runs with.
pip_install --no-build-isolation "${build_args[@]}" .
step "ready: $(python -c 'import circle_loss, torch; print(f"circle_loss {circle_loss.__version__} on torch {torch.__version__}")')"
