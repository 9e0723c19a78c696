"""The point-to-point benchmark's headline rows and its peers (``python -m transport bench --peers
nixl,mooncake``), run as real processes with tiny settings.

Whatever ``--sizes`` says, a run reports the 8 B and 4 KiB latencies, the 1 MiB put and one batch of
10,000 x 4 KiB segments. With ``--peers nixl`` it measures NIXL the same way (UCX backend, DRAM, its
own target process), with ``--peers mooncake`` Mooncake Transfer Engine (TCP transport, DRAM, its own
target process); the bench itself checks the bytes each reads back, and prints the ratios. Without a
peer installed it says so in one line and the rest of the run stands. CI installs neither, so the
side-by-side tests run where they are installed by hand. No timings are asserted.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
TIMEOUT_S = 120
TINY = ("--backends", "ipc", "--sizes", "64KiB", "--iters", "2", "--latency-iters", "20")

# A real process in which no NIXL or Mooncake module can be imported, whatever is installed here.
_WITHOUT_PEERS = (
    "import sys\n"
    "for name in ('nixl', 'nixl_cu12', 'nixl_cu13', 'mooncake'):\n"
    "    sys.modules[name] = None\n"
    "from transport.__main__ import main\n"
    "sys.exit(main(sys.argv[1:]))\n"
)


def _nixl_installed() -> bool:
    # find_spec on the top-level names only: it imports nothing of NIXL into this process.
    return any(importlib.util.find_spec(name) is not None for name in ("nixl", "nixl_cu12", "nixl_cu13"))


def _mooncake_installed() -> bool:
    return importlib.util.find_spec("mooncake") is not None


def _bench(tmp_path: Path, *args: str, without_peers: bool = False) -> tuple[str, dict[str, Any]]:
    """Runs the bench with ``args``; returns its stdout and its JSON."""
    out = tmp_path / "bench.json"
    prefix = ["-c", _WITHOUT_PEERS] if without_peers else ["-m", "transport"]
    cmd = [sys.executable, *prefix, "bench", *args, "--json", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S, cwd=REPO)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout, json.loads(out.read_text())


def _check_latency(rows: list[dict[str, Any]], ops: set[str]) -> None:
    assert {(x["op"], x["nbytes"]) for x in rows if not x["variant"]} == {(op, n) for op in ops for n in (8, 4096)}
    for x in rows:
        assert x["iters"] == 20 and 0 < x["median_us"] <= x["p99_us"], x


def _check_sizes(rows: list[dict[str, Any]]) -> None:
    assert [x["size"] for x in rows] == [64 << 10, 1 << 20]  # 1 MiB always, though not asked for
    for x in rows:
        for key in ("put_gbps", "get_gbps", "memcpy_gbps", "put_ratio", "get_ratio"):
            assert x[key] > 0, (x, key)


def test_headline_rows_and_missing_peers_in_one_line_each(tmp_path: Path) -> None:
    stdout, data = _bench(tmp_path, *TINY, "--peers", "nixl,mooncake", without_peers=True)

    for text in ("latency put 8 B", "latency put 4 KiB", "latency get 4 KiB", "batch of 10000 x 4 KiB", "1 MiB |"):
        assert text in stdout, text
    [line] = [x for x in stdout.splitlines() if x.startswith("nixl:")]
    assert line.startswith("nixl: not installed (pip install nixl-cu12"), line
    [line] = [x for x in stdout.splitlines() if x.startswith("mooncake:")]
    assert line.startswith("mooncake: not installed (pip install mooncake-transfer-engine-non-cuda"), line

    assert data["schema"] == 2 and data["config"]["latency_sizes"] == [8, 4096]
    ipc = data["backends"]["ipc"]
    _check_sizes(ipc["sizes"])
    _check_latency(ipc["latency"], {"put", "get"})
    [batch] = ipc["batch"]
    assert (batch["segments"], batch["segment_bytes"], batch["stride"]) == (10_000, 4096, 8192)
    assert batch["prepared_seg_per_s"] > 0 and batch["single_seg_per_s"] > 0
    for peer in ("nixl", "mooncake"):
        assert data["peers"][peer]["unavailable"].startswith("not installed")
    assert data["ratios"] == []


@pytest.mark.skipif(not _nixl_installed(), reason="nixl not installed (pip install nixl-cu12); CI does not install it")
def test_nixl_measured_side_by_side(tmp_path: Path) -> None:
    stdout, data = _bench(tmp_path, *TINY, "--peers", "nixl")

    nixl = data["peers"]["nixl"]
    # The bench checks what NIXL reads back (every size, latency series and the batch): a wrong byte
    # would have made it report the peer unavailable with the reason.
    assert nixl["unavailable"] is None, nixl["unavailable"]
    assert "peer nixl (" in stdout and "transport / nixl" in stdout
    _check_sizes(nixl["sizes"])
    _check_latency(nixl["latency"], {"put", "get"})
    new_handle = {(x["op"], x["nbytes"]) for x in nixl["latency"] if x["variant"] == "new handle"}
    assert new_handle == {("put", 8), ("put", 4096)}
    [batch] = nixl["batch"]
    assert (batch["segments"], batch["segment_bytes"], batch["stride"]) == (10_000, 4096, 8192)
    assert batch["seg_per_s"] > 0

    ratios = {r["measure"]: r for r in data["ratios"] if r["backend"] == "ipc"}
    assert set(ratios) == {
        "batch 10000 x 4 KiB",
        "put 64 KiB",
        "put 1 MiB",
        "put 8 B median latency",
        "put 4 KiB median latency",
        # our one-segment prepared put reposted, against NIXL's reposted handle of the same size
        "prepared put 8 B, reposted (time each)",
        "prepared put 4 KiB, reposted (time each)",
        "prepared put 1 MiB, reposted",
    }
    for r in ratios.values():
        assert r["ours"] > 0 and r["theirs"] > 0 and r["ratio"] == pytest.approx(r["ours"] / r["theirs"])


@pytest.mark.skipif(
    not _mooncake_installed(),
    reason="mooncake not installed (pip install mooncake-transfer-engine-non-cuda; needs libibverbs1); "
    "CI does not install it",
)
def test_mooncake_measured_side_by_side_with_tcp(tmp_path: Path) -> None:
    stdout, data = _bench(tmp_path, "--backends", "tcp", *TINY[2:], "--peers", "mooncake")

    mooncake = data["peers"]["mooncake"]
    # As for NIXL, the bench checks what Mooncake reads back (every size and both batches).
    assert mooncake["unavailable"] is None, mooncake["unavailable"]
    assert "peer mooncake (" in stdout and "transport / mooncake" in stdout
    _check_sizes(mooncake["sizes"])
    _check_latency(mooncake["latency"], {"put", "get"})
    [batch] = mooncake["batch"]
    [separate] = mooncake["separate"]
    for x in (batch, separate):
        assert (x["segments"], x["segment_bytes"], x["stride"]) == (10_000, 4096, 8192)
    assert batch["seg_per_s"] > 0 and separate["puts_per_s"] > 0

    ratios = {r["measure"]: r for r in data["ratios"] if r["backend"] == "tcp"}
    assert {"put 1 MiB", "10000 separate 4 KiB puts", "batch 10000 x 4 KiB"} <= set(ratios)
    for r in ratios.values():
        assert r["ours"] > 0 and r["theirs"] > 0 and r["ratio"] == pytest.approx(r["ours"] / r["theirs"])
