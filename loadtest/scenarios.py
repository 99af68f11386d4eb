"""Scenario presets: what traffic to send, to what kind of fleet, at which load, judged by which SLO.

Each preset is a TOML file in `loadtest/scenarios/` whose comment header says where the workload comes from.
Token lengths in a file are the published ones; `scale` shrinks them all so the default run fits a 2-core
machine in minutes, and the fleet's KV capacity is chosen so the scaled working set does not fit one replica
but fits the fleet (the regime where routing decides the hit rate).

Time: simulated replicas sleep `time_scale` wall seconds per modelled second. The presets use 8.0 (slow
motion): the modelled H100 fleet is so fast that at time-scale 1 the Python client, gateway and replicas on a
2-core machine saturate (about 2,500 streamed chunks/s) long before the simulated GPUs do; at 8 the fleet's
knee is reached at ~15 wall requests/s, so the simulated fleet, not the test harness, is the bottleneck.
Every rate, latency and SLO in a scenario and in the reports is in *simulated* seconds, i.e. wall-clock
values divided by `time_scale`, so results read as if the fleet ran in real time (and the harness's own
per-request cost shrinks by the same factor).

Load levels were calibrated on that machine with `shared-prefix`: at 120 simulated req/s round robin
saturates (~95 req/s served, TTFT p50 0.5 s) while prefix-aware routing still keeps up; 60 is light, 200 is
overload.
"""

from __future__ import annotations

import dataclasses
import tomllib
from dataclasses import dataclass
from enum import Enum
from importlib import resources
from pathlib import Path
from typing import Any


class Kind(str, Enum):
    SHARED_PREFIX = "shared-prefix"    # groups of prompts behind one system prompt each
    MULTITURN = "multiturn"            # clients x rounds, each round appends the model's answer
    MIXED_MODELS = "mixed-models"      # chat to an LLM pool, embeddings to an embedding pool


class Popularity(str, Enum):
    UNIFORM = "uniform"   # every group equally often (exactly, in a shuffled order)
    ZIPF = "zipf"         # group k drawn with weight 1 / (k + 1) ** zipf_exponent
    HOT = "hot"           # group 0 takes `hot_share` of the requests, the rest share the remainder evenly
    UNIQUE = "unique"     # every request its own group: nothing is shared


class SessionKeys(str, Enum):
    """How a client names its conversation to the gateway (gateway/api/prompts.py session_key)."""

    NONE = "none"
    PROMPT_CACHE_KEY = "prompt_cache_key"  # OpenAI's body field
    USER = "user"
    HEADER = "header"                      # x-session-id


class LoadLevel(str, Enum):
    LIGHT = "light"
    KNEE = "knee"
    OVERLOAD = "overload"


@dataclass(frozen=True)
class Workload:
    """The request sequence; token lengths are before `scale` is applied."""

    kind: Kind
    groups: int = 1                    # shared-prefix: distinct system prompts
    prompts_per_group: int = 1         # shared-prefix: requests per group when popularity is uniform
    clients: int = 1                   # multiturn: concurrent conversations
    rounds: int = 1                    # multiturn: user turns per conversation
    system_tokens: int = 0             # length of each group's (multiturn: the one shared) system prompt
    question_tokens: int = 128         # length of each user message
    output_tokens: int = 128           # max_tokens of each request (replicas generate exactly this many)
    popularity: Popularity = Popularity.UNIFORM
    zipf_exponent: float = 1.1
    hot_share: float = 0.7
    id_prefix: bool = False            # random-id: a request ID and timestamp open the system prompt
    embedding_share: float = 0.0       # mixed-models: fraction of requests that are embeddings
    embedding_tokens: int = 256        # mixed-models: input length of an embedding request
    model: str = "sim-llm"
    embedding_model: str = "sim-embed"
    scale: float = 1.0                 # multiplies every token length above
    random_range_ratio: float = 1.0    # lengths drawn from [L * ratio, L], as SGLang's bench; 1.0 = fixed
    num_prompts: int | None = None     # None: groups x prompts_per_group, or clients x rounds
    idle_share: float = 0.0            # multiturn: share of conversations that pause once, halfway through
    idle_s: float = 0.0                # multiturn: simulated seconds such a pause lasts
    session_keys: SessionKeys = SessionKeys.NONE  # multiturn: the key each conversation sends, if any
    seed: int = 0

    def tokens(self, published: int) -> int:
        return max(1, round(published * self.scale)) if published > 0 else 0


