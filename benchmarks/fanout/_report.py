"""The fan-out benchmark's figures: per-method rows from the processes' records, the floor, the
issue's targets, and the table and Markdown report."""

from __future__ import annotations

import statistics
from typing import Any

from ..common.machine import library_line

HOSTS = 2
TARGET_FLOOR = 1.15  # relays at most this times the floor
TARGET_DIRECT = 2.5  # relays at least this many times faster than direct
TARGET_STRIPED = 1.8  # two striped links at least this many times one
TARGET_NORMAL = 1.15  # a fault run's other host: at most this times the relays' median
RELAY_TIMEOUT_S = 5.0  # the Publisher's relay timeout when none is given: min(deadline, this)


def _first_live(lives: list[dict[str, Any]], v: int) -> dict[str, Any] | None:
    """The record of the first version >= ``v`` a generator had live."""
    return next((r for r in lives if r["version"] >= v), None)


def _spread(times: list[float]) -> dict[str, Any]:
    return {"times_s": times, "median_s": statistics.median(times), "min_s": min(times), "max_s": max(times)}


def weights_rows(method: str, trainer: dict[str, Any], gens: dict[str, dict[str, Any]], names: dict[str, list[str]],
                 warmup: int, fault: dict[str, Any] | None) -> dict[str, Any]:
    """A ``transport.weights`` method's figures: per timed version, when each generator was live
    (seconds from the publish's start) and the slowest; the publish reports' per-subscriber
    results; torn tensors seen (must be 0)."""
    every = [n for h in sorted(names) for n in names[h]]
    per_sub: dict[str, list[float | None]] = {n: [] for n in every}
    times, torn, missing = [], 0, []
    timed = [r for r in trainer["versions"] if r["version"] > warmup]
    for row in timed:
        worst = 0.0
        for n in every:
            live = _first_live(gens.get(n, {}).get("lives", []), row["version"])
            if live is None:
                per_sub[n].append(None)
                missing.append(f"{n}@v{row['version']}")
                continue
            s = live["at"] - row["t0"]
            per_sub[n].append(s)
            torn += live["torn_tensors"]
            if not (fault and n == fault["victim"]):
                worst = max(worst, s)
        times.append(worst)
    out: dict[str, Any] = {**_spread(times), "per_sub": per_sub, "torn_tensors": torn, "missing": missing,
                           "publish_s": [r["publish_s"] for r in timed],
                           "results": [r["results"] for r in timed],
                           "relayed_by": {n: r.get("relayed_by") for n, r in timed[-1]["results"].items()},
                           "hostnames": sorted({g.get("hostname", "?") for g in gens.values()})}
    out["publisher_kwargs"] = trainer.get("publisher_kwargs")
    if fault:
        row = timed[-1]
        out["fault"] = {"signal": fault["signal"], "victim": fault["victim"],
                        "planned_after_s": fault["after_s"],
                        "injected_after_s": (row["injected_at"] - row["t0"]) if "injected_at" in row else None,
                        "live_s": {n: per_sub[n][-1] for n in every}, "results": row["results"],
                        "hosts": {h: names[h] for h in names}}
    return out


