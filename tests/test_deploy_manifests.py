"""Offline checks of the deployment files: Kubernetes manifests, Prometheus config, Grafana dashboard.

Nothing here needs a cluster. The manifests are validated against the Kubernetes OpenAPI schemas
shipped by `kubernetes-validate`, then checked for the wiring a schema cannot see (services that
select no pod, mounts of undeclared volumes, config paths no volume provides). PromQL in the
dashboard may only name metrics the processes export.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
K8S_DIR = ROOT / "deploy" / "k8s"
PROMETHEUS_YML = ROOT / "deploy" / "prometheus" / "prometheus.yml"
DASHBOARD_JSON = ROOT / "deploy" / "grafana" / "asyncppo.json"

# Oldest Kubernetes release still in common managed offerings, and the newest schema shipped.
K8S_VERSIONS = ("1.30", "1.37")
METRICS_PORT = 9100
BROKER_PORT = 5555
WORKLOAD_KINDS = ("Deployment", "StatefulSet")

WEIGHT_PHASES = {  # docs/architecture.md, Weights: the pause apart from the transfer
    f"asyncppo_actor_weights_{phase}_seconds"
    for phase in ("pause", "first_byte", "transfer", "verify", "load")
}
HISTOGRAMS = WEIGHT_PHASES | {
    "asyncppo_learner_staleness",
    "asyncppo_learner_step_seconds",
    "asyncppo_actor_episode_reward",
    "asyncppo_actor_weight_sync_seconds",
}
KNOWN_METRICS = HISTOGRAMS | {
    "asyncppo_build_info",
    "asyncppo_broker_trajectories_received_total",
    "asyncppo_broker_trajectories_accepted_total",
    "asyncppo_broker_trajectories_rejected_total",
    "asyncppo_broker_trajectories_dropped_total",
    "asyncppo_broker_queue_items",
    "asyncppo_broker_queue_bytes",
    "asyncppo_broker_permits_granted_total",
    "asyncppo_broker_permits_in_use",
    "asyncppo_broker_actors_connected",
    "asyncppo_broker_policy_version",
    "asyncppo_broker_bytes_received_total",
    "asyncppo_broker_bytes_sent_total",
    "asyncppo_learner_steps_total",
    "asyncppo_learner_action_tokens_trained_total",
    "asyncppo_learner_trajectories_trained_total",
    "asyncppo_learner_policy_loss",
    "asyncppo_learner_value_loss",
    "asyncppo_learner_icepop_kept_fraction",
    "asyncppo_learner_importance_weight_mean",
    "asyncppo_learner_importance_weight_max",
    "asyncppo_learner_clip_fraction",
    "asyncppo_learner_approx_kl",
    "asyncppo_learner_explained_variance",
    "asyncppo_learner_grad_norm",
    "asyncppo_learner_reward_mean",
    "asyncppo_learner_idle_seconds_total",
    "asyncppo_learner_last_step_timestamp_seconds",
    "asyncppo_learner_policy_version",
    "asyncppo_actor_tokens_generated_total",
    "asyncppo_actor_episodes_total",
    "asyncppo_actor_segments_sent_total",
    "asyncppo_actor_policy_version",
    "asyncppo_actor_hacks_intercepted_total",
    "asyncppo_weights_bytes_served_total",
    "asyncppo_weights_bytes_fetched_total",
}
# One metric per view the dashboard must show.
REQUIRED_ON_DASHBOARD = WEIGHT_PHASES | {
    "asyncppo_broker_trajectories_accepted_total",
    "asyncppo_learner_action_tokens_trained_total",
    "asyncppo_learner_reward_mean",
    "asyncppo_learner_staleness",
    "asyncppo_learner_icepop_kept_fraction",
    "asyncppo_broker_queue_items",
    "asyncppo_broker_queue_bytes",
    "asyncppo_actor_weight_sync_seconds",
    "asyncppo_broker_actors_connected",
    "asyncppo_broker_trajectories_rejected_total",
    "asyncppo_learner_idle_seconds_total",
}
METRIC_NAME = re.compile(r"asyncppo_\w+")
HISTOGRAM_SERIES = re.compile(r"_(bucket|sum|count)$")


# ---------------------------------------------------------------- loading


def k8s_documents() -> list[tuple[str, dict[str, Any]]]:
    """Every non-empty YAML document under deploy/k8s, with the file it came from."""
    documents = []
    for path in sorted(K8S_DIR.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                documents.append((path.name, doc))
    return documents


def find(kind: str, name: str) -> dict[str, Any]:
    matches = [d for _, d in k8s_documents() if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(matches) == 1, f"expected exactly one {kind}/{name} in {K8S_DIR}, got {len(matches)}"
    return matches[0]


def workloads() -> list[dict[str, Any]]:
    return [d for _, d in k8s_documents() if d["kind"] in WORKLOAD_KINDS]


def container(workload: dict[str, Any]) -> dict[str, Any]:
    """The single asyncppo container of a workload (one role per pod)."""
    containers = workload["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1, f"{workload['metadata']['name']}: one container per pod expected"
    return containers[0]


def role_of(workload: dict[str, Any]) -> str:
    """The asyncppo subcommand the pod runs: the argument after `asyncppo` or `-m deploy.cli`."""
    c = container(workload)
    argv = c["command"] + c.get("args", [])
    roles = [arg for arg in argv if arg in ("broker", "learner", "actor")]
    assert len(roles) == 1, f"{workload['metadata']['name']}: no single role in {argv}"
    return roles[0]


def run_config() -> dict[str, Any]:
    return yaml.safe_load(find("ConfigMap", "asyncppo-config")["data"]["config.yaml"])


def mounted_files(workload: dict[str, Any]) -> set[str]:
    """Absolute paths of files the pod sees from ConfigMap and Secret volumes."""
    spec = workload["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    files = set()
    for mount in container(workload)["volumeMounts"]:
        source = volumes.get(mount["name"], {})
        items = (source.get("secret") or source.get("configMap") or {}).get("items", [])
        files |= {f"{mount['mountPath']}/{item['path']}" for item in items}
    return files


def is_under(path: str, directory: str) -> bool:
    return path == directory or path.startswith(directory.rstrip("/") + "/")


def claim_mounts(workload: dict[str, Any]) -> set[str]:
    """Mount paths backed by a persistent volume claim (direct or from volumeClaimTemplates)."""
    spec = workload["spec"]
    volumes = {v["name"]: v for v in spec["template"]["spec"]["volumes"]}
    templates = {t["metadata"]["name"] for t in spec.get("volumeClaimTemplates", [])}
    return {
        m["mountPath"]
        for m in container(workload)["volumeMounts"]
        if m["name"] in templates or "persistentVolumeClaim" in volumes.get(m["name"], {})
    }


def dashboard_panels() -> list[dict[str, Any]]:
    """All panels, including those nested in collapsed rows."""
    panels = []
    for panel in json.loads(DASHBOARD_JSON.read_text())["panels"]:
        panels.append(panel)
        panels.extend(panel.get("panels", []))
    return panels


def dashboard_exprs() -> list[str]:
    return [t["expr"] for p in dashboard_panels() for t in p.get("targets", [])]


def scrape_job(name: str) -> dict[str, Any]:
    jobs = yaml.safe_load(PROMETHEUS_YML.read_text())["scrape_configs"]
    matches = [j for j in jobs if j["job_name"] == name]
    assert len(matches) == 1, f"{PROMETHEUS_YML}: expected one scrape job {name!r}"
    return matches[0]


def relabel(labels: dict[str, str], rules: list[dict[str, Any]]) -> dict[str, str] | None:
    """Prometheus' `keep` and `replace` relabelling: anchored regex over `;`-joined sources."""
    labels = dict(labels)
    for rule in rules:
        action = rule.get("action", "replace")
        if action not in ("keep", "replace"):
            raise ValueError(f"relabel action {action!r} is not simulated by this test")
        value = ";".join(labels.get(name, "") for name in rule.get("source_labels", []))
        match = re.fullmatch(rule.get("regex", "(.*)"), value)
        if action == "keep" and match is None:
            return None
        if action == "replace" and match is not None:
            replacement = re.sub(r"\$(\d+)", r"\\\1", rule.get("replacement", "$1"))
            labels[rule["target_label"]] = match.expand(replacement)
    return labels


