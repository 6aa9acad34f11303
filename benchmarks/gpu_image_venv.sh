#!/usr/bin/env bash
# gpu_session.sh's CPU dry run in a venv pinned to the GPU image's versions (issue 54 part 6).
#
# The one GPU session has no second try, so a library API that moved between the versions we
# develop against and the image's (torch, transformers, sentence-transformers, tokenizers, numpy)
# must break here first. From the checkout root:
#
#   bash benchmarks/gpu_image_venv.sh            # builds the venv once (about 1 min), then the dry run (about 40 s)
#   OUT=/tmp/gpu-image-try SURGE_IMAGE_VENV=/tmp/my-venv bash benchmarks/gpu_image_venv.sh
#
# The pins, and the ones this machine cannot match (Python 3.11 for 3.12, torch 2.13.0 CPU for 2.11.0
# CUDA, numpy 2.4.6 for 2.5.2) with the reason, are in benchmarks/gpu_image.txt. The venv is rebuilt
# when that file changes. Python 3.12 still parses the package and the benchmarks (syntax drift).
# The dry run is `SURGE_GPU_TRY=1 bash benchmarks/gpu_session.sh` with the venv first on PATH and
# this checkout on PYTHONPATH; results land in $OUT. Exit status: 0 when every stage ended ok or
# skipped; 4 when the venv could not be built (no package index, a pin not found); else the
# dry run's own status, or 1 when a stage failed.
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PINS="$ROOT/benchmarks/gpu_image.txt"
VENV=${SURGE_IMAGE_VENV:-/tmp/surge-gpu-image-venv}
OUT=${OUT:-/tmp/surge-gpu-image-try}
PY=${SURGE_IMAGE_PYTHON:-}
PY312=${SURGE_IMAGE_PY312:-}
for p in "$PY" /root/.pyenv/versions/3.11.7/bin/python "$(command -v python3.11 || true)"; do
  if [ -n "$p" ] && [ -x "$p" ]; then PY=$p; break; fi
done
for p in "$PY312" /root/.pyenv/versions/3.12.1/bin/python "$(command -v python3.12 || true)"; do
  if [ -n "$p" ] && [ -x "$p" ]; then PY312=$p; break; fi
done
if [ -z "$PY" ]; then
  echo "gpu_image_venv: no Python 3.11 to build the venv with (set SURGE_IMAGE_PYTHON)" >&2
  exit 4
fi

STAMP="$(sha256sum "$PINS" | cut -c1-16) $("$PY" -c 'import platform; print(platform.python_version())')"
if [ "$(cat "$VENV/.surge-pins" 2> /dev/null)" != "$STAMP" ]; then
  echo "== building $VENV with $PY from $PINS"
  rm -rf "$VENV"
  pip_q() {  # pip install, quiet, less the index's "Location ... is ignored" warnings
    "$VENV/bin/python" -m pip install -q "$@" 2>&1 | grep -v "^WARNING: Location"
    return "${PIPESTATUS[0]}"
  }
  build() {
    "$PY" -m venv "$VENV" &&
    # the CPU torch first: anything else resolves to a CUDA build of several GB
    pip_q torch==2.13.0 &&
    pip_q -r "$PINS" pytest pytest-timeout hypothesis &&
    pip_q -e "$ROOT" -c "$PINS"
  }
  if ! build; then
    echo "gpu_image_venv: could not build the venv (see pip's message above)" >&2
    rm -rf "$VENV"
    exit 4
  fi
  echo "$STAMP" > "$VENV/.surge-pins"
  echo "$ROOT" > "$VENV/.surge-root"
fi
if [ "$(cat "$VENV/.surge-root" 2> /dev/null)" != "$ROOT" ]; then  # another checkout: point the install here
  "$VENV/bin/python" -m pip install -q --no-deps -e "$ROOT" 2>&1 | grep -v "^WARNING: Location"
  echo "$ROOT" > "$VENV/.surge-root"
fi

# what the venv holds against the pins: one line each, "=" when it matches, "!= want" when it does not
"$VENV/bin/python" - "$PINS" << 'EOF'
import platform, sys
from importlib.metadata import version
want = dict(line.split("#")[0].strip().split("==") for line in open(sys.argv[1]) if "==" in line.split("#")[0])
got = {name: version(name) for name in want}
print("== venv: python", platform.python_version(), "(image: 3.12)")
for name in want:
    print(f"   {name} {got[name]}" + ("" if got[name].split("+")[0] == want[name] else f" != {want[name]}"))
bad = [n for n in want if got[n].split("+")[0] != want[n]]
sys.exit(f"gpu_image_venv: the venv does not hold the pins {bad}" if bad else 0)
EOF
[ $? -eq 0 ] || exit 4

if [ -n "$PY312" ]; then  # the image's Python: does it parse everything the session imports?
  "$PY312" - "$ROOT" << 'EOF' || exit 1
import ast, pathlib, platform, sys
root = pathlib.Path(sys.argv[1])
files = [*(root / "dask_surge").rglob("*.py"), *(root / "benchmarks").glob("*.py"), *(root / "tests").glob("*.py")]
for f in files:
    ast.parse(f.read_text(encoding="utf-8"), str(f))
print(f"== Python {platform.python_version()} parses {len(files)} files of the package, benchmarks and tests")
EOF
fi

cd "$ROOT" || exit 1
rm -rf "$OUT"
T0=$(date +%s)
PATH="$VENV/bin:$PATH" PYTHONPATH="$ROOT" SURGE_GPU_TRY=1 OUT="$OUT" bash benchmarks/gpu_session.sh > /dev/null 2>&1
RC=$?
echo "== dry run in the pinned venv: rc $RC, $(( $(date +%s) - T0 )) s; results in $OUT/results.jsonl"
"$VENV/bin/python" - "$OUT/results.jsonl" "$RC" << 'EOF'
import json, sys
lines = [json.loads(line) for line in open(sys.argv[1])] if sys.argv[1] else []
final = {r["stage"]: r for r in lines if r["status"] != "partial"}
bad = []
for name, r in final.items():
    why = r.get("reason") or (r.get("error") or "").strip().splitlines()[-1:] or ""
    print(f"   {name:14s} {r['status']:8s} {str(r.get('loaded_by', '')):12s} {str(why)[:160]}")
    if r["status"] not in ("ok", "skipped", "start", "done"):
        bad.append(name)
sys.exit(1 if bad or int(sys.argv[2]) else 0)
EOF
