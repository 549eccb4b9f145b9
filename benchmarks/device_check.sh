#!/usr/bin/env bash
# The GPU checks of issue #18 (item 6) in one run, for a machine with a CUDA GPU and its own python3 + torch:
# benchmarks/cuda_check.py (device-to-host GB/s against a pinned copy, the gpu tier's blocking time), the tests
# that skip without CUDA, and the genuine Megatron job on CUDA (tests/megatron_real, where megatron-core is
# importable). Run from the repository root; results go to $OUT (default /tmp/device_check).
#
# tiered_ckpt is used from the checkout (PYTHONPATH), not installed; PYTHON= picks another interpreter than
# python3. Dependencies that interpreter lacks can be put beside it as wheels in .whl/ (installed with --no-deps
# into /tmp/site); nothing is fetched.
#
#     bash benchmarks/device_check.sh                  # every step
#     bash benchmarks/device_check.sh megatron         # some of: cuda_check tests megatron
set -u
OUT=${OUT:-/tmp/device_check}
mkdir -p "$OUT"
exec > >(tee "$OUT/device_check.log") 2>&1
export PYTHONUNBUFFERED=1
STEPS=${*:-cuda_check tests megatron}
step() { [[ " $STEPS " == *" $1 "* ]]; }
PY=${PYTHON:-python3}

echo "== machine"
date -u
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv 2>&1 || echo "no nvidia-smi"
nproc; free -g | head -2; df -h /tmp /dev/shm | tail -2

if compgen -G ".whl/*.whl" > /dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || echo "wheels from .whl/ did not install"
    export PYTHONPATH=/tmp/site:$PWD
else
    export PYTHONPATH=$PWD
fi
# The streaming-copy helper is optional (glibc's memmove otherwise): build it for this machine's Python if we can.
"$PY" setup.py -q build_ext --inplace > "$OUT/build_ext.log" 2>&1 && echo "built _streamcopy" \
    || echo "could not build _streamcopy (see build_ext.log): copies use memmove"
"$PY" - <<'EOF'
import sys, torch, tiered_ckpt.memcopy as m
print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda,
      "available", torch.cuda.is_available(), "streaming copy", m._HAS_STREAMING if hasattr(m, "_HAS_STREAMING") else "?")
EOF

if step cuda_check; then
    echo "== cuda_check (1 GiB fp32, 8 tensors, medians of 5)"
    timeout 300 "$PY" benchmarks/cuda_check.py --json "$OUT/cuda_check.json"
    echo "cuda_check rc=$?"
fi

if step tests; then
    echo "== the tests that need CUDA (and the files they live in)"
    timeout 200 "$PY" -m pytest -q -p no:cacheprovider -rs \
        --junitxml="$OUT/pytest_cuda.xml" \
        tests/test_cuda_path.py tests/test_flat_codec.py tests/test_tiers_specific.py 2>&1 | tail -60
    echo "pytest rc=${PIPESTATUS[0]}"
fi

if step megatron; then
    echo "== genuine megatron-core on CUDA: train, save through the adapter, resume bit-exact"
    if "$PY" -c "import megatron.core" 2>/dev/null; then
        timeout 300 "$PY" -m pytest -q -p no:cacheprovider -rs --junitxml="$OUT/pytest_megatron_cuda.xml" \
            "tests/megatron_real/test_adapter_real.py::test_a_job_on_cuda_resumes_bit_exact_in_both_layouts" \
            2>&1 | tail -80
        echo "pytest rc=${PIPESTATUS[0]}"
    else
        echo "megatron.core is not importable here: put its wheel in .whl/ (megatron-core 0.16.x)"
    fi
fi
rm -rf /dev/shm/cuda_check_* 2>/dev/null
date -u
