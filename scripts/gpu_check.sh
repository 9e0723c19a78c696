#!/usr/bin/env bash
# The GPU check: the one command to run on a machine with an NVIDIA GPU, from the repo root:
#
#     bash scripts/gpu_check.sh [OUTDIR]      # default OUTDIR: benchmarks/results/gpu-check-DATE
#
# It records the machine (date, GPUs, driver, Python, torch), builds transport with its CUDA
# kernels (pip install -e ., offline), runs `python -m transport doctor`, every GPU test
# (pytest -m gpu over tests/, then the unmarked tests of test_cuda/test_kernels/test_nccl), the
# NCCL tests again with NCCL >= 2.30 and two ranks on one GPU (NCCL_MULTI_RANK_GPU_ENABLE=1:
# torch's own NCCL may be older), the GPU micro-benchmark (python -m benchmarks.gpu_bench) and
# the colocated weight-sync benchmark (python -m benchmarks.colocated), and prints a summary
# table last. Every step runs even when an earlier one failed; each is bounded in time, and the
# whole run by $GPU_CHECK_BUDGET_S (default 480 s: it must fit a lease of a few minutes).
#
# Needs no network: torch with CUDA must already be installed (it is never pip-installed here).
# What the machine lacks travels with the repo (scripts/gpu_wheels.sh readies it and prints the
# calls): Python wheels in $TRANSPORT_WHEELS (default .whl/ in the repo), installed offline; and
# an NCCL >= 2.30 wheel cut in parts, carried in earlier calls into $NCCL_PARTS (default
# /tmp/transport-nccl, with wheel.sha256), joined and checked here.
#
# Output: OUTDIR/gpu_check.log (everything), OUTDIR/summary.md (the table printed last),
# OUTDIR/pytest-*.xml, OUTDIR/gpu_bench.{json,md}, OUTDIR/colocated.{json,md}.
# Exit status: 0 every step passed, 1 a step failed, 2 no usable CUDA GPU (nothing was run).
#
# Environment: PYTHON (default python3), GPU_CHECK_BUDGET_S, GPU_CHECK_TEST_TIMEOUT_S (per test,
# default 150), TRANSPORT_WHEELS, NCCL_PARTS. Steps that are shell functions run in a child bash,
# so what they read is exported.
set -u -o pipefail

cd "$(dirname "$0")/.." || exit 1
ROOT=$(pwd)
PY=${PYTHON:-python3}
OUT=${1:-benchmarks/results/gpu-check-$(date +%F)}
mkdir -p "$OUT" || { echo "gpu_check: cannot create $OUT" >&2; exit 1; }
OUT=$(cd "$OUT" && pwd)
LOG=$OUT/gpu_check.log
STEPS=$OUT/steps.tsv
: >"$LOG"
: >"$STEPS"
BUDGET=${GPU_CHECK_BUDGET_S:-480}
TEST_TIMEOUT=${GPU_CHECK_TEST_TIMEOUT_S:-150}
WHEELS=${TRANSPORT_WHEELS:-$ROOT/.whl}
NCCL_PARTS=${NCCL_PARTS:-/tmp/transport-nccl}
NCCL_LIB=$NCCL_PARTS/lib/libnccl.so.2
STARTED=$(date +%s)
FAILED=0

export PY OUT WHEELS NCCL_PARTS NCCL_LIB
export PYTHONUNBUFFERED=1
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PIP_ROOT_USER_ACTION=ignore PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1
# Checked with torch's default allocator: expandable segments cannot be exported over legacy
# CUDA IPC (tests/gpu/test_cuda.py checks that error in a process of its own).
ALLOC_CONF_NOTE=""
if [ -n "${PYTORCH_CUDA_ALLOC_CONF:-}" ]; then
    ALLOC_CONF_NOTE="PYTORCH_CUDA_ALLOC_CONF=$PYTORCH_CUDA_ALLOC_CONF was set; unset for this run"
    unset PYTORCH_CUDA_ALLOC_CONF
fi

say() { printf '%s\n' "$@" | tee -a "$LOG"; }
elapsed() { echo $(($(date +%s) - STARTED)); }

