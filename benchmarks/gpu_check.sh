#!/usr/bin/env bash
# Every GPU check of knitkit in one run (a few minutes on one GPU):
#   1. every test marked @pytest.mark.cuda under tests/ (all parts; `pytest -m cuda tests/`),
#      the micro-batch iterator's first (tests/microbatch_iter: stream/event hand-off, device
#      copies straight from a cudaHostRegister-ed /dev/shm ring), so their result stands apart;
#   2. every GPU benchmark: benchmarks/prefetch.py --gpu (the iterator against
#      DataLoader(num_workers=2, pin_memory=True) and a one-ahead thread, cold and warm:
#      cuda.exposed_ratio, cuda.<method>.cold_first_wait_ms, cuda.overhead_us_per_micro,
#      in-place vs pinned-staging copies), and
#      benchmarks/encoder_dedup.py with its GPU flag when it has one.
# Results (JSON, text logs, junit XML) land in ${OUT:-gpu-results}. Exits non-zero if CUDA is
# absent, if no CUDA test is collected, or if any test or benchmark fails.
#   OUT=gpu-results bash benchmarks/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
OUT=${OUT:-gpu-results}
mkdir -p "$OUT"

if ! "$PYTHON" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    echo "gpu_check: FAIL: CUDA is not available (torch.cuda.is_available() is False);" \
        "run this on a GPU machine with a CUDA build of torch" >&2
    exit 2
fi
"$PYTHON" -c 'import knitkit.integration' 2>/dev/null ||
    "$PYTHON" -m pip install --quiet --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1
"$PYTHON" - >"$OUT/device.json" <<'EOF'
import json, torch
props = torch.cuda.get_device_properties(0)
print(json.dumps({"device": props.name, "count": torch.cuda.device_count(),
                  "memory_gib": props.total_memory / 2**30, "torch": torch.__version__,
                  "cuda": torch.version.cuda}))
EOF
cat "$OUT/device.json"

# Tests that touch CUDA but carry no `cuda` marker would be missed by `-m cuda`: name them.
unmarked=$(grep -rlE 'cuda\.is_available\(\)|device="cuda"|\.cuda\(' tests --include='test_*.py' |
    xargs -r grep -L 'mark\.cuda' || true)
if [ -n "$unmarked" ]; then
    echo "gpu_check: WARNING: these test files use CUDA without @pytest.mark.cuda:" $unmarked >&2
fi

status=0
run() {  # run NAME TIMEOUT CMD...: log to $OUT/NAME.txt, remember failures
    local name=$1 limit=$2
    shift 2
    echo "== $name: $*"
    timeout "$limit" "$@" 2>&1 | tee "$OUT/$name.txt"
    local rc=${PIPESTATUS[0]}
    echo "== $name: exit $rc"
    [ "$rc" -eq 0 ] || status=1
}

# pytest exits 5 when nothing is collected: that counts as a failure here too.
run cuda-tests-prefetch 300 "$PYTHON" -m pytest -m cuda tests/microbatch_iter -q -rs \
    -p no:cacheprovider --junitxml="$OUT/cuda-tests-prefetch.xml"
run cuda-tests 900 "$PYTHON" -m pytest -m cuda tests/ --ignore=tests/microbatch_iter -q -rs \
    -p no:cacheprovider --junitxml="$OUT/cuda-tests.xml"
"$PYTHON" - "$unmarked" "$OUT/cuda-tests-prefetch.xml" "$OUT/cuda-tests.xml" \
    >"$OUT/cuda-tests.json" <<'EOF'
import json, os, sys, xml.etree.ElementTree as ET
cases = []
reports = [path for path in sys.argv[2:] if os.path.exists(path)]
for case in (case for path in reports for case in ET.parse(path).iter("testcase")):
    outcome, reason = "passed", ""
    for tag in ("failure", "error", "skipped"):
        node = case.find(tag)
        if node is not None:
            outcome, reason = tag, node.get("message", "")
    cases.append({"test": f"{case.get('classname')}::{case.get('name')}", "outcome": outcome,
                  "seconds": float(case.get("time", 0)), "reason": reason})
counts = {k: sum(c["outcome"] == k for c in cases) for k in ("passed", "failure", "error", "skipped")}
print(json.dumps({"counts": counts, "unmarked_cuda_test_files": sys.argv[1].split(),
                  "reports": reports, "cases": cases}, indent=1))
EOF

run prefetch 420 "$PYTHON" benchmarks/prefetch.py --quick --gpu --json "$OUT/prefetch.json"

if [ -f benchmarks/encoder_dedup.py ]; then
    help=$("$PYTHON" benchmarks/encoder_dedup.py --help 2>/dev/null || true)
    gpu_args=()
    if grep -q -- '--device' <<<"$help"; then
        gpu_args=(--device cuda)
    elif grep -qE -- '--(gpu|cuda)\b' <<<"$help"; then
        gpu_args=("$(grep -oE -- '--(gpu|cuda)\b' <<<"$help" | head -1)")
    else
        echo "gpu_check: NOTE: benchmarks/encoder_dedup.py has no GPU flag; running it as is" >&2
    fi
    run encoder_dedup 420 "$PYTHON" benchmarks/encoder_dedup.py --quick "${gpu_args[@]}" \
        --json "$OUT/encoder_dedup.json"
fi

# The Megatron VLM examples in their GPU form (NCCL, TE layer specs when TE is installed); their
# TE equivalence tests (LLaVA and mRoPE at TP2 and CP2 x TP2) are among the cuda tests above.
gpus=$("$PYTHON" -c 'import torch; print(torch.cuda.device_count())')
for example in megatron_llava megatron_mrope; do
    if [ "$gpus" -ge 2 ]; then
        run "example-$example" 300 "$PYTHON" -m torch.distributed.run --nproc-per-node 2 \
            "examples/$example.py"
    else
        echo "gpu_check: NOTE: examples/$example.py needs 2 GPUs, found $gpus; skipped" >&2
    fi
done

# Megatron correctness (issue 10): the NCCL variants in tests/integration/test_megatron_step.py
# (*_nccl: TP2 and DP2 x TP2 replicated / TP-sharded vision, the sequence-parallel ViT with q/k
# layernorm, DistributedOptimizer.step() with and without overlap_param_gather) and
# tests/encoder_dedup (test_nccl_*) run with the cuda tests above; here the wrap example on NCCL.
if [ "$gpus" -ge 2 ]; then
    run example-megatron_wrap 300 "$PYTHON" -m torch.distributed.run --nproc-per-node 2 \
        examples/megatron_wrap.py
else
    echo "gpu_check: NOTE: examples/megatron_wrap.py needs 2 GPUs, found $gpus; skipped" >&2
fi

echo "gpu_check: results in $OUT/ ($(ls "$OUT" | tr '\n' ' '))"
[ "$status" -eq 0 ] && echo "gpu_check: OK" || echo "gpu_check: FAILED (see $OUT/*.txt)" >&2
exit "$status"
