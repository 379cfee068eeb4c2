#!/usr/bin/env bash
# The GPU half of the matrix in one run, for a lent GPU machine (issue 18): the machine's own
# python with a CUDA torch, distcompat from src/ (nothing is installed). Each step has its own
# time limit, so a hang costs that step only. Logs and generated files go to $OUT (./gpu-out):
# run.log (env, capability tables, demo), tests.log, collectives.log, attention.log,
# nanochat.log, and the files they generate (eight in all: the most the device tool brings back).
#
#     OUT=gpu-out bash tools/gpu_checks.sh            # everything: 202 s on an H100 before the
#                                                     # nanochat step (59-87 s on an H200)
#     bash tools/gpu_checks.sh tests caps             # only the named steps
#     ATTENTION_ARGS="--seq 4096 --dtypes bfloat16" bash tools/gpu_checks.sh attention
#     ATTENTION_LIMIT=400 ATTENTION_ARGS="--seq 2048 --windows 127,255,511,1023 --dtypes bfloat16 \
#         --dispatch-calls 2000" bash tools/gpu_checks.sh attention   # issue 29: flex crossover
#     bash tools/gpu_checks.sh env nanochat           # issue 29: distcompat vs direct SDPA training
#     NANOCHAT_ARGS=--profile bash tools/gpu_checks.sh nanochat   # plus each variant's top kernels
#     PYTHON=/venv-2.15/bin/python bash tools/gpu_checks.sh nccl2 tests demo   # issue 53: NCCL on
#         # the torch that PYTHON has (2.15: ProcessGroupNCCL2): device bound without device_id,
#         # Flight Recorder dumps where distcompat points them, diagnose reads them
#
# The torch tested is PYTHON's (the machine's python3 by default): the env step and every log
# start with its version.
set -u
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
STEPS=${*:-env nccl2 tests caps demo collectives attention nanochat}

step() {  # step LOG LIMIT_S COMMAND...: run it, append to $OUT/LOG.log, say how it ended
    local name=$1 limit=$2 start rc
    shift 2
    echo "== $name: limit ${limit}s: $*"
    start=$(date +%s)
    timeout -k 5 "$limit" "$@" >>"$OUT/$name.log" 2>&1
    rc=$?
    echo "== $name: rc=$rc after $(($(date +%s) - start))s"
}

for name in $STEPS; do
    case $name in
    env)
        step run 60 sh -c "nvidia-smi; $PY - <<'PY'
import sys, torch
from distcompat.attention._kernels import probe_kernel
print(sys.version)
print(torch.__version__, 'cuda', torch.version.cuda, 'nccl', torch.cuda.nccl.version())
print(torch.cuda.get_device_name(), torch.cuda.get_device_capability())
for name in ('fa2', 'fa3', 'fa4', 'flex'):
    probe = probe_kernel(name)
    print(name, probe.available, probe.reason)
PY
$PY -m pip list 2>/dev/null | grep -i -E '^(flash|kernels|triton|torch |pytest|hypothesis)'"
        cat "$OUT/run.log"
        ;;
    nccl2)
        step nccl2 120 "$PY" tools/gpu_nccl2.py
        cat "$OUT/nccl2.log"
        ;;
    tests)
        step tests 200 "$PY" -m pytest -m cuda -p no:cacheprovider -q -rfEs --timeout 150
        tail -n 40 "$OUT/tests.log"
        ;;
    caps)
        step run 90 "$PY" tools/generate_capabilities.py --cuda
        cp docs/capabilities_nccl.md docs/capabilities_gloo_cuda.md "$OUT"/ 2>/dev/null
        tail -n 5 "$OUT/run.log"
        ;;
    demo)
        step run 60 "$PY" -m distcompat demo --device cuda --nproc 1 --out /tmp/demo-nccl
        step run 90 "$PY" -m distcompat demo --device cuda:0 --backend gloo --out /tmp/demo-gloo
        grep -E "distcompat demo:|throughput|all-reduce|replicas|resume|PASS|FAIL|Error" \
            "$OUT/run.log"
        ;;
    collectives)
        step collectives 120 "$PY" benchmarks/bench_collectives.py --cuda --out "$OUT"
        tail -n 70 "$OUT/collectives.log"
        ;;
    attention)
        # shellcheck disable=SC2086  # ATTENTION_ARGS is a list of flags
        step attention "${ATTENTION_LIMIT:-150}" "$PY" benchmarks/bench_attention.py --device cuda \
            ${ATTENTION_ARGS:---dtypes bfloat16 --rounds 5 --dispatch-calls 2000}
        cat "$OUT/attention.log"
        ;;
    nanochat)
        # Issue 29: a nanochat-shaped model (depth 8, width 512, head dim 128, seq 2048, batch 16,
        # SSSL windows, bf16 autocast, torch.compile), 40 steps each with attention through
        # distcompat and through direct SDPA, interleaved: median step, peak memory, ratio.
        # shellcheck disable=SC2086  # NANOCHAT_ARGS is a list of flags
        step nanochat "${NANOCHAT_LIMIT:-300}" "$PY" benchmarks/bench_nanochat_attention.py --device cuda \
            ${NANOCHAT_ARGS:-}
        cat "$OUT/nanochat.log"
        ;;
    *) echo "unknown step $name" ;;
    esac
done
