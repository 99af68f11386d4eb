"""The policy registry: every policy is built by name from its own config, and every knob reaches a policy."""

import dataclasses
import subprocess
import sys

import pytest

from gateway.config import OPTIONS, build_config
from gateway.routing.policies import registry
from gateway.routing.policies.cache_aware import CacheAwareConfig
from gateway.routing.policies.prefix_aware import PrefixAwareConfig
from gateway.routing.router import RoutingConfig
from tests.policy_fixtures import make_backends, request, text


@pytest.mark.parametrize("name", list(registry.POLICIES))
def test_every_policy_is_built_by_name_from_its_default_config_and_chooses(name: str) -> None:
    policy = registry.make_policy(name, registry.POLICIES[name].config())
    assert policy.name == name
    assert policy.choose(make_backends(3), request(text("hello", 640))).backend.url.startswith("http://b")


def test_every_policy_knob_option_reaches_at_least_one_policy() -> None:
    for option in OPTIONS:
        if option.section == "policy":
            assert registry.policies_with(option.field), option.key


def test_policies_sharing_a_knob_agree_on_its_default() -> None:
    defaults: dict[str, set[object]] = {}
    for spec in registry.POLICIES.values():
        for field in dataclasses.fields(spec.config):
            defaults.setdefault(field.name, set()).add(field.default)
    assert {knob: values for knob, values in defaults.items() if len(values) > 1} == {}


def test_knobs_go_to_the_chosen_policy_and_other_policies_knobs_are_ignored() -> None:
    values = {"policy": "cache_aware", "cache_threshold": 0.5, "affinity_weight": 8.0, "index_kv_share": 0.5}
    routing = build_config(values, {}).routing
    assert routing.policy_config == CacheAwareConfig(cache_threshold=0.5)
    assert routing.policy_config.index_share == 1.0
    assert build_config({"affinity_weight": 8.0}, {}).routing.policy_config == PrefixAwareConfig(affinity_weight=8.0)


def test_a_policy_refuses_another_policys_config() -> None:
    with pytest.raises(TypeError, match="CacheAwareConfig"):
        registry.make_policy("cache_aware", PrefixAwareConfig())


def test_default_routing_config_is_the_default_policys() -> None:
    routing = RoutingConfig()
    assert type(routing.policy_config) is registry.POLICIES[routing.policy].config


def test_help_says_which_policies_a_knob_belongs_to() -> None:
    help_text = subprocess.run([sys.executable, "-m", "gateway", "serve", "--help"], capture_output=True,
                               text=True, check=True).stdout
    flat = " ".join(help_text.split())
    assert "--affinity-weight WEIGHT prefix_aware: how many queued" in flat
    assert "--cache-threshold THRESHOLD prefix_aware, cache_aware: share of the prompt" in flat
    assert all(name in flat for name in registry.POLICIES)
