"""The rules that find volatile spans in prompt text, and the text surgery that takes them out.

This module works on plain strings; `gateway/rewrite/__init__.py` decides which strings of a request body are searched
and where the moved spans go.

Built-in rules, in priority order (when two rules could match at the same place, the earlier one wins; user
rules from the config come before all of them):

- ``billing_header``: a Claude-Code ``x-anthropic-billing-header:`` line, from the key to the end of the line.
  ``x-anthropic-billing-header: cc_version=1.0.83.abc; cc_entrypoint=cli; cch=7f3a;``
- ``id_line``: ``key: value`` or ``key=value`` whose key names a request-scoped ID; the span is the whole
  ``key: value``. Keys, any case, with an optional ``x-`` prefix and words joined by a space, ``_``, ``-`` or
  nothing: request, req, correlation, corr, conversation, conv, run, span, trace, session, sess, message, msg,
  call, transaction, txn, job, invocation, execution, thread, turn or chat followed by id, uuid, guid, hash,
  key or token; or alone: session, trace, nonce, timestamp, time stamp, cache buster. The value is an ISO
  date-time or one token (up to whitespace or one of ``,;|&'"`()<>[]{}``, without a trailing ``.`` or ``:``)
  of at least 4 characters with a digit, so ``Session: active`` stays. ``Request ID: req_8f1c22``
- ``iso_datetime``: an ISO-8601 / RFC 3339 date and time (``T``, ``t`` or a space between them), optional
  seconds, fraction and zone (``Z``, ``+02:00``, ``+0200``, `` UTC``); a date alone is not matched.
  ``2024-05-01T10:00:00.123Z``
- ``uuid``: 8-4-4-4-12 hex digits, any case. ``8f1c2d3e-4b5a-4c6d-9e8f-0a1b2c3d4e5f``
- ``ulid``: 26 Crockford base-32 characters, the first ``0``-``7``, at least one letter.
  ``01HZX3K4M5N6P7Q8R9S0T1V2W3``
- ``epoch``: Unix seconds (10 digits) or milliseconds (13 digits) between 2001-09 and 2033-05 (a leading
  ``1``), or seconds with a 3-9 digit fraction. ``1715000000``, ``1715000000123``, ``1715000000.123``
- ``hex_nonce``: 16 or more hex digits with both a digit and a letter, optional ``0x``. ``7f3a9c1e5b2d4f60a8e1``
- ``base64_nonce``: 20 or more base64/base64url characters (``A-Za-z0-9+/_-``, ``=`` padding) with an
  upper-case letter, a lower-case letter and a digit, whose class (upper/lower/digit) changes between at least
  40% of adjacent pairs: random tokens do, identifiers and paths (``getUserAccount2``, ``/home/User1/src``)
  do not. ``Zk9xR2tTbDN1V0hQcWE4``

Every rule except ``id_line``/``billing_header`` needs a non-word character (or the text's edge) on both
sides, so nothing is found inside a longer word or number: ``v1.2.3``, ``3.11.7``, ``deadbeef``, a 7-char
git SHA, ``$1234567890.00``, ``+1 415 555 0100``, ``internationalization`` are all left alone.

Removing a span keeps the text around it clean; only whitespace is ever removed beside a span (punctuation
stays):

- a line left blank by the removal is dropped with its newline (``"Request ID: 8f1c-22\\nYou are..."`` →
  ``"You are..."``); a dropped last line takes the preceding newline with it;
- a span at the start of a line takes the blanks after it (``"8f1c... You are"`` → ``"You are"``);
- a span at the end of a line takes the blanks before it (``"Session 8f1c..."`` → ``"Session"``);
- a span between blanks takes the blanks after it (``"id 8f1c... ok"`` → ``"id ok"``);
- a span after a blank and before closing punctuation (``.,;:!?)]}``) takes the blanks before it
  (``"started at 2024-05-01T10:00:00Z."`` → ``"started at."``);
- a span between other characters is removed alone (``"(8f1c...)"`` → ``"()"``).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import NamedTuple


class Action(str, Enum):
    MOVE = "move"     # take the span out of the prefix and append it, labelled, at the end of the prompt
    STRIP = "strip"   # remove it
    KEEP = "keep"     # leave it; only count it


@dataclass(frozen=True)
class RuleSpec:
    """A user rule: a regex without capturing groups; ``action`` None means the config's default action."""

    name: str
    pattern: str
    action: Action | None = None


