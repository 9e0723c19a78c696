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

from benchmarks.common.capabilities import available_backends
from benchmarks.mesh_sync._roles import BASELINE, DELTA, MESH, MeshBenchSpec, local_tensors, order
from benchmarks.mesh_sync._run import assemble, model_of, parse_args, sizes
from tests._support import PYTHON, ROOT, python_env
from transport.plan import ITEMSIZE, checkpoint_tensors, generator_rank, model_config, volume

TINY = ["--layers", "1", "--hidden", "128", "--vocab", "512", "--versions", "2", "--warmup", "1"]


def test_methods_alternate_and_local_tensors_are_cut_from_the_full_weights() -> None:
    import torch

    assert order(0) == (MESH, BASELINE) and order(1) == (BASELINE, MESH)
    assert order(1, (MESH, BASELINE, DELTA)) == (BASELINE, DELTA, MESH)
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


def _messages(spec: MeshBenchSpec, size: dict) -> list[dict]:
    """What the processes of a clean run report (as ``run`` collects them)."""
    msgs: list[dict] = []
    gens = [(f"replica-{r}", k) for r in range(spec.replicas) for k in range(spec.tp)]
    for v in range(spec.versions):
        ref = {str(k): {"a": f"a{v}{k}", "b": f"b{v}{k}"} for k in range(spec.tp)}
        msgs.append({"who": "trainer-0", "kind": "ref", "version": v, "sha": ref})
        for method in (MESH, BASELINE):
            for i in range(spec.trainers):
                m = {"who": f"trainer-{i}", "kind": "start", "method": method, "version": v, "rank": i,
                     "t_start": 100.0 * v + i, "t_end": 100.0 * v + 2}
                if method == MESH:
                    m |= {"pack_s": 0.0, "push_s": 0.0, "nbytes": size["mesh_bytes_per_version"] // spec.trainers,
                          "deltas": 0, "changed": None,
                          "status": {f"{r}/{k}": "done" for r, k in gens}, "errors": {}, "incomplete": [],
                          "refused": {}}
                msgs.append(m)
            for j, (r, k) in enumerate(gens):
                msgs.append({"who": f"{r}-rank{k}", "kind": "live", "method": method, "version": v, "replica": r,
                             "rank": k, "t_live": 100.0 * v + 3 + j, "sha": dict(ref[str(k)])})
    return msgs


def test_assemble_times_and_fails_on_any_difference() -> None:
    args = parse_args(TINY)
    spec = MeshBenchSpec(trainers=2, replicas=2, tp=2, versions=2, warmup=1, model=model_of(args), dtype="bfloat16",
                         backends=("ipc",), tmp="/nonexistent", timeout=1.0, deadline=1.0, poll_s=0.01)
    size = sizes(spec)
    assert size["mesh_bytes_per_version"] % 2 == 0
    msgs = _messages(spec, size)
    ok = assemble(msgs, spec, size)
    assert ok["verified"] and ok["problems"] == []
    v1 = ok["methods"][MESH]["versions"][1]
    assert v1["all_live_s"] == 100 + 3 + 3 - 100 and v1["first_live_s"] == 3  # from the first trainer's start
    assert v1["replica_live_s"] == {"replica-0": 4, "replica-1": 6}
    assert ok["ratio_baseline_over_mesh"]["median"] == 1.0

    def broken(change) -> dict:
        bad = [dict(m) for m in msgs]
        change(bad)
        return assemble(bad, spec, size)

    def flip_sha(ms: list[dict]) -> None:
        live = next(m for m in ms if m["kind"] == "live" and m["method"] == BASELINE and m["version"] == 1)
        live["sha"] = {**live["sha"], "b": "something else"}

    got = broken(flip_sha)
    assert not got["verified"] and got["methods"][BASELINE]["verified"] is False and got["methods"][MESH]["verified"]
    assert "baseline version 1: NOT bit-for-bit equal" in got["problems"][0] and "(b)" in got["problems"][0]

    def straggler(ms: list[dict]) -> None:
        start = next(m for m in ms if m["kind"] == "start" and m["method"] == MESH)
        start["status"] = {**start["status"], "replica-1/1": "straggler"}
        start["nbytes"] -= 1

    got = broken(straggler)
    assert not got["methods"][MESH]["verified"] and len(got["problems"]) == 2
    assert "not every generator rank was served" in got["problems"][0] and "need" in got["problems"][1]

    def same_weights(ms: list[dict]) -> None:
        refs = [m for m in ms if m["kind"] == "ref"]
        refs[1]["sha"] = refs[0]["sha"]

    assert "the weights did not change" in " ".join(broken(same_weights)["problems"])
    assert "no report from ['replica-1-rank1']" in " ".join(broken(lambda ms: ms.pop())["problems"])