def meta_label(prefix: str, key: str) -> str:
    """Kubernetes service discovery's label name: non-alphanumerics become underscores."""
    return prefix + re.sub(r"[^a-zA-Z0-9_]", "_", key)


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    if shutil.which("promtool") is None:
        pytest.skip("promtool not installed (Debian/Ubuntu: apt-get install prometheus)")
    return subprocess.run(["promtool", *args], capture_output=True, text=True, timeout=60)


# ---------------------------------------------------------------- Kubernetes


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("name", sorted(p.name for p in K8S_DIR.glob("*.yaml")))
def test_manifest_matches_kubernetes_schema(name: str, version: str) -> None:
    kv = pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate")
    docs = [doc for file, doc in k8s_documents() if file == name]
    assert docs, f"{name} holds no Kubernetes object"
    for doc in docs:
        try:
            kv.validate(doc, version, strict=True)
        except kv.ValidationError as err:
            path = ".".join(str(p) for p in err.path)
            pytest.fail(f"{name}: {doc['kind']}/{doc['metadata']['name']} at {path}: {err.message}")


def test_strict_schema_rejects_a_misspelled_field() -> None:
    """Guards the test above: strict validation must catch a typo, not only wrong types."""
    kv = pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate")
    broker = find("Deployment", "asyncppo-broker")
    broken = json.loads(json.dumps(broker))
    broken["spec"]["template"]["spec"]["containers"][0]["livenesProbe"] = {"periodSeconds": 1}
    with pytest.raises(kv.ValidationError):
        kv.validate(broken, K8S_VERSIONS[-1], strict=True)


