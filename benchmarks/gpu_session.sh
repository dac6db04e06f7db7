#!/usr/bin/env bash
# A GPU machine's whole errand in one call of a few minutes: the CUDA tests (the `cuda`
# marker's and the Triton kernels', compiled on the device), then the device check
# (benchmarks/gpu_check.py). Run from the repository root under the machine's own python3
# (its torch and Triton: the project's pins do not apply there):
#
#     benchmarks/gpu_session.sh [TEST_SECONDS=150] [CHECK_SECONDS=300]
#
# Logs and the check's JSON go to $OUT (default /tmp/tessera-gpu); a summary to stdout, with
# each failing test's name even when the time limit stops the tests. The engine needs no
# web stack and no gguf-py here; the TP test needs msgspec (skipped without it: carry its
# wheel, see the device tool's notes). Each part stops at its limit, so the call's length is
# bounded: about TEST_SECONDS + CHECK_SECONDS + 60.
set -u
out=${OUT:-/tmp/tessera-gpu}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
test_s=${1:-150}
check_s=${2:-300}

nvidia-smi -L 2>/dev/null
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'

tests=(
    tests/engine/kernels/test_triton_fused.py
    tests/engine/worker/test_cuda_graph.py
    tests/engine/worker/test_no_host_sync.py
    tests/engine/worker/test_kv_budget.py
    tests/engine/worker/test_tp_cuda.py
    tests/engine/models/test_loader.py::test_dummy_weights_are_drawn_on_the_gpu
    tests/engine/kernels/test_triton_attention.py  # last: each shape compiles its kernels
)
timeout -k 5 "$test_s" python3 -m pytest -v -p no:cacheprovider -rfE --timeout 60 \
    "${tests[@]}" > "$out/pytest.log" 2>&1
echo "tests: exit $? (124: stopped at ${test_s} s)"
grep -cE " PASSED" "$out/pytest.log" | sed 's/^/passed: /'
grep -E " (FAILED|ERROR)|^(FAILED|ERROR) | (passed|failed)" "$out/pytest.log" | cut -c1-300

timeout -k 5 $((check_s + 30)) python3 benchmarks/gpu_check.py --time-limit "$check_s" \
    --json "$out/gpu_check.json" > "$out/gpu_check.log" 2>&1
rc=$?
echo "gpu_check: exit $rc"
grep -E "^\| |^sections:" "$out/gpu_check.log" | cut -c1-260
[ "$rc" -eq 0 ] || tail -n 5 "$out/gpu_check.log"
