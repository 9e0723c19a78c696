#!/usr/bin/env bash
# Checks that every csrc/ source includes the C++ standard headers it uses, with
# include-what-you-use (Debian: `apt-get install iwyu`). A standard header that one library
# version pulls in by accident (gcc 12's <string> brings <stdexcept>) is missing under another
# (newer libstdc++), where the build then fails: IWYU names each such header for every file.
#
#     bash scripts/check_includes.sh          # exit 0: nothing missing; 1: missing headers listed
#
# Only IWYU's suggestions of standard library headers count (`#include <name>`: no directory, no
# extension, so not <bits/...>, <ucp/...>, "local.h" or <emmintrin.h>); its other suggestions
# (forward declarations, project and third-party headers) are its taste, not a portability bug.
# Each .cpp is analysed with the header of the same name, as IWYU does; a header without a .cpp
# of its own (delta_detail.h, the delta units' shared internals) is analysed in every .cpp that
# includes it. The CUDA kernels (.cu) are compiled by nvcc, which IWYU cannot parse.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
IWYU=${IWYU:-include-what-you-use}
if ! command -v "$IWYU" >/dev/null 2>&1; then
    echo "check_includes: $IWYU is not installed (Debian/Ubuntu: apt-get install iwyu)" >&2
    exit 1
fi
if ! nb=$("$PY" -m nanobind --include_dir 2>/dev/null); then
    echo "check_includes: nanobind is not importable by $PY (pip install nanobind, or the dev extra)" >&2
    exit 1
fi
py_inc=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')
flags=(-std=c++17 -I"$nb" -isystem "$py_inc" -Xiwyu --no_fwd_decls)
# The ucx sources compile against UCX's headers (the libucx-cu12 wheel); without them they are
# checked with TRANSPORT_HAVE_UCX undefined, which leaves them out of module.cpp only.
if ucx_inc=$("$PY" -c 'import libucx, os; print(os.path.join(os.path.dirname(libucx.__file__), "include"))' 2>/dev/null) \
        && [ -f "$ucx_inc/ucp/api/ucp.h" ]; then
    flags+=(-isystem "$ucx_inc" -DTRANSPORT_HAVE_UCX=1)
else
    echo "check_includes: no UCX headers (pip install libucx-cu12): csrc/ucx_*.cpp are not checked" >&2
fi
for hdr in csrc/*.h; do
    [ -f "${hdr%.h}.cpp" ] || flags+=(-Xiwyu "--check_also=$hdr")
done
missing=0
checked=0
reported=""
for src in csrc/*.cpp; do
    case "$src" in
        csrc/ucx_*) [[ " ${flags[*]} " == *" -DTRANSPORT_HAVE_UCX=1 "* ]] || continue ;;
    esac
    out=$("$IWYU" "${flags[@]}" "$src" 2>&1)
    # IWYU's exit status is not a verdict (it is non-zero whenever it suggests anything), but a
    # file it could not parse must not pass as clean.
    if grep -q "error:" <<<"$out"; then
        echo "check_includes: include-what-you-use could not analyse $src:" >&2
        grep "error:" <<<"$out" | head -5 >&2
        missing=1
        continue
    fi
    checked=$((checked + 1))
    # "<file> should add these lines:" then one #include per line, up to a blank line.
    found=$(awk '
        / should add these lines:$/ { file = $1; adding = 1; next }
        /^$/ { adding = 0 }
        adding && /^#include <[a-z_0-9]+>/ { sub(/[ \t]+\/\/.*/, ""); print file ": " $0 }
    ' <<<"$out")
    if [ -n "$found" ]; then
        reported+="$found"$'\n'
        missing=1
    fi
done
# A shared header's findings come once per source that includes it.
[ -z "$reported" ] || printf '%s' "$reported" | sort -u
if [ "$missing" -ne 0 ]; then
    echo "check_includes: standard headers are missing (above): include each one in the file named" >&2
    exit 1
fi
echo "check_includes: $checked sources in csrc/ include every standard header they use ($("$IWYU" --version | head -1))"