def mesh_rows(ranks: list[dict[str, Any]], gens: dict[str, dict[str, Any]], names: dict[str, list[str]],
              warmup: int) -> dict[str, Any]:
    """A mesh method's figures: per timed version, when each generator replica had it applied
    (seconds from the first trainer rank's publish start) and the slowest; when the last
    trainer rank's publish returned, and how long after that the last replica applied; every
    publish result not DONE; the digest of every version applied (warm-up included) against
    trainer rank 0's (``wrong``: must be empty); torn tensors; the relay events."""
    every = [n for h in sorted(names) for n in names[h]]
    by_version = [{r["version"]: r for r in rank["versions"]} for rank in ranks]
    timed = sorted(v for v in by_version[0] if v > warmup)
    per_sub: dict[str, list[float | None]] = {n: [] for n in every}
    times: list[float] = []
    published: list[float] = []
    after: list[float] = []  # from the last publish's return until the last replica applied
    missing: list[str] = []
    wrong: list[str] = []
    not_done: list[str] = []
    torn = checked = 0
    digests = {v: r["digest"] for v, r in by_version[0].items()}
    for v in timed:
        rows = [b[v] for b in by_version]
        t0 = min(r["t0"] for r in rows)
        published.append(max(r["publish_end"] for r in rows) - t0)
        not_done += [f"trainer{k}/v{v}: {label} {res['status']} ({res['error']})" for k, r in enumerate(rows)
                     for label, res in r["results"].items() if res["status"] != "done"]
        worst = 0.0
        for n in every:
            live = _first_live(gens.get(n, {}).get("lives", []), v)
            if live is None:
                per_sub[n].append(None)
                missing.append(f"{n}@v{v}")
                continue
            per_sub[n].append(live["at"] - t0)
            worst = max(worst, live["at"] - t0)
            torn += live["torn_tensors"]
        times.append(worst)
        after.append(worst - published[-1])
    for n in every:  # every version applied, warm-up included
        for live in gens.get(n, {}).get("lives", []):
            checked += 1
            if live["digest"] != digests.get(live["version"]):
                wrong.append(f"{n}@v{live['version']}")
    polls = [g["commit"] for g in gens.values() if "commit" in g]
    last = [{label.split("/")[0]: res["relayed_by"] for label, res in b[timed[-1]]["results"].items()}
            for b in by_version] if timed else []
    return {**_spread(times), "per_sub": per_sub, "torn_tensors": torn, "missing": missing,
            "published": _spread(published), "after_publish": _spread(after), "not_done": not_done,
            "wrong": wrong, "digests_checked": checked, "relayed_by": last,
            "publisher_kwargs": ranks[0].get("publisher_kwargs"),
            "relay_events": [e for rank in ranks for e in rank.get("relay_events", [])],
            "trainer_ranks": len(ranks), "commit_polls": {"calls": sum(p["calls"] for p in polls),
                                                          "seconds": sum(p["seconds"] for p in polls)},
            "poll_s": next((g["poll_s"] for g in gens.values()), None),
            "hostnames": sorted({g.get("hostname", "?") for g in gens.values()})}


def gloo_rows(rows: list[dict[str, Any]], names: list[str], warmup: int) -> dict[str, Any]:
    """The gloo broadcast's figures: per timed version, when each rank's broadcast returned,
    from rank 0's start (after the barrier)."""
    per_sub: dict[str, list[float]] = {n: [] for n in names[1:]}
    times, torn = [], 0
    for i, r0 in enumerate(rows[0]["rows"]):
        if r0["version"] <= warmup:
            continue
        worst = 0.0
        for rank, n in enumerate(names[1:], start=1):
            r = rows[rank]["rows"][i]
            per_sub[n].append(r["at"] - r0["t0"])
            torn += r["torn_tensors"]
            worst = max(worst, r["at"] - r0["t0"])
        times.append(worst)
    return {**_spread(times), "per_sub": per_sub, "torn_tensors": torn, "missing": []}


def floor(args: Any, refs: dict[str, Any]) -> dict[str, Any]:
    """One copy per host across T's link: at the shaped rate, and at the plain stream's goodput
    (and across two links, where measured)."""
    copies = HOSTS * args.state_bytes
    out = {"copies_bytes": copies, "rate_s": copies * 8 / (args.rate_mbit * 1e6),
           "stream_s": copies / refs["one_link"]["median_bytes_per_s"]}
    if "two_links" in refs:
        out["two_links_rate_s"] = out["rate_s"] / 2
        out["two_links_stream_s"] = copies / refs["two_links"]["median_bytes_per_s"]
    return out


def refs_line(refs: dict[str, Any], args: Any) -> str:
    parts = [f"{k.replace('_', ' ')}: {v['median_bytes_per_s'] * 8 / 1e6:.0f} Mbit/s "
             f"({', '.join(f'{x * 8 / 1e6:.0f}' for x in v['bytes_per_s'])})" for k, v in refs.items()]
    return f"plain socket stream, {args.state_bytes / 1e6:.0f} MB per link, shaped {args.rate_mbit:g} Mbit/s: " \
        + "; ".join(parts)