# step NAME LIMIT_S RESERVE_S [--quiet] CMD...: runs CMD (a program or a function of this
# script) with a time limit of LIMIT_S, or less so that RESERVE_S seconds of the budget stay for
# the steps after it. Output goes to the log, and to the terminal unless --quiet (then only its
# last lines, on failure). Records the result in $STEPS; never stops the script.
step() {
    local name=$1 limit=$2 reserve=$3
    shift 3
    local quiet=0
    if [ "${1:-}" = "--quiet" ]; then quiet=1; shift; fi
    local left=$((BUDGET - $(elapsed) - reserve))
    if [ "$left" -lt "$limit" ]; then limit=$left; fi
    if [ "$limit" -lt 5 ]; then
        say "" "==> $name: SKIPPED, the time budget (${BUDGET}s) is spent"
        printf '%s\t%s\t%s\n' "$name" "SKIPPED (time budget)" 0 >>"$STEPS"
        FAILED=1
        return 1
    fi
    say "" "==> $name (limit ${limit}s): $*"
    local cmd=("$@")
    if declare -F "$1" >/dev/null; then
        # timeout runs programs, not shell functions: run the function in a child bash.
        export -f "$1"
        cmd=(bash -c '"$@"' "$1" "$@")
    fi
    local t0 rc
    t0=$(date +%s)
    if [ "$quiet" = 1 ]; then
        timeout --kill-after=15 "$limit" "${cmd[@]}" >>"$LOG" 2>&1 </dev/null
        rc=$?
    else
        timeout --kill-after=15 "$limit" "${cmd[@]}" 2>&1 </dev/null | tee -a "$LOG"
        rc=${PIPESTATUS[0]}
    fi
    local took=$(($(date +%s) - t0)) status
    case $rc in
        0) status=ok ;;
        124 | 137) status="TIMEOUT after ${limit}s" ;;
        *) status="FAILED (exit $rc)" ;;
    esac
    if [ "$rc" != 0 ] && [ "$quiet" = 1 ]; then
        echo "--- last lines of the log ($LOG) ---"
        tail -n 40 "$LOG"
    fi
    say "<== $name: $status (${took}s)"
    printf '%s\t%s\t%s\n' "$name" "$status" "$took" >>"$STEPS"
    if [ "$rc" != 0 ]; then FAILED=1; fi
    return 0
}

steps_table() {
    printf '| step | result | seconds |\n| --- | --- | --- |\n'
    while IFS=$'\t' read -r n s t; do printf '| %s | %s | %s |\n' "$n" "$s" "$t"; done <"$STEPS"
}

# ---- the machine ------------------------------------------------------------------------------

say "gpu_check: $(date -Is) on $(hostname) ($(uname -sr)), output in $OUT"
if command -v git >/dev/null 2>&1 && git rev-parse --git-dir >/dev/null 2>&1; then
    say "commit: $(git rev-parse --short HEAD 2>/dev/null)$(git diff --quiet 2>/dev/null || echo ' (with uncommitted changes)')"
fi
if [ -n "$ALLOC_CONF_NOTE" ]; then say "note: $ALLOC_CONF_NOTE"; fi
if command -v nvidia-smi >/dev/null 2>&1; then
    say "nvidia-smi -L:"
    nvidia-smi -L 2>&1 | sed 's/^/  /' | tee -a "$LOG"
    say "driver: $(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>&1 | head -n 1)"
else
    say "nvidia-smi: not found"
fi
NVCC=$(command -v nvcc 2>/dev/null || true)
if [ -z "$NVCC" ] && [ -x /usr/local/cuda/bin/nvcc ]; then NVCC=/usr/local/cuda/bin/nvcc; fi
if [ -n "$NVCC" ]; then
    say "nvcc: $NVCC ($("$NVCC" --version 2>&1 | grep -o 'release [0-9.]*' | head -n 1))"
else
    say "nvcc: not found on PATH or in /usr/local/cuda/bin (the CUDA kernels will be built out)"
fi
say "python: $(command -v "$PY" 2>/dev/null || echo "$PY: not found") $("$PY" -c 'import platform; print(platform.python_version())' 2>&1)"

