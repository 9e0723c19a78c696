"""The two roles of the RL loop, each an async function run in its own process (or Ray actor).

* **trainer**: owns the policy and the optimizer. Each step it takes the newest rollout batch of
  every generator that has one (never waiting for a particular generator), does one
  policy-gradient step, and publishes the new weights with ``transport.weights.Publisher``.
* **generator**: generates rollouts continuously with whatever weights version is live,
  applies newer versions between batches (``Subscriber.apply``), tags each batch with the
  version that produced it, and writes it one-sidedly into its inbox in the trainer's memory.

Rollouts travel over ``transport`` too: the trainer registers one inbox per generator name;
a generator ``put``s a batch and rings ``batch.<name>``; the trainer copies it and rings
``ack`` back, which lets the generator send the next one (so an inbox is never overwritten
while it is being read). A replacement generator (same name, new process) simply continues.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import anyio
import torch

import transport
from transport.weights import Publisher, Subscriber, SyncStatus

from .policy import Policy, generate, group_advantages, policy_gradient_loss, prompts, reward

log = logging.getLogger("rlhf_sync")


@dataclass
class Config:
    store: str
    out: str
    generators: list[str] = field(default_factory=lambda: ["gen-0", "gen-1"])
    steps: int = 300
    backends: list[str] | None = None
    digits: int = 5  # K: prompt length
    prompts_per_batch: int = 16
    group: int = 8  # samples per prompt (GRPO group)
    hidden: int = 128
    lr: float = 3e-3
    seed: int = 0
    deadline: float = 5.0  # publish deadline per generator
    timeout: float = 60.0  # bound on every other wait
    slow: dict[str, float] = field(default_factory=dict)  # generator -> extra seconds per batch
    notify: str | None = None  # a peer (the launcher) told about each finished step

    @property
    def batch(self) -> int:
        return self.prompts_per_batch * self.group

    @property
    def seq_len(self) -> int:
        return 2 * self.digits + 2

    @property
    def inbox_words(self) -> int:
        # [seq, version, tokens (batch x seq_len), rewards in micro-units (batch), seq]
        return 3 + self.batch * self.seq_len + self.batch


def _encode(cfg: Config, seq: int, version: int, seqs: torch.Tensor, rewards: torch.Tensor) -> torch.Tensor:
    body = torch.cat([seqs.reshape(-1), (rewards * 1e6).round().long()])
    return torch.cat([torch.tensor([seq, version]), body, torch.tensor([seq])])


def _decode(cfg: Config, rec: torch.Tensor) -> tuple[int, int, torch.Tensor, torch.Tensor]:
    n = cfg.batch * cfg.seq_len
    seqs = rec[2 : 2 + n].view(cfg.batch, cfg.seq_len).clone()
    rewards = rec[2 + n : 2 + n + cfg.batch].double().div(1e6).float()
    return int(rec[0]), int(rec[1]), seqs, rewards


# -- trainer ----------------------------------------------------------------------------------


async def _collect(
    t: transport.Transport, cfg: Config, inboxes: dict[str, torch.Tensor], consumed: dict[str, int], tg
) -> list[tuple[str, int, torch.Tensor, torch.Tensor]]:
    """Waits (bounded) until at least one generator has a new batch; takes every new one."""
    with anyio.fail_after(cfg.timeout):
        while True:
            got = []
            for g, box in inboxes.items():
                seq = t.signal_value(f"batch.{g}")
                if seq is None or seq <= consumed.get(g, 0):
                    continue
                rec = box.clone()  # the generator waits for our ack before writing again
                head, version, seqs, rewards = _decode(cfg, rec)
                if head != seq or int(rec[-1]) != seq:
                    continue  # a record from a generator being replaced; take the next one
                consumed[g] = seq
                got.append((g, version, seqs, rewards))
                tg.start_soon(_ack, t, g, seq, cfg)
            if got:
                return got
            await anyio.sleep(0.002)


async def _ack(t: transport.Transport, g: str, seq: int, cfg: Config) -> None:
    try:
        await t.signal(g, "ack", seq, timeout=cfg.timeout)
    except transport.TransportError as exc:  # it died or is being replaced: its successor needs no ack
        log.info("ack to %s not delivered: %s", g, exc)


async def trainer(cfg: Config) -> dict:
    torch.manual_seed(cfg.seed)
    policy = Policy(cfg.hidden)
    opt = torch.optim.Adam(policy.parameters(), lr=cfg.lr)
    history: list[dict] = []
    async with transport.Transport("trainer", store=cfg.store, backends=cfg.backends, timeout=cfg.timeout) as t:
        inboxes = {g: t.empty(f"inbox.{g}", cfg.inbox_words, torch.int64) for g in cfg.generators}
        async with Publisher(t, policy, deadline=cfg.deadline) as pub, anyio.create_task_group() as tg:
            await pub.publish(0)
            consumed: dict[str, int] = {}
            for step in range(1, cfg.steps + 1):
                t_wait = time.perf_counter()
                batches = await _collect(t, cfg, inboxes, consumed, tg)
                t_train = time.perf_counter()
                seqs = torch.cat([b[2] for b in batches])
                rewards = torch.cat([b[3] for b in batches])
                loss = policy_gradient_loss(policy, seqs, group_advantages(rewards, cfg.group), cfg.digits)
                opt.zero_grad()
                loss.backward()
                opt.step()
                t_pub = time.perf_counter()
                report = await pub.publish(step)
                row = {
                    "step": step,
                    "reward": round(float(rewards.mean()), 4),
                    "batches": {b[0]: b[1] for b in batches},  # generator -> version that produced it
                    "staleness_mean": round(sum(step - 1 - b[1] for b in batches) / len(batches), 3),
                    "staleness_max": max(step - 1 - b[1] for b in batches),
                    "sync_s": {g: round(r.seconds, 5) for g, r in report.results.items()},
                    "sync_status": {g: r.status.value for g, r in report.results.items()},
                    "wait_s": round(t_train - t_wait, 4),
                    "train_s": round(t_pub - t_train, 4),
                    "publish_s": round(report.seconds, 4),
                }
                history.append(row)
                syncs = "  ".join(
                    f"{g} {r.seconds * 1e3:6.1f}ms{'' if r.status == SyncStatus.DONE else ' ' + r.status.value}"
                    for g, r in sorted(report.results.items())
                )
                print(f"step {step:4d}  reward {row['reward']:.3f}  "
                      f"staleness {row['staleness_mean']:.1f} (max {row['staleness_max']})  "
                      f"batches {len(batches)}  sync: {syncs}", flush=True)
                if cfg.notify:
                    tg.start_soon(_notify, t, cfg.notify, step)
            for g in cfg.generators:
                tg.start_soon(_stop, t, g)
    return {"history": history}


async def _notify(t: transport.Transport, peer: str, step: int) -> None:
    try:
        await t.signal(peer, "step", step, timeout=5)
    except transport.TransportError:
        pass


async def _stop(t: transport.Transport, g: str) -> None:
    try:
        await t.signal(g, "stop", 1, timeout=10)
    except transport.TransportError:
        pass


# -- generator --------------------------------------------------------------------------------


async def generator(cfg: Config, name: str) -> dict:
    torch.set_num_threads(1)
    policy = Policy(cfg.hidden)
    rng = torch.Generator().manual_seed(cfg.seed * 1000 + cfg.generators.index(name) + int(time.time()) % 1000)
    slow = cfg.slow.get(name, 0.0)
    produced = 0
    async with transport.Transport(name, store=cfg.store, backends=cfg.backends, timeout=cfg.timeout) as t:
        async with Subscriber(t, policy, publisher="trainer") as sub:
            await sub.pull()  # a new or replacement generator starts from the latest version
            if sub.version is None:
                await sub.wait_version(0, timeout=cfg.timeout)
            last_seq = None
            while t.signal_value("stop") is None:
                await sub.apply_async()  # between batches: the newest complete version, never a torn one;
                # the copy runs in a worker thread, so the agent and the doorbell keep running
                version = sub.version
                assert version is not None  # pulled or waited for before the loop
                pr = prompts(cfg.prompts_per_batch, cfg.digits, rng).repeat_interleave(cfg.group, 0)
                seqs = generate(policy, pr, rng)
                r = reward(seqs, cfg.digits)
                if slow:
                    time.sleep(slow)  # a generator busy elsewhere: its event loop does not run
                if last_seq is not None:
                    try:
                        await t.wait_signal("ack", at_least=last_seq, timeout=1.0)
                    except transport.TransferTimeoutError:
                        continue  # the trainer has not taken the last one yet: regenerate fresher
                seq = time.time_ns()
                try:
                    await t.put(_encode(cfg, seq, version, seqs, r), "trainer", key=f"inbox.{name}")
                    await t.signal("trainer", f"batch.{name}", seq)
                except (transport.PeerLostError, transport.PeerNotFoundError):
                    break  # the trainer finished
                last_seq = seq
                produced += 1
    return {"name": name, "batches": produced}


def run_role(role: str, cfg_dict: dict, name: str | None = None) -> dict:
    """Process / actor entry point."""
    import trio

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(processName)s %(name)s: %(message)s")
    cfg = Config(**cfg_dict)
    if role == "trainer":
        result = trio.run(trainer, cfg)
        Path(cfg.out).mkdir(parents=True, exist_ok=True)
        (Path(cfg.out) / "trainer.json").write_text(json.dumps({"config": asdict(cfg), **result}))
        return {"steps": len(result["history"])}
    if name is None:
        raise ValueError("a generator needs a name")
    return trio.run(generator, cfg, name)