def method_line(method: str, r: dict[str, Any]) -> str:
    if "error" in r:
        return f"{method}: FAILED ({r['error'].splitlines()[0][:300]})"
    if "digests_checked" in r:
        return f"{method}: median {r['median_s']:.2f} s (min {r['min_s']:.2f}, max {r['max_s']:.2f}; " \
            f"{', '.join(f'{t:.2f}' for t in r['times_s'])}; publish returned {r['published']['median_s']:.2f} s), " \
            f"torn tensors {r['torn_tensors']}, wrong digests {len(r['wrong'])} of {r['digests_checked']}, " \
            f"missing {len(r['missing'])}, not done {len(r['not_done'])}, wall {r['wall_s']:.0f} s; {t_sent(r)}"
    return f"{method}: median {r['median_s']:.2f} s (min {r['min_s']:.2f}, max {r['max_s']:.2f}; " \
        f"{', '.join(f'{t:.2f}' for t in r['times_s'])}), torn tensors {r['torn_tensors']}, " \
        f"missing {len(r['missing'])}, wall {r['wall_s']:.0f} s; {t_sent(r)}"


def t_sent(r: dict[str, Any]) -> str:
    """What T's NICs sent during the method (all its versions, warm-up included, headers too)."""
    nics = {k: v["tx"] for k, v in r.get("nic_bytes", {}).items() if k.startswith("T/")}
    return "T sent " + " + ".join(f"{v / 1e6:.0f} MB on {k[2:]}" for k, v in sorted(nics.items()))


def _check(ok: bool | None) -> str:
    return "n/a" if ok is None else ("holds" if ok else "MISSED")


def summarize(result: dict[str, Any]) -> dict[str, Any]:
    """The issue's targets against this run's figures (None where a method did not run)."""
    m, fl = result["methods"], result["floor"]
    ok = {k: v for k, v in m.items() if "error" not in v}

    def med(k: str) -> float | None:
        return ok[k]["median_s"] if k in ok and k not in ("stop", "kill") else None

    relays, direct, gloo, striped = med("relays"), med("direct"), med("gloo"), med("striped")
    def ratio(a: float | None, b: float | None) -> float | None:
        return None if a is None or b is None else a / b

    def at_least(value: float | None, target: float) -> bool | None:
        return None if value is None else value >= target

    gloo_over_relays = ratio(gloo, relays)
    targets: list[dict[str, Any]] = [
        {"target": f"relays <= {TARGET_FLOOR}x floor (shaped rate)",
         "value": ratio(relays, fl["rate_s"]),
         "holds": None if relays is None else relays <= TARGET_FLOOR * fl["rate_s"]},
        {"target": f"relays >= {TARGET_DIRECT}x faster than direct",
         "value": ratio(direct, relays), "holds": at_least(ratio(direct, relays), TARGET_DIRECT)},
        {"target": "relays faster than gloo broadcast",
         "value": gloo_over_relays, "holds": None if gloo_over_relays is None else gloo_over_relays > 1.0},
        {"target": f"two striped links >= {TARGET_STRIPED}x one (striped vs relays)",
         "value": ratio(relays, striped), "holds": at_least(ratio(relays, striped), TARGET_STRIPED)},
    ]
    one_copy_s = result["args"]["state_bytes"] / result["refs"]["one_link"]["median_bytes_per_s"]
    for k in [k for k in ("stop",) if k in result["args"]["methods"]]:  # the targets: the stopped relay
        f = ok.get(k, {}).get("fault")
        if f is None:
            targets.append({"target": f"{k}: host B live in normal time, host A's others within the timeout "
                            "plus one direct push", "value": None, "holds": None})
            continue
        b = [s for n in f["hosts"]["B"] if (s := f["live_s"][n]) is not None]
        b_ok = None if relays is None else (len(b) == len(f["hosts"]["B"]) and max(b) <= TARGET_NORMAL * relays)
        others = [n for n in f["hosts"]["A"] if n != f["victim"]]
        a = [f["live_s"][n] for n in others]
        # What a stalled relay may cost its host (the issue: "within the timeout plus one direct
        # push"), counted from the fault: the relay timeout in effect (the library's default:
        # min(deadline, RELAY_TIMEOUT_S)), then the version once more across T's link (through
        # the next relay, or to one member directly).
        timeout = result["args"]["relay_timeout"]
        timeout = min(result["args"]["fault_deadline"], RELAY_TIMEOUT_S) if timeout is None else timeout
        bound = f["injected_after_s"] + timeout + one_copy_s
        a_ok = all(s is not None for s in a) and max(a, default=0) <= bound
        targets.append({"target": f"{k}: host B's subscribers <= {TARGET_NORMAL}x the relays' median",
                        "value": None if not b or relays is None else max(b) / relays, "holds": b_ok})
        targets.append({"target": f"{k}: host A's other subscribers <= the fault ({f['injected_after_s']:.2f} s) + "
                        f"the relay timeout ({timeout:g} s) + one push ({bound:.2f} s)",
                        "value": None if None in a else max(a, default=0), "holds": a_ok})
    return {"targets": targets}


