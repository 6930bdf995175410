"""A real Prometheus server scrapes a running ``asyncppo up``; promtool lints every role's /metrics.

The scrape job is the shipped one (``asyncppo-local`` in deploy/prometheus/prometheus.yml), moved
to free ports: its targets must follow the launcher's port layout (broker on the base port,
learner on base + 1, actors from base + 10), so only the base changes.
"""

from __future__ import annotations

import json
import shutil
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request

import pytest
import yaml
from conftest import ROOT, free_port
from test_roles import get, steps_of, wait_for

from common.lifecycle import spawn

PROMETHEUS, PROMTOOL = shutil.which("prometheus"), shutil.which("promtool")
pytestmark = [
    pytest.mark.system,
    pytest.mark.skipif(
        not (PROMETHEUS and PROMTOOL),
        reason="needs Debian's prometheus package (prometheus and promtool on PATH)",
    ),
]
ACTORS = 2


def free_base_port() -> int:
    """A base port whose launcher layout (base, base + 1, base + 10 ...) is free right now."""
    for _ in range(100):
        base = free_port()
        ports = [base, base + 1, *(base + 10 + i for i in range(ACTORS))]
        try:
            for port in ports:
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port))
        except OSError:
            continue
        return base
    raise RuntimeError("no free block of metrics ports")


def scrape_config(base: int) -> dict:
    """The shipped local job, its targets moved from the shipped base port to ``base``."""
    shipped = yaml.safe_load((ROOT / "deploy/prometheus/prometheus.yml").read_text())
    job = next(j for j in shipped["scrape_configs"] if j["job_name"] == "asyncppo-local")
    ports = {
        g["labels"]["role"]: [int(t.rsplit(":", 1)[1]) for t in g["targets"]]
        for g in job["static_configs"]
    }
    shipped_base = ports["broker"][0]
    assert ports["learner"] == [shipped_base + 1]
    assert ports["actor"][0] == shipped_base + 10 and ports["actor"] == sorted(ports["actor"])
    for group in job["static_configs"]:
        group["targets"] = [
            f"127.0.0.1:{int(t.rsplit(':', 1)[1]) - shipped_base + base}" for t in group["targets"]
        ][:ACTORS]
    return {"global": {"scrape_interval": "1s", "scrape_timeout": "1s"}, "scrape_configs": [job]}


def query(prom: str, expr: str) -> list[dict]:
    url = f"{prom}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    reply = json.loads(urllib.request.urlopen(url, timeout=5).read())
    assert reply["status"] == "success", reply
    return reply["data"]["result"]


def value(prom: str, expr: str) -> float:
    """The one value of an expression that must yield exactly one series (-1 while it has none)."""
    result = query(prom, expr)
    return float(result[0]["value"][1]) if len(result) == 1 else -1.0


@pytest.mark.timeout(300)
def test_prometheus_scrapes_a_running_up_and_promtool_accepts_every_role(
    tmp_path, tiny_model, procs
):
    base, endpoint = free_base_port(), f"tcp://127.0.0.1:{free_port()}"
    run_dir = tmp_path / "run"
    settings = {
        "model.path": tiny_model,
        "run.out_dir": run_dir,
        "learner.total_steps": 0,
        "run.num_actors": ACTORS,
        "run.metrics_base_port": base,
        "broker.bind": endpoint,
        "actor.broker": endpoint,
        "learner.broker": endpoint,
    }
    overrides = [a for k, v in settings.items() for a in ("--set", f"{k}={v}")]
    up = procs.start(["up", "--config", "configs/smoke.yaml", *overrides], tmp_path / "up.log")
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(scrape_config(base)))
    check = subprocess.run(
        [PROMTOOL, "check", "config", str(tmp_path / "prometheus.yml")],
        capture_output=True,
        text=True,
    )
    assert check.returncode == 0, check.stdout + check.stderr
    prom_port = free_port()
    prom = f"http://127.0.0.1:{prom_port}"
    command = [
        PROMETHEUS,
        f"--config.file={tmp_path / 'prometheus.yml'}",
        f"--storage.tsdb.path={tmp_path / 'tsdb'}",
        f"--web.listen-address=127.0.0.1:{prom_port}",
        "--log.level=warn",
    ]
    with open(tmp_path / "prometheus.log", "wb") as log:
        procs.procs.append(spawn(command, stdout=log, stderr=subprocess.STDOUT))

    wait_for(lambda: get(f"{prom}/-/ready")[0] == 200, 60, "Prometheus to start", [up])
    trained = 'asyncppo_learner_action_tokens_trained_total{job="asyncppo-local",role="learner"}'
    accepted = 'asyncppo_broker_trajectories_accepted_total{job="asyncppo-local",role="broker"}'
    wait_for(
        lambda: value(prom, trained) > 0 and value(prom, accepted) > 0,
        240,
        "Prometheus to see trained tokens and accepted trajectories",
        [up],
    )
    first = {expr: value(prom, expr) for expr in (trained, accepted)}
    n = len(steps_of(run_dir))
    wait_for(lambda: len(steps_of(run_dir)) >= n + 2, 180, "two more learner steps", [up])
    time.sleep(2)  # two scrape intervals
    for expr, before in first.items():
        assert value(prom, expr) > before, f"{expr} did not rise"
    assert value(prom, f"increase({trained}[1m])") > 0
    targets = query(prom, 'up{job="asyncppo-local"}')
    assert sorted(t["metric"]["role"] for t in targets) == ["actor"] * ACTORS + [
        "broker",
        "learner",
    ]
    assert all(t["value"][1] == "1" for t in targets), targets

    for port in (base, base + 1, *(base + 10 + i for i in range(ACTORS))):
        status, text = get(f"http://127.0.0.1:{port}/metrics")
        assert status == 200
        lint = subprocess.run([PROMTOOL, "check", "metrics"], input=text, capture_output=True)
        assert lint.returncode == 0 and not lint.stdout.strip(), (port, lint.stdout + lint.stderr)
        for path in ("/healthz", "/readyz"):
            status, body = get(f"http://127.0.0.1:{port}{path}")
            assert status == 200 and json.loads(body)["alive"], (port, path, body)
    up.send_signal(signal.SIGINT)
    assert up.wait(timeout=90) == 0, (tmp_path / "up.log").read_text()[-3000:]
