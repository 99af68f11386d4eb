"""Scenario presets load, and generators are deterministic for a seed and produce what their parameters say."""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import replace

import pytest

from loadtest.__main__ import build_parser, scenario_from_args, traffic_from_args
from loadtest.client import _name_session
from loadtest.runner import Traffic, replica_args
from loadtest.scenarios import Kind, Popularity, SessionKeys, Workload, list_scenarios, load_scenario, parse_scenario
from loadtest.textgen import draw_length, words_text
from loadtest.workload import RequestKind, generate, request_count, working_set_tokens
from simulator.tokenizer import count_tokens


def shared(**fields: object) -> Workload:
    base = Workload(kind=Kind.SHARED_PREFIX, groups=8, prompts_per_group=4, system_tokens=200,
                    question_tokens=40, output_tokens=30, seed=3)
    return replace(base, **fields)  # type: ignore[arg-type]


def test_every_preset_loads_and_its_working_set_fits_the_fleet_but_not_one_replica() -> None:
    names = list_scenarios()
    for required in ("shared-prefix", "multiturn", "multiturn-20x20", "multiturn-200x2", "multiturn-long",
                     "random-id", "hot-tenant", "b2b-saas", "mixed-models", "unique"):
        assert required in names
    for name in names:
        scenario = load_scenario(name)
        assert scenario.source and scenario.description
        working_set = working_set_tokens(scenario.workload)
        if working_set:
            assert max(scenario.fleet.capacities) < working_set <= scenario.fleet.total_kv_capacity_tokens, name


def test_tight_presets_fill_most_of_the_fleet_with_live_histories() -> None:
    for name in ("tight", "tight-poisson", "tight-unequal"):
        scenario = load_scenario(name)
        fill = working_set_tokens(scenario.workload) / scenario.fleet.total_kv_capacity_tokens
        assert 0.7 <= fill <= 1.0, (name, fill)
    assert load_scenario("tight").load.max_concurrency == 24
    assert load_scenario("tight-poisson").load.max_concurrency is None
    assert len(set(load_scenario("tight-unequal").fleet.capacities)) == 4


def test_a_closed_loop_preset_runs_closed_unless_a_rate_or_load_is_asked_for() -> None:
    def traffic(*flags: str) -> Traffic:
        args = build_parser().parse_args(["run", "tight", *flags])
        return traffic_from_args(args, scenario_from_args(args))
    assert traffic() == Traffic(request_rate=None, max_concurrency=24)
    assert traffic("--max-concurrency", "8").max_concurrency == 8
    assert traffic("--load", "light") == Traffic(request_rate=40.0, max_concurrency=None)


def test_unequal_replicas_take_one_capacity_each_and_the_count_must_match() -> None:
    unequal = {"replicas": 2, "replica_kv_capacity_tokens": [10, 30]}
    fleet = parse_scenario({"kind": "multiturn", "fleet": unequal}).fleet
    assert fleet.capacities == (10, 30) and fleet.total_kv_capacity_tokens == 40
    assert replica_args(replace(load_scenario("tight-unequal"), fleet=fleet))[3] == "10,30"
    with pytest.raises(ValueError, match="replica_kv_capacity_tokens"):
        parse_scenario({"kind": "multiturn", "fleet": {"replicas": 3, "replica_kv_capacity_tokens": [10, 30]}})


def test_one_capacity_on_the_command_line_is_every_replicas() -> None:
    args = build_parser().parse_args(["run", "tight-unequal", "--kv-capacity-tokens", "5000"])
    assert scenario_from_args(args).fleet.capacities == (5000,) * 4


def test_few_prompts_keep_their_prompts_per_group_so_a_quick_run_still_shares() -> None:
    workload = replace(load_scenario("shared-prefix").workload, num_prompts=40)
    counts = Counter(c.group for c in generate(workload))
    assert len(counts) == 2 and set(counts.values()) == {20}
    assert len({c.group for c in generate(replace(workload, num_prompts=None))}) == 64


def test_unknown_keys_are_named() -> None:
    with pytest.raises(ValueError, match="grups"):
        parse_scenario({"kind": "shared-prefix", "workload": {"grups": 3}})


def test_text_has_the_requested_token_length() -> None:
    rng = random.Random(1)
    for tokens in (0, 1, 7, 128, 2048):
        assert count_tokens(words_text(rng, tokens)) == tokens


def test_range_ratio_draws_lengths_between_ratio_and_full() -> None:
    rng = random.Random(2)
    assert {draw_length(rng, 100, 1.0) for _ in range(20)} == {100}
    drawn = [draw_length(rng, 100, 0.5) for _ in range(500)]
    assert min(drawn) >= 50 and max(drawn) == 100 and len(set(drawn)) > 30


def test_generation_is_deterministic_for_a_seed_and_differs_across_seeds() -> None:
    assert generate(shared()) == generate(shared())
    assert generate(shared()) != generate(shared(seed=4))


def test_shared_prefix_has_the_groups_prompts_and_lengths_asked_for() -> None:
    conversations = generate(shared())
    assert len(conversations) == 32
    assert Counter(c.group for c in conversations) == {group: 4 for group in range(8)}
    systems = {c.group: c.system_text for c in conversations}
    assert len(set(systems.values())) == 8
    for conversation in conversations:
        assert conversation.system_text == systems[conversation.group]
        assert count_tokens(conversation.system_text) == 200
        (turn,) = conversation.turns
        assert count_tokens(turn.user_text) == 40 and turn.max_tokens == 30
    assert [c.group for c in conversations] != sorted(c.group for c in conversations)  # shuffled order


def test_scale_multiplies_every_length() -> None:
    (first, *_) = generate(shared(scale=0.5))
    assert count_tokens(first.system_text) == 100
    assert count_tokens(first.turns[0].user_text) == 20 and first.turns[0].max_tokens == 15


def test_num_prompts_overrides_the_request_count() -> None:
    assert len(generate(shared(num_prompts=10))) == 10


def test_zipf_popularity_favours_low_ranks() -> None:
    counts = Counter(c.group for c in generate(shared(popularity=Popularity.ZIPF, num_prompts=2000)))
    assert counts[0] > counts[1] > counts[7]


def test_hot_tenant_takes_its_share() -> None:
    counts = Counter(c.group for c in generate(shared(popularity=Popularity.HOT, hot_share=0.7, num_prompts=100)))
    assert counts[0] == 70 and sum(counts.values()) == 100 and len(counts) == 8


def test_unique_shares_no_system_prompt() -> None:
    conversations = generate(shared(popularity=Popularity.UNIQUE, num_prompts=20))
    assert len({c.system_text for c in conversations}) == 20
    assert working_set_tokens(shared(popularity=Popularity.UNIQUE)) == 0


def test_random_id_opens_every_system_prompt_with_a_distinct_id_then_the_shared_text() -> None:
    conversations = generate(shared(id_prefix=True))
    headers = [c.system_text.split("\n", 1)[0] for c in conversations]
    assert all(header.startswith("Request ID: ") and "Current time: 2026-" in header for header in headers)
    assert len(set(headers)) == len(conversations)
    plain = {c.group: c.system_text for c in generate(shared())}
    assert all(c.system_text.split("\n", 1)[1] == plain[c.group] for c in conversations)


def test_multiturn_has_clients_times_rounds_behind_one_system_prompt() -> None:
    workload = Workload(kind=Kind.MULTITURN, clients=5, rounds=3, system_tokens=64, question_tokens=32,
                        output_tokens=8, seed=1)
    conversations = generate(workload)
    assert len(conversations) == 5 and request_count(conversations) == 15
    assert len({c.system_text for c in conversations}) == 1
    assert all(len(c.turns) == 3 for c in conversations)
    assert all(count_tokens(t.user_text) == 32 and t.max_tokens == 8 for c in conversations for t in c.turns)
    assert len({t.user_text for c in conversations for t in c.turns}) == 15
    assert len(generate(replace(workload, num_prompts=9))) == 3  # clients = num_prompts // rounds


def test_mixed_models_sends_the_embedding_share_to_the_embedding_model() -> None:
    workload = shared(kind=Kind.MIXED_MODELS, embedding_share=0.25, embedding_tokens=50)
    conversations = generate(workload)
    embeddings = [c for c in conversations if c.kind is RequestKind.EMBEDDING]
    assert len(embeddings) == 8
    assert all(c.model == workload.embedding_model and not c.system_text for c in embeddings)
    assert all(count_tokens(c.turns[0].user_text) == 50 for c in embeddings)
    assert all(c.model == workload.model for c in conversations if c.kind is RequestKind.CHAT)


def test_agent_sessions_pause_once_halfway_and_name_themselves() -> None:
    workload = Workload(kind=Kind.MULTITURN, clients=8, rounds=4, system_tokens=50, question_tokens=20,
                        output_tokens=5, idle_share=0.25, idle_s=3.0, session_keys=SessionKeys.USER)
    conversations = generate(workload)
    pauses = [[turn.idle_s for turn in c.turns] for c in conversations]
    assert sorted(pauses)[-2:] == [[0.0, 0.0, 3.0, 0.0]] * 2 and sum(map(sum, pauses)) == 6.0
    assert {c.session_keys for c in conversations} == {SessionKeys.USER}
    assert len({c.session_key for c in conversations}) == 8


def test_session_keys_go_in_the_body_field_or_the_header_named() -> None:
    (conversation,) = generate(Workload(kind=Kind.MULTITURN, clients=1, rounds=1))
    sent = {}
    for keys in SessionKeys:
        body: dict[str, object] = {}
        headers = _name_session(replace(conversation, session_keys=keys), body)
        sent[keys] = (body, headers)
    key = conversation.session_key
    assert sent == {SessionKeys.NONE: ({}, {}), SessionKeys.PROMPT_CACHE_KEY: ({"prompt_cache_key": key}, {}),
                    SessionKeys.USER: ({"user": key}, {}), SessionKeys.HEADER: ({}, {"x-session-id": key})}