def _row(name: str, r: dict[str, Any], fl: dict[str, Any], direct: float | None) -> str:
    if "error" in r:
        return f"| {name} | failed: {r['error'].splitlines()[0][:160]} | | | | | | |"
    med = r["median_s"]
    floor_s = fl["two_links_rate_s"] if name == "striped" and "two_links_rate_s" in fl else fl["rate_s"]
    stream_s = fl["two_links_stream_s"] if name == "striped" and "two_links_stream_s" in fl else fl["stream_s"]
    vs_direct = f"{direct / med:.2f}" if direct else "-"
    live = "yes" if not r["missing"] else f"no: {', '.join(r['missing'])}"
    if "digests_checked" in r:  # a mesh method: every version applied, checked against the trainer's digest
        live += f", digests {'ok' if not r['wrong'] else 'WRONG ' + ', '.join(r['wrong'])} " \
            f"({r['digests_checked']} checked)"
    return (f"| {name} | {med:.2f} | {r['min_s']:.2f}-{r['max_s']:.2f} | {med / floor_s:.2f} | {med / stream_s:.2f} | "
            f"{vs_direct} | {live}, torn {r['torn_tensors']} | {t_sent(r)[7:]} |")


def table(result: dict[str, Any]) -> str:
    """The results as the text the benchmark prints (Markdown tables)."""
    m, fl, a = result["methods"], result["floor"], result["args"]
    direct = m.get("direct", {}).get("median_s")
    lines = [f"Floor: {a['state_bytes'] * HOSTS / 1e6:.0f} MB across T's link: {fl['rate_s']:.2f} s at "
             f"{a['rate_mbit']:g} Mbit/s, {fl['stream_s']:.2f} s at the measured stream"
             + (f"; two links {fl['two_links_rate_s']:.2f} s / {fl['two_links_stream_s']:.2f} s"
                if "two_links_rate_s" in fl else ""), "",
             "| method | median s | min-max s | x floor (rate) | x floor (stream) | direct / method | every subscriber "
             "live | T sent, all versions |", "|---|---|---|---|---|---|---|---|"]
    if "floor" in a["methods"]:
        over = f"{direct / fl['rate_s']:.2f}" if direct else "-"  # (no direct push run: no ratio)
        lines.append(f"| floor | {fl['rate_s']:.2f} | (stream {fl['stream_s']:.2f}) | 1.00 | "
                     f"{fl['rate_s'] / fl['stream_s']:.2f} | {over} | - | - |")
    for name in ("direct", "relays", "striped", "gloo"):
        if name in m:
            lines.append(_row(name, m[name], fl, direct))
    mesh_direct = m.get("mesh-direct", {}).get("median_s")
    for name in ("mesh-direct", "mesh-relays"):
        if name in m:
            lines.append(_row(name, m[name], fl, mesh_direct))
    kwargs = [f"{n}: Publisher({', '.join(f'{k}={v!r}' for k, v in m[n]['publisher_kwargs'].items())})"
              for n in ("direct", "relays", "striped") if m.get(n, {}).get("publisher_kwargs") is not None]
    if kwargs:
        lines += ["", "Switches passed: " + "; ".join(kwargs) + " (with delta=False)."]
    lines += mesh_lines(m)
    for name in ("stop", "kill"):
        if name not in m:
            continue
        r = m[name]
        lines += ["", f"Fault run `{name}`:"]
        if "error" in r:
            lines.append(f"failed: {r['error']}")
            continue
        f = r["fault"]
        inj = "not injected (the version finished first)" if f["injected_after_s"] is None \
            else f"{f['signal']} to {f['victim']} at {f['injected_after_s']:.2f} s"
        inj += f" ({t_sent(r)}, warm-up included)"
        lines += [f"{inj}; per subscriber: live s from the publish's start / the publish report's result", "",
                  "| subscriber | live s | status | seconds | relayed_by | error |", "|---|---|---|---|---|---|"]
        for n, s in f["live_s"].items():
            res = f["results"].get(n, {})
            lines.append(f"| {n} | {'-' if s is None else f'{s:.2f}'} | {res.get('status', '-')} | "
                         f"{res.get('seconds', 0):.2f} | {res.get('relayed_by')} | {(res.get('error') or '')[:120]} |")
    lines += ["", "Targets (issue):", ""]
    for t in result["summary"]["targets"]:
        v = "-" if t["value"] is None else f"{t['value']:.2f}"
        lines.append(f"- {t['target']}: {v} -> {_check(t['holds'])}")
    return "\n".join(lines)


