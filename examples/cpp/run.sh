#!/usr/bin/env bash
# Saves the scripted model (and its AOTInductor package) from Python, builds
# the C++ program against libtorch and the op library, and runs it: prints
# `python loss <v>`, then the C++ program's `loss <v>` and `aoti loss <v>`.
# Needs the circle_loss package installed.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
work="${WORK_DIR:-$here/build}"
python="${PYTHON:-python}"
"$python" "$here/export_model.py" "$work"
cmake -S "$here" -B "$work" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_PREFIX_PATH="$("$python" -c 'import torch; print(torch.utils.cmake_prefix_path)')" \
  -DCIRCLE_LOSS_LIBRARY="$("$python" -c 'import circle_loss; print(circle_loss.library_path())')" \
  > "$work/cmake.log" 2>&1 || { cat "$work/cmake.log"; exit 1; }
cmake --build "$work" > "$work/build.log" 2>&1 || { cat "$work/build.log"; exit 1; }
"$work/circle_loss_example" "$work/model.pt" "$work/inputs.pt" "$work/model.pt2"
