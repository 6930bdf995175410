"""Roles on separate hosts: broker, learner and two actors, each in its own network namespace.

The test builds the network itself: one namespace per role, and a veth cable from each client
namespace to the broker's (10.77.<i>.2 on the client end, 10.77.<i>.1 on the broker's), which
routes between them (weight chunks go from peer to peer). Every namespace has only its loopback
and its cable, so a role that silently used localhost or the wrong address could not reach the
broker or a peer. Nothing outside these namespaces is touched: no
address is added to the host, and no packet leaves them. Skips, saying why, where namespaces
cannot be made (not root, no veth, a container without CAP_SYS_ADMIN).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import ROOT, free_port
from test_roles import steps_of, wait_for

from common.lifecycle import spawn

CLIENTS = ("learner", "a1", "a2")
STATS_PROBE = (
    "import json, sys; from common.config import SecurityConfig; "
    "from common.transport import Client, Endpoint; "
    "c = Client(Endpoint(SecurityConfig(), 1 << 20), sys.argv[1], 'probe', timeout_s=10); "
    "print(json.dumps(c.request('STATS').header['stats']))"
)


pytestmark = pytest.mark.system  # every test here starts real processes


def ip(*args: str) -> None:
    out = subprocess.run(["ip", *args], capture_output=True, text=True)
    if out.returncode:
        raise OSError(f"ip {' '.join(args)}: {out.stderr.strip()}")


class Hosts:
    """Network namespaces named ``<prefix>-<role>``; the broker's is the hub of the veth cables."""

    def __init__(self, prefix: str):
        self.prefix = prefix
        self.made: list[str] = []

    def ns(self, role: str) -> str:
        return f"{self.prefix}-{role}"

    def broker_address(self, client: str) -> str:
        return f"10.77.{CLIENTS.index(client) + 1}.1"

    def client_address(self, client: str) -> str:
        return f"10.77.{CLIENTS.index(client) + 1}.2"

    def build(self) -> None:
        for role in ("broker", *CLIENTS):
            ip("netns", "add", self.ns(role))
            self.made.append(self.ns(role))
            ip("-n", self.ns(role), "link", "set", "lo", "up")
        hub = self.ns("broker")
        for i, client in enumerate(CLIENTS, start=1):
            ip(
                "-n",
                hub,
                "link",
                "add",
                f"veth{i}",
                "type",
                "veth",
                "peer",
                "name",
                "eth0",
                "netns",
                self.ns(client),
            )
            ip("-n", hub, "addr", "add", f"{self.broker_address(client)}/24", "dev", f"veth{i}")
            ip(
                "-n",
                self.ns(client),
                "addr",
                "add",
                f"{self.client_address(client)}/24",
                "dev",
                "eth0",
            )
            ip("-n", hub, "link", "set", f"veth{i}", "up")
            ip("-n", self.ns(client), "link", "set", "eth0", "up")
            # Peers reach each other's chunk servers through the hub (docs/protocol.md §6.3).
            ip("-n", self.ns(client), "route", "add", "default", "via", self.broker_address(client))
        self.run("broker", ["sysctl", "-qw", "net.ipv4.ip_forward=1"], check=True)

    def remove(self) -> None:
        for name in self.made:
            subprocess.run(["ip", "netns", "del", name], capture_output=True)

    def run(self, role: str, args: list[str], **kw) -> subprocess.CompletedProcess:
        return subprocess.run(
            ["ip", "netns", "exec", self.ns(role), *args],
            capture_output=True,
            text=True,
            cwd=ROOT,
            **kw,
        )

    def cable_bytes(self, client: str) -> int:
        """Bytes the client's namespace sent over its cable (kernel counters, not a probe in time)."""
        out = self.run(client, ["ip", "-j", "-s", "link", "show", "dev", "eth0"], check=True)
        return json.loads(out.stdout)[0]["stats64"]["tx"]["bytes"]

    def start(self, procs, role: str, args: list[str], log) -> subprocess.Popen:
        """``asyncppo <args>`` on the host ``role`` (ip netns exec execs it: the pid is the role's)."""
        cmd = ["ip", "netns", "exec", self.ns(role), sys.executable, "-m", "deploy.cli", *args]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        with open(log, "wb") as out:
            proc = spawn(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
        procs.procs.append(proc)
        return proc


@pytest.fixture
def hosts(procs):
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root")
    made = Hosts(f"appo{os.getpid()}")
    try:
        made.build()
    except OSError as exc:
        made.remove()
        pytest.skip(f"cannot build network namespaces here: {exc}")
    yield made
    procs.close()  # the roles go before their network does
    made.remove()


@pytest.mark.timeout(300)
def test_roles_in_separate_network_namespaces_train_together(tmp_path, tiny_model, procs, hosts):
    port = free_port()
    common = ["--config", "configs/smoke.yaml", "--set", f"model.path={tiny_model}"]
    common += ["--set", f"run.out_dir={tmp_path}", "--set", "learner.total_steps=3"]

    def start(host: str, role: str, *settings: str) -> subprocess.Popen:
        args = [role, *common, *(a for s in settings for a in ("--set", s))]
        return hosts.start(procs, host, args, tmp_path / f"{host}.log")

    def to_broker(host: str) -> str:
        return f"tcp://{hosts.broker_address(host)}:{port}"

    broker = start("broker", "broker", f"broker.bind=tcp://0.0.0.0:{port}")
    learner = start("learner", "learner", f"learner.broker={to_broker('learner')}")
    actors = [
        start(name, "actor", f"actor.id={name}", f"actor.broker={to_broker(name)}")
        for name in ("a1", "a2")
    ]
    # Each actor reaches the broker over its own cable, from its own address; its connection lasts
    # as long as it runs. The learner's may last under a second (a fast learner finds the batches
    # waiting, takes its 3 steps and leaves between two probes), so it is proven by what survives
    # it: it exits 0, and its cable, the only way out of its namespace, carried its traffic.
    expected = {hosts.client_address(a) for a in ("a1", "a2")}
    seen: set[str] = set()

    def actors_seen() -> bool:
        out = hosts.run("broker", ["ss", "-Htn", "state", "established", f"( sport = :{port} )"])
        seen.update(line.split()[-1].rsplit(":", 1)[0] for line in out.stdout.splitlines())
        return seen >= expected

    try:
        wait_for(actors_seen, 240, "the actors' connections", [broker, *actors])
    except AssertionError as exc:
        raise AssertionError(f"{exc}; seen only {sorted(seen)}") from None
    assert seen <= expected | {hosts.client_address("learner")}, seen

    assert learner.wait(timeout=240) == 0, (tmp_path / "learner.log").read_text()[-3000:]
    assert hosts.cable_bytes("learner") > 0
    steps = steps_of(tmp_path)
    assert len(steps) == 3 and {"a1", "a2"} <= {a for s in steps for a in s["actors"]}
    out = hosts.run("a1", [sys.executable, "-c", STATS_PROBE, to_broker("a1")])
    assert out.returncode == 0, out.stderr
    stats = json.loads(out.stdout)
    assert stats["policy_version"] == len(steps) and stats["rejected_invalid"] == 0
    assert {"a1", "a2"} <= set(stats["actor_versions"])
    assert min(stats["actor_versions"].values()) >= 1  # both loaded weights the learner published