@pytest.mark.skipif(available_backends().get("ipc") is not None, reason="the ipc backend cannot run here")
def test_tiny_run_verifies_every_method_and_reports_consistent_bytes(tmp_path: Path) -> None:
    out, md = tmp_path / "mesh.json", tmp_path / "mesh.md"
    cmd = [PYTHON, "-m", "benchmarks.mesh_sync", *TINY, "--timeout", "120", "--run-timeout", "280",
           "--json", str(out), "--markdown", str(md), "--delta-sync", "--update", "adamw"]
    proc = subprocess.run(cmd, cwd=ROOT, env=python_env(), capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "| method | verified | bytes moved / version |" in proc.stdout
    assert "every method verified bit for bit" in proc.stdout
    assert "| mesh, delta sync (MeshPublisher(delta=True)" in proc.stdout

    doc = json.loads(out.read_text())
    assert doc["benchmark"] == "mesh_sync" and doc["command"].startswith("python -m benchmarks.mesh_sync")
    assert doc["machine"]["nproc"] >= 1 and doc["machine"]["torch"] and len(doc["machine"]["loadavg_before"]) == 3
    assert doc["date"][:4].isdigit()
    assert doc["config"] | {"trainers": 2, "replicas": 2, "tp": 2, "generator_ranks": 4, "versions": 2,
                            "warmup": 1, "dtype": "bfloat16", "backends": ["ipc"]} == doc["config"]
    result = doc["result"]
    assert doc["verified"] == {MESH: True, BASELINE: True, DELTA: True}
    assert result["verified"] is True and result["problems"] == []

    # The bytes, from the model's shapes alone.
    cfg = model_config(doc["model"]["config"])
    params = sum(volume(tuple((0, d) for d in s)) for _, s in checkpoint_tensors(cfg))
    assert doc["model"]["params"] == params and doc["model"]["nbytes"] == 2 * params
    layouts = [generator_rank(cfg, tp=2, rank=k, dtype="bfloat16") for k in range(2)]
    needed = [sum(volume(p.box) * ITEMSIZE[lt.dtype] for lt in g.tensors for p in lt.pieces) for g in layouts]
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


@pytest.mark.skipif(available_backends().get("ipc") is not None, reason="the ipc backend cannot run here")
def test_a_failing_rank_fails_the_run_and_every_process_goes(tmp_path: Path) -> None:
    # A publish deadline nobody can meet: the trainer ranks report stragglers and move on, the
    # generator ranks wait for a commit that never comes, time out, report, and the launcher
    # kills the rest and exits 1 with their tracebacks.
    cmd = [PYTHON, "-m", "benchmarks.mesh_sync", *TINY, "--deadline", "0.000001", "--timeout", "15",
           "--run-timeout", "200", "--json", str(tmp_path / "x.json")]
    proc = subprocess.run(cmd, cwd=ROOT, env=python_env(), capture_output=True, text=True, timeout=240, check=False)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "mesh_sync: FAILED" in proc.stderr and "TimeoutError" in proc.stderr
    assert not (tmp_path / "x.json").exists()