def test_objects_live_in_the_asyncppo_namespace() -> None:
    for name, doc in k8s_documents():
        if doc["kind"] != "Namespace":
            assert doc["metadata"].get("namespace") == "asyncppo", f"{name}: {doc['kind']}"


def test_every_pod_is_scraped_and_probed() -> None:
    for workload in workloads():
        name = workload["metadata"]["name"]
        annotations = workload["spec"]["template"]["metadata"]["annotations"]
        assert annotations["prometheus.io/scrape"] == "true", name
        assert annotations["prometheus.io/port"] == str(METRICS_PORT), name
        c = container(workload)
        assert c["image"] == "asyncppo:latest", name
        args = c["command"] + c["args"]
        assert args[args.index("--metrics-port") + 1] == str(METRICS_PORT), name
        assert args[args.index("--config") + 1] in mounted_files(workload), name
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        assert ports["metrics"] == METRICS_PORT, name
        for probe, path in (("livenessProbe", "/healthz"), ("readinessProbe", "/readyz")):
            assert c[probe]["httpGet"] == {"path": path, "port": "metrics"}, f"{name} {probe}"


def test_mounts_and_secret_items_resolve() -> None:
    secret_keys = set(find("Secret", "asyncppo-curve")["stringData"])
    config_keys = set(find("ConfigMap", "asyncppo-config")["data"])
    for workload in workloads():
        name = workload["metadata"]["name"]
        spec = workload["spec"]
        volumes = {v["name"]: v for v in spec["template"]["spec"]["volumes"]}
        declared = set(volumes) | {
            t["metadata"]["name"] for t in spec.get("volumeClaimTemplates", [])
        }
        for mount in container(workload)["volumeMounts"]:
            assert mount["name"] in declared, f"{name}: mount of undeclared volume {mount['name']}"
        for volume in volumes.values():
            if "secret" in volume:
                items = {item["key"] for item in volume["secret"]["items"]}
                assert items <= secret_keys, f"{name}: unknown Secret keys {items - secret_keys}"
            if "configMap" in volume:
                items = {item["key"] for item in volume["configMap"]["items"]}
                assert items <= config_keys, f"{name}: unknown ConfigMap keys {items - config_keys}"


def test_configmap_loads_as_a_cluster_config(tmp_path: Path) -> None:
    """The ConfigMap passes the real config loader (unknown keys and bad values fail there)."""
    from common.config import load_config

    path = tmp_path / "config.yaml"
    path.write_text(find("ConfigMap", "asyncppo-config")["data"]["config.yaml"])
    config = load_config(path)
    assert config.run.metrics_host == "0.0.0.0", "probes and scrapes come from outside the pod"
    assert config.model.builtin is None, "a cluster run must not build the tiny test model"
    assert config.actor.engine == "sglang"


