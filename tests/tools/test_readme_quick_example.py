"""The README's quick example runs as a newcomer copies it: the Python block under "Quick
example", saved to a file and run with `python quick.py`, exits 0 and prints what the README
says it prints."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from tests._support import ROOT, python_env


def quick_example() -> str:
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Quick example\n"):]
    block = re.search(r"```python\n(.*?)```", section, re.S)
    assert block is not None, "the Quick example section has no python block"
    return block.group(1)


def test_the_quick_example_runs_as_copied(tmp_path: Path) -> None:
    script = tmp_path / "quick.py"
    script.write_text(quick_example())
    r = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=python_env(), capture_output=True,
                       text=True, timeout=180)
    assert r.returncode == 0, r.stdout + r.stderr
    assert re.search(r"^trainer-0: put 2097152 bytes via ipc in [\d.]+ ms$", r.stdout, re.M), r.stdout
    assert "gen-0: got version 1, sum 1048576.0" in r.stdout, r.stdout
