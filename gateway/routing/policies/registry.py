"""Every routing policy by name: its class, its config dataclass and the line `--help` shows for it.

Adding a policy is a module in this package (the policy class with a `name` and a constructor taking its
config, the config dataclass with its knobs) and one line in `POLICIES`. A knob becomes a flag and a TOML key
through an `Option` with section "policy" in `gateway/config.py`; it applies to every policy whose config has a
field of that name.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

from gateway.routing.policies import Policy, PolicyConfig
from gateway.routing.policies.basic import LeastLoad, PowerOfTwo, Random, RoundRobin, SeededConfig
from gateway.routing.policies.cache_aware import CacheAware, CacheAwareConfig
from gateway.routing.policies.prefix_aware import PrefixAware, PrefixAwareConfig

C = TypeVar("C", bound=PolicyConfig)
C_contra = TypeVar("C_contra", bound=PolicyConfig, contravariant=True)


class PolicyClass(Protocol[C_contra]):
    name: str

    def __call__(self, config: C_contra) -> Policy: ...


@dataclass(frozen=True)
class PolicySpec(Generic[C]):
    policy: PolicyClass[C]
    config: type[C]
    summary: str = ""

    @property
    def name(self) -> str:
        return self.policy.name


def _by_name(*specs: PolicySpec[Any]) -> Mapping[str, PolicySpec[Any]]:
    return {spec.name: spec for spec in specs}


POLICIES = _by_name(
    PolicySpec(PrefixAware, PrefixAwareConfig, "cache affinity weighed against queued work"),
    PolicySpec(CacheAware, CacheAwareConfig, "sglang-router's algorithm"),
    PolicySpec(RoundRobin, PolicyConfig),
    PolicySpec(Random, SeededConfig),
    PolicySpec(LeastLoad, PolicyConfig),
    PolicySpec(PowerOfTwo, SeededConfig),
)
DEFAULT_POLICY = PrefixAware.name


def default_config() -> PolicyConfig:
    return POLICIES[DEFAULT_POLICY].config()


def knobs(config: type[PolicyConfig]) -> frozenset[str]:
    return frozenset(field.name for field in dataclasses.fields(config))


def configure(name: str, values: Mapping[str, Any]) -> PolicyConfig:
    """Policy `name`'s config from the knob values given; knobs of other policies are not its business."""
    config = POLICIES[name].config
    own = knobs(config)
    return config(**{knob: value for knob, value in values.items() if knob in own})


def make_policy(name: str, config: PolicyConfig) -> Policy:
    spec = POLICIES[name]
    if type(config) is not spec.config:
        raise TypeError(f"policy {name} takes a {spec.config.__name__}, got a {type(config).__name__}")
    return spec.policy(config)


def policies_with(knob: str) -> list[str]:
    """The policies a knob applies to, in registry order (for --help)."""
    return [name for name, spec in POLICIES.items() if knob in knobs(spec.config)]


def knob_default(knob: str) -> Any:
    """A knob's default, from the first policy that has it (tests check that they all agree)."""
    for spec in POLICIES.values():
        for field in dataclasses.fields(spec.config):
            if field.name == knob:
                return field.default
    raise KeyError(knob)


def describe() -> str:
    """The policies for --help: each name, with its one-line summary where it has one."""
    shown = [f"{name} ({spec.summary})" if spec.summary else name for name, spec in POLICIES.items()]
    return " or ".join([", ".join(shown[:-1]), shown[-1]]) if len(shown) > 1 else shown[0]

