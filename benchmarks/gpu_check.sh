#!/usr/bin/env bash
# The GPU checks as one run, for a machine with a CUDA device (about 4 minutes on one H200):
# the CUDA tests, then benchmarks/step_overhead.py on the device at default threads and at one
# thread. dpfy need not be installed there: src/ and tests/
# go on PYTHONPATH. Opacus, for the comparison, only if importable (copy it along otherwise).
# Usage: bash benchmarks/gpu_check.sh [RESULTS_DIR]   (default: benchmarks/results)
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-benchmarks/results}
mkdir -p "$out"
export PYTHONPATH="$PWD/src:$PWD/tests${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
python3 -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.__version__, torch.cuda.get_device_name())"
python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py tests/test_noise.py
python3 benchmarks/step_overhead.py --device cuda --seconds 1.5 \
    --out "$out/step_overhead_cuda.json"
python3 benchmarks/step_overhead.py --device cuda --threads 1 --seconds 1.5 \
    --methods nonprivate dpfy_fast dpfy_fast_nonoise --out "$out/step_overhead_cuda_threads1.json"