@dataclass(frozen=True)
class SpanHit:
    rule: str
    action: Action


Check = Callable[["re.Match[str]"], bool]


@dataclass(frozen=True)
class _Builtin:
    name: str
    pattern: str
    check: Check | None = None


_DATE = r"[0-9]{4}-(?:0[1-9]|1[0-2])-(?:0[1-9]|[12][0-9]|3[01])"
_TIME = r"(?:[01][0-9]|2[0-3]):[0-5][0-9](?::(?:[0-5][0-9]|60)(?:[.,][0-9]{1,9})?)?"
_ZONE = r"(?:[Zz]|[+-](?:[01][0-9]|2[0-3])(?::?[0-5][0-9])?|[ ]?(?:UTC|GMT))?"
_ISO = _DATE + r"[Tt ]" + _TIME + _ZONE + r"(?![\w:]|[.,][0-9])"
_ID_WORDS = ("request|req|correlation|corr|conversation|conv|run|span|trace|session|sess|message|msg|call"
             "|transaction|txn|job|invocation|execution|thread|turn|chat")
_ID_KEY = (r"(?i:(?:x-)?(?:(?:" + _ID_WORDS + r")[ _-]?(?:id|uuid|guid|hash|key|token)"
           r"|session|trace|nonce|timestamp|time[ _-]?stamp|cache[ _-]?buster))")
_TOKEN_CHAR = r"[^\s,;|&'\"`()<>\[\]{}]"
_ID_VALUE = r"(?P<idval>" + _ISO + "|" + _TOKEN_CHAR + r"*[^\s,;|&'\"`()<>\[\]{}.:])"
_B64_CLASS = str.maketrans(
    "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789",
    "U" * 26 + "l" * 26 + "d" * 10,
)


def _id_value_ok(match: re.Match[str]) -> bool:
    value = match.group("idval")
    return len(value) >= 4 and any(c.isdigit() for c in value)


def _looks_random(match: re.Match[str]) -> bool:
    # Random base64 switches class (upper/lower/digit) between ~58% of adjacent pairs; words, camelCase
    # identifiers and paths switch far less often. Symbols (+/_-) neither count nor break a pair.
    classes = match.group().rstrip("=").translate(_B64_CLASS)
    if not ("U" in classes and "l" in classes and "d" in classes):
        return False
    switches = sum(1 for a, b in zip(classes, classes[1:], strict=False) if a != b and a in "Uld" and b in "Uld")
    return switches >= 0.4 * (len(classes) - 1)


BUILTINS: tuple[_Builtin, ...] = (
    # The (?=...) first-character tests let the regex engine skip an alternative without trying its words.
    _Builtin("billing_header", r"(?=[xX])(?<![\w-])(?i:x-anthropic-billing-header)[ \t]*:[^\r\n]*"),
    _Builtin("id_line", r"(?=[cCeEiIjJmMnNrRsStTxX])(?<![\w-])" + _ID_KEY + r"[ \t]*[:=][ \t]*" + _ID_VALUE,
             _id_value_ok),
    _Builtin("iso_datetime", r"(?<![\w.:/-])" + _ISO),
    _Builtin("uuid", r"(?<!\w)[0-9A-Fa-f]{8}(?:-[0-9A-Fa-f]{4}){3}-[0-9A-Fa-f]{12}(?!\w)"),
    _Builtin("ulid", r"(?<!\w)(?=[0-9]{0,25}[A-Za-z])[0-7][0-9A-HJKMNP-TV-Za-hjkmnp-tv-z]{25}(?!\w)"),
    _Builtin("epoch", r"(?<![\w.,$€£¥+-])1[0-9]{9}(?:[0-9]{3}|\.[0-9]{3,9})?(?![\w]|[.,][0-9])"),
    _Builtin("hex_nonce",
             r"(?<!\w)(?:0[xX])?(?=[0-9A-Fa-f]*[A-Fa-f])(?=[0-9A-Fa-f]*[0-9])[0-9A-Fa-f]{16,}(?!\w)"),
    _Builtin("base64_nonce", r"(?<![\w+/=-])[A-Za-z0-9+/_-]{20,}={0,2}(?![\w+/=-])", _looks_random),
)
BUILTIN_RULE_NAMES: tuple[str, ...] = tuple(rule.name for rule in BUILTINS)

