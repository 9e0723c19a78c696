"""Processes of one multi-host test on a :class:`~tests._support.netns.Fabric`, each printing
JSON objects a line on stdout (the peers of the relay tests), gathered as they come."""

from __future__ import annotations

import json
import os
import queue
import subprocess
import threading
import time
from collections.abc import Callable

from tests._support import PYTHON, ROOT, python_env
from tests._support.netns import Fabric


class FabricRun:
    """Starts peers on the fabric's hosts and reads their JSON lines.

    Args:
        fab: the fabric.
        flight: the folder the peers dump their flight records into.
    """

    def __init__(self, fab: Fabric, flight: str) -> None:
        self.fab, self.flight = fab, flight
        self.lines: dict[str, queue.Queue] = {}
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, name: str, host: str, module: str, spec: dict) -> None:
        """Runs ``python -m module SPEC_JSON`` on ``host`` as ``name``; a thread queues its JSON
        lines (None once its stdout closed)."""
        p = self.fab.popen(host, [PYTHON, "-m", module, json.dumps(spec)], env=python_env(), cwd=ROOT,
                           stdout=subprocess.PIPE, text=True)
        q: queue.Queue = queue.Queue()

        def read() -> None:
            for line in p.stdout:
                if line.startswith("{"):
                    q.put(json.loads(line))
            q.put(None)

        threading.Thread(target=read, daemon=True).start()
        self.procs[name], self.lines[name] = p, q

    def reports(self, name: str, on: Callable[[dict], None], until: float) -> list[dict]:
        """The lines of ``name`` that name a ``"version"`` (a trainer's publish reports), once it
        ended (by ``time.monotonic()`` ``until``; it must exit 0); ``on`` sees every line as it
        comes."""
        out = []
        while (doc := self.lines[name].get(timeout=max(0.1, until - time.monotonic()))) is not None:
            on(doc)
            if "version" in doc:
                out.append(doc)
        assert self.procs[name].wait(timeout=30) == 0, name
        return out

    def generator(self, name: str) -> tuple[list[dict], dict | None]:
        """What generator ``name`` printed (killed if it did not end within 30 s): its lines,
        and its summary line (``"summary"`` set; None: it did not end itself)."""
        p = self.procs[name]
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(timeout=30)
        lives, summary = [], None
        while (doc := self.lines[name].get(timeout=30)) is not None:
            if doc.get("summary"):
                summary = doc
            else:
                lives.append(doc)
        return lives, summary

    def events(self, who: str) -> list[dict]:
        """The flight recorder events of ``who``'s last dump."""
        dumps = sorted((f for f in os.listdir(self.flight) if f.startswith(who)),
                       key=lambda f: os.path.getmtime(os.path.join(self.flight, f)))
        assert dumps, f"{who} dumped no flight record"
        with open(os.path.join(self.flight, dumps[-1])) as f:
            return json.load(f)["events"]
