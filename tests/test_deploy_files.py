"""Every shipped config, compose file, Dockerfile and manifest: it parses, refers only to files that exist, uses
only flags our CLI accepts, and pins its images. No Docker engine or cluster runs here, so this is what can be
checked without one."""

from __future__ import annotations

import functools
import re
from collections.abc import Iterator
from importlib.metadata import distribution
from pathlib import Path
from typing import Any

import pytest
import yaml
from packaging.requirements import Requirement

from gateway.cli import build_parser, config_from_args, main
from simulator.replica import build_parser as replica_parser

REPO = Path(__file__).resolve().parent.parent
DOCKER = REPO / "docker"
COMPOSE = DOCKER / "compose.yaml"
KUBERNETES = REPO / "deploy" / "kubernetes"
GATEWAY_IMAGE = "prefix-gateway:0.1.0"
YAML_FILES = sorted([*REPO.glob("docker/*.yaml"), *REPO.glob("deploy/**/*.yaml")])


@functools.cache
def compose() -> dict[str, Any]:
    """Parsed once; tests only read it."""
    document: dict[str, Any] = yaml.safe_load(COMPOSE.read_text())
    return document


def services() -> dict[str, dict[str, Any]]:
    found: dict[str, dict[str, Any]] = compose()["services"]
    return found


def manifests() -> Iterator[dict[str, Any]]:
    for path in sorted(KUBERNETES.glob("*.yaml")):
        yield from (document for document in yaml.safe_load_all(path.read_text()) if document)


def gateway_argv(args: list[str]) -> list[str]:
    """A gateway command line with `${VAR:-default}` substitutions resolved to their defaults."""
    return [re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", arg) for arg in args]


def check_gateway_command(args: list[str]) -> None:
    """The arguments parse as our CLI's, and a `serve` without --config builds a valid configuration."""
    parsed = build_parser().parse_args(gateway_argv(args))  # exits (SystemExit) on an unknown flag
    if parsed.command == "serve" and parsed.config is None:
        config_from_args(parsed)


def is_pinned(image: str) -> bool:
    name, _, tag = image.rpartition(":")
    return bool(name) and "/" not in tag and tag not in ("", "latest") and any(ch.isdigit() for ch in tag)


def dockerfile_instructions() -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", (DOCKER / "Dockerfile").read_text())
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1]) for line in lines]


@pytest.mark.parametrize("path", YAML_FILES, ids=lambda path: str(path.relative_to(REPO)))
def test_yaml_file_parses(path: Path) -> None:
    assert list(yaml.safe_load_all(path.read_text()))


@pytest.mark.parametrize("path", sorted(REPO.glob("config/*.toml")), ids=lambda path: path.name)
def test_shipped_toml_passes_check_config(path: Path) -> None:
    assert main(["check-config", str(path)]) == 0


# -- the Dockerfile -----------------------------------------------------------------------------------------------

def test_dockerfile_is_multi_stage_pinned_and_non_root() -> None:
    instructions = dockerfile_instructions()
    bases = [argument.split()[0] for keyword, argument in instructions if keyword == "FROM"]
    assert len(bases) >= 2
    assert all(is_pinned(base) for base in bases), bases
    users = [argument for keyword, argument in instructions if keyword == "USER"]
    assert users and users[-1] not in ("root", "0")


def test_dockerfile_copies_only_files_that_exist() -> None:
    for keyword, argument in dockerfile_instructions():
        if keyword == "COPY" and not argument.startswith("--from"):
            for source in argument.split()[:-1]:
                assert (REPO / source).exists(), source


def test_dockerfile_health_checks_ready_and_runs_a_valid_command() -> None:
    instructions = dict(dockerfile_instructions())
    assert "/ready" in instructions["HEALTHCHECK"]
    assert yaml.safe_load(instructions["ENTRYPOINT"]) == ["prefix-gateway"]
    command = yaml.safe_load(instructions["CMD"])
    check_gateway_command(command)
    config_path = command[command.index("--config") + 1]
    assert ("COPY", f"config/gateway.toml {config_path}") in dockerfile_instructions()