TORCH_INFO=$("$PY" - 2>&1 <<'PYEOF'
import os, sys
try:
    import torch
except Exception as exc:
    print(f"STOP: cannot import torch ({type(exc).__name__}: {exc}); install torch with CUDA first")
    sys.exit(3)
print(f"torch {torch.__version__}, built with CUDA {torch.version.cuda}")
if torch.version.cuda is None:
    print(f"STOP: torch {torch.__version__} is a CPU-only build (no CUDA); this check needs torch with CUDA")
    sys.exit(4)
if not torch.cuda.is_available():
    print("STOP: torch sees no usable CUDA GPU (driver missing or no device visible; "
          f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r})")
    sys.exit(5)
for i in range(torch.cuda.device_count()):
    p = torch.cuda.get_device_properties(i)
    print(f"cuda:{i}: {p.name}, {p.total_memory / 2**30:.1f} GiB, {p.multi_processor_count} SMs, capability {p.major}.{p.minor}")
PYEOF
)
TORCH_RC=$?
say "$TORCH_INFO"
if [ "$TORCH_RC" != 0 ]; then
    STOP_REASON=$(printf '%s\n' "$TORCH_INFO" | grep '^STOP: ' | head -n 1 | sed 's/^STOP: //')
    STOP_REASON=${STOP_REASON:-$(printf '%s\n' "$TORCH_INFO" | tail -n 1)}
    {
        echo ""
        echo "## gpu_check summary ($(date -Is))"
        echo ""
        echo "gpu_check: no usable CUDA GPU here: ${STOP_REASON:-the torch check failed}."
        echo "Nothing was built, tested or measured: run this on a machine with an NVIDIA GPU and torch with CUDA."
    } >"$OUT/summary.md"
    tee -a "$LOG" <"$OUT/summary.md"
    exit 2
fi

# ---- steps ------------------------------------------------------------------------------------

