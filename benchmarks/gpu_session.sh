#!/usr/bin/env bash
# A GPU machine's whole errand in one call of under 10 minutes: the CUDA tests (the `cuda`
# marker's and the Triton kernels', compiled on the device, the cheap ones first), then the
# device check (python3 -m benchmarks.gpu: every section, each in its budget). Run from the
# repository root under the machine's own python3 (its torch and Triton: the project's pins
# do not apply there):
#
#     benchmarks/gpu_session.sh [TEST_SECONDS=170] [CHECK_SECONDS=360] [SECTIONS...]
#     benchmarks/gpu_session.sh 0 540 serving   # §10 alone (TEST_SECONDS 0: no tests), with
#                                               # benchmarks/gpu_wheels.sh's .whl carried
#
# Logs and the check's JSON go to $OUT (default /tmp/tessera-gpu); a summary to stdout, with
# each failing test's name even when the time limit stops the tests, and the check's summary
# table last (the device tool returns the output's tail). The engine needs no web stack and
# no gguf-py here; the TP test needs msgspec (skipped without it: carry its wheel, see the
# device tool's notes). Each part stops at its limit, so the call's length is bounded: about
# TEST_SECONDS + CHECK_SECONDS + 60. GPU_CHECK_FLAGS adds flags to the check (the tests run
# the errand on a CPU with "--quick --device cpu").
set -u
out=${OUT:-/tmp/tessera-gpu}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
test_s=${1:-170}
check_s=${2:-360}
shift $(($# < 2 ? $# : 2))
sections=("$@")

if compgen -G ".whl/*.whl" > /dev/null; then  # the web stack, for §10 (benchmarks/gpu_wheels.sh)
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
nvidia-smi -L 2>/dev/null
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'

tests=(  # cheap kernel tests first; engines, graphs and the attention shapes' compiles last
    tests/engine/kernels/test_fp8.py
    tests/engine/kernels/test_triton_fused.py
    tests/engine/kernels/test_triton_fused_moe.py
    tests/engine/lora/test_triton_lora.py
    tests/engine/kernels/test_triton_quant_gemm.py
    tests/engine/kernels/test_triton_fp8_block_gemm.py
    tests/engine/kernels/test_triton_nvfp4_gemm.py
    tests/engine/layers/quantization/test_triton_int_method.py
    tests/engine/models/test_loader.py::test_dummy_weights_are_drawn_on_the_gpu
    tests/engine/worker/test_kv_budget.py
    tests/engine/worker/test_no_host_sync.py
    tests/engine/lora/test_lora_engine.py::test_the_triton_kernels_serve_a_mixed_batch
    tests/engine/lora/test_lora_engine.py::test_lora_decode_steps_replay_in_cuda_graphs
    tests/engine/lora/test_lora_experts.py::test_expert_adapters_on_cuda
    tests/engine/spec_decode/test_spec_engine.py  # LLM's default device: the GPU here
    tests/engine/spec_decode/test_draft_model.py::test_target_as_its_own_draft_accepts_everything  # draft graphs
    tests/engine/spec_decode/test_eagle3.py::test_mirror_head_greedy_identical_and_mostly_accepted  # aux in graphs
    tests/engine/worker/test_cuda_graph.py
    tests/engine/worker/test_piecewise_graphs.py
    tests/engine/worker/test_tp_cuda.py
    tests/engine/layers/quantization/test_quant_moe.py  # quantized experts' fused kernel
    tests/engine/layers/quantization/test_kv_scales.py::test_the_fp8_cache_serves_with_the_checkpoints_scales_cuda
    tests/engine/layers/quantization/test_fp8_block.py  # block FP8: the GEMM and MoE kernels
    tests/engine/layers/quantization/test_nvfp4.py  # NVFP4: the Triton GEMM on loaded layers, through the engine
    tests/engine/layers/quantization/test_mxfp4_linear.py  # MXFP4 layers: the same GEMM with E8M0 scales, through the engine
    tests/engine/layers/quantization/test_bnb.py  # bitsandbytes NF4 / FP4: the same GEMM's LUT4 kind, through the engine
    tests/engine/models/test_gpt_oss.py  # sinks, expert biases: LLM's default device here
    tests/engine/kernels/test_triton_attention.py  # sliding window, fp8, split-K; each shape compiles
)
if [ "$test_s" -gt 0 ]; then  # 0: the check alone (§10's call)
    timeout -k 5 "$test_s" python3 -m pytest -v -p no:cacheprovider -rfE --timeout 60 \
        "${tests[@]}" > "$out/pytest.log" 2>&1
    echo "tests: exit $? (124: stopped at ${test_s} s)"
    grep -cE " PASSED" "$out/pytest.log" | sed 's/^/passed: /'
    grep -E " (FAILED|ERROR)|^(FAILED|ERROR) | (passed|failed)" "$out/pytest.log" | cut -c1-300
fi

# shellcheck disable=SC2086  # GPU_CHECK_FLAGS: words to split
timeout -k 5 $((check_s + 30)) python3 -m benchmarks.gpu --time-limit "$check_s" \
    --json "$out/gpu_check.json" ${sections[@]+--sections "${sections[@]}"} \
    ${GPU_CHECK_FLAGS:-} > "$out/gpu_check.log" 2>&1
rc=$?
echo "gpu_check: exit $rc (details in $out/gpu_check.log and gpu_check.json)"
# the details, then the summary table again: the tail is what comes back first
sed -n '/^| § | check |/,/^$/p' "$out/gpu_check.log" | cut -c1-220
sed -n '/^| § | section |/,/^$/p' "$out/gpu_check.log" | cut -c1-400
grep -E "^sections:" "$out/gpu_check.log"
[ "$rc" -eq 0 ] || tail -n 5 "$out/gpu_check.log"