def test_constraints_pin_every_runtime_dependency() -> None:
    pinned = {}
    for line in (DOCKER / "constraints.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, version = line.split("==")
            pinned[re.sub(r"[-_.]+", "-", name).lower()] = version
    for requirement in distribution("prefix-gateway").requires or []:
        parsed = Requirement(requirement)
        if parsed.marker is None or parsed.marker.evaluate({"extra": ""}):
            assert re.sub(r"[-_.]+", "-", parsed.name).lower() in pinned, parsed.name


# -- the compose file ---------------------------------------------------------------------------------------------

def test_compose_images_are_pinned_and_built_images_tagged() -> None:
    for name, service in services().items():
        assert "image" in service, name
        assert is_pinned(service["image"]), f"{name}: {service['image']}"
        if "build" in service:
            assert service["image"] == GATEWAY_IMAGE, name


def test_compose_refers_only_to_files_that_exist() -> None:
    for name, service in services().items():
        if "build" in service:
            context = (DOCKER / service["build"]["context"]).resolve()
            assert (context / service["build"]["dockerfile"]).is_file(), name
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("."):
                assert (DOCKER / source).exists(), f"{name}: {source}"


def test_compose_gateway_and_replica_commands_use_valid_flags() -> None:
    gateways = 0
    for name, service in services().items():
        if service.get("image") != GATEWAY_IMAGE:
            continue
        entrypoint = service.get("entrypoint")
        if entrypoint is None:  # the image's own: prefix-gateway
            check_gateway_command(service["command"])
            gateways += 1
        else:
            assert entrypoint[:3] == ["python", "-m", "simulator.replica"], name
            replica_parser().parse_args([*entrypoint[3:], *service["command"]])
    assert gateways == 5  # the sim profile runs two instances


def test_compose_gives_gateways_time_to_drain() -> None:
    for name, service in services().items():
        if service.get("image") == GATEWAY_IMAGE and "entrypoint" not in service:
            config = config_from_args(build_parser().parse_args(gateway_argv(service["command"])))
            assert int(service["stop_grace_period"].rstrip("s")) >= \
                config.shutdown_delay_s + config.shutdown_grace_s + 5, name


def named_hosts(args: list[str], flag: str) -> set[str]:
    """The hosts of the URLs given to `flag` in a command line."""
    return {re.match(r"\w+://([^:/]+)", args[i + 1]).group(1)  # type: ignore[union-attr]
            for i, arg in enumerate(args) if arg == flag}


def test_compose_gateways_wait_for_healthy_backends_and_state_they_name() -> None:
    all_services = services()
    for name, service in all_services.items():
        if service.get("image") != GATEWAY_IMAGE or "entrypoint" in service:
            continue
        args = gateway_argv(service["command"])
        hosts = named_hosts(args, "--backend") | named_hosts(args, "--state")
        assert set(service["depends_on"]) == hosts, name
        for backend in hosts:
            assert service["depends_on"][backend] == {"condition": "service_healthy"}, name
            assert "healthcheck" in all_services[backend], backend
            assert set(all_services[backend]["profiles"]) == set(service["profiles"]), backend


def test_compose_sim_gateways_are_several_instances_of_several_workers_sharing_one_store() -> None:
    gateways = {name: gateway_argv(service["command"]) for name, service in services().items()
                if service.get("image") == GATEWAY_IMAGE and "entrypoint" not in service
                and service["profiles"] == ["sim"]}
    assert len(gateways) == 2
    configs = [config_from_args(build_parser().parse_args(args)) for args in gateways.values()]
    assert all(config.workers > 1 for config in configs)
    assert len({config.state for config in configs}) == 1
    (store,) = set().union(*(named_hosts(args, "--state") for args in gateways.values()))
    assert "valkey" in services()[store]["image"] or "redis" in services()[store]["image"]
    assert len({tuple(services()[name]["ports"]) for name in gateways}) == 2  # each on a port of its own


def test_compose_engines_report_cached_tokens_and_metrics() -> None:
    for name, service in services().items():
        image, command = service["image"], service.get("command", [])
        if image.startswith("lmsysorg/sglang:"):
            assert "--enable-metrics" in command, name
            assert "--enable-cache-report" in command or "--is-embedding" in command, name
        if image.startswith("vllm/vllm-openai:"):
            assert "--enable-prompt-tokens-details" in command, name


def gpu_share(service: dict[str, Any]) -> tuple[str, float] | None:
    """(GPU id, share of its memory) of an engine service, or None for one without a GPU."""
    devices = service.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices", [])
    command = service.get("command", [])
    for flag in ("--mem-fraction-static", "--gpu-memory-utilization"):
        if flag in command:
            assert len(devices) == 1 and len(devices[0]["device_ids"]) == 1
            return devices[0]["device_ids"][0], float(command[command.index(flag) + 1])
    return None


def test_engines_sharing_a_gpu_take_less_than_all_of_its_memory() -> None:
    profiles = {profile for service in services().values() for profile in service.get("profiles", [])}
    shared_somewhere = False
    for profile in profiles:
        per_gpu: dict[str, list[float]] = {}
        for service in services().values():
            share = gpu_share(service) if profile in service.get("profiles", []) else None
            if share:
                per_gpu.setdefault(share[0], []).append(share[1])
        for gpu, shares in per_gpu.items():
            assert sum(shares) < 1.0, f"profile {profile}, GPU {gpu}: {shares}"
            shared_somewhere |= len(shares) > 1
    assert shared_somewhere  # the seeds' LLM + embedding pair


def test_prometheus_and_grafana_files_are_mounted_where_their_configs_look() -> None:
    all_services = services()
    mounts = {volume.split(":")[1]: volume.split(":")[0]
              for name in ("prometheus", "grafana") for volume in all_services[name]["volumes"]}
    prometheus = yaml.safe_load((REPO / "deploy/prometheus/prometheus.yaml").read_text())
    assert all(rule_file in mounts for rule_file in prometheus["rule_files"])
    provider = yaml.safe_load((REPO / "deploy/grafana/provisioning/dashboards/prefix-gateway.yaml").read_text())
    dashboards_dir = provider["providers"][0]["options"]["path"]
    assert any(target.startswith(dashboards_dir + "/") and source.endswith(".json")
               for target, source in mounts.items())
    grafana_env = all_services["grafana"]["environment"]
    assert grafana_env["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"] in mounts


# -- Kubernetes ---------------------------------------------------------------------------------------------------

def test_kustomization_lists_files_that_exist() -> None:
    kustomization = yaml.safe_load((KUBERNETES / "kustomization.yaml").read_text())
    for resource in kustomization["resources"]:
        assert (KUBERNETES / resource).is_file(), resource


def test_kubernetes_deployment_probes_terminates_gracefully_and_runs_a_valid_command() -> None:
    by_kind = {document["kind"]: document for document in manifests()}
    deployment = by_kind["Deployment"]
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert container["livenessProbe"]["httpGet"]["path"] == "/health"
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert is_pinned(container["image"])
    check_gateway_command(container["args"])
    # After SIGTERM the gateway serves on while the endpoint's removal spreads (a few seconds), then drains for
    # the grace period and takes 5 s more to close.
    config = config_from_args(build_parser().parse_args(container["args"]))
    assert config.shutdown_delay_s >= 3
    assert pod["terminationGracePeriodSeconds"] >= config.shutdown_delay_s + config.shutdown_grace_s + 5


def test_kubernetes_service_and_budget_select_the_deployments_pods() -> None:
    by_kind = {document["kind"]: document for document in manifests()}
    labels = by_kind["Deployment"]["spec"]["template"]["metadata"]["labels"]
    assert by_kind["Deployment"]["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert by_kind["Service"]["spec"]["selector"].items() <= labels.items()
    assert by_kind["PodDisruptionBudget"]["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert by_kind["PodDisruptionBudget"]["spec"]["minAvailable"] < by_kind["Deployment"]["spec"]["replicas"]

