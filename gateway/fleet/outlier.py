"""Outlier ejection, Envoy's passive health check: a backend that keeps failing real requests is taken out of
rotation for a back-off that grows while it keeps failing, then let back one request at a time.

Least-load routing alone rewards failure: a replica that answers 500 at once always looks idle, and a hung
replica whose `/health` still answers keeps receiving requests until each times out. Ejection reads what the
requests themselves say:

- *counts against a backend*: a 500, 502, 503 or 504 answer, and an exchange that broke. After
  `consecutive_failures` of them in a row the backend is ejected; any success starts the count again.
- *ejects at once* (strong evidence): a refused connection and a timeout (no first byte, or a stalled stream).
- *never counts*: 4xx answers (a prompt over the context length is the client's fault, not the engine's; they
  neither count nor restart the count), a client that left, and the gateway's own resource failures
  (`Failure.LOCAL`, which the caller never reports).

States: SERVING → EJECTED for `base_ejection_s × 2^n`, capped at `max_ejection_s` → PROBING (half-open: one
request at a time) → SERVING on that request's success, or EJECTED again, twice as long, on its failure. `n`
counts the ejections of a failure streak: it grows by one per ejection and shrinks by one for every
`base_ejection_s` the backend then serves without being ejected, so a backend that fails now and then starts
from the base again while a flapping one stays out longer each time.

While EJECTED, answers to requests sent before the ejection are neither counted nor believed: the back-off
runs out first. A good health check ends an ejection only when refused connections caused it (the check
proves the backend listens again); a 5xx or a timeout is not disproved by a `/health` that a hung engine still
answers. Nothing here clears the prefix index: an ejected engine usually keeps its cache (health.py clears the
index when checks fail past their threshold or the model changes).

Nothing here awaits; `clock` is injectable for tests.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Any

from gateway.fleet.upstream import Failure

# The statuses of a backend that failed, as Envoy's gateway failures and 500. 501, 505 and the rest mean the
# request asked for something unsupported: like 4xx, the client's business.
FAILED_STATUSES = frozenset({500, 502, 503, 504})


@dataclass(frozen=True)
class OutlierConfig:
    consecutive_failures: int = 5  # failures in a row that eject; 0 turns ejection off
    base_ejection_s: float = 10.0  # the first ejection's length
    max_ejection_s: float = 300.0  # the cap of its doubling


class OutlierState(str, Enum):
    SERVING = "serving"
    EJECTED = "ejected"   # the back-off runs: no traffic
    PROBING = "probing"   # half-open: one request at a time until one succeeds or fails


@dataclass(frozen=True)
class Ejection:
    """An ejection that just started: why, after how many failures in a row, for how long."""

    cause: str  # "5xx" or the `Failure` value of the exchange that decided it
    failures: int
    duration_s: float


class Outlier:
    """One backend's ejection state."""

    def __init__(self, config: OutlierConfig = OutlierConfig(), clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self._clock = clock
        self.consecutive_failures = 0
        self.ejections_total: collections.Counter[str] = collections.Counter()  # by cause
        self.cause: str | None = None  # of the current ejection
        self._until_s: float | None = None  # end of the current back-off; None while SERVING
        self._streak = 0  # the next back-off's exponent
        self._serving_since_s = clock()
        self._probe_in_flight = False

    @property
    def state(self) -> OutlierState:
        if self._until_s is None:
            return OutlierState.SERVING
        return OutlierState.EJECTED if self._clock() < self._until_s else OutlierState.PROBING

    @property
    def ejected(self) -> bool:
        """Out of rotation, or back on probation (half-open)."""
        return self._until_s is not None

    def admits(self) -> bool:
        """Whether the backend may take a new request now."""
        if self._until_s is None:  # the hot path: one attribute read
            return True
        return self.state is OutlierState.PROBING and not self._probe_in_flight

    def remaining_s(self) -> float:
        return 0.0 if self._until_s is None else max(0.0, self._until_s - self._clock())

    # -- requests ---------------------------------------------------------------------------------------

    def probe_started(self) -> bool:
        """A request was placed on the backend; returns whether it is the half-open probe (then call
        `probe_ended` when it ends, whatever way)."""
        if self._until_s is None or self._probe_in_flight or self.state is not OutlierState.PROBING:
            return False
        self._probe_in_flight = True
        return True

    def probe_ended(self) -> None:
        self._probe_in_flight = False

    def succeeded(self) -> bool:
        """A request succeeded; returns whether that ended the backend's ejection."""
        self.consecutive_failures = 0
        if self.state is not OutlierState.PROBING:
            return False
        self._restore()
        return True

    def failed(self, cause: str, at_once: bool) -> Ejection | None:
        """A request failed in a way that is the backend's fault; returns the ejection it started, if any."""
        if self.config.consecutive_failures == 0:
            return None
        state = self.state
        if state is OutlierState.EJECTED:
            return None  # a request sent before the ejection: the same incident
        self.consecutive_failures += 1
        if state is OutlierState.SERVING and not at_once \
                and self.consecutive_failures < self.config.consecutive_failures:
            return None
        return self._eject(cause)

    def listening(self) -> bool:
        """A health check passed; returns whether that ended an ejection for refused connections."""
        if self._until_s is None or self.cause != Failure.CONNECT.value:
            return False
        self._restore()
        return True

    def reset(self) -> None:
        """Forget everything: the engine was down long enough to be marked so, and comes back afresh."""
        self._restore()
        self._streak = 0
        self.consecutive_failures = 0

    # -- transitions ------------------------------------------------------------------------------------

    def _eject(self, cause: str) -> Ejection:
        now = self._clock()
        base, cap = self.config.base_ejection_s, self.config.max_ejection_s
        if self._until_s is None:  # serving since `_serving_since_s`: each base period of it forgives one
            self._streak = max(0, self._streak - int((now - self._serving_since_s) // base))
        duration_s = min(cap, base * 2 ** self._streak)
        if duration_s < cap:
            self._streak += 1
        ejection = Ejection(cause, self.consecutive_failures, duration_s)
        self._until_s = now + duration_s
        self.cause = cause
        self.consecutive_failures = 0
        self._probe_in_flight = False
        self.ejections_total[cause] += 1
        return ejection

    def _restore(self) -> None:
        self._until_s = None
        self.cause = None
        self._probe_in_flight = False
        self._serving_since_s = self._clock()

    def describe(self) -> dict[str, Any]:
        return {"state": self.state.value, "cause": self.cause, "remaining_s": round(self.remaining_s(), 3),
                "consecutive_failures": self.consecutive_failures,
                "ejections": sum(self.ejections_total.values())}
