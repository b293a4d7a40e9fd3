#!/usr/bin/env bash
# The GPU proofs and figures, on a machine with CUDA and a CUDA build of torch already
# installed (the `device` machine's python3, or any GPU node). Installs nothing: the
# package runs from this checkout (PYTHONPATH); its pure-Python needs (prometheus-client,
# safetensors, numpy, pytest, pytest-timeout) are expected there, and a folder .whl/ of
# wheels, when present, is unpacked to /tmp/site first (etcd3gw is needed only for etcd).
#
#   bash scripts/gpu-check.sh env      # what the machine has (seconds)
#   bash scripts/gpu-check.sh tests    # tests/gpu (a few minutes)
#   bash scripts/gpu-check.sh bench    # benchmarks/gpu.py: 1B and small GPT (minutes)
#   bash scripts/gpu-check.sh all      # the three
#
# Within the device tool's 10 minutes a command, split the benchmark (as run on the H100,
# benchmarks/results/h100-2026-11-24/README.md):
#   bash scripts/gpu-check.sh bench --models 1b --saves 3 --skip-recovery --dir /dev/shm --steady none
#   bash scripts/gpu-check.sh bench --models small --saves 3 --skip-recovery --dir /dev/shm --steady-steps 300 --every 150
#   bash scripts/gpu-check.sh bench --models 1b --saves 0 --steady 1b --steady-steps 80 --every 80 --dir /dev/shm --skip-recovery
#   bash scripts/gpu-check.sh bench --models ''      # recovery only
#
# Logs go to $OUT (the device tool's folder) or ./gpu-results.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-gpu-results}
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1

env_report() {
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "no nvidia-smi"
    "$PY" - <<'PY'
import torch, torch.distributed as dist
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, available "
      f"{torch.cuda.is_available()}, devices {torch.cuda.device_count()}, "
      f"nccl {dist.is_nccl_available()} {torch.cuda.nccl.version() if dist.is_nccl_available() else ''}")
import elastic_train, elastic_train.agent.launch, elastic_train.agent.live_agent, prometheus_client, safetensors
print("elastic_train imports: ok")
PY
    # What the forkserver's preload does to CUDA, module by module, in a fresh process:
    # libcuda mapped (harmless), NVIDIA device files open (the driver initialised: unsafe
    # to fork after), torch's own CUDA state initialised.
    "$PY" - <<'PY'
import importlib, os
from elastic_train.agent.worker_start import PRELOAD
def driver_files():
    fds = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            fds.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            pass
    return sorted(f for f in fds if f.startswith("/dev/nvidia"))
for name in PRELOAD:
    importlib.import_module(name)
    import torch
    with open("/proc/self/maps") as f:
        mapped = "libcuda.so" in f.read()
    print(f"forkserver preload {name}: libcuda mapped {mapped}, driver files open "
          f"{driver_files()}, torch.cuda initialised {torch.cuda.is_initialized()}")
PY
}
tests() {
    set -o pipefail
    "$PY" -m pytest tests/gpu -m gpu -v -s -p no:cacheprovider --timeout 420 2>&1 | tee "$OUT/gpu-tests.log"
}
bench() {
    set -o pipefail
    "$PY" benchmarks/gpu.py "$@" 2>&1 | tee "$OUT/gpu-bench.log"
}
what=${1:-all}
shift || true
case "$what" in
    env) env_report 2>&1 | tee "$OUT/gpu-env.log" ;;
    tests) tests ;;
    bench) bench "$@" ;;
    all) env_report 2>&1 | tee "$OUT/gpu-env.log"; tests; bench "$@" ;;
    *) echo "usage: $0 env|tests|bench|all [benchmark options]" >&2; exit 2 ;;
esac