check_deps() {
    # Every carried wheel goes in (without its dependencies, over the image's version: the
    # image's anyio, say, may be older than transport needs); then what is still missing is named.
    if [ -d "$WHEELS" ] && ls "$WHEELS"/*.whl >/dev/null 2>&1; then
        echo "installing the wheels in $WHEELS (offline): $(cd "$WHEELS" && ls ./*.whl | tr '\n' ' ')"
        "$PY" -m pip install --quiet --no-index --no-deps --upgrade "$WHEELS"/*.whl || return 1
    fi
    local missing
    missing=$("$PY" -c '
import importlib.util
need = {"trio": "trio", "anyio": "anyio", "pytest": "pytest", "pytest_trio": "pytest-trio", "pytest_timeout": "pytest-timeout",
        "outcome": "outcome", "sniffio": "sniffio", "nanobind": "nanobind", "scikit_build_core": "scikit-build-core"}
print(" ".join(dist for mod, dist in need.items() if importlib.util.find_spec(mod) is None))
') || return 1
    if [ -z "$missing" ]; then
        echo "every Python package the build and the tests need is installed"
        return 0
    fi
    echo "missing Python packages: $missing"
    echo "carry them as wheels: on a machine with pip access, from the repo root, bash scripts/gpu_wheels.sh"
    return 1
}

# The NCCL >= 2.30 wheel carried in parts (scripts/gpu_wheels.sh): joined, its sha256 checked,
# and its libnccl.so.2 extracted to $NCCL_LIB.
nccl_join() {
    "$PY" - "$NCCL_PARTS" <<'PYEOF'
import hashlib, pathlib, sys, zipfile
folder = pathlib.Path(sys.argv[1])
lib = folder / "lib" / "libnccl.so.2"
if lib.exists():
    print(f"{lib} is there already")
    sys.exit(0)
parts = sorted(folder.glob("part-*"))
sums = folder / "wheel.sha256"
if not parts or not sums.exists():
    print(f"no NCCL wheel parts and wheel.sha256 in {folder}: carry them first (scripts/gpu_wheels.sh prints the calls)")
    sys.exit(1)
digest, name = sums.read_text().split()[:2]
joined = folder / name
h = hashlib.sha256()
with joined.open("wb") as out:
    for part in parts:
        data = part.read_bytes()
        h.update(data)
        out.write(data)
if h.hexdigest() != digest:
    print(f"the {len(parts)} parts joined give sha256 {h.hexdigest()}, not {name}'s {digest}: a part is missing or damaged")
    sys.exit(1)
with zipfile.ZipFile(joined) as z:
    lib.parent.mkdir(exist_ok=True)
    lib.write_bytes(z.read("nvidia/nccl/lib/libnccl.so.2"))
print(f"joined {len(parts)} parts into {name} (sha256 checked); {lib}")
PYEOF
}

# The NCCL tests with that library: LD_PRELOAD makes torch's own libnccl.so.2 the same one (two
# NCCLs in one process must be avoided), and two ranks may share the one GPU.
nccl_tests() {
    if [ ! -f "$NCCL_LIB" ]; then
        echo "no NCCL >= 2.30 library at $NCCL_LIB (see the step before): the two-process tests on one GPU cannot run"
        return 1
    fi
    LD_PRELOAD="$NCCL_LIB" TRANSPORT_NCCL_LIB="$NCCL_LIB" NCCL_MULTI_RANK_GPU_ENABLE=1 \
        "$PY" -m pytest -m gpu "$@" --junitxml="$OUT/pytest-nccl.xml" tests/backends/test_nccl.py \
        tests/gpu/test_relays_cuda.py
}

kernels_built() {
    "$PY" -c '
import sys
try:
    import transport._C as c
except Exception as exc:
    print(f"transport._C does not import: {type(exc).__name__}: {exc}")
    sys.exit(1)
f = getattr(c, "kernels_image", None)
print("kernels built: unknown (this build has no kernels_image())" if f is None else f"kernels built: {f() is not None}")
'
}

# The rest of the three GPU files (tests not marked gpu, e.g. CPU references), so that every
# test in them runs, marked or not. pytest exits 5 when nothing is left to run: that is fine.
run_unmarked() {
    "$PY" -m pytest -m "not gpu" "$@" --junitxml="$OUT/pytest-files.xml"
    local rc=$?
    if [ "$rc" = 5 ]; then echo "(no unmarked tests in these files)"; return 0; fi
    return "$rc"
}

# RESERVE_S of each step: the minimum kept for the steps after it (build 40, kernels 5, doctor
# 10, gpu tests 120, nccl 60, other tests 20, gpu_bench 60, colocated 120, summary 5 s).
step "python packages" 60 380 check_deps

step "build (pip install -e ., offline)" 180 360 --quiet \
    "$PY" -m pip install -v --no-index --no-build-isolation --no-deps -e .
grep -E "transport: (transfer kernels|ucx backend|the ucx backend|UCX headers)" "$LOG" | sed 's/^[ -]*/  /' | sort -u || true

step "kernels" 30 355 kernels_built

step "doctor" 60 345 "$PY" -m transport doctor

PYTEST_ARGS=(-v -rfEs -p no:cacheprovider)
if "$PY" -c "import pytest_timeout" >/dev/null 2>&1; then
    PYTEST_ARGS+=(--timeout="$TEST_TIMEOUT")
else
    say "note: pytest-timeout is missing: tests run without a per-test timeout (each step is still bounded)"
fi

# Every GPU-marked test in tests/ (a file that fails to import does not stop the others).
step "pytest -m gpu tests/" 240 225 \
    "$PY" -m pytest -m gpu "${PYTEST_ARGS[@]}" --continue-on-collection-errors --junitxml="$OUT/pytest-gpu.xml" tests/

step "nccl >= 2.30 (join the carried wheel)" 60 220 nccl_join
step "pytest -m gpu test_nccl.py, test_relays_cuda.py (NCCL >= 2.30, two ranks on one GPU)" 200 200 nccl_tests \
    "${PYTEST_ARGS[@]}"

FILES=()
for f in tests/gpu/test_cuda.py tests/gpu/test_kernels.py tests/backends/test_nccl.py; do
    if [ -f "$f" ]; then FILES+=("$f"); else say "note: $f does not exist (yet)"; fi
done
if [ "${#FILES[@]}" -gt 0 ]; then
    step "pytest -m 'not gpu' ${FILES[*]}" 90 180 run_unmarked "${PYTEST_ARGS[@]}" "${FILES[@]}"
fi

step "benchmark (python -m benchmarks.gpu_bench)" 120 120 \
    "$PY" -m benchmarks.gpu_bench --json "$OUT/gpu_bench.json" --markdown "$OUT/gpu_bench.md"

step "benchmark (python -m benchmarks.colocated)" 150 5 \
    "$PY" -m benchmarks.colocated --run-timeout 140 --json "$OUT/colocated.json" --markdown "$OUT/colocated.md"

# ---- summary ----------------------------------------------------------------------------------

summarize() {
    "$PY" - "$OUT" <<'PYEOF'
import json, sys
import xml.etree.ElementTree as ET
from pathlib import Path

out = Path(sys.argv[1])
files: dict[str, dict[str, int]] = {}
failures: list[str] = []
for xml in ("pytest-gpu.xml", "pytest-nccl.xml", "pytest-files.xml"):
    path = out / xml
    if not path.exists():
        continue
    try:
        root = ET.parse(path).getroot()
    except ET.ParseError as exc:
        print(f"({xml} is unreadable: {exc})")
        continue
    for case in root.iter("testcase"):
        cls, name = case.get("classname", ""), case.get("name", "")
        parts = (cls or name).split(".")  # a collection error has no class name
        while len(parts) > 1 and not parts[-1].startswith("test"):
            parts.pop()  # a test class
        key = "/".join(parts) + ".py" + (" (NCCL >= 2.30, multi-rank)" if xml == "pytest-nccl.xml" else "")
        if case.find("failure") is not None:
            status = "failed"
        elif case.find("error") is not None:
            status = "errors"
        elif case.find("skipped") is not None:
            status = "skipped"
        else:
            status = "passed"
        row = files.setdefault(key, {"passed": 0, "failed": 0, "errors": 0, "skipped": 0})
        row[status] += 1
        if status in ("failed", "errors"):
            failures.append(f"{key}::{name} ({'error' if status == 'errors' else 'failed'})")

print("| test file | passed | failed | errors | skipped |")
print("| --- | --- | --- | --- | --- |")
total = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
for key in sorted(files):
    r = files[key]
    for k in total:
        total[k] += r[k]
    print(f"| {key} | {r['passed']} | {r['failed']} | {r['errors']} | {r['skipped']} |")
print(f"| all | {total['passed']} | {total['failed']} | {total['errors']} | {total['skipped']} |")
if not files:
    print("(no test results: pytest did not run or wrote no report)")
for f in failures[:20]:
    print(f"- {f}")
if len(failures) > 20:
    print(f"- ... and {len(failures) - 20} more (see gpu_check.log)")

print()
def size(n: int) -> str:
    for unit, nm in ((1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")):
        if n >= unit and n % unit == 0:
            return f"{n // unit} {nm}"
    return f"{n} B"


bench = out / "gpu_bench.json"
try:
    b = json.loads(bench.read_text())
except (OSError, ValueError) as exc:
    print(f"gpu_bench: no results ({bench.name}: {exc})")
    b = None
if b is not None:
    print(f"gpu_bench on {b.get('gpu')} (driver {b.get('driver')}, torch {b.get('torch')}, {b.get('date')}):")
    print("| op | size | transport GB/s | baseline | baseline GB/s | ratio |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in b.get("rows", []):
        print(f"| {r['op']} | {size(r['size'])} | {r['gbps']:.1f} | {r['baseline']} copy_ | {r['baseline_gbps']:.1f} | {r['ratio']:.2f} |")
    if b.get("error"):
        print(f"gpu_bench error: {b['error']}")
    print()
    print("| target | measured | bar | met |")
    print("| --- | --- | --- | --- |")
    for t in b.get("targets", []):
        value = "not measured" if t["value"] is None else f"{t['value']:.3g}"
        met = "not measured" if t["met"] is None else ("yes" if t["met"] else "NO")
        print(f"| {t['what']} | {value} | {t['bar']} | {met} |")

print()
col = out / "colocated.md"
if col.exists():
    print(col.read_text())
else:
    print("colocated: no results (colocated.md is missing)")
PYEOF
}

{
    echo ""
    echo "## gpu_check summary ($(date -Is), $(elapsed) s)"
    echo ""
    steps_table
    echo ""
    summarize || echo "(the tests and benchmark could not be summarised: see $LOG)"
    echo ""
    if [ "$FAILED" = 0 ]; then echo "gpu_check: every step passed"; else echo "gpu_check: SOME STEPS FAILED (see above and $LOG)"; fi
} >"$OUT/summary.md" 2>&1
tee -a "$LOG" <"$OUT/summary.md"
exit "$FAILED"
