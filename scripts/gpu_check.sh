#!/usr/bin/env bash
# On a CUDA machine with torch already installed: build and install the
# package, then run the steps asked for (default: tests sanitize bench):
#   tests          the whole test suite
#   tests-by-file  the same, one process per file (isolates a crash)
#   tests-ops      the suite without tests/test_examples.py; examples: that file alone
#   tests-cuda     the CUDA cases alone (test ids naming cuda), 2 processes on the one GPU
#                  (4 ran out of its memory where two large tests met)
#   sanitize       compute-sanitizer memcheck and racecheck over the CUDA tests
#   bench-16384    bench/bench.py at B = 16384, 10 classes, float32 and bfloat16: one
#                  row a dtype, to set builds side by side (CIRCLE_LOSS_ARCH_LIST)
#   bench          bench/bench.py (fp32 sizes; label distributions in fp32, bf16, fp16 and TF32-allowed fp32)
#   bench-anchor   bench/bench_anchor.py (the per-anchor op, the drop-ins and PML, memory-bank steps)
#   bench-class    bench/bench_class.py (the class-level head against the eager CircleSoftmax, C = 10^5 and 10^6)
#   distributed    with 2+ GPUs: the NCCL test and bench/bench_distributed.py (the three forms, PML's wrapper)
# CIRCLE_LOSS_ARCH_LIST, when set, is the TORCH_CUDA_ARCH_LIST of the build
# (e.g. "8.0+PTX" on an H200 runs the mma.sync path every non-Hopper GPU takes).
# Logs are packed into $OUT/gpu_logs.tgz (or ./gpu_logs).
#   bash scripts/gpu_check.sh [step ...]
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
# Logs are written to a scratch folder and packed into $OUT/gpu_logs.tgz at the
# end (the device tool returns at most 8 files); the benchmark tables, plots and
# the built library are copied to $OUT beside it.
dest="${OUT:-$root/gpu_logs}"
out="$(mktemp -d)"
mkdir -p "$dest"
trap 'tar czf "$dest/gpu_logs.tgz" -C "$out" . ; cp "$out"/*.md "$out"/*.png "$dest"/ 2>/dev/null' EXIT
trap 'exit 143' TERM INT  # a run stopped at its time limit still packs its logs
mkdir -p "$out/classes"
export PYTHONUNBUFFERED=1
steps=("$@")
[ ${#steps[@]} -gt 0 ] || steps=(tests sanitize bench)
status=0

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/gpu.txt"
# Built exactly as the README's install section says, with whatever compiler
# the environment gives: CMakeLists.txt makes any of them link the shared C++
# runtime.
rm -rf build  # a cached CMake tree would keep its old compiler choice
if [ -n "${CIRCLE_LOSS_LIBRARY:-}" ]; then
  # A library built by an earlier run on this kind of machine: use the sources' package.
  export PYTHONPATH="$root/python${PYTHONPATH:+:$PYTHONPATH}"
else
  [ -z "${CIRCLE_LOSS_ARCH_LIST:-}" ] || export TORCH_CUDA_ARCH_LIST="$CIRCLE_LOSS_ARCH_LIST"
  python3 -m pip install --no-build-isolation --no-deps -v -C build.verbose=true . > "$out/build.log" 2>&1 \
    || { tail -40 "$out/build.log"; exit 1; }
  cp "$(python3 -c 'import circle_loss; print(circle_loss.library_path())')" "$dest/"
fi

# pytest with its output in $out/NAME.log, the last LINES lines shown; a
# failure marks the whole check failed.
run_pytest() {
  local name="$1" lines="$2"
  shift 2
  python3 -m pytest -q -p no:cacheprovider "$@" 2>&1 | tee "$out/$name.log" | tail -"$lines"
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
}

for step in "${steps[@]}"; do
  case "$step" in
    tests) run_pytest pytest 15 tests ;;
    tests-ops) run_pytest pytest_ops 5 tests --ignore tests/test_examples.py ;;  # examples build C++ and take minutes
    examples) run_pytest pytest_examples 5 tests/test_examples.py ;;
    tests-cuda) run_pytest pytest_cuda 5 -n 2 tests --ignore tests/test_examples.py -k cuda ;;
    tests-by-file)  # one process per file: isolates a crash
      for file in tests/test_*.py; do
        python3 -m pytest -q -p no:cacheprovider "$file" > "$out/pytest_$(basename "$file" .py).log" 2>&1
        echo "$file: exit $? $(tail -1 "$out/pytest_$(basename "$file" .py).log")"
      done ;;
    sanitize)
      # memcheck looks at every kernel. racecheck over all of cuBLAS's GEMMs
      # runs for many minutes, so it looks at our kernels (their names carry
      # the circle_loss namespace) and cuBLAS's nvjet GEMMs only: under
      # racecheck an nvjet GEMM it does not instrument (bfloat16 or float16
      # with float32 output, as split float32's gradient and half precision
      # run) fails with a hardware exception the sanitizer cannot handle, in
      # plain torch.mm(a, b, out_dtype=torch.float32) too. The nvjet GEMMs
      # report hazards of their own, so racecheck fails on a hazard in ours.
      compute-sanitizer --tool memcheck --error-exitcode 9 --target-processes all \
        python3 -m pytest -q -p no:cacheprovider -x tests -m sanitize -k "cuda or not cpu" \
        > "$out/sanitizer_memcheck.log" 2>&1
      rc=$?
      echo "compute-sanitizer memcheck: exit $rc"
      tail -3 "$out/sanitizer_memcheck.log"
      [ "$rc" = 0 ] || status=1
      compute-sanitizer --tool racecheck --kernel-name "regex=circle_loss|nvjet" --target-processes all \
        python3 -m pytest -q -p no:cacheprovider -x tests -m sanitize -k "cuda or not cpu" \
        > "$out/sanitizer_racecheck.log" 2>&1
      rc=$?
      ours=$(grep -cE "access at .*circle_loss|Internal Sanitizer Error" "$out/sanitizer_racecheck.log")
      echo "compute-sanitizer racecheck: exit $rc; hazards in our kernels and sanitizer errors: $ours"
      tail -3 "$out/sanitizer_racecheck.log"
      [ "$rc" = 0 ] && [ "$ours" = 0 ] || status=1 ;;
    distributed)  # needs 2+ GPUs
      export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
      run_pytest pytest_distributed 3 tests/test_distributed.py
      for dtype in float32 bfloat16; do
        torchrun --nproc_per_node="$(nvidia-smi -L | wc -l)" bench/bench_distributed.py --dtype "$dtype" \
          --per-rank 4096 16384 --global 32768 --forms loss anchor --pml-wrapper 16384 --out "$out" 2>&1 \
          | tee "$out/bench_distributed_$dtype.log" | tail -24
        torchrun --nproc_per_node="$(nvidia-smi -L | wc -l)" bench/bench_distributed.py --dtype "$dtype" \
          --per-rank 1024 --forms class --classes 2000000 --out "$out/class" 2>&1 \
          | tee "$out/bench_distributed_class_$dtype.log" | tail -8
      done ;;
    bench-anchor)
      python3 bench/bench_anchor.py --device cuda --sizes 256 4096 16384 65536 --refs 256:65536 1024:262144 \
        --banks 256:65536 1024:65536 \
        --classes 10 100 --min-run-time 0.3 --out "$out" 2>&1 | tee "$out/bench_anchor.log" | tail -45 ;;
    bench-class)
      for dtype in float32 bfloat16; do
        python3 bench/bench_class.py --device cuda --batch 1024 --dim 512 --classes 100000 1000000 --dtype "$dtype" \
          --max-eager-pairs 1100000000 --min-run-time 0.3 --out "$out" 2>&1 | tee "$out/bench_class_$dtype.log" | tail -8
      done ;;
    bench-16384)
      for dtype in float32 bfloat16; do
        python3 bench/bench.py --device cuda --dtype "$dtype" --sizes 16384 --classes 10 --max-reference-batch 0 \
          --no-memory --min-run-time 0.3 --out "$out/classes" 2>&1 | tee "$out/bench_16384_$dtype.log" \
          | grep -E "^\| 16384"
      done ;;
    bench)
      # docs/performance.md's float32 table, then the label distributions at B = 16384
      # in float32, bfloat16 and float16 (also at 65536) and TF32-allowed float32.
      python3 bench/bench.py --device cuda --sizes 256 4096 16384 65536 262144 --max-reference-batch 16384 \
        --min-run-time 0.3 --out "$out" 2>&1 | tee "$out/bench_fp32.log" | tail -24
      python3 bench/bench.py --device cuda --sizes 16384 --classes 2 10 100 1000 B --max-reference-batch 0 \
        --no-memory --min-run-time 0.3 --out "$out/classes" 2>&1 | tee "$out/bench_fp32_classes.log" | grep -E "^\| 16384"
      for dtype in bfloat16 float16; do
        python3 bench/bench.py --device cuda --dtype "$dtype" --sizes 16384 65536 --classes 2 10 100 1000 B \
          --max-reference-batch 0 --no-memory --min-run-time 0.3 --out "$out/classes" 2>&1 \
          | tee "$out/bench_$dtype.log" | grep -E "^\| (16384|65536)"
      done
      # float32 with TF32 GEMMs allowed, as torch.set_float32_matmul_precision("high") allows them
      python3 bench/bench.py --device cuda --sizes 16384 --classes 10 1000 --max-reference-batch 0 --no-memory \
        --matmul-precision high --min-run-time 0.3 --out "$out/classes" 2>&1 | tee "$out/bench_fp32_tf32.log" \
        | grep -E "^\| 16384" ;;
  esac
done
exit $status
