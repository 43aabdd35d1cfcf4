#!/usr/bin/env bash
# The GPU checks (CI has no GPU; run this on a machine with a CUDA GPU and torch built for it):
#   tests  the engine's CUDA path: the unit tests of decoding, sampling, trees, Medusa and DSpark on
#          tiny random models, with every LLM on the GPU ($SPECSERVE_DEVICE=cuda); needs pytest-xdist
#   bench  the shipped drafters on the default model on the GPU, greedy and at temperature 0.7
# Usage: scripts/gpu_check.sh [tests|bench|all] (default all). Logs and JSON go to $OUT (default
# ./gpu-check-out). $PROMPTS: the bench prompts (default chitchat-heldout); $DTYPE: the bench dtype
# (default float32, in which greedy outputs must equal plain decoding's; bfloat16 rounds a k-token forward
# differently from k one-token forwards); $PYTHON: the interpreter.
set -u
what=${1:-all}
out=${OUT:-gpu-check-out}
py=${PYTHON:-python3}
prompts=${PROMPTS:-chitchat-heldout}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 SPECSERVE_DEVICE=cuda TOKENIZERS_PARALLELISM=false
$py -c "import torch; assert torch.cuda.is_available(), 'torch sees no CUDA GPU'; \
print('torch', torch.__version__, torch.cuda.get_device_name())" || exit 1
rc=0
if [[ $what == tests || $what == all ]]; then
  timeout "${TESTS_TIMEOUT:-420}" $py -m pytest -q -p no:cacheprovider -n "${WORKERS:-8}" -m "not multiproc" \
    --timeout 200 -o addopts="" tests/unit/test_spec_engine.py tests/unit/test_sampling.py \
    tests/unit/test_rejection_sampler.py tests/unit/test_tree.py tests/unit/test_model_parity.py \
    tests/unit/test_medusa.py tests/unit/test_dspark.py \
    2>&1 | tee "$out/tests.log" | tail -60
  rc=$((rc | PIPESTATUS[0]))
fi
if [[ $what == bench || $what == all ]]; then
  common=(--device cuda --dtype "${DTYPE:-float32}" --prompts "$prompts" --num-prompts "${NUM_PROMPTS:-20}" --max-tokens 128)
  timeout "${BENCH_TIMEOUT:-300}" $py -m specserve bench "${common[@]}" --json "$out/bench-t0.json" \
    --methods "${METHODS:-none,hf,ngram,medusa,medusa-tree-dynamic,dspark,dspark-auto,dspark-tree}" \
    --speculative-config 'medusa-tree-64={"method": "medusa", "medusa_tree": 64}' \
    --speculative-config 'dspark-tree-32={"method": "dspark", "dspark_tree": 32}' \
    2>&1 | tee "$out/bench-t0.log"
  rc=$((rc | PIPESTATUS[0]))
  timeout "${BENCH_TIMEOUT:-300}" $py -m specserve bench "${common[@]}" --json "$out/bench-t07.json" \
    --temperature 0.7 --methods "${METHODS_T07:-none,medusa,medusa-tree-dynamic,dspark,dspark-auto,dspark-tree}" \
    2>&1 | tee "$out/bench-t07.log"
  rc=$((rc | PIPESTATUS[0]))
fi
exit $rc