def test_config_paths_are_provided_to_the_roles_that_read_them() -> None:
    """Each role finds its key files, allow-list, spool and checkpoint directory on a volume."""
    config = run_config()
    security = config["security"]
    assert security["curve"] is True
    needs = {
        "broker": [security["server_secret_key_file"]],
        "learner": [security["client_secret_key_file"], security["server_public_key_file"]],
        "actor": [security["client_secret_key_file"], security["server_public_key_file"]],
    }
    persistent = {
        "broker": [config["broker"]["spool_dir"]],
        "learner": [config["learner"]["checkpoint_dir"], config["run"]["out_dir"]],
    }
    by_role = {role_of(w): w for w in workloads()}
    assert set(by_role) == {"broker", "learner", "actor"}
    for role, workload in by_role.items():
        files = mounted_files(workload)
        assert set(needs[role]) <= files, f"{role}: {set(needs[role]) - files} not mounted"
        for path in persistent.get(role, []):
            on_claim = any(is_under(path, mount) for mount in claim_mounts(workload))
            assert on_claim, f"{role}: {path} is not on a persistent volume"
    broker_files = mounted_files(by_role["broker"])
    for key, role in (("authorized_keys_dir", "actor"), ("learner_keys_dir", "learner")):
        allowed = [f for f in broker_files if is_under(f, security[key])]
        assert allowed == [f"{security[key]}/{role}.key"], f"{key}: {allowed}"


def test_broker_service_matches_pod_and_config() -> None:
    config = run_config()
    service = find("Service", "asyncppo-broker")
    broker = find("Deployment", "asyncppo-broker")
    assert service["spec"]["selector"] == broker["spec"]["template"]["metadata"]["labels"]
    ports = {p["name"]: p for p in service["spec"]["ports"]}
    container_ports = {p["name"]: p["containerPort"] for p in container(broker)["ports"]}
    assert ports["zmq"]["port"] == BROKER_PORT
    assert set(container_ports) >= {p["targetPort"] for p in ports.values()}
    assert config["broker"]["bind"] == f"tcp://0.0.0.0:{container_ports['zmq']}"
    endpoint = f"tcp://{service['metadata']['name']}:{BROKER_PORT}"
    assert config["actor"]["broker"] == endpoint
    assert config["learner"]["broker"] == endpoint
    assert broker["spec"]["replicas"] == 1
    assert broker["spec"]["strategy"]["type"] == "Recreate", "two brokers must never share a spool"


def test_learner_runs_torchrun_on_gpus_with_a_checkpoint_claim() -> None:
    learner = find("StatefulSet", "asyncppo-learner")
    c = container(learner)
    assert c["command"] == ["torchrun"]
    assert c["args"][:4] == ["--nproc-per-node=gpu", "-m", "deploy.cli", "learner"]
    assert c["resources"]["limits"]["nvidia.com/gpu"] >= 1
    assert learner["spec"]["serviceName"] == find("Service", "asyncppo-learner")["metadata"]["name"]
    assert learner["spec"]["volumeClaimTemplates"], "checkpoints must outlive the pod"


def test_a_restarted_learner_pod_resumes_and_its_overrides_load(tmp_path: Path) -> None:
    """`--resume auto`: the first start has no checkpoint (plain `--resume` would fail there)."""
    from common.config import load_config
    from deploy.cli import build_parser

    args = container(find("StatefulSet", "asyncppo-learner"))["args"]
    parsed = build_parser().parse_args(args[args.index("learner") :])
    assert parsed.resume == "auto"
    path = tmp_path / "config.yaml"
    path.write_text(find("ConfigMap", "asyncppo-config")["data"]["config.yaml"])
    assert load_config(path, parsed.overrides).run.stall_timeout_s >= 120


