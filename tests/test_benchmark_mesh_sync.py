"""Smoke test of the mesh-sync benchmark (``python -m benchmarks.mesh_sync``).

A tiny real run (a one-layer Llama-style model, FSDP2 over 2 gloo trainer processes, 2 replicas
x TP 2 generator processes, 2 versions) checks that the entry point works end to end: both
methods (transport mesh sync, gather + broadcast) verified bit for bit on every version, the
JSON and Markdown have the documented contents, and the bytes agree with what the model's shapes
say: the baseline delivers the whole model to every generator rank, the mesh exactly the slices
each generator rank needs. No timing is asserted.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from benchmarks._capabilities import available_backends
from benchmarks._mesh_roles import BASELINE, MESH, local_tensors, order
from transport.plan import ITEMSIZE, checkpoint_tensors, generator_rank, model_config, volume

from .conftest import PYTHON, ROOT, python_env

TINY = ["--layers", "1", "--hidden", "128", "--vocab", "512", "--versions", "2", "--warmup", "1"]


def test_methods_alternate_and_local_tensors_are_cut_from_the_full_weights() -> None:
    import torch

    assert order(0) == (MESH, BASELINE) and order(1) == (BASELINE, MESH)
    cfg = model_config({"model_type": "llama", "hidden_size": 128, "num_hidden_layers": 1, "num_attention_heads": 4,
                        "num_key_value_heads": 2, "head_dim": 32, "intermediate_size": 256, "vocab_size": 100})
    full = {n: torch.arange(volume(tuple((0, d) for d in s)), dtype=torch.float32).reshape(s).to(torch.bfloat16)
            for n, s in checkpoint_tensors(cfg)}
    for k in range(2):
        got = local_tensors(generator_rank(cfg, tp=2, rank=k, dtype="bfloat16"), full, torch.bfloat16)
        qkv = got["model.layers.0.self_attn.qkv_proj.weight"]
        q, kk = full["model.layers.0.self_attn.q_proj.weight"], full["model.layers.0.self_attn.k_proj.weight"]
        assert torch.equal(qkv[:64], q[64 * k : 64 * (k + 1)])  # this rank's heads of q, then its k heads
        assert torch.equal(qkv[64:96], kk[32 * k : 32 * (k + 1)])
        emb = got["model.embed_tokens.weight"]  # vocab 100 padded to 128 over TP 2: rank 1 ends in padding
        assert emb.shape[0] == 64
        if k == 1:
            assert torch.equal(emb[:36], full["model.embed_tokens.weight"][64:]) and not emb[36:].any()


@pytest.mark.skipif(available_backends().get("ipc") is not None, reason="the ipc backend cannot run here")
def test_tiny_run_verifies_both_methods_and_reports_consistent_bytes(tmp_path: Path) -> None:
    out, md = tmp_path / "mesh.json", tmp_path / "mesh.md"
    cmd = [PYTHON, "-m", "benchmarks.mesh_sync", *TINY, "--timeout", "120", "--run-timeout", "280",
           "--json", str(out), "--markdown", str(md)]
    proc = subprocess.run(cmd, cwd=ROOT, env=python_env(), capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "| method | verified | bytes moved / version |" in proc.stdout
    assert "both methods verified bit for bit" in proc.stdout

    doc = json.loads(out.read_text())
    assert doc["benchmark"] == "mesh_sync" and doc["command"].startswith("python -m benchmarks.mesh_sync")
    assert doc["machine"]["nproc"] >= 1 and doc["machine"]["torch"] and len(doc["machine"]["loadavg_before"]) == 3
    assert doc["date"][:4].isdigit()
    assert doc["config"] | {"trainers": 2, "replicas": 2, "tp": 2, "generator_ranks": 4, "versions": 2,
                            "warmup": 1, "dtype": "bfloat16", "backends": ["ipc"]} == doc["config"]
    result = doc["result"]
    assert doc["verified"] == {MESH: True, BASELINE: True}
    assert result["verified"] is True and result["problems"] == []

    # The bytes, from the model's shapes alone.
    cfg = model_config(doc["model"]["config"])
    params = sum(volume(tuple((0, d) for d in s)) for _, s in checkpoint_tensors(cfg))
    assert doc["model"]["params"] == params and doc["model"]["nbytes"] == 2 * params
    needed = [sum(volume(p.box) * ITEMSIZE[lt.dtype] for lt in generator_rank(cfg, tp=2, rank=k, dtype="bfloat16").tensors
                  for p in lt.pieces) for k in range(2)]
    assert doc["bytes"]["baseline_per_version"] == 2 * params * 4  # full model bytes x 4 generator ranks
    assert doc["bytes"]["mesh_per_version"] == 2 * sum(needed)  # 2 replicas x what their ranks need
    # Every generator rank gets its half of the sharded tensors plus the replicated norms: a bit more
    # than half the model each, so the mesh moves a bit more than half of what the broadcast does.
    assert params < sum(needed) // 2 < params + 2 * 128 * 3

    for method in (MESH, BASELINE):
        m = result["methods"][method]
        assert m["verified"] is True
        assert [(r["version"], r["warmup"]) for r in m["versions"]] == [(0, True), (1, False)]
        for r in m["versions"]:
            assert r["all_live_s"] > 0 and r["all_live_s"] >= max(r["replica_live_s"].values()) - 1e-9
            assert set(r["rank_live_s"]) == {f"replica-{i}-rank{k}" for i in range(2) for k in range(2)}
            assert set(r["trainer_blocked_s"]) == {"trainer-0", "trainer-1"}
        s = m["summary"]
        assert s["timed_versions"] == 1 and len(s["warmup_s"]) == 1
        assert s["median_s"] == s["max_s"] == m["versions"][1]["all_live_s"]
    mesh = result["methods"][MESH]
    for r in mesh["versions"]:  # what the publish reports say was moved: exactly what the ranks need
        assert r["bytes"] == doc["bytes"]["mesh_per_version"]
        assert all(s == "done" for per in r["status"].values() for s in per.values())
        assert set(r["status"]["trainer-0"]) == {"replica-0/0", "replica-0/1", "replica-1/0", "replica-1/1"}
    assert result["methods"][BASELINE]["summary"]["bytes_per_version"] == doc["bytes"]["baseline_per_version"]
    ratio = result["ratio_baseline_over_mesh"]["median"]
    assert ratio == pytest.approx(result["methods"][BASELINE]["summary"]["median_s"] / mesh["summary"]["median_s"])

    text = md.read_text()
    assert text.startswith("# Mesh sync benchmark") and "Command: `python -m benchmarks.mesh_sync" in text
    assert "| method | verified |" in text and "Machine:" in text and "torch" in text
