"""The ``nccl.h`` of every NCCL release series transport loads, for the config-layout test.

Each header is read out of its ``nvidia-nccl-cu*`` wheel on PyPI with HTTP range requests (the zip's
directory and the one member: ~100 KB of a ~300 MB wheel) and cached under
``build/nccl-headers/<package>-<version>/nccl.h``. The test command (``scripts/test.sh``) runs

    python -m tests._support.nccl_headers

before the tests; it fetches only what the cache lacks, and the test fails, naming this command,
when a header is missing.
"""

from __future__ import annotations

import io
import re
import sys
import urllib.request
import zipfile
from pathlib import Path

from tests._support import ROOT

INDEX = "https://pypi.org/simple"
CACHE = ROOT / "build" / "nccl-headers"
MEMBER = "nvidia/nccl/include/nccl.h"
# The newest patch of each minor series from 2.27 (commName) on, and the cu13 build torch 2.11 ships.
VERSIONS = [
    ("nvidia-nccl-cu12", "2.27.7"),
    ("nvidia-nccl-cu12", "2.28.9"),
    ("nvidia-nccl-cu12", "2.29.7"),
    ("nvidia-nccl-cu12", "2.30.7"),
    ("nvidia-nccl-cu12", "2.31.2"),
    ("nvidia-nccl-cu12", "2.32.3"),
    ("nvidia-nccl-cu13", "2.28.9"),
]
_TIMEOUT_S = 60


def path_of(package: str, version: str) -> Path:
    return CACHE / f"{package}-{version}" / "nccl.h"


class _RangeFile(io.RawIOBase):
    """A read-only, seekable view of a file over HTTP range requests (what zipfile needs)."""

    def __init__(self, url: str) -> None:
        self._url = url
        self._pos = 0
        with urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=_TIMEOUT_S) as r:
            self._size = int(r.headers["Content-Length"])

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, b: bytearray | memoryview) -> int:  # type: ignore[override]
        end = min(self._size, self._pos + len(b)) - 1
        if end < self._pos:
            return 0
        req = urllib.request.Request(self._url, headers={"Range": f"bytes={self._pos}-{end}"})
        with urllib.request.urlopen(req, timeout=_TIMEOUT_S) as r:
            data = r.read()
        if r.status != 206 or len(data) != end - self._pos + 1:
            raise OSError(f"{self._url}: the server did not answer the range request")
        b[: len(data)] = data
        self._pos += len(data)
        return len(data)


def _wheel_url(package: str, version: str) -> str:
    with urllib.request.urlopen(f"{INDEX}/{package}/", timeout=_TIMEOUT_S) as r:
        html = r.read().decode()
    wheel = re.escape(package.replace("-", "_")) + "-" + re.escape(version) + r"-[^\"#]*x86_64\.whl"
    found = re.findall(r'href="([^"]*/' + wheel + r')(?:#[^"]*)?"', html)
    if not found:
        raise OSError(f"no x86_64 wheel of {package} {version} on {INDEX}")
    return str(found[0])


def fetch(package: str, version: str) -> Path:
    """The cached header of ``package`` ``version``, read from its wheel when not cached yet."""
    path = path_of(package, version)
    if path.exists():
        return path
    with zipfile.ZipFile(io.BufferedReader(_RangeFile(_wheel_url(package, version)), 1 << 20)) as z:
        data = z.read(MEMBER)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(data)
    tmp.replace(path)
    return path


def main() -> int:
    for package, version in VERSIONS:
        try:
            fetch(package, version)
        except OSError as exc:
            print(f"nccl_headers: {package} {version}: {exc}", file=sys.stderr)
            return 1
    print(f"nccl_headers: {len(VERSIONS)} headers in {CACHE.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
