#!/usr/bin/env bash
# Saves the scripted model (and its AOTInductor package) from Python, builds
# the C++ program against libtorch and the op library, and runs it: prints
# `python loss <v>`, then the C++ program's `loss <v>` and `aoti loss <v>`.
# Needs the circle_loss package installed: the Python of $PYTHON, else of the
# active virtual environment, else the repository's .venv (what
# scripts/setup.sh makes), else `python`.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../.." && pwd)"
work="${WORK_DIR:-$here/build}"
if [ -n "${PYTHON:-}" ]; then
  python="$PYTHON"
elif [ -z "${VIRTUAL_ENV:-}" ] && [ -x "$root/.venv/bin/python" ]; then
  python="$root/.venv/bin/python"
else
  python=python
fi
if ! "$python" -c "import circle_loss" 2>/dev/null; then
  echo "run.sh: $python cannot import circle_loss. Run scripts/setup.sh (it installs into .venv)," \
    "activate the environment that has it, or set PYTHON=/path/to/its/python." >&2
  exit 1
fi
# That environment's cmake and ninja, where pip installed them there.
PATH="$(dirname "$python"):$PATH"
"$python" "$here/export_model.py" "$work"
cmake -S "$here" -B "$work" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_PREFIX_PATH="$("$python" -c 'import torch; print(torch.utils.cmake_prefix_path)')" \
  -DTORCH_VERSION_STRING="$("$python" -c 'import torch; print(torch.__version__)')" \
  -DTORCH_CUDA_VERSION="$("$python" -c 'import torch; print(torch.version.cuda or "")')" \
  -DCIRCLE_LOSS_LIBRARY="$("$python" -c 'import circle_loss; print(circle_loss.library_path())')" \
  > "$work/cmake.log" 2>&1 || { cat "$work/cmake.log"; exit 1; }
cmake --build "$work" > "$work/build.log" 2>&1 || { cat "$work/build.log"; exit 1; }
"$work/circle_loss_example" "$work/model.pt" "$work/inputs.pt" "$work/model.pt2"
