#!/usr/bin/env bash
# Device check for the NVML node agent, for a machine with an NVIDIA GPU and a bare python3.
# Installs the wheels found under .whl/ (pip if present, else by unpacking them, which is all a wheel install is),
# then runs the NVML backend for 10 s without Kafka. The JSON goes to stdout and, when $OUT is set, to
# $OUT/gpu-check.json (stderr to $OUT/gpu-check.err). Exits with gpu-check's status.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
site="${TMPDIR:-/tmp}/gpupool-site"
mkdir -p "$site"
if compgen -G ".whl/*.whl" >/dev/null; then
  if ! { python3 -m pip --version >/dev/null 2>&1 &&
         python3 -m pip install -q --no-index --find-links .whl --target "$site" .whl/*.whl; }; then
    for w in .whl/*.whl; do python3 -m zipfile -e "$w" "$site"; done
  fi
fi
export PYTHONPATH="$PWD:$site${PYTHONPATH:+:$PYTHONPATH}"
python3 --version
if command -v nvidia-smi >/dev/null; then nvidia-smi -L 2>&1; else echo "(no nvidia-smi)"; fi
args=(--seconds 10)
if [ -n "${OUT:-}" ]; then
  mkdir -p "$OUT"
  python3 -m agents.node.gpu_check "${args[@]}" --out "$OUT/gpu-check.json" 2>"$OUT/gpu-check.err"
  rc=$?
  cat "$OUT/gpu-check.err" >&2
else
  python3 -m agents.node.gpu_check "${args[@]}"
  rc=$?
fi
echo "gpu-check exit status: $rc"
exit $rc
