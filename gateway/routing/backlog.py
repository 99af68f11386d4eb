"""The prefill we sent a backend and saw no first byte for: what a newcomer would queue behind there.

Every request reserves its uncached prompt tokens on the backend it is sent to until its first byte arrives
(the router does it at decision time, so a burst sees its own placements). Counted at full size, though, a
request sent 20 ms ago to a backend that prefills it in 25 ms weighs as much as one sent just now. Routing was
then blind to the difference: in a burst that keeps every backend busy, the newcomer went to whichever ran
fewer requests, not to the one about to be free (round robin's rotation, by luck, picks the backend served
longest ago, and beat it).

So the oldest pending request -- the one the engine works on (SGLang's scheduler runs prefill first, FCFS) --
is credited with the progress the backend would have made on it since it started (since the first byte of the
request before it arrived, or since it was sent to an idle backend) at the rate the backend has shown. The rate is
prompt tokens whose first byte arrived over the seconds work of ours was pending, a ratio of exponentially
weighted sums over about the last `RATE_MEMORY` first bytes (a batched prefill, several first bytes after one
long wait, averages out). Those seconds include decode steps, batch overhead and, for non-streamed requests,
the whole answer, so the rate errs low and the backlog high. A request that ends without a first byte (a
broken connection, a timeout, a client that left) or answers with an error status is released without teaching
anything. No credit is given until `MIN_SAMPLES` first bytes have taught the rate.

Only the oldest request is credited, never the ones behind it: a backend that stops making progress (its KV
pool full, requests waiting for admission) keeps all but one of them in its backlog however long they wait.
Crediting the whole queue at the learned rate sends more and more conversations to such a backend under
overload.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass

# First bytes needed before the learned rate is trusted; until then nothing is credited.
MIN_SAMPLES = 8
# About how many recent first bytes the rate is averaged over.
RATE_MEMORY = 64


@dataclass(eq=False)  # each request's own entry: two requests of one size must not stand for each other
class PendingPrefill:
    tokens: int


class PrefillBacklog:
    """One backend's pending prefills, in prompt tokens, oldest first. Times are `time.monotonic()` seconds."""

    def __init__(self) -> None:
        self._pending: collections.deque[PendingPrefill] = collections.deque()
        self.reserved_tokens = 0
        self._keep = 1.0 - 1.0 / RATE_MEMORY   # weight of the past at each new first byte
        self._drained_tokens = 0.0             # decayed sums behind the rate
        self._busy_s = 0.0
        self._samples = 0
        self._head_since_s = 0.0               # when the oldest pending request got the engine's turn

    @property
    def requests(self) -> int:
        """Requests sent that have not produced a first byte yet."""
        return len(self._pending)

    @property
    def tokens_per_s(self) -> float | None:
        """The learned prefill rate, or None while too few first bytes were seen."""
        if self._samples < MIN_SAMPLES or self._busy_s <= 0:
            return None
        return self._drained_tokens / self._busy_s

    def remaining_tokens(self, now_s: float) -> float:
        """Reserved tokens less the progress the backend has probably made on the oldest request."""
        rate = self.tokens_per_s
        if rate is None or not self._pending:
            return float(self.reserved_tokens)
        return self.reserved_tokens - min(float(self._pending[0].tokens), rate * (now_s - self._head_since_s))

    def add(self, tokens: int, now_s: float) -> PendingPrefill:
        """A request with `tokens` to prefill was sent; the entry returned is what `finish` or `drop` takes."""
        if not self._pending:
            self._head_since_s = now_s
        pending = PendingPrefill(tokens)
        self._pending.append(pending)
        self.reserved_tokens += tokens
        return pending

    def finish(self, pending: PendingPrefill, now_s: float) -> None:
        """The request's first byte arrived: it teaches the rate, and the next in line gets the engine's turn."""
        if self._remove(pending):
            self._drained_tokens = self._drained_tokens * self._keep + pending.tokens
            self._busy_s = self._busy_s * self._keep + (now_s - self._head_since_s)
            self._samples += 1
            self._head_since_s = now_s

    def drop(self, pending: PendingPrefill, now_s: float) -> None:
        """The request ended without a first byte (failed, timed out, abandoned): released, but not learned
        from. When it was the oldest, the next one in line gets the engine's turn now."""
        if self._pending and self._pending[0] is pending:
            self._head_since_s = now_s
        self._remove(pending)

    def _remove(self, pending: PendingPrefill) -> bool:
        try:
            self._pending.remove(pending)  # one scan of the deque, not a membership test and then another
        except ValueError:
            return False
        self.reserved_tokens -= pending.tokens
        return True
