#!/usr/bin/env bash
# Readies here, on a machine with PyPI access, everything scripts/gpu_check.sh needs that the GPU
# machine's image lacks (it has no network; the image's python3 is 3.12 with torch 2.11+cu130):
#
#   .whl/         the wheels the check installs offline: trio, pytest-trio and what they need, a
#                 recent anyio, and libucx-cu12 (the UCX headers, so the ucx backend is compiled
#                 there too). ~45 MiB: it travels with the repo in the check's own call.
#   .nccl-parts/  an NCCL >= 2.30 wheel (two ranks on one GPU need it; torch 2.11 ships 2.28.9),
#                 cut into parts of at most 50 MiB: one call to the GPU machine carries at most
#                 64 MiB with the repo (~6 MiB), so the parts go one call each, to the same warm
#                 machine, before the check.
#
#     bash scripts/gpu_wheels.sh            # idempotent; prints the calls to make, in order
#
# The check then joins the parts (gpu_check.sh, step "nccl >= 2.30": $NCCL_PARTS, default
# /tmp/transport-nccl) and runs the NCCL tests with that library.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TARGET_PY=${GPU_PYTHON_VERSION:-3.12}  # the GPU image's Python
NCCL_PACKAGE=${GPU_NCCL_PACKAGE:-nvidia-nccl-cu13}  # CUDA 13, as the image's torch
NCCL_VERSION=${GPU_NCCL_VERSION:-2.32.6}
PART_MIB=50
export PIP_ROOT_USER_ACTION=ignore
for d in .whl .nccl-parts; do
    mkdir -p "$d"
    grep -qxF "/$d/" .git/info/exclude 2>/dev/null || echo "/$d/" >>.git/info/exclude
done

platforms=()
for n in 39 35 34 31 28 27 24 18 17; do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
platforms+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64)
get() {  # pip download --no-deps of exact pins for the GPU machine's Python
    "$PY" -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
        --python-version "$TARGET_PY" --implementation cp "${platforms[@]}" -d "$1" "${@:2}"
}

get .whl "trio>=0.27" "pytest-trio>=0.8" "outcome" "sniffio" "anyio>=4.11" "typing_extensions>=4.12" \
    "libucx-cu12>=1.18"
echo "gpu_wheels: .whl/ ($(du -sh .whl | cut -f1)):"
ls .whl

wheel=$(ls .nccl-parts/*.whl 2>/dev/null | head -n 1 || true)
if [ -z "$wheel" ]; then
    rm -f .nccl-parts/part-*
    get .nccl-parts "${NCCL_PACKAGE}==${NCCL_VERSION}"
    wheel=$(ls .nccl-parts/*.whl | head -n 1)
fi
if ! ls .nccl-parts/part-* >/dev/null 2>&1; then
    split -b "${PART_MIB}M" -d "$wheel" .nccl-parts/part-
    (cd .nccl-parts && sha256sum "$(basename "$wheel")" >wheel.sha256)
fi
parts=(.nccl-parts/part-*)
echo "gpu_wheels: $(basename "$wheel") in ${#parts[@]} parts of <= ${PART_MIB} MiB in .nccl-parts/"
cat <<EOF

To run the check on a lent GPU machine (one session, the machine kept warm: each call within
30 s of the last), make these calls with the device tool, from the repo root:
EOF
i=1
for p in "${parts[@]}"; do
    cat <<EOF
  $i. move only $(basename "$p") into .gpu-carry/ (mkdir -p .gpu-carry; echo /.gpu-carry/ >> .git/info/exclude), then
     run(carry=[".gpu-carry"], command="mkdir -p /tmp/transport-nccl && cp .gpu-carry/* /tmp/transport-nccl/ && ls -la /tmp/transport-nccl")
EOF
    i=$((i + 1))
done
cat <<EOF
  $i. leave only wheel.sha256 in .gpu-carry/ (rm .gpu-carry/*; cp .nccl-parts/wheel.sha256 .gpu-carry/), then
     run(carry=[".whl", ".gpu-carry"], timeout_s=600, command=
       "cp .gpu-carry/wheel.sha256 /tmp/transport-nccl/ && bash scripts/gpu_check.sh /tmp/gc;
        tar -C /tmp -czf \$OUT/gpu-check.tgz gc; cp /tmp/gc/*.md \$OUT/; true")
and commit what comes back under benchmarks/results/gpu-check-DATE-<gpu>/.
EOF
