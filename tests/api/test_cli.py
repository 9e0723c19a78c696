"""The command line (``python -m transport ...``) and the quickstart example, run as real processes.

``python -m transport bench`` is a thin entry to the harness in ``benchmarks/`` (``benchmarks.p2p``).

These check that the commands run and report sensibly; they assert no timings.
"""

from __future__ import annotations

import json
import os
import re
import select
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.common.sizes import parse_size, parse_sizes

REPO = Path(__file__).resolve().parents[2]
TIMEOUT_S = 120


def run_cli(*args: str, timeout: float = TIMEOUT_S) -> subprocess.CompletedProcess[str]:
    """Runs ``python -m transport ARGS``; the child is killed if it overruns ``timeout``."""
    return subprocess.run(
        [sys.executable, "-m", "transport", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
    )


def test_doctor_lists_backends_and_ipc_permissions() -> None:
    r = run_cli("doctor", timeout=60)
    assert r.returncode == 0, r.stderr
    for backend in ("ipc", "tcp", "ucx", "nccl"):
        assert re.search(rf"^\s+{backend}\s+(available|unavailable: .+)$", r.stdout, re.M), r.stdout
    assert "torch" in r.stdout
    assert "cross-memory attach" in r.stdout
    assert "Yama ptrace_scope" in r.stdout
    # Each fact once: the NCCL library's path has its own line, the CUDA driver's loader message too.
    from transport._native import nccl

    lib, _ = nccl.library()
    if lib is not None:
        assert r.stdout.count(lib.path) == 1, r.stdout
    assert r.stdout.count("cannot open shared object file") <= 1, r.stdout


def test_version() -> None:
    import transport

    r = run_cli("--version", timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == f"transport {transport.__version__}", r.stdout + r.stderr


def test_bench_small_run_writes_json(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    r = run_cli("bench", "--sizes", "1MiB", "--iters", "2", "--backends", "ipc,tcp", "--json", str(out))
    assert r.returncode == 0, r.stdout + r.stderr
    for backend in ("ipc", "tcp"):
        assert f"backend {backend}" in r.stdout
    assert "put/memcpy" in r.stdout and "latency put 8 B" in r.stdout

    data = json.loads(out.read_text())
    for k in ("date", "hostname", "cpu_model", "torch_version", "transport_version", "config", "memcpy", "backends"):
        assert k in data, k
    assert data["config"]["sizes"] == [1 << 20]
    assert data["memcpy"][0]["size"] == 1 << 20 and data["memcpy"][0]["gbps"] > 0
    assert set(data["backends"]) == {"ipc", "tcp"}
    for name, b in data["backends"].items():
        assert b["one_sided"] is (name == "ipc")
        [row] = b["sizes"]
        assert row["size"] == 1 << 20 and row["iters"] == 2
        for field in ("put_gbps", "get_gbps", "memcpy_gbps", "put_ratio", "get_ratio"):
            assert row[field] > 0, (name, field)
        assert {lat["op"] for lat in b["latency"]} == {"put", "get"}
        assert {lat["nbytes"] for lat in b["latency"]} == {8, 4096}
        for lat in b["latency"]:
            assert lat["nbytes"] in (8, 4096) and lat["iters"] > 0
            assert 0 < lat["median_us"] <= lat["p99_us"]


def test_bench_rejects_bad_arguments() -> None:
    assert run_cli("bench", "--sizes", "lots", timeout=60).returncode == 2
    r = run_cli("bench", "--sizes", "1MiB", "--backends", "carrier-pigeon", timeout=60)
    assert r.returncode == 1 and "carrier-pigeon" in r.stderr


def test_bench_help_lists_the_harness_options() -> None:
    r = run_cli("bench", "--help", timeout=60)
    assert r.returncode == 0, r.stderr
    assert "python -m transport bench" in r.stdout
    for flag in ("--backends", "--sizes", "--max-size", "--iters", "--warmup", "--latency-iters", "--latency-size",
                 "--timeout", "--json"):
        assert flag in r.stdout, flag


def test_bench_without_the_harness_says_to_use_a_checkout() -> None:
    # As in an installed wheel: no benchmarks package to import.
    code = (
        "import sys; sys.modules['benchmarks'] = None; "
        "from transport.__main__ import main; sys.exit(main(sys.argv[1:]))"
    )
    r = subprocess.run(
        [sys.executable, "-c", code, "bench", "--sizes", "1MiB"], capture_output=True, text=True, timeout=60, cwd=REPO
    )
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr.count("\n") == 1 and "source checkout" in r.stderr, r.stderr


def test_other_commands_still_reject_unknown_arguments() -> None:
    r = run_cli("doctor", "--sizes", "1MiB", timeout=60)
    assert r.returncode == 2 and "unrecognized arguments: --sizes 1MiB" in r.stderr, r.stderr


def test_parse_sizes() -> None:
    assert parse_size("1MiB") == parse_size("1M") == parse_size("1mb") == 1 << 20
    assert parse_size("1GiB") == 1 << 30 and parse_size("8") == 8 and parse_size("512KiB") == 512 << 10
    assert parse_sizes("4MiB,1MiB,1M") == (1 << 20, 4 << 20)
    for bad in ("", "0", "-1M", "1.5", "ten"):
        with pytest.raises(ValueError, match=r"not a size|positive whole number"):
            parse_size(bad)


def _sigint_default() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _sigint_ignored() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # as a shell's ``&`` or ``nohup`` leaves it


@pytest.mark.parametrize("inherited", ["default", "ignored"])
def test_store_serves_until_interrupted(inherited: str) -> None:
    """SIGINT stops it whatever disposition it inherited (the suite itself may run under
    ``nohup``: the child's is set explicitly here, both ways)."""
    from transport._rendezvous import open_store

    proc = subprocess.Popen(
        [sys.executable, "-m", "transport", "store", "--port", "0", "--host", "127.0.0.1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
        preexec_fn=_sigint_ignored if inherited == "ignored" else _sigint_default,
    )
    try:
        assert proc.stdout is not None and proc.stderr is not None
        ready, _, _ = select.select([proc.stdout], [], [], 60)
        assert ready, "the store printed nothing within 60 s"
        line = proc.stdout.readline()
        m = re.search(r"tcp://127\.0\.0\.1:(\d+)", line)
        assert m, line + proc.stderr.read()
        client = open_store(m.group(0), timeout=10)
        client.set("greeting", b"hello")
        assert client.get("greeting") == b"hello"
        client.close()
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)


@pytest.mark.parametrize("runtime", ["asyncio", "trio"])
def test_quickstart_example_runs(runtime: str) -> None:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    r = subprocess.run(
        [sys.executable, str(REPO / "examples" / "quickstart.py"), *(["--trio"] if runtime == "trio" else [])],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        cwd=REPO,
        env=env,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "via ipc" in r.stdout and f"quickstart: OK (under {runtime})" in r.stdout
