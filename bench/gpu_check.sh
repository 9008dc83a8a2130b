#!/usr/bin/env bash
# The GPU check: every CUDA path of tridens and its figures, in one command, each part stopped at
# its own time limit, every figure written to one file. About 8 minutes on one H200-class GPU.
#
#   bench/gpu_check.sh --prepare              # here, with network: wheels and data into .gpu/ (git-ignored; carry it)
#   bench/gpu_check.sh --device cuda --out $OUT/gpu_check.txt    # on the GPU machine (carry .gpu)
#   bench/gpu_check.sh --device cpu           # a dry run on the CPU: the same parts, smaller, on the CPU
#
# Parts (limit in seconds, on a GPU):
#   1. tests   pytest -m cuda (tests/cuda: fused == separate on the device for batching, the shared
#              pipeline, a frozen prefix and a stage tree; a NaN member; a batched member's checkpoint;
#              max_unit_memory against GPU memory; the device chosen by itself; store and dashboard) (110)
#   2. batching  bench/batching.py at K = 1, 4, 16, 64: MLPs and small CNNs, fused vs a plain sequential
#              loop on the same device, synchronized wall time and peak memory (110)
#   3. headline  bench/headline.py's mlp and hpo workloads: tridens vs Optuna's plain loop on the same
#              device (2 x 70)
#   4. graphs  bench/cuda_graphs.py: a fused step eager vs captured once in a CUDA graph and replayed (35)
#   5. fluid   bench/fluid.py real on a local Ray with the evaluator on the GPU: Fluid shares as
#              fractional num_gpus (45; skipped where Ray is not installed)
set -u
cd "$(dirname "$0")/.."

device=cuda
out=gpu_check.txt
prepare=0
while [ $# -gt 0 ]; do
  case "$1" in
    --device) device=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    --prepare) prepare=1; shift ;;
    *) echo "gpu_check.sh: unknown argument $1 (--device cuda|cpu, --out FILE, --prepare)" >&2; exit 2 ;;
  esac
done

if [ $prepare = 1 ]; then
  # The GPU machine has Python 3.12 with CUDA torch and no network: tridens' other requirements travel
  # as wheels (Ray's wheel is larger than what a device call carries: the fluid part then skips),
  # Fashion-MNIST as Debian's files.
  mkdir -p .gpu/whl .gpu/fashion-mnist
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .gpu/whl optuna sqlalchemy alembic colorlog mako greenlet starlette uvicorn plotly mlxtend || exit 1
  make fashion-mnist >/dev/null
  cp /usr/share/datasets/fashion-mnist/*.gz .gpu/fashion-mnist/ 2>/dev/null || echo "no Fashion-MNIST: hpo skips"
  du -sh .gpu
  exit 0
fi

PY=${PYTHON:-}
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
site=""
if [ -d .gpu/whl ] && ! "$PY" -c "import optuna" 2>/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/gpu-site .gpu/whl/*.whl \
    && site=/tmp/gpu-site
fi
if [ -d .gpu/fashion-mnist ] && [ ! -e /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz ]; then
  mkdir -p /usr/share/datasets/fashion-mnist 2>/dev/null && cp .gpu/fashion-mnist/*.gz /usr/share/datasets/fashion-mnist/ 2>/dev/null
fi
export PYTHONPATH="$PWD/src${site:+:$site}${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 TRIDENS_DECISION_CACHE=off

if [ "$device" = cpu ]; then   # the dry run: the same parts, small enough for a 2-core CPU
  ks=1,4; size=tiny; graph_ks=1,4; scale=1
else
  ks=1,4,16,64; size=small; graph_ks=1,4,16,64; scale=1
fi

: > "$out"
started=$(date +%s)
part() {  # part NAME LIMIT COMMAND...: run it, its output to the screen and the file, stopped at LIMIT seconds
  local name=$1 limit=$(( $2 * scale )); shift 2
  local t0=$(date +%s)
  echo "=== $name (limit ${limit}s): $*" | tee -a "$out"
  timeout -k 10 "$limit" "$@" 2>&1 | tee -a "$out"
  local rc=${PIPESTATUS[0]}
  local took=$(( $(date +%s) - t0 ))
  case $rc in
    0) echo "=== $name: done in ${took}s" | tee -a "$out" ;;
    124|137) echo "=== $name: stopped at its time limit (${limit}s); the figures above are what finished" | tee -a "$out" ;;
    *) echo "=== $name: FAILED (exit $rc) after ${took}s" | tee -a "$out" ;;
  esac
}

{
  echo "gpu_check on $(hostname) at $(date -u +%FT%TZ), device $device, commit $(git rev-parse --short HEAD 2>/dev/null)"
  "$PY" -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, \
'|', torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no CUDA device')"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null
} 2>&1 | tee -a "$out"

part tests 110 env TRIDENS_TEST_DEVICE="$device" "$PY" -m pytest -p no:cacheprovider -m cuda -q -rs tests/cuda
part batching 110 "$PY" bench/batching.py --device "$device" --scenarios digits-mlp,digits-cnn,digits-cnn-pool \
  --ks "$ks" --reps 1 --modes sequential,fused
part headline-mlp 70 "$PY" bench/headline.py --device "$device" --workload mlp --size "$size" --rounds 1 \
  --systems tridens,tridens-noopt,optuna
if [ -e /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz ]; then
  part headline-hpo 70 "$PY" bench/headline.py --device "$device" --workload hpo --size "$size" --rounds 1 \
    --systems tridens,optuna
else
  echo "=== headline-hpo: skipped: no Fashion-MNIST (make fashion-mnist, or --prepare and carry .gpu)" | tee -a "$out"
fi
part graphs 35 "$PY" bench/cuda_graphs.py --device "$device" --ks "$graph_ks" --steps 30 --reps 3
if "$PY" -c "import ray" 2>/dev/null; then
  part fluid 45 "$PY" bench/fluid.py real --executor ray --device "$device" --rounds 1
else
  echo "=== fluid: skipped: Ray is not installed here (its wheel is larger than a device call carries)" | tee -a "$out"
fi
echo "=== gpu_check: $(( $(date +%s) - started ))s in all; figures in $out" | tee -a "$out"