# A span must start inside the window but may end past it; the regex sees this much text beyond the window
# edge, so a span longer than this that starts near the edge is cut at it (the rest is found on the next
# pass). Matches ending this close to the search end are re-checked on the full text, because a lookahead
# there could not see the characters that follow.
MAX_SPAN_CHARS = 512
_CLEAN_MEMORY = 4096  # windows remembered as clean (at most window_chars + MAX_SPAN_CHARS characters each)
_LOOKAHEAD_SLACK = 8
_LEADING_FLAGS = re.compile(r"\A\(\?([aiLmsux]+)\)")
_HWS = " \t"
_CLOSING = tuple(".,;:!?)]}")


def embeddable(pattern: str) -> str:
    """The user pattern as one alternative of the combined regex: leading global flags become scoped ones."""
    flags = _LEADING_FLAGS.match(pattern)
    if flags is None:
        return pattern
    return f"(?{flags.group(1)}:{pattern[flags.end():]})"


@dataclass(frozen=True)
class Rule:
    name: str
    pattern: str
    action: Action
    check: Check | None = None
    builtin: bool = False   # built-ins obey the gate property below, so they can be scanned sparsely


class TextRewrite(NamedTuple):
    """One searched string after one pass: its new text, the spans to move (in order) and every hit."""

    text: str
    moved: tuple[str, ...]
    hits: tuple[SpanHit, ...]
    changed: bool


Found = tuple[Rule, int, int]


class _Alternation:
    """Rules compiled into one regex; the wrapping group that matched names the rule."""

    def __init__(self, rules: Sequence[Rule]) -> None:
        self.regex = re.compile("|".join(f"(?P<r{i}>{rule.pattern})" for i, rule in enumerate(rules)))
        self._rule_at_group = {self.regex.groupindex[f"r{i}"]: rule for i, rule in enumerate(rules)}

    def accept(self, match: re.Match[str] | None) -> Found | None:
        if match is None or match.end() == match.start():
            return None
        rule = self._rule_at_group[match.lastindex or 0]
        return (rule, match.start(), match.end()) if rule.check is None or rule.check(match) else None


# Python's regex engine tries every alternative at every position (~0.3 us per position for the built-ins),
# too slow for a 2k window on every request. So built-ins are only tried near a *gate*: every built-in span
# but id_line and billing_header lies in a run of at least 10 non-blank characters with a digit (uuid, ulid,
# hex, base64, dates, epochs), and those two have a ':'/'=' right after a key, at most _KEY_REACH characters
# after their start on the same line. Gates are found at C speed, so prose with numbers and colons ("Rules:",
# "9:00", "3 sizes") costs one regex scan; only word starts between a gate and its reach are tried.
_MIN_RUN = 10
_GATE = re.compile(
    # a digit in a run of _MIN_RUN or more non-blank characters (itself and k before it, the rest after it)
    "[0-9](?:" + "|".join(rf"(?<=\S{{{k + 1}}})(?=\S{{{_MIN_RUN - 1 - k}}})" for k in range(_MIN_RUN)) + ")"
    # or a ':'/'=' after a letter that ends an id_line or billing_header key (id, key, token, session, trace,
    # stamp, buster, header, ...) or after a blank (keys may be followed by blanks)
    r"|[:=](?<=[dDhHyYnNeEpPrR \t][:=])")
