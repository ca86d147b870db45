"""deploy/: the files parse, name only settings that exist, run real CLI commands, cover every partition,
and agree with one another (ports, names, metrics). Docker is not needed: structure is checked here, and the
stream layout that `memories bus init` applies is applied for real to a 3-node JetStream cluster."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import os
import re
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import nats
import promql_parser
import pytest
import yaml  # type: ignore[import-untyped]
from nats.js.api import AckPolicy, ConsumerConfig, RetentionPolicy

from services.cli import _parse_partitions, build_parser, main
from services.extractor.main import POOL_SIZE as EXTRACTOR_POOL_SIZE
from services.writer.partitions import PinnedPull
from shared import bus, bus_permissions, metrics
from shared.db.session import create_engine
from shared.servers import nats_server_binary, start_nats_cluster
from shared.settings import Settings, get_settings

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
K8S_KEDA = DEPLOY / "k8s-keda"
MEMORIES_IMAGE_K8S = "memories"  # kustomize's `images:` maps it onto the pushed image
SETTING_NAMES = {name.upper() for name in Settings.model_fields}


def load_yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


def k8s_objects() -> list[tuple[str, dict[str, Any]]]:
    found = []
    for path in sorted(K8S.glob("*.yaml")):
        found += [(path.name, doc) for doc in yaml.safe_load_all(path.read_text()) if doc is not None]
    return found


def of_kind(kind: str, *, include_examples: bool = False) -> list[dict[str, Any]]:
    return [
        doc
        for name, doc in k8s_objects()
        if doc.get("kind") == kind and (include_examples or "example" not in name)
    ]


def compose_text() -> str:
    return (DEPLOY / "compose.yaml").read_text()


def compose() -> dict[str, Any]:
    return yaml.safe_load(compose_text())  # type: ignore[no-any-return]


def compose_memories_services() -> dict[str, dict[str, Any]]:
    doc = compose()
    image = doc["x-memories"]["image"]
    return {name: service for name, service in doc["services"].items() if service.get("image") == image}


def assert_known_settings(where: str, environment: dict[str, Any]) -> None:
    unknown = sorted(set(environment) - SETTING_NAMES)
    assert not unknown, f"{where} sets variables no setting reads: {unknown}"
    # The values must also be valid for the settings (an int field given "sixteen" fails here).
    Settings(**{name.lower(): value for name, value in environment.items()})


def assert_cli_command(where: str, argv: list[str]) -> None:
    try:
        build_parser().parse_args(argv)
    except SystemExit:
        pytest.fail(f"{where} runs `memories {' '.join(argv)}`, which the CLI rejects")


def assert_partitions_covered(where: str, specs: list[str], partitions: int) -> None:
    counts = Counter(p for spec in specs for p in _parse_partitions(spec) or [])
    missing = [p for p in range(partitions) if counts[p] == 0]
    shared = sorted(p for p, n in counts.items() if n > 1)
    extra = sorted(p for p in counts if p >= partitions)
    assert not (missing or shared or extra), (
        f"{where}: missing {missing}, in two ranges {shared}, beyond N {extra}"
    )


# --- every file parses ------------------------------------------------------------------------------


def deploy_files(*suffixes: str) -> Iterator[Path]:
    return (path for path in sorted(DEPLOY.rglob("*")) if path.suffix in suffixes)


@pytest.mark.parametrize(
    "path", list(deploy_files(".yaml", ".yml")), ids=lambda p: str(p.relative_to(DEPLOY))
)
def test_yaml_parses(path: Path) -> None:
    docs = [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]
    assert docs and all(isinstance(doc, dict) for doc in docs)


@pytest.mark.parametrize("path", list(deploy_files(".json")), ids=lambda p: str(p.relative_to(DEPLOY)))
def test_json_parses(path: Path) -> None:
    assert isinstance(json.loads(path.read_text()), dict)


@pytest.mark.parametrize("path", sorted((DEPLOY / "nats").glob("nats-*.conf")), ids=lambda p: p.name)
def test_nats_node_config_is_valid_for_nats_server(path: Path) -> None:
    def check(environment: dict[str, str]) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(nats_server_binary()), "-t", "-c", str(path)], check=False, capture_output=True,
                              text=True, timeout=30, env=environment)

    passwords = {user.password_variable: "a-password" for user in bus_permissions.USERS}
    # The route login and the other nodes' URLs, as compose's x-nats environment gives them.
    passwords["MEMORIES_NATS_ROUTE_PASSWORD"] = "a-route-password"
    for number in (1, 2, 3):
        passwords[f"MEMORIES_NATS_ROUTE_{number}"] = f"nats-route://memories-route:a-route-password@nats-{number}:6222"
    result = check({**os.environ, **passwords})
    assert result.returncode == 0, result.stderr or result.stdout
    # A password not given is a server that does not start, not a user let in without one.
    del passwords[bus_permissions.USERS[0].password_variable]
    refused = check({**os.environ, **passwords})
    assert refused.returncode != 0 and bus_permissions.USERS[0].password_variable in refused.stderr + refused.stdout


def test_dockerfile_builds_one_image_for_every_command() -> None:
    text = (DEPLOY / "Dockerfile").read_text()
    assert re.search(r"^FROM python:3\.11-slim\b", text, re.MULTILINE)
    assert "pip install --no-deps ." in text
    assert re.search(r'^ENTRYPOINT \["memories"\]', text, re.MULTILINE)
    exposed = {
        int(port) for line in re.findall(r"^EXPOSE (.+)$", text, re.MULTILINE) for port in line.split()
    }
    assert {Settings().memories_port, 9100} <= exposed


def test_dockerfile_installs_the_locked_dependencies_in_a_layer_the_code_does_not_touch() -> None:
    lines = (DEPLOY / "Dockerfile").read_text().splitlines()

    def first(pattern: str) -> int:
        return next(i for i, line in enumerate(lines) if re.search(pattern, line))

    locked, code, package = first(r"pip install -r requirements\.lock"), first(r"^COPY shared "), first(r"pip install --no-deps \.")
    assert locked < code < package
    assert "!deploy/requirements.lock" in (DEPLOY / "Dockerfile.dockerignore").read_text().splitlines()


def test_the_lock_pins_every_dependency_within_its_range_and_no_embedded_server() -> None:
    import tomllib

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pinned = {}
    for line in (DEPLOY / "requirements.lock").read_text().splitlines():
        if line and not line.startswith("#"):
            name, version = line.split("==")
            pinned[canonicalize_name(name)] = version
    for dependency in map(Requirement, project["dependencies"]):
        name = canonicalize_name(dependency.name)
        assert name in pinned, f"{name} is not in deploy/requirements.lock: run `make lock`"
        assert dependency.specifier.contains(pinned[name], prereleases=True), (
            f"deploy/requirements.lock pins {name}=={pinned[name]}, outside {dependency.specifier}: run `make lock`")
    for local_only in map(Requirement, project["optional-dependencies"]["local"]):
        assert canonicalize_name(local_only.name) not in pinned


# --- compose ----------------------------------------------------------------------------------------


def test_compose_services_set_only_known_settings_and_run_real_commands() -> None:
    services = compose_memories_services()
    assert {"migrate", "bus-init", "api", "extractor"} <= set(services)
    for name, service in services.items():
        assert_known_settings(f"compose service {name}", service["environment"])
        assert_cli_command(f"compose service {name}", service["command"])
    assert services["migrate"]["command"] == ["migrate"]
    assert services["bus-init"]["command"] == ["bus", "init"]


def test_compose_long_running_services_wait_for_migrations_and_the_bus_layout() -> None:
    for name, service in compose_memories_services().items():
        if name in ("migrate", "bus-init"):
            continue
        conditions = {dep: spec["condition"] for dep, spec in service["depends_on"].items()}
        assert conditions == {
            "migrate": "service_completed_successfully",
            "bus-init": "service_completed_successfully",
        }


BUS_ROLE_OF_COMMAND = {"api": "api", "writer": "writer", "extractor": "extractor", "bus": "admin"}
BUS_USERS = {user.role: user for user in bus_permissions.USERS}


def test_compose_services_log_in_to_the_bus_as_their_own_users() -> None:
    routes = {"MEMORIES_NATS_ROUTE_PASSWORD", *(f"MEMORIES_NATS_ROUTE_{number}" for number in (1, 2, 3))}
    assert set(compose()["x-nats"]["environment"]) == {user.password_variable for user in bus_permissions.USERS} | routes
    # deploy/.env holds every user's password for compose's interpolation: no container loads it whole.
    assert [entry["path"] for entry in compose()["x-memories"]["env_file"]] == ["providers.env"]
    for name, service in compose_memories_services().items():
        environment = service["environment"]
        if service["command"][0] == "migrate":
            assert "NATS_USER" not in environment, name
            continue
        user = BUS_USERS[BUS_ROLE_OF_COMMAND[service["command"][0]]]
        assert environment["NATS_USER"] == user.user, name
        assert environment["NATS_PASSWORD"] == f"${{{user.password_variable}}}", name


def test_k8s_containers_log_in_to_the_bus_as_their_own_users() -> None:
    for where, container in memories_containers():
        environment = {var["name"]: var for var in container.get("env", [])}
        if container["args"][0] == "migrate":
            assert "NATS_USER" not in environment, where
            continue
        role = BUS_ROLE_OF_COMMAND[container["args"][0]]
        assert environment["NATS_USER"]["value"] == BUS_USERS[role].user, where
        assert environment["NATS_PASSWORD"]["valueFrom"]["secretKeyRef"] == {
            "name": bus_permissions.HELM_SECRET, "key": role}, where
    [example] = [doc for doc in of_kind("Secret", include_examples=True)
                 if doc["metadata"]["name"] == bus_permissions.HELM_SECRET]
    assert set(example["stringData"]) == set(BUS_USERS)
    # The NATS release reads every user's password from the same keys.
    server_environment = load_yaml(bus_permissions.HELM_VALUES)["container"]["env"]
    assert {name: env["valueFrom"]["secretKeyRef"] for name, env in server_environment.items()} == {
        user.password_variable: {"name": bus_permissions.HELM_SECRET, "key": user.role}
        for user in bus_permissions.USERS
    }


def test_compose_writers_cover_every_partition_once() -> None:
    services = compose_memories_services()
    writers = {name: s for name, s in services.items() if s["command"][0] == "writer"}
    assert len(writers) >= 2
    partitions = {int(s["environment"]["MEMORIES_PARTITIONS"]) for s in services.values()}
    assert len(partitions) == 1, "every service must compute partitions with the same N"
    specs = [s["command"][s["command"].index("--partitions") + 1] for s in writers.values()]
    assert_partitions_covered("compose writers", specs, partitions.pop())


def test_compose_nats_cluster_has_three_nodes_for_three_stream_replicas() -> None:
    doc = compose()
    nodes = sorted(name for name in doc["services"] if name.startswith("nats-"))
    assert nodes == ["nats-1", "nats-2", "nats-3"]
    cluster_conf = (DEPLOY / "nats" / "cluster.conf").read_text()
    nats_env = doc["x-nats"]["environment"]
    for number, node in enumerate(nodes, start=1):
        assert f"$MEMORIES_NATS_ROUTE_{number}" in cluster_conf
        assert nats_env[f"MEMORIES_NATS_ROUTE_{number}"] == (
            f"nats-route://memories-route:${{MEMORIES_NATS_ROUTE_PASSWORD}}@{node}:6222")
        config_file = doc["services"][node]["command"][-1]
        assert (DEPLOY / "nats" / Path(config_file).name).exists()
        assert f"server_name: {node}" in (DEPLOY / "nats" / Path(config_file).name).read_text()
    env = doc["x-memories-env"]
    assert int(env["MEMORIES_STREAM_REPLICAS"]) == len(nodes)
    assert sorted(re.findall(r"nats://(nats-\d):4222", env["NATS_URL"])) == nodes


def test_prometheus_scrapes_every_memories_service_on_its_port() -> None:
    services = compose_memories_services()
    scraped: dict[str, int] = {}
    for job in load_yaml(DEPLOY / "prometheus.yml")["scrape_configs"]:
        for sd in job.get("dns_sd_configs", []):
            scraped.update({name: sd["port"] for name in sd["names"]})
    long_running = {name for name in services if name not in ("migrate", "bus-init")}
    assert set(scraped) == long_running
    for name in long_running:
        env = services[name]["environment"]
        expected = env["MEMORIES_PORT"] if name == "api" else env["MEMORIES_METRICS_PORT"]
        assert scraped[name] == int(expected), name


# --- Grafana ----------------------------------------------------------------------------------------


def dashboard_expressions() -> list[str]:
    dashboard = json.loads((DEPLOY / "grafana" / "dashboards" / "memories.json").read_text())
    return [target["expr"] for panel in dashboard["panels"] for target in panel.get("targets", [])]


def declared_metric_families() -> set[str]:
    return {family.name for family in metrics.REGISTRY.collect() if family.name.startswith("memories_")}


_SERIES_SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum"), "gauge": ("",)}


def exposed_series() -> dict[str, str]:
    """Each series name a service's /metrics can show (a counter's with _total, a histogram's _bucket…) → its
    family; and `up`, which Prometheus adds to every target."""
    return {
        "up": "up",
        **{
            family.name + suffix: family.name
            for family in metrics.REGISTRY.collect()
            for suffix in _SERIES_SUFFIXES.get(family.type, ("",))
        },
    }


def selected_series(expression: str) -> set[str]:
    """The metric names a PromQL expression selects, read by a PromQL parser (which fails on a syntax error)."""
    found: set[str] = set()

    def walk(node: Any) -> None:
        if isinstance(node, promql_parser.VectorSelector):
            found.add(node.name)
        for child in ("lhs", "rhs", "expr", "param", "vector_selector"):
            if getattr(node, child, None) is not None:
                walk(getattr(node, child))
        for argument in getattr(node, "args", None) or []:
            walk(argument)

    walk(promql_parser.parse(expression.replace("$__rate_interval", "5m")))
    return found


def test_dashboard_queries_only_declared_metrics_and_shows_all_of_them() -> None:
    exposed = exposed_series()
    used = set().union(*(selected_series(expr) for expr in dashboard_expressions()))
    assert used - set(exposed) == set(), "the dashboard queries series shared/metrics.py does not expose"
    assert declared_metric_families() - {exposed[name] for name in used} == set(), "metrics missing from the dashboard"


def alert_rules() -> list[dict[str, Any]]:
    return [rule for group in load_yaml(DEPLOY / "prometheus-alerts.yml")["groups"] for rule in group["rules"]]


def test_alert_rules_parse_and_watch_only_series_the_services_expose() -> None:
    rules = alert_rules()
    assert len({rule["alert"] for rule in rules}) == len(rules) >= 10
    exposed = set(exposed_series())
    for rule in rules:
        selected = selected_series(rule["expr"])
        assert selected and selected <= exposed, (rule["alert"], selected - exposed)
        assert rule["labels"]["severity"] in ("page", "ticket") and rule["annotations"]["summary"], rule["alert"]
    # The ones docs/operations.md names as worth alerting on are there.
    watched = set().union(*(selected_series(rule["expr"]) for rule in rules))
    assert {"memories_consumer_pending", "memories_consumer_redeliveries", "memories_dead_letters_total",
            "memories_stream_messages", "memories_embedding_errors_total", "memories_stream_bytes"} <= watched


def test_compose_prometheus_loads_the_alert_rules() -> None:
    [rule_file] = load_yaml(DEPLOY / "prometheus.yml")["rule_files"]
    assert f"./prometheus-alerts.yml:{rule_file}:ro" in compose()["services"]["prometheus"]["volumes"]


def test_the_monitoring_uis_listen_on_the_docker_host_only_and_grafana_has_no_default_password() -> None:
    # Prometheus has no login, and Grafana's first start took admin/admin: both were open on every interface.
    services = compose()["services"]
    for name in ("prometheus", "grafana"):
        assert services[name]["ports"] and all(port.startswith("127.0.0.1:") for port in services[name]["ports"]), name
    assert services["grafana"]["environment"]["GF_SECURITY_ADMIN_PASSWORD"].startswith("${GRAFANA_ADMIN_PASSWORD:?")
    # The one-liner at the top of compose.yaml that makes deploy/.env generates it with the bus users' passwords.
    header = compose_text().split("\nname:")[0]
    assert 'echo "GRAFANA_ADMIN_PASSWORD=$(openssl rand -hex 16)"' in header


def test_compose_keeps_the_admin_token_in_its_env_file() -> None:
    # Exported in one shell, the token was missing from every later `docker compose` command (an upgrade, a scale,
    # `run --rm bus-init dlq list`), and each new start made a new one, refusing the clients that held the old.
    header = compose_text().split("\nname:")[0]
    assert 'echo "MEMORIES_ADMIN_TOKEN=$(openssl rand -hex 32)"; } > deploy/.env' in header
    assert "export MEMORIES_ADMIN_TOKEN" not in (ROOT / "docs/operations.md").read_text()
    token = compose()["x-memories-env"]["MEMORIES_ADMIN_TOKEN"]
    assert token.startswith("${MEMORIES_ADMIN_TOKEN:?") and "deploy/.env" in token


def test_grafana_provisioning_matches_the_dashboard_and_compose() -> None:
    datasource = load_yaml(DEPLOY / "grafana/provisioning/datasources/prometheus.yaml")["datasources"][0]
    dashboard = json.loads((DEPLOY / "grafana/dashboards/memories.json").read_text())
    uids = {panel["datasource"]["uid"] for panel in dashboard["panels"] if "datasource" in panel}
    assert uids == {datasource["uid"]}
    provider = load_yaml(DEPLOY / "grafana/provisioning/dashboards/memories.yaml")["providers"][0]
    mounts = compose()["services"]["grafana"]["volumes"]
    assert f"./grafana/dashboards:{provider['options']['path']}:ro" in mounts


# --- Kubernetes -------------------------------------------------------------------------------------


def pod_specs() -> list[tuple[str, dict[str, Any]]]:
    specs = []
    for kind in ("Deployment", "StatefulSet", "Job"):
        specs += [
            (f"{kind} {doc['metadata']['name']}", doc["spec"]["template"]["spec"]) for doc in of_kind(kind)
        ]
    return specs


def memories_containers() -> list[tuple[str, dict[str, Any]]]:
    found = []
    for where, spec in pod_specs():
        for container in spec.get("initContainers", []) + spec["containers"]:
            if container["image"] == MEMORIES_IMAGE_K8S:
                found.append((f"{where}/{container['name']}", container))
    return found


def config_data() -> dict[str, str]:
    [config] = [doc for doc in of_kind("ConfigMap") if doc["metadata"]["name"] == "memories-config"]
    return config["data"]  # type: ignore[no-any-return]


def test_every_k8s_object_is_well_formed() -> None:
    objects = k8s_objects()
    assert objects
    for file_name, doc in objects:
        assert doc.get("apiVersion") and doc.get("kind"), file_name
        if doc["kind"] != "Kustomization":
            assert doc["metadata"]["name"], file_name
    kustomization = load_yaml(K8S / "kustomization.yaml")
    for resource in kustomization["resources"]:
        assert (K8S / resource).exists(), resource
    assert [image["name"] for image in kustomization["images"]] == [MEMORIES_IMAGE_K8S]


def test_k8s_network_policies_open_only_the_api_and_the_metrics_ports_of_the_pods_that_have_them() -> None:
    def selects(policy: dict[str, Any], labels: dict[str, str]) -> bool:
        selector = policy["spec"]["podSelector"]
        matched = all(labels.get(key) == value for key, value in selector.get("matchLabels", {}).items())
        for expression in selector.get("matchExpressions", []):
            assert expression["operator"] == "In"
            matched = matched and labels.get(expression["key"]) in expression["values"]
        return matched

    policies = of_kind("NetworkPolicy")
    workloads = of_kind("Deployment") + of_kind("Job")
    for workload in workloads:
        template = workload["spec"]["template"]
        applying = [p for p in policies if selects(p, template["metadata"]["labels"])]
        # Every pod is closed by default, and opened only where a policy names one of its container ports.
        assert any(p["spec"]["podSelector"] == {} and "ingress" not in p["spec"] for p in applying), workload["metadata"]
        ports = {port["name"] for c in template["spec"]["containers"] for port in c.get("ports", [])}
        opened = {port["port"] for p in applying for rule in p["spec"].get("ingress", []) for port in rule["ports"]}
        assert opened <= ports, (workload["metadata"]["name"], opened, ports)
        name = template["metadata"]["labels"]["app.kubernetes.io/name"]
        expected = {"memories-api": {"http"}, "memories-writer": {"metrics"}, "memories-extractor": {"metrics"}}
        assert opened == expected.get(name, set()), (name, opened)
    assert all(p["spec"]["policyTypes"] == ["Ingress"] for p in policies)  # without it an `ingress` list may not apply
    (metrics,) = [p for p in policies if p["metadata"]["name"] == "memories-metrics"]
    sources = [source for rule in metrics["spec"]["ingress"] for source in rule.get("from", [None])]
    # Not open to every namespace (no `from`, or an empty selector): to the one Prometheus runs in.
    assert sources and all(
        source and set(source["namespaceSelector"]["matchLabels"]) == {"kubernetes.io/metadata.name"} for source in sources
    ), sources


def test_k8s_containers_set_only_known_settings_and_run_real_commands() -> None:
    secret_keys = {
        doc["metadata"]["name"]: set(doc["stringData"]) for doc in of_kind("Secret", include_examples=True)
    }
    configs = {doc["metadata"]["name"]: doc["data"] for doc in of_kind("ConfigMap")}
    containers = memories_containers()
    assert containers
    for where, container in containers:
        assert_cli_command(where, container["args"])
        environment: dict[str, Any] = {}
        for source in container.get("envFrom", []):
            if "configMapRef" in source:
                environment.update(configs[source["configMapRef"]["name"]])
            elif source["secretRef"].get("optional"):
                continue  # provider keys for litellm: not ours to know
            else:
                environment.update(dict.fromkeys(secret_keys[source["secretRef"]["name"]], "x"))
        environment.update({var["name"]: var.get("value", "x") for var in container.get("env", [])})
        assert_known_settings(where, environment)


def test_k8s_long_running_containers_have_probes_and_resource_requests() -> None:
    metrics_port = int(config_data()["MEMORIES_METRICS_PORT"])
    for kind in ("Deployment", "StatefulSet"):
        for doc in of_kind(kind):
            for container in doc["spec"]["template"]["spec"]["containers"]:
                where = f"{doc['metadata']['name']}/{container['name']}"
                assert {"cpu", "memory"} <= set(container["resources"]["requests"]), where
                ports = {port["name"]: port["containerPort"] for port in container["ports"]}
                for probe, path in (("livenessProbe", "/healthz"), ("readinessProbe", "/readyz")):
                    check = container[probe]["httpGet"]
                    assert check["path"] == path and check["port"] in ports, f"{where} {probe}"
                annotations = doc["spec"]["template"]["metadata"]["annotations"]
                assert int(annotations["prometheus.io/port"]) in ports.values(), where
                if container["args"][0] in ("writer", "extractor"):
                    assert ports[container["livenessProbe"]["httpGet"]["port"]] == metrics_port, where


def test_the_api_drains_before_it_stops_and_has_the_time_for_a_write_in_hand() -> None:
    # No pause before SIGTERM (requests routed to a pod whose listener had closed) and too little grace for a write
    # that may take 5 s to publish and MEMORIES_WRITE_TIMEOUT_S to be decided, then the bus drained.
    from services.api.serving import stop_grace_s
    from shared.settings import WRITE_TIMEOUT_MAX_S, Settings

    (api,) = [doc for doc in of_kind("Deployment") if doc["metadata"]["name"] == "memories-api"]
    pod = api["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    pause = int(container["lifecycle"]["preStop"]["exec"]["command"][-1])
    slowest = Settings.model_construct(memories_write_timeout_s=WRITE_TIMEOUT_MAX_S)
    assert pause >= 5 and pod["terminationGracePeriodSeconds"] >= pause + stop_grace_s(slowest)


def test_the_nats_cluster_runs_the_server_version_the_tests_run() -> None:
    # Unpinned, the chart deploys its own default: an older server has no pinned priority groups for the writers.
    from shared.servers import nats_server_binary

    values = yaml.safe_load((DEPLOY / "nats" / "helm-values.yaml").read_text())
    tested = subprocess.run([str(nats_server_binary()), "--version"], capture_output=True, text=True, check=True)
    assert values["container"]["image"]["tag"] == tested.stdout.split()[-1].removeprefix("v") + "-alpine"


def test_a_deployment_an_autoscaler_scales_leaves_its_count_to_it() -> None:
    # A count in the Deployment reset the autoscaler's on every `kubectl apply -k`, stopping busy extractors.
    scaled = {doc["spec"]["scaleTargetRef"]["name"] for doc in of_kind("HorizontalPodAutoscaler")}
    assert scaled and all("replicas" not in doc["spec"] for doc in of_kind("Deployment")
                          if doc["metadata"]["name"] in scaled)


def test_no_kustomization_lies_within_a_base_it_builds_on() -> None:
    # kustomize refuses it ("cycle detected"): the KEDA overlay inside deploy/k8s could not be applied at all.
    for kustomization in DEPLOY.rglob("kustomization.yaml"):
        here = kustomization.parent.resolve()
        for resource in load_yaml(kustomization)["resources"]:
            base = (here / resource).resolve()
            assert base.exists(), f"{kustomization}: {resource} does not exist"
            assert not (base.is_dir() and here.is_relative_to(base)), f"{kustomization} lies within its base {resource}"


def test_the_keda_overlay_scales_the_extractors_on_their_backlog_in_place_of_the_cpu_autoscaler() -> None:
    overlay = load_yaml(K8S_KEDA / "kustomization.yaml")
    assert overlay["resources"] == ["../k8s", "extractor-scaler.yaml"]
    # Its own objects (the scaler) land in the base's namespace, where the Deployment it scales is.
    assert overlay["namespace"] == load_yaml(K8S / "kustomization.yaml")["namespace"]
    [hpa] = of_kind("HorizontalPodAutoscaler")
    [patch] = overlay["patches"]
    deleted = yaml.safe_load(patch["patch"])
    assert deleted["$patch"] == "delete"
    assert (deleted["apiVersion"], deleted["kind"], deleted["metadata"]["name"]) == (
        hpa["apiVersion"], hpa["kind"], hpa["metadata"]["name"])
    scaler = load_yaml(K8S_KEDA / "extractor-scaler.yaml")["spec"]
    assert scaler["scaleTargetRef"]["name"] == hpa["spec"]["scaleTargetRef"]["name"]
    assert (scaler["minReplicaCount"], scaler["maxReplicaCount"]) == (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"])
    [trigger] = scaler["triggers"]
    assert trigger["type"] == "nats-jetstream"
    assert (trigger["metadata"]["stream"], trigger["metadata"]["consumer"]) == (bus.GENERATIONS_STREAM, bus.EXTRACTOR_DURABLE)
    # The monitoring port of the same NATS release the services connect to, through its headless Service.
    release, namespace = re.fullmatch(r"nats://([^.]+)\.([^.]+)\.svc\.cluster\.local:4222", config_data()["NATS_URL"]).groups()
    assert trigger["metadata"]["natsServerMonitoringEndpoint"] == f"{release}-headless.{namespace}.svc.cluster.local:8222"


def test_the_api_and_each_writer_range_spread_their_replicas_over_nodes() -> None:
    # Both replicas of a writer range on one node: a lost node left the range unconsumed until its pods moved.
    for doc in of_kind("Deployment"):
        if doc["metadata"]["name"] == "memories-extractor":
            continue
        template = doc["spec"]["template"]
        (spread,) = template["spec"]["topologySpreadConstraints"]
        assert spread["topologyKey"] == "kubernetes.io/hostname", doc["metadata"]["name"]
        chosen = spread["labelSelector"]["matchLabels"]
        # Its own pods only: a selector spanning every writer range would let a range's two replicas share a node.
        assert chosen.items() <= doc["spec"]["selector"]["matchLabels"].items(), doc["metadata"]["name"]


def test_k8s_writers_cover_every_partition_once() -> None:
    specs = []
    for doc in of_kind("Deployment") + of_kind("StatefulSet"):
        for container in doc["spec"]["template"]["spec"]["containers"]:
            if container["args"][0] == "writer":
                specs.append(container["args"][container["args"].index("--partitions") + 1])
    assert len(specs) >= 2
    assert_partitions_covered("k8s writers", specs, int(config_data()["MEMORIES_PARTITIONS"]))


def test_k8s_selectors_autoscaler_and_init_job_point_at_real_objects() -> None:
    deployments = {doc["metadata"]["name"]: doc for doc in of_kind("Deployment")}
    for doc in deployments.values():
        labels = doc["spec"]["template"]["metadata"]["labels"]
        assert doc["spec"]["selector"]["matchLabels"].items() <= labels.items()
    pod_labels = [doc["spec"]["template"]["metadata"]["labels"] for doc in deployments.values()]
    for doc in of_kind("Service"):
        selector = doc["spec"]["selector"]
        assert any(selector.items() <= labels.items() for labels in pod_labels), doc["metadata"]
    for doc in of_kind("PodDisruptionBudget"):
        selector = doc["spec"]["selector"]["matchLabels"]
        assert any(selector.items() <= labels.items() for labels in pod_labels), doc["metadata"]
    [autoscaler] = of_kind("HorizontalPodAutoscaler")
    target = deployments[autoscaler["spec"]["scaleTargetRef"]["name"]]
    assert target["spec"]["template"]["spec"]["containers"][0]["args"] == ["extractor"]
    [job] = of_kind("Job")
    steps = [
        c["args"]
        for c in job["spec"]["template"]["spec"]["initContainers"]
        + job["spec"]["template"]["spec"]["containers"]
    ]
    assert steps == [["migrate"], ["bus", "init"]]


# --- the stream layout, applied by `memories bus init` as compose's bus-init service runs it ----------


@pytest.fixture(scope="module")
def nats_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    nodes = start_nats_cluster(tmp_path_factory.mktemp("nats-cluster"), size=3)
    try:
        yield ",".join(node.url for node in nodes)
    finally:
        for node in nodes:
            node.stop()


def run_bus_init(nats_url: str, **overrides: str) -> subprocess.CompletedProcess[str]:
    return run_bus("init", nats_url, **overrides)


def run_bus(command: str, nats_url: str, **overrides: str) -> subprocess.CompletedProcess[str]:
    return run_memories(["bus", command], nats_url, **overrides)


def run_memories(arguments: list[str], nats_url: str, **overrides: str) -> subprocess.CompletedProcess[str]:
    """`memories …` configured as compose configures its services, with `overrides`."""
    environment = {name: str(value) for name, value in compose()["x-memories-env"].items()}
    environment.update(NATS_URL=nats_url, **overrides)
    env = {key: value for key, value in os.environ.items() if key.upper() not in SETTING_NAMES} | environment
    return subprocess.run(
        [sys.executable, "-m", "services.cli", *arguments],
        check=False,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


async def test_bus_init_applies_the_compose_layout_to_a_three_node_cluster(nats_cluster: str) -> None:
    result = run_bus_init(nats_cluster)
    assert result.returncode == 0, result.stderr
    partitions = int(compose()["x-memories-env"]["MEMORIES_PARTITIONS"])
    nc = await nats.connect(nats_cluster.split(","))
    try:
        js = nc.jetstream()
        for stream in [config.name or "" for config in bus.layout(Settings()).streams]:
            info = await js.stream_info(stream)
            assert info.config.num_replicas == 3
            assert info.cluster is not None and len(info.cluster.replicas or []) == 2  # leader + 2 followers
        writes = (await js.stream_info(bus.WRITES_STREAM)).config
        assert writes.retention == RetentionPolicy.WORK_QUEUE
        assert writes.duplicate_window == Settings().memories_duplicate_window_s
        consumers = {c.name: c.config for c in await js.consumers_info(bus.WRITES_STREAM)}
        assert set(consumers) == {bus.writer_durable(p) for p in range(partitions)}
        assert all(
            c.max_ack_pending == 2 * Settings().memories_write_batch and c.max_deliver == -1  # outages never exhaust deliveries
            for c in consumers.values()
        )

        # Applying again changes nothing and fails nothing: it runs on every deploy.
        assert run_bus_init(nats_cluster).returncode == 0
        # Lowering the partition count does NOT delete the consumers of the dropped partitions (see
        # docs/operations.md): if ensure_layout starts deleting them, that document must change too.
        half = str(partitions // 2)
        assert run_bus_init(nats_cluster, MEMORIES_PARTITIONS=half).returncode == 0
        assert len(await js.consumers_info(bus.WRITES_STREAM)) == partitions
        # `bus status` shows them as left over; `bus prune` deletes the idle ones and keeps one a write waits on. An
        # integrator's durable on the change feed is not the service's: shown as such, never pruned.
        await js.add_consumer(bus.EVENTS_STREAM, ConsumerConfig(durable_name="crm-sync", ack_policy=AckPolicy.EXPLICIT))
        status = run_bus("status", nats_cluster, MEMORIES_PARTITIONS=half)
        stale = [line.split()[1] for line in status.stdout.splitlines() if "beyond the count" in line]
        # In the partitions' order (writer-p8, writer-p9, writer-p10, …), not the names' (writer-p10 before writer-p8).
        assert status.returncode == 0 and stale == [bus.writer_durable(p) for p in range(partitions // 2, partitions)]
        assert f"laid out for {half} partitions" in status.stdout
        assert any("crm-sync" in line and "not the service's" in line for line in status.stdout.splitlines())
        header, *rows = status.stdout.splitlines()[1:]
        end = header.index("PENDING") + len("PENDING")
        assert all(row[end - 1].isdigit() and row[end] == " " for row in rows), status.stdout  # no row shifted by a long name
        # Run with another count than the bus is laid out for (a shell's default, a typo): nothing is deleted.
        refused = run_bus("prune", nats_cluster, MEMORIES_PARTITIONS=str(partitions // 4))
        assert refused.returncode == 1 and f"laid out for {half} partitions" in refused.stderr
        assert f"prune with MEMORIES_PARTITIONS={half}" in refused.stderr  # not "apply the count", which would change it
        # A service configured for another count refuses to start in one line, not a traceback of 35.
        for service in ("extractor", "api"):
            refusal = run_memories([service], nats_cluster, MEMORIES_PARTITIONS=str(partitions // 4),
                                   DATABASE_URL="postgresql+psycopg://nobody@127.0.0.1:1/none")
            assert refusal.returncode == 1 and f"laid out for {half} partitions" in refusal.stderr, refusal.stderr
            assert "Traceback" not in refusal.stderr, refusal.stderr
        assert len(await js.consumers_info(bus.WRITES_STREAM)) == partitions
        waiting = bus.writer_durable(partitions - 1)
        await js.publish(f"{bus.WRITE_SUBJECT_ROOT}.{partitions - 1}.mem_left", b"{}", stream=bus.WRITES_STREAM)
        # A writer of the old count still pulling from a dropped partition: its consumer is kept too.
        pulled = bus.writer_durable(partitions - 2)
        old_writer = PinnedPull(nc, partitions - 2)
        pulling = asyncio.create_task(old_writer.fetch(batch=1, wait_s=20))
        while not (await js.consumer_info(bus.WRITES_STREAM, pulled)).num_waiting:
            await asyncio.sleep(0.05)
        pruned = run_bus("prune", nats_cluster, MEMORIES_PARTITIONS=half)
        assert pruned.returncode == 1 and waiting in pruned.stderr and pulled in pruned.stderr
        left = {c.name for c in await js.consumers_info(bus.WRITES_STREAM)}
        assert left == {bus.writer_durable(p) for p in range(partitions // 2)} | {waiting, pulled}
        assert "crm-sync" in {c.name for c in await js.consumers_info(bus.EVENTS_STREAM)}
        # The write stranded on the dropped partition goes to its memory's partition under the count; the one a
        # writer of the old count still pulls from is left to it, and named.
        status = run_bus("status", nats_cluster, MEMORIES_PARTITIONS=half)
        assert any(waiting in line and "`memories bus reroute`" in line for line in status.stdout.splitlines())
        rerouted = run_bus("reroute", nats_cluster, MEMORIES_PARTITIONS=half)
        assert rerouted.returncode == 1 and "moved 1 writes" in rerouted.stdout and pulled in rerouted.stderr
        moved = await js.get_msg(bus.WRITES_STREAM, seq=1, subject=bus.write_subject("mem_left", int(half)), next=True)
        await js.delete_msg(bus.WRITES_STREAM, moved.seq or 0)
        pulling.cancel()
        with contextlib.suppress(asyncio.CancelledError, TimeoutError):
            await pulling
        await old_writer.close()
        for consumer in (pulled, waiting):  # their pull requests expire
            while (await js.consumer_info(bus.WRITES_STREAM, consumer)).num_waiting:
                await asyncio.sleep(0.2)
        assert run_bus("prune", nats_cluster, MEMORIES_PARTITIONS=half).returncode == 0
        assert len(await js.consumers_info(bus.WRITES_STREAM)) == partitions // 2
    finally:
        await nc.close()


@pytest.mark.parametrize(
    ("spec", "told"),
    [("8-9", "partitions [8, 9] do not exist"), ("0-7,12", "[12] do not exist"), ("abc", "expected ranges"),
     ("5-3", "expected ranges"), ("1-", "expected ranges")],
)
def test_a_writer_refuses_partitions_that_do_not_exist(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], spec: str, told: str
) -> None:
    # A stale writer deployment after the partition count was lowered would otherwise look ready and consume nothing.
    monkeypatch.setenv("MEMORIES_PARTITIONS", "8")
    get_settings.cache_clear()
    try:
        assert main(["writer", "--partitions", spec]) == 2
    finally:
        get_settings.cache_clear()
    assert told in capsys.readouterr().err
    assert _parse_partitions("0-3,5", 8) == [0, 1, 2, 3, 5]


@pytest.mark.parametrize("spec", ["0-31", "0-7,12,14-15", "3", "0,2,4,6,8,10,12,14"])
def test_a_writer_logs_its_partitions_as_they_are_given(spec: str) -> None:
    # Eight or more were logged as "first..last", also when they were not consecutive ("0..14" for the even ones).
    from services.writer.main import _ranges

    assert _ranges(_parse_partitions(spec, 32) or []) == spec


@pytest.mark.parametrize(
    ("service", "missing"),
    [("api", "DATABASE_URL and NATS_URL"), ("writer", "DATABASE_URL and NATS_URL"),
     ("extractor", "DATABASE_URL and NATS_URL"), ("migrate", "DATABASE_URL")],
)
def test_a_service_run_without_its_servers_says_so_in_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], service: str, missing: str
) -> None:
    for name in ("DATABASE_URL", "NATS_URL"):
        monkeypatch.delenv(name, raising=False)
    get_settings.cache_clear()
    try:
        assert main([service]) == 2
    finally:
        get_settings.cache_clear()
    assert capsys.readouterr().err == f"memories {service}: {missing} not set (or run `memories up`)\n"


def test_every_setting_is_in_the_readmes_configuration_table() -> None:
    readme = (ROOT / "README.md").read_text()
    table = readme[readme.index("## Configuration"):readme.index("## Limits")]
    documented = set(re.findall(r"`([A-Z][A-Z0-9_]+)`", table))
    assert {name.upper() for name in Settings.model_fields} <= documented, sorted(
        {name.upper() for name in Settings.model_fields} - documented
    )


def test_compose_postgres_admits_every_pool_of_the_shipped_compose() -> None:
    # The pools as docs/operations.md counts them: PostgreSQL's default of 100 refused the shipped compose's ~130.
    defaults = inspect.signature(create_engine).parameters
    api = defaults["pool_size"].default + defaults["max_overflow"].default + 1  # and the readiness probe's
    services = compose()["services"]
    needed = 0
    for service in services.values():
        command = service.get("command") or []
        replicas = service.get("deploy", {}).get("replicas", 1)
        if command[:1] == ["api"]:
            needed += replicas * api
        elif command[:1] == ["writer"]:
            first, last = map(int, command[command.index("--partitions") + 1].split("-"))
            needed += replicas * (min(last - first + 1, 32) + 2 + defaults["max_overflow"].default)
        elif command[:1] == ["extractor"]:
            needed += 4 * (EXTRACTOR_POOL_SIZE + defaults["max_overflow"].default)  # scaled to 4, as the docs show
    postgres = services["postgres"]["command"]
    limit = int(next(arg for arg in postgres if arg.startswith("max_connections=")).split("=")[1])
    assert needed > 100 and limit > needed + 10, (needed, limit)


def test_the_nats_nodes_log_in_to_each_other() -> None:
    # Without a route login, any server that reached port 6222 joined the cluster, and routes bypass every user's
    # permissions: it read every tenant's writes and turns, and could forge writes and outcomes (a security review
    # showed it with two servers).
    cluster = (DEPLOY / "nats" / "cluster.conf").read_text()
    block = cluster[cluster.index("cluster {"):]
    assert re.search(r"authorization\s*\{\s*user: memories-route\s*password: \$MEMORIES_NATS_ROUTE_PASSWORD", block)
    # Its password is generated into deploy/.env with the users' (test_nats_node_config_is_valid_for_nats_server
    # checks that the files hold together).
    assert 'echo "MEMORIES_NATS_${user}_PASSWORD' in compose_text() and "ADMIN ROUTE; do" in compose_text()


def test_the_nats_namespace_admits_routes_from_its_own_servers_only() -> None:
    policy = load_yaml(DEPLOY / "nats" / "network-policy.yaml")
    servers = policy["spec"]["podSelector"]["matchLabels"]
    by_port = {rule["ports"][0]["port"]: rule["from"] for rule in policy["spec"]["ingress"]}
    assert by_port[6222] == [{"podSelector": {"matchLabels": servers}}]  # no namespace, no other pod
    assert {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "memories"}}} in by_port[4222]
    assert set(by_port) == {4222, 6222, 8222} and policy["metadata"]["namespace"] == "nats"
