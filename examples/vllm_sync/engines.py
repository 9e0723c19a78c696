"""The vLLM engines of the example: offline ``LLM`` objects in this process, or OpenAI-compatible
servers in processes of their own (``--serve``). Both are driven by the trainer engine through a
weight-sync client, and both answer ``generate`` with greedy tokens and their logprobs."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

KV_BYTES = 32 << 20  # the KV cache of a tiny model; vLLM reserves 90% of RAM without it


@dataclass
class Generation:
    prompt_ids: list[int]
    tokens: list[int]
    logprobs: list[float]


def cpu_env(tp: int) -> dict[str, str]:
    """vLLM's CPU backend binds each worker's threads to cores; with TP > 1 on one NUMA node it
    must be told which (``VLLM_CPU_OMP_THREADS_BIND``): here the cores are split evenly."""
    if tp == 1 or "VLLM_CPU_OMP_THREADS_BIND" in os.environ:
        return {}
    cores = sorted(os.sched_getaffinity(0))
    per = max(len(cores) // tp, 1)
    parts = [cores[(i * per) % len(cores): (i * per) % len(cores) + per] for i in range(tp)]
    return {"VLLM_CPU_OMP_THREADS_BIND": "|".join(f"{p[0]}-{p[-1]}" for p in parts)}


def engine_args(model: str, tp: int, dtype: str) -> dict[str, Any]:
    return {"dtype": dtype, "tensor_parallel_size": tp, "kv_cache_memory_bytes": KV_BYTES, "max_model_len": 128,
            "enforce_eager": True, "seed": 0}


@dataclass
class OfflineEngine:
    """An offline ``vllm.LLM`` in this process."""

    name: str
    llm: Any
    client: Any = None
    started_s: float = 0.0
    procs: list[int] = field(default_factory=list)

    @classmethod
    def start(cls, name: str, model: str, tp: int, dtype: str, env: dict[str, str] | None = None) -> OfflineEngine:
        from vllm import LLM
        from vllm.config import WeightTransferConfig

        from transport.vllm import LLMClient

        t0 = time.perf_counter()
        before = {p.pid for p in psutil.Process().children(recursive=True)}
        env = {**cpu_env(tp), **(env or {})}
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)  # vLLM's processes inherit it (TRANSPORT_VLLM_INIT: join by itself)
        try:
            llm = LLM(model, weight_transfer_config=WeightTransferConfig(backend="transport"),
                      **engine_args(model, tp, dtype))
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        procs = [p.pid for p in psutil.Process().children(recursive=True) if p.pid not in before]
        return cls(name, llm, LLMClient(llm), time.perf_counter() - t0, procs)

    def generate(self, prompts: list[str], max_tokens: int) -> list[Generation]:
        from vllm import SamplingParams

        sp = SamplingParams(max_tokens=max_tokens, temperature=0, logprobs=0, ignore_eos=True)
        out = []
        for o in self.llm.generate(prompts, sp, use_tqdm=False):
            c = o.outputs[0]
            out.append(Generation(list(o.prompt_token_ids), list(c.token_ids),
                                  [d[t].logprob for d, t in zip(c.logprobs, c.token_ids, strict=True)]))
        return out

    def pids(self) -> list[int]:
        """The engine's processes (its engine core and workers), started by ``start``."""
        return list(self.procs)

    def close(self) -> None:
        try:
            self.llm.llm_engine.engine_core.shutdown()
        except Exception:  # noqa: BLE001 - a killed engine is already gone
            pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class ServedEngine:
    """``python -m vllm.entrypoints.openai.api_server`` in a process group of its own."""

    name: str
    proc: subprocess.Popen[bytes]
    url: str
    log: Path
    client: Any = None
    started_s: float = 0.0

    @classmethod
    def launch(cls, name: str, model: str, tp: int, dtype: str, logdir: Path,
               env: dict[str, str] | None = None, extra: list[str] | None = None) -> ServedEngine:
        from vllm.distributed.weight_transfer import HTTPVLLMWeightSyncClient

        port = free_port()
        a = engine_args(model, tp, dtype)
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--port", str(port),
               "--host", "127.0.0.1", "--dtype", a["dtype"], "--tensor-parallel-size", str(tp),
               "--kv-cache-memory-bytes", str(a["kv_cache_memory_bytes"]), "--max-model-len", str(a["max_model_len"]),
               "--enforce-eager", "--seed", "0", "--weight-transfer-config", json.dumps({"backend": "transport"}),
               *(extra or [])]
        log = logdir / f"{name}.log"
        full_env = dict(os.environ, VLLM_SERVER_DEV_MODE="1", **cpu_env(tp), **(env or {}))
        with open(log, "ab") as f:
            proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=full_env, start_new_session=True)
        url = f"http://127.0.0.1:{port}"
        return cls(name, proc, url, log, HTTPVLLMWeightSyncClient(url, timeout=120))

    def wait_ready(self, timeout: float) -> None:
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited ({self.proc.returncode}); see {self.log}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        self.started_s = time.perf_counter() - t0
                        return
            except OSError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"{self.name} not ready within {timeout:g}s; see {self.log}")

    def _post(self, path: str, doc: dict[str, Any], timeout: float = 60) -> Any:
        req = urllib.request.Request(self.url + path, data=json.dumps(doc).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())

    def generate(self, prompts: list[str], max_tokens: int) -> list[Generation]:
        out = []
        for p in prompts:
            doc = self._post("/v1/completions", {"model": self.model_name(), "prompt": p, "max_tokens": max_tokens,
                                                 "temperature": 0, "logprobs": 0, "ignore_eos": True,
                                                 "return_tokens_as_token_ids": True, "return_token_ids": True})
            c = doc["choices"][0]
            out.append(Generation(list(c.get("prompt_token_ids") or []), list(c["token_ids"]),
                                  [float(x) for x in c["logprobs"]["token_logprobs"]]))
        return out

    def model_name(self) -> str:
        with urllib.request.urlopen(self.url + "/v1/models", timeout=10) as r:
            return str(json.loads(r.read())["data"][0]["id"])

    def weight_version(self) -> str | None:
        with urllib.request.urlopen(self.url + "/weight_info", timeout=10) as r:
            v = json.loads(r.read()).get("weight_version")
            return None if v is None else str(v)

    def pids(self) -> list[int]:
        try:
            root = psutil.Process(self.proc.pid)
            return [root.pid] + [c.pid for c in root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)


def signal_all(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass
