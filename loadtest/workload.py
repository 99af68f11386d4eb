"""The seeded request sequence of a scenario: conversations in arrival order, texts drawn from `textgen`.

A single-turn request is a conversation of one turn, so one driver serves every scenario. Multi-turn answers
are not known here: the client appends each round's real answer before sending the next round.
Every random choice comes from an RNG seeded by (seed, purpose), so one purpose's draws never shift another's
and the same seed gives the same sequence on every machine.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from enum import Enum

from loadtest.scenarios import Kind, Popularity, SessionKeys, Workload
from loadtest.textgen import draw_length, words_text

# random-id timestamps start here and advance per request, so they are deterministic for a seed.
EPOCH = datetime(2026, 1, 1, tzinfo=UTC)


class RequestKind(str, Enum):
    CHAT = "chat"
    EMBEDDING = "embedding"


@dataclass(frozen=True)
class Turn:
    user_text: str
    max_tokens: int
    idle_s: float = 0.0        # simulated seconds the client waits after the previous answer before sending it


@dataclass(frozen=True)
class Conversation:
    index: int
    kind: RequestKind
    model: str
    group: int                 # the shared-prefix group; -1 when the request shares nothing by design
    system_text: str           # "" for no system message
    turns: tuple[Turn, ...]
    session_keys: SessionKeys = SessionKeys.NONE  # how it names itself to the gateway (`session_key`)

    @property
    def session_key(self) -> str:
        return f"session-{self.index}"


def seeded(seed: int, purpose: str) -> random.Random:
    return random.Random(f"{seed}:{purpose}")


def generate(workload: Workload) -> tuple[Conversation, ...]:
    if workload.kind is Kind.MULTITURN:
        return _multiturn(workload)
    conversations = _shared_prefix(workload)
    if workload.kind is Kind.MIXED_MODELS:
        conversations = _with_embeddings(workload, conversations)
    return conversations


def request_count(conversations: tuple[Conversation, ...]) -> int:
    return sum(len(conversation.turns) for conversation in conversations)


def prompt_count(workload: Workload) -> int:
    if workload.num_prompts is not None:
        return workload.num_prompts
    if workload.kind is Kind.MULTITURN:
        return workload.clients * workload.rounds
    return workload.groups * workload.prompts_per_group


def group_count(workload: Workload, count: int) -> int:
    """Distinct groups among `count` requests: the scenario's, or fewer when `num_prompts` asks for fewer requests
    than groups x prompts per group, so that a group keeps its prompts (12 prompts over 64 groups would share
    nothing, and a quick run would show no policy's effect)."""
    groups = max(1, workload.groups)
    if workload.num_prompts is None:
        return groups
    return max(1, min(groups, round(count / max(1, workload.prompts_per_group))))


def group_sequence(workload: Workload, count: int) -> list[int]:
    """Which group each of `count` requests belongs to, in arrival order."""
    rng = seeded(workload.seed, "groups")
    groups = group_count(workload, count)
    if workload.popularity is Popularity.UNIQUE:
        return list(range(count))
    if workload.popularity is Popularity.ZIPF:
        weights = [1.0 / (rank + 1) ** workload.zipf_exponent for rank in range(groups)]
        return rng.choices(range(groups), weights=weights, k=count)
    if workload.popularity is Popularity.HOT and groups > 1:
        hot = round(count * workload.hot_share)
        sequence = [0] * hot + [1 + i % (groups - 1) for i in range(count - hot)]
    else:
        sequence = [i % groups for i in range(count)]
    rng.shuffle(sequence)
    return sequence


def _shared_prefix(workload: Workload) -> tuple[Conversation, ...]:
    count = prompt_count(workload)
    sequence = group_sequence(workload, count)
    system_rng = seeded(workload.seed, "system")
    systems: dict[int, str] = {}
    for group in sorted(set(sequence)):
        length = draw_length(system_rng, workload.tokens(workload.system_tokens), workload.random_range_ratio)
        systems[group] = words_text(system_rng, length)
    question_rng, output_rng = seeded(workload.seed, "question"), seeded(workload.seed, "output")
    id_rng = seeded(workload.seed, "request-id")
    conversations = []
    for index, group in enumerate(sequence):
        system = systems[group]
        if workload.id_prefix:
            system = _id_header(id_rng, index) + system
        question = words_text(question_rng, draw_length(
            question_rng, workload.tokens(workload.question_tokens), workload.random_range_ratio))
        output = draw_length(output_rng, workload.tokens(workload.output_tokens), workload.random_range_ratio)
        unique = workload.popularity is Popularity.UNIQUE
        conversations.append(Conversation(index, RequestKind.CHAT, workload.model, -1 if unique else group,
                                          system, (Turn(question, max(1, output)),)))
    return tuple(conversations)


def _id_header(rng: random.Random, index: int) -> str:
    """What the cheat sheet found at the start of every system prompt: a per-request ID and a timestamp."""
    stamp = EPOCH + timedelta(milliseconds=137 * index + rng.randrange(137))
    return f"Request ID: {rng.getrandbits(64):016x}. Current time: {stamp.isoformat(timespec='milliseconds')}.\n"


def _multiturn(workload: Workload) -> tuple[Conversation, ...]:
    rounds = max(1, workload.rounds)
    clients = workload.clients if workload.num_prompts is None else max(1, workload.num_prompts // rounds)
    system_rng, question_rng = seeded(workload.seed, "system"), seeded(workload.seed, "question")
    output_rng = seeded(workload.seed, "output")
    system = words_text(system_rng, workload.tokens(workload.system_tokens))
    idle = set(seeded(workload.seed, "idle").sample(range(clients), round(clients * workload.idle_share)))
    conversations = []
    for client in range(clients):
        turns = []
        for round_ in range(rounds):
            length = draw_length(question_rng, workload.tokens(workload.question_tokens), workload.random_range_ratio)
            output = draw_length(output_rng, workload.tokens(workload.output_tokens), workload.random_range_ratio)
            pause = workload.idle_s if client in idle and round_ == rounds // 2 else 0.0
            turns.append(Turn(words_text(question_rng, length), max(1, output), pause))
        conversations.append(Conversation(client, RequestKind.CHAT, workload.model, 0, system, tuple(turns),
                                          workload.session_keys))
    return tuple(conversations)


def _with_embeddings(workload: Workload, chats: tuple[Conversation, ...]) -> tuple[Conversation, ...]:
    """Replace an exact `embedding_share` of the positions (seeded) by embedding requests."""
    rng = seeded(workload.seed, "embedding")
    count = len(chats)
    positions = set(rng.sample(range(count), round(count * workload.embedding_share)))
    mixed = []
    for index, chat in enumerate(chats):
        if index in positions:
            length = draw_length(rng, workload.tokens(workload.embedding_tokens), workload.random_range_ratio)
            chat = Conversation(index, RequestKind.EMBEDDING, workload.embedding_model, -1, "",
                                (Turn(words_text(rng, length), 0),))
        mixed.append(chat)
    return tuple(mixed)


def working_set_tokens(workload: Workload) -> int:
    """Tokens worth keeping cached: the distinct shared prefixes (multiturn: every conversation's history)."""
    if workload.kind is Kind.MULTITURN:
        rounds = max(1, workload.rounds)
        clients = workload.clients if workload.num_prompts is None else max(1, workload.num_prompts // rounds)
        per_round = workload.tokens(workload.question_tokens) + workload.tokens(workload.output_tokens)
        return workload.tokens(workload.system_tokens) + clients * rounds * per_round
    if workload.popularity is Popularity.UNIQUE:
        return 0
    groups = len(set(group_sequence(workload, prompt_count(workload))))
    return groups * workload.tokens(workload.system_tokens)