@dataclass(frozen=True)
class FleetSpec:
    replicas: int = 4
    kv_capacity_tokens: int = 16384    # per replica
    time_scale: float = 8.0            # wall-clock duration = modelled duration x time_scale
    max_running_requests: int | None = None
    embedding_replicas: int = 0        # mixed-models: size of the embedding pool
    # A fleet of unequal replicas: one capacity per replica (overrides kv_capacity_tokens); empty = all equal.
    replica_kv_capacity_tokens: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "replica_kv_capacity_tokens", tuple(self.replica_kv_capacity_tokens))
        if self.replica_kv_capacity_tokens and len(self.replica_kv_capacity_tokens) != self.replicas:
            raise ValueError(f"[fleet] replica_kv_capacity_tokens has {len(self.replica_kv_capacity_tokens)} "
                             f"entries for {self.replicas} replicas")

    @property
    def capacities(self) -> tuple[int, ...]:
        """KV capacity of each LLM replica, in tokens."""
        return self.replica_kv_capacity_tokens or (self.kv_capacity_tokens,) * self.replicas

    @property
    def total_kv_capacity_tokens(self) -> int:
        return sum(self.capacities)

    def describe_capacity(self) -> str:
        if self.replica_kv_capacity_tokens:
            return " + ".join(map(str, self.replica_kv_capacity_tokens))
        return f"{self.replicas} x {self.kv_capacity_tokens}"


@dataclass(frozen=True)
class LoadRates:
    """Poisson arrival rates in simulated requests/s (conversation starts for multiturn), or a closed loop."""

    light: float = 1.0
    knee: float = 4.0
    overload: float = 8.0
    # Closed loop: this many requests in flight, used when neither --load nor --request-rate is given.
    max_concurrency: int | None = None

    def rate(self, level: LoadLevel) -> float:
        return float(getattr(self, level.value))


@dataclass(frozen=True)
class Slo:
    """Goodput counts requests meeting both targets; simulated seconds."""

    ttft_s: float = 2.0
    tpot_s: float = 0.1


@dataclass(frozen=True)
class Scenario:
    name: str
    description: str
    source: str
    workload: Workload
    fleet: FleetSpec
    load: LoadRates
    slo: Slo


def scenario_dir() -> Path:
    return Path(str(resources.files("loadtest") / "scenarios"))


def list_scenarios() -> list[str]:
    return sorted(path.stem for path in scenario_dir().glob("*.toml"))


def load_scenario(name_or_path: str) -> Scenario:
    """A preset by name (`shared-prefix`) or a TOML file by path."""
    path = Path(name_or_path)
    if not path.suffix:
        path = scenario_dir() / f"{name_or_path}.toml"
    if not path.is_file():
        known = ", ".join(list_scenarios())
        raise ValueError(f"unknown scenario {name_or_path!r}; presets: {known}")
    with path.open("rb") as file:
        return parse_scenario(tomllib.load(file), default_name=path.stem)


def parse_scenario(data: dict[str, Any], *, default_name: str = "custom") -> Scenario:
    workload_fields = dict(data.get("workload", {}))
    workload_fields["kind"] = Kind(data.get("kind", workload_fields.pop("kind", Kind.SHARED_PREFIX.value)))
    if "popularity" in workload_fields:
        workload_fields["popularity"] = Popularity(workload_fields["popularity"])
    if "session_keys" in workload_fields:
        workload_fields["session_keys"] = SessionKeys(workload_fields["session_keys"])
    return Scenario(
        name=str(data.get("name", default_name)),
        description=str(data.get("description", "")),
        source=str(data.get("source", "")),
        workload=_build(Workload, workload_fields, "workload"),
        fleet=_build(FleetSpec, dict(data.get("fleet", {})), "fleet"),
        load=_build(LoadRates, dict(data.get("load", {})), "load"),
        slo=_build(Slo, dict(data.get("slo", {})), "slo"),
    )


def _build(cls: Any, fields: dict[str, Any], table: str) -> Any:
    known = {field.name for field in dataclasses.fields(cls)}
    unknown = sorted(set(fields) - known)
    if unknown:
        raise ValueError(f"[{table}] has unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    return cls(**fields)


def with_overrides(scenario: Scenario, *, workload: dict[str, Any] | None = None,
                   fleet: dict[str, Any] | None = None, slo: dict[str, Any] | None = None) -> Scenario:
    """The scenario with the non-None values of the given tables replaced (command-line knobs)."""
    def pick(values: dict[str, Any] | None) -> dict[str, Any]:
        return {key: value for key, value in (values or {}).items() if value is not None}
    return dataclasses.replace(
        scenario,
        workload=dataclasses.replace(scenario.workload, **pick(workload)),
        fleet=dataclasses.replace(scenario.fleet, **pick(fleet)),
        slo=dataclasses.replace(scenario.slo, **pick(slo)),
    )