_BLANK = re.compile(r"\s")
_WORD_STARTS = re.compile(r"(?<!\w)(?=\S)")  # every built-in needs a non-word character before it
_KEY_REACH = 48


class RuleSet:
    """The active rules: user rules in one alternation searched everywhere, built-ins in one gated one."""

    def __init__(self, rules: Sequence[Rule]) -> None:
        self.rules = tuple(rules)
        custom = [rule for rule in self.rules if not rule.builtin]
        builtin = [rule for rule in self.rules if rule.builtin]
        self._custom = _Alternation(custom) if custom else None
        self._builtin = _Alternation(builtin) if builtin else None
        # Windows of text known to hold nothing: a shared system prompt is searched once, not per request.
        self._clean: set[tuple[int, str]] = set()

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(rule.name for rule in self.rules)

    def rewrite(self, text: str, budget: int, can_move: bool) -> TextRewrite | None:
        """Act on every span starting within ``budget`` characters of the text as rewritten; None when there is
        none (the text stays as it is)."""
        searched = (budget, text[:budget + MAX_SPAN_CHARS])  # all that decides whether anything is found
        if searched in self._clean:
            return None
        result = self._rewrite(text, budget, can_move)
        if result.hits:
            return result
        if len(self._clean) >= _CLEAN_MEMORY:
            self._clean.clear()
        self._clean.add(searched)
        return None

    def _rewrite(self, text: str, budget: int, can_move: bool) -> TextRewrite:
        spans: list[tuple[int, int]] = []
        moved: list[str] = []
        hits: list[SpanHit] = []
        pos, removed = 0, 0
        while (found := self._next(text, pos, budget + removed)) is not None:
            rule, start, end = found
            action = Action.KEEP if rule.action is Action.MOVE and not can_move else rule.action
            hits.append(SpanHit(rule.name, action))
            pos = end
            if action is Action.KEEP:
                continue
            spans.append((start, end))
            removed += end - start
            if action is Action.MOVE:
                moved.append(text[start:end])
        if not spans:
            return TextRewrite(text, (), tuple(hits), False)
        return TextRewrite(cut(text, spans), tuple(moved), tuple(hits), True)

    def _next(self, text: str, pos: int, limit: int) -> Found | None:
        """The leftmost span starting in [pos, limit); a user rule wins a tie."""
        builtin = self._next_builtin(text, pos, limit)
        custom = self._next_custom(text, pos, limit if builtin is None else builtin[1] + 1)
        return custom if custom is not None else builtin

    def _next_custom(self, text: str, pos: int, limit: int) -> Found | None:
        if self._custom is None:
            return None
        size = len(text)
        endpos = min(size, limit + MAX_SPAN_CHARS)
        while pos < limit:
            match = self._custom.regex.search(text, pos, endpos)
            if match is None or match.start() >= limit:
                return None
            start = match.start()
            if endpos < size and match.end() > endpos - _LOOKAHEAD_SLACK:
                match = self._custom.regex.match(text, start)
            if (found := self._custom.accept(match)) is not None:
                return found
            pos = start + 1
        return None

    def _next_builtin(self, text: str, pos: int, limit: int) -> Found | None:
        if self._builtin is None:
            return None
        gate_end = min(len(text), limit + MAX_SPAN_CHARS)
        tried = pos  # every position before this one has been tried
        while tried < limit and (gate := _GATE.search(text, tried, gate_end)) is not None:
            at = gate.start()
            blank = _BLANK.search(text, at)
            run_end = min(len(text) if blank is None else blank.start(), limit)
            # Every word start from the gate's reach to the end of its run, so later gates in the run are done.
            for start in _WORD_STARTS.finditer(text, _reach_back(text, at, tried), run_end):
                found = self._builtin.accept(self._builtin.regex.match(text, start.start()))
                if found is not None:
                    return found
            tried = max(run_end, at + 1)
        return None


