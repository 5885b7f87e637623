#!/usr/bin/env bash
# On an NVIDIA machine (a driver with libcuda, bare Python 3, this repo copied in): build a venv,
# check the GPU is seen, run the whole suite on cuda and the benchmarks. Logs go to $OUT (if set)
# or ./gpu-logs. Usage: bash tests/gpu/run_on_device.sh   (from anywhere; it cds to the repo)
set -u
cd "$(dirname "$0")/../.."
LOGS="${OUT:-$PWD/gpu-logs}"
mkdir -p "$LOGS"
PY="${PYTHON:-python3}"
exec > >(tee "$LOGS/run.log") 2>&1

echo "== machine"; date; nvidia-smi || echo "nvidia-smi: not found"
if [ ! -x .venv-gpu/bin/python ]; then
  "$PY" -m venv .venv-gpu || { echo "venv creation failed"; exit 1; }
fi
V=.venv-gpu/bin/python
$V -m pip install -q --upgrade pip
$V -m pip install -q -e '.[test]' || { echo "pip install failed"; exit 1; }

echo "== devices"
$V - <<'PYEOF' 2>&1 | tee "$LOGS/devices.txt"
import tilefuse as tx
devs, why = tx.devices(all=True)
print("devices:", devs)
print("unavailable:", why)
for d in devs:
    print(d, d.info)
PYEOF

echo "== smoke"
$V - <<'PYEOF' 2>&1 | tee "$LOGS/smoke.txt"
import numpy as np, time
import tilefuse as tx, tilefuse.numpy as tnp
x = np.random.default_rng(0).standard_normal((1024, 1024)).astype(np.float32)
f = tx.jit(lambda x: tnp.sum(tnp.exp(x) * 2 + 1, axis=1), device="cuda")
got = np.asarray(f(x)); ref = (np.exp(x) * 2 + 1).sum(axis=1)
print("max rel err", float(np.max(np.abs(got - ref) / np.abs(ref))))
t = time.perf_counter()
for _ in range(100): y = f(x)
tx.get_device("cuda").synchronize() if hasattr(tx, "get_device") else None
np.asarray(y); print("ms per call", (time.perf_counter() - t) * 10)
PYEOF

echo "== tests on cuda"
TILEFUSE_DEVICE=cuda TILEFUSE_TEST_DEVICES=cuda timeout 3000 $V -m pytest -q tests \
  -p no:cacheprovider --junitxml="$LOGS/junit.xml" 2>&1 | tee "$LOGS/pytest.txt" | tail -60
echo "pytest exit: ${PIPESTATUS[0]}"

echo "== benchmarks"
for b in benchmarks/bench_*.py; do
  echo "-- $b (cuda)"
  TILEFUSE_DEVICE=cuda timeout 600 $V "$b" 2>&1 | tee "$LOGS/$(basename "$b" .py).cuda.txt" | tail -30
  echo "-- $b (cpu, for the ratio)"
  TILEFUSE_DEVICE=cpu timeout 600 $V "$b" 2>&1 | tee "$LOGS/$(basename "$b" .py).cpu.txt" | tail -30
done
echo "== done"; date