def test_actors_scale_as_a_deployment_and_name_themselves_after_the_pod() -> None:
    actors = find("Deployment", "asyncppo-actors")
    c = container(actors)
    env = {e["name"]: e for e in c["env"]}
    assert env["ASYNCPPO_ACTOR_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert c["resources"]["limits"]["nvidia.com/gpu"] >= 1
    assert role_of(actors) == "actor"


# ---------------------------------------------------------------- Prometheus


def test_local_job_scrapes_the_launcher_ports() -> None:
    job = scrape_job("asyncppo-local")
    targets = {
        (target, group["labels"]["role"])
        for group in job["static_configs"]
        for target in group["targets"]
    }
    expected = {("localhost:9100", "broker"), ("localhost:9101", "learner")}
    expected |= {(f"localhost:{port}", "actor") for port in range(9110, 9118)}
    assert targets == expected


def test_kubernetes_job_turns_pod_annotations_into_metrics_targets() -> None:
    """Run the pod job's relabelling over each workload's pod metadata, as Prometheus would."""
    job = scrape_job("asyncppo-kubernetes")
    assert job["kubernetes_sd_configs"][0]["role"] == "pod"
    for workload in workloads():
        template = workload["spec"]["template"]["metadata"]
        discovered = {"__address__": "10.1.2.3:5555", "__metrics_path__": "/metrics"}
        for key, value in template["annotations"].items():
            discovered[meta_label("__meta_kubernetes_pod_annotation_", key)] = value
        for key, value in template["labels"].items():
            discovered[meta_label("__meta_kubernetes_pod_label_", key)] = value
        target = relabel(discovered, job["relabel_configs"])
        assert target is not None, f"{workload['metadata']['name']} is not scraped"
        assert target["__address__"] == f"10.1.2.3:{METRICS_PORT}"
        assert target["__metrics_path__"] == "/metrics"
        assert target["role"] == role_of(workload)

    unannotated = {"__address__": "10.1.2.4:8080"}
    assert relabel(unannotated, job["relabel_configs"]) is None, "pods must opt in to scraping"


@pytest.mark.system
def test_promtool_accepts_the_config(tmp_path: Path) -> None:
    """Full check where promtool knows Kubernetes discovery; else every other job is checked.

    Debian's prometheus package is built without kubernetes_sd_configs, so there the Kubernetes
    job is left out and covered by the relabelling test above.
    """
    probe = tmp_path / "probe.yml"
    probe.write_text(yaml.safe_dump({"scrape_configs": [scrape_job("asyncppo-kubernetes")]}))
    config = PROMETHEUS_YML
    if promtool("check", "config", str(probe)).returncode != 0:
        full = yaml.safe_load(PROMETHEUS_YML.read_text())
        full["scrape_configs"] = [
            j for j in full["scrape_configs"] if "kubernetes_sd_configs" not in j
        ]
        config = tmp_path / "prometheus.yml"
        config.write_text(yaml.safe_dump(full))
    result = promtool("check", "config", str(config))
    assert result.returncode == 0, result.stdout + result.stderr


# ---------------------------------------------------------------- Grafana


def test_dashboard_structure() -> None:
    dashboard = json.loads(DASHBOARD_JSON.read_text())
    assert dashboard["schemaVersion"] >= 36
    panels = dashboard_panels()
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for panel in panels:
        if panel["type"] != "row":
            assert panel["targets"], f"panel {panel['title']!r} has no query"
            assert all(t["expr"].strip() for t in panel["targets"]), panel["title"]
            assert {"h", "w", "x", "y"} <= set(panel["gridPos"]), panel["title"]


def test_dashboard_queries_only_exported_metrics() -> None:
    used = {m for expr in dashboard_exprs() for m in METRIC_NAME.findall(expr)}
    unknown = {m for m in used if HISTOGRAM_SERIES.sub("", m) not in KNOWN_METRICS}
    assert not unknown, f"{DASHBOARD_JSON.name} queries metrics nobody exports: {sorted(unknown)}"
    suffixed = {m for m in used if HISTOGRAM_SERIES.search(m)}
    wrong_suffix = {m for m in suffixed if HISTOGRAM_SERIES.sub("", m) not in HISTOGRAMS}
    assert not wrong_suffix, f"_bucket/_sum/_count on a non-histogram: {sorted(wrong_suffix)}"
    bare_histograms = used & HISTOGRAMS
    assert not bare_histograms, f"histograms have no bare series: {sorted(bare_histograms)}"
    missing = REQUIRED_ON_DASHBOARD - {HISTOGRAM_SERIES.sub("", m) for m in used}
    assert not missing, f"dashboard lacks a panel for {sorted(missing)}"


@pytest.mark.system
def test_dashboard_promql_parses(tmp_path: Path) -> None:
    """promtool parses PromQL when it checks recording rules; Grafana's interval is substituted."""
    rules = [
        {"record": f"asyncppo_dashboard_expr_{i}", "expr": expr.replace("$__rate_interval", "1m")}
        for i, expr in enumerate(dashboard_exprs())
    ]
    path = tmp_path / "rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    result = promtool("check", "rules", str(path))
    assert result.returncode == 0, result.stdout + result.stderr