def _reach_back(text: str, gate: int, floor: int) -> int:
    """The first position whose span could reach this gate."""
    if text[gate] in ":=":
        return max(floor, text.rfind("\n", floor, gate) + 1, gate - _KEY_REACH)
    start = gate
    while start > floor and not text[start - 1].isspace():
        start -= 1
    return start


# The trailer that carries moved spans; its format is documented in gateway/rewrite/__init__.py.
MARKER = "[prefix-gateway: moved from prompt start]"
_TRAILER_START = "\n\n" + MARKER + "\n"


def split_trailer(text: str) -> tuple[str, str]:
    """(text before the trailer, the trailer or "")."""
    if text.startswith(MARKER + "\n"):
        return "", text
    start = text.rfind(_TRAILER_START)
    return (text, "") if start < 0 else (text[:start], text[start:])


def with_trailer(body: str, trailer: str, moved: Sequence[str]) -> str:
    if not moved:
        return body + trailer
    if not trailer:
        trailer = ("\n\n" if body else "") + MARKER
    return "".join([body, trailer, *("\n" + span for span in moved)])  # one copy of a long body, not two


def cut(text: str, spans: Sequence[tuple[int, int]]) -> str:
    """Remove sorted, non-overlapping spans, tidying the whitespace of the lines they sit on."""
    out: list[str] = []
    cursor, i, size = 0, 0, len(text)
    dropped_last_line = False
    while i < len(spans):
        line_start = text.rfind("\n", 0, spans[i][0]) + 1
        line_end = _line_end(text, spans[i][1])
        j = i + 1
        while j < len(spans) and spans[j][0] <= line_end:  # spans sharing a line are tidied together
            line_end = max(line_end, _line_end(text, spans[j][1]))
            j += 1
        out.append(text[cursor:line_start])
        tidy = _tidy_line(text, line_start, line_end, spans[i:j])
        if tidy is None:
            cursor = line_end + 1 if line_end < size else size
            dropped_last_line = line_end >= size
        else:
            out.append(tidy)
            cursor = line_end
        i = j
    out.append(text[cursor:])
    result = "".join(out)
    if dropped_last_line and cursor >= size:
        # "...\nRequest ID: x" becomes "..." rather than "...\n".
        result = result[:-2] if result.endswith("\r\n") else result.removesuffix("\n")
    return result


def _line_end(text: str, pos: int) -> int:
    end = text.find("\n", pos)
    return len(text) if end < 0 else end


def _blank(text: str) -> bool:
    return not text.strip(" \t\r")


def _tidy_line(text: str, start: int, end: int, spans: Sequence[tuple[int, int]]) -> str | None:
    """The line(s) text[start:end] without the spans, or None when nothing but blanks would remain."""
    bounds = [start, *(edge for span in spans for edge in span), end]
    pieces = [text[bounds[k]:bounds[k + 1]] for k in range(0, len(bounds), 2)]
    result = pieces[0]
    for piece in pieces[1:]:
        line_so_far = result[result.rfind("\n") + 1:]
        if _blank(line_so_far):            # span opened the line: keep indentation, drop the gap after it
            piece = piece.lstrip(_HWS)
        elif _blank(piece):                # span closed the line: drop the gap before it
            result = result.rstrip(_HWS)
            piece = piece.lstrip(_HWS)
        elif result and result[-1] in _HWS and piece and piece[0] in _HWS:
            piece = piece.lstrip(_HWS)     # span between two gaps: keep one
        elif result and result[-1] in _HWS and piece[:1] in _CLOSING:
            result = result.rstrip(_HWS)   # "at <span>." reads "at.", not "at ."
        result += piece
    return None if _blank(result) else result