def mesh_lines(m: dict[str, Any]) -> list[str]:
    """What the mesh rows measure, the ratio mesh-direct / mesh-relays, and per mesh method when
    the publishes returned and any result not DONE."""
    ran = {n: m[n] for n in ("mesh-direct", "mesh-relays") if n in m}
    if not ran:
        return []
    some = next(iter(ran.values()))
    out = ["", f"Mesh rows: {some.get('trainer_ranks', 2)} trainer ranks on T (every tensor Shard(0) over them), "
           "one tp=1 replica per generator process (each needs the whole state: from each trainer rank the same "
           "bytes); time = from the first trainer rank's publish() start until the last replica had the version "
           "committed and applied (its leader tries commit() once every trainer rank signalled that its "
           f"publish() returned, and every {1e3 * (some.get('poll_s') or 0):g} ms besides); every version "
           "applied is checked against trainer rank 0's digest; `direct / method` of the mesh rows is against "
           "mesh-direct."]
    ok = {n: r for n, r in ran.items() if "error" not in r}
    if "mesh-direct" in ok and "mesh-relays" in ok:
        out.append(f"mesh-direct / mesh-relays: {ok['mesh-direct']['median_s'] / ok['mesh-relays']['median_s']:.2f}")
    for n, r in ok.items():
        p = r["published"]
        kw = ", ".join(f"{k}={v!r}" for k, v in (r.get("publisher_kwargs") or {}).items())
        relayed = sorted({f"{g} via {by}" for ranks in r["relayed_by"] for g, by in ranks.items() if by})
        out.append(f"{n}: MeshPublisher({kw}); every trainer rank's publish() returned after median "
                   f"{p['median_s']:.2f} s ({p['min_s']:.2f}-{p['max_s']:.2f}), the last replica applied "
                   f"{r['after_publish']['median_s']:.2f} s after that (median); results not done: "
                   f"{'; '.join(r['not_done'][:6]) or 'none'}; relayed in the last version: "
                   f"{', '.join(relayed) or 'none'}; commit() calls: {r['commit_polls']['calls']} taking "
                   f"{r['commit_polls']['seconds']:.2f} s in all; relay events: {relay_events(r)}.")
    return out


def relay_events(r: dict[str, Any]) -> str:
    """How many of each relay event the trainer ranks recorded (all versions, warm-up included)."""
    counts: dict[str, int] = {}
    for e in r.get("relay_events", []):
        counts[e["event"]] = counts.get(e["event"], 0) + 1
    return ", ".join(f"{k} {v}" for k, v in sorted(counts.items())) or "none"


def markdown(result: dict[str, Any]) -> str:
    mach, a = result["machine"], result["args"]
    head = [f"# Fan-out: T -> 2 hosts x {a['per_host']} generators over shaped links ({result['date']})", "",
            f"Machine: {mach['cpu']}, {mach['nproc']} cores, {mach['memory_gib']} GiB, no GPU; {result['platform']}; "
            f"torch {mach['torch']}. {library_line(result['library'])}", "",
            f"Command: `{result['command']}`. Methods run: {', '.join(a['methods'])}.", "",
            f"Fabric: hosts T, A, B as network namespaces, two NICs each (veth into one switch bridge per NIC), "
            f"every link tbf-shaped to {a['rate_mbit']:g} Mbit/s each way; state {a['state_bytes'] / 1e6:.0f} MB "
            f"bf16, Llama-shaped; {a['warmup']} untimed + {a['reps']} timed versions per method; time = from the "
            "publish's start (gloo: rank 0's start after a barrier) until the last subscriber's wait returned "
            "(the mesh methods: see below the table), all clocks on this one machine.", "",
            refs_line(result["refs"], _Args(a)) + ".", "",
            f"Other load during the run: {result['load']}.", ""]
    head += [f"Note: {n}" for n in a.get("note", [])]
    return "\n".join([*head, "", table(result), ""])


class _Args:
    def __init__(self, a: dict[str, Any]) -> None:
        self.state_bytes, self.rate_mbit = a["state_bytes"], a["rate_mbit"]
