"""Binary rule-based reward for math answers (GRPO/PPO on AIME, AMC, MATH500).

``math_reward(response, ground_truth)`` returns exactly ``1.0`` or ``0.0``. It is
a pipeline of small pure functions, each testable on its own::

    response ──final_section──> text after the last </think> (None if thinking is unclosed)
             ──extract_answer─> last balanced \\boxed{..} / \\fbox{..}, else last "Answer:" line
    ground_truth ─extract_ground_truth─> last \\boxed{..} if present, else the whole string
    both ──normalize_answer──> canonical string; plain numbers become canonical decimals
         ──answers_match────> equal strings -> 1; both plain numbers -> exact compare;
                              otherwise math-verify (sympy) decides equivalence

Design choices, and why
-----------------------
* **Only explicit answers are graded.** If the final section holds neither a
  ``\\boxed{}`` nor an answer line (``Answer: 42``, ``Final Answer: ..``,
  ``the answer is 42``, ``**Answer:** 42``), the reward is 0.0. We never guess
  from "the last number in the text": in RL that rewards rambling that happens
  to mention the right number and teaches the policy to skip the answer format.
* **The answer section is what follows the last ``</think>``.** A boxed value
  that only appears inside the thinking does not count, and a response whose
  ``<think>`` never closed is treated as truncated (0.0). Responses without
  think tags (or with only the closing tag, as Qwen3 chat templates produce
  when the prompt opens the block) are graded as a whole.
* **Truncation is a failure, not a fallback.** If the last ``\\boxed{`` never
  closes we return 0.0 instead of falling back to an earlier box: a response
  cut off by the generation length limit must not be rewarded for a
  provisional answer it was in the middle of revising.
* **Numbers are ours, LaTeX is math-verify's.** Plain integers/decimals
  (after removing ``$``, ``\\text{}``, ``\\left``/``\\right``, thousands
  separators ``1,000`` / ``1{,}000`` / ``1\\,000``, a leading ``+``, leading
  zeros and trailing zeros) are compared exactly through a canonical decimal
  string, so AIME's ``025`` equals ``25`` and no float rounding is involved. Anything
  else (fractions, radicals, pi, intervals, tuples, sets, matrices, percent,
  degrees, units in ``\\text{}``) is handed to math-verify, which parses both
  sides to sympy and compares symbolically and numerically (6 decimal places).
  A number is passed to math-verify in our canonical form, everything else
  as extracted (minus ``$`` and outer braces) so math-verify's own LaTeX
  normalization (units, ``\\text``, ``\\%``, ``^\\circ``) still sees it.
* **Ambiguity we accept:** ``100,200`` is read as the integer 100200, not the
  list {100, 200} (MATH writes ``58,500`` for 58500). A tuple answer
  ``(1,2)`` is an open interval to math-verify; it still equals ``(1,2)`` but
  not ``(2,1)``.
* **Never raise, never hang.** A deadline of our own bounds each math-verify
  parse and comparison (``PARSE_TIMEOUT_S``, ``VERIFY_TIMEOUT_S``); any
  exception, including the deadline's ``TimeoutException`` (a
  ``BaseException``), is a 0.0. The deadline is a ``SIGALRM`` timer that
  keeps firing every ``DEADLINE_RETRY_S`` until the call returns, rather than
  math-verify's one-shot ``signal.alarm``: a signal handled inside a garbage
  collection callback (JAX registers one) has its exception swallowed, and
  with a one-shot alarm the parse then ran on unbounded (7.9 s in a CI run
  against a 2 s limit). Answers longer than ``MAX_ANSWER_CHARS`` are
  compared verbatim (real answers are < 100 chars; long ones are garbage, and
  this keeps every later step bounded in cost). Worst case
  is about ``2 * PARSE_TIMEOUT_S + VERIFY_TIMEOUT_S`` seconds per call.
* **Threads:** the deadline is a ``SIGALRM`` timer, which only
  works in the main thread. Off the main thread we call it with timeouts
  disabled rather than failing (which would silently zero every reward), so a
  pathological expression can then block that thread. Score in the main
  thread or in worker *processes*. Note too that the deadline replaces any
  ``SIGALRM`` timer the caller had armed.
"""

import functools
import re
import signal
import threading
from typing import Any, Callable, Final, TypeVar

from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify
from math_verify.errors import TimeoutException

PARSE_TIMEOUT_S: Final[float] = 2.0
"""Seconds math-verify may spend parsing one answer."""

VERIFY_TIMEOUT_S: Final[float] = 2.0
"""Seconds math-verify may spend on one gold/prediction comparison."""

DEADLINE_RETRY_S: Final[float] = 0.2
"""After a deadline passes, its timeout is raised again this often until the call returns."""

MAX_ANSWER_CHARS: Final[int] = 512
"""Extracted answers longer than this are compared verbatim only (no normalization, no math-verify)."""

_MATH_VERIFY_CONFIG: Final = (
    # The answer is already extracted; priority 0 lets a \boxed inside it win.
    LatexExtractionConfig(boxed_match_priority=0),
    ExprExtractionConfig(),
)

_BOXED_RE: Final = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")
# "answer" + ("is" [":"] | ":" ), optionally preceded by "final"; the answer is what follows.
_ANSWER_MARKER_RE: Final = re.compile(
    r"\b(?:final\s+)?answer\b\s*(?:is\b\s*:?|[:：])", re.IGNORECASE
)
# First inline-math span of an answer line: $..$ (not the currency sign \$) or \(..\).
_INLINE_MATH_RE: Final = re.compile(r"(?<!\\)\$([^$]+?)(?<!\\)\$|\\\((.+?)\\\)")
_NUMBER_RE: Final = re.compile(r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)")
_THOUSANDS_RE: Final = re.compile(r"[+-]?\d{1,3}(?:,\d{3})+(?:\.\d+)?")
_TEXT_WRAPPER_RE: Final = re.compile(
    r"\\(?:text|textbf|textit|textrm|mbox|mathrm|mathbf|operatorname)\s*\{([^{}]*)\}"
)
_LEFT_RIGHT_RE: Final = re.compile(r"\\(?:left|right|big|Big|bigg|Bigg)(?![A-Za-z])")
# A LaTeX line break (two backslashes) is matched first so its second backslash is not read as "\ ".
_SPACING_RE: Final = re.compile(r"(\\\\)|\\[,!;: ]|\\q?quad(?![A-Za-z])")
_DISPLAY_DELIMITERS: Final = (("\\[", "\\]"), ("\\(", "\\)"))


def final_section(response: str) -> str | None:
    """The part of ``response`` that may hold the final answer.

    Text after the last ``</think>``; the whole response if it has no think
    tags; ``None`` if a ``<think>`` was opened and never closed (truncated).
    """
    close = response.rfind("</think>")
    if close >= 0:
        return response[close + len("</think>") :]
    if "<think>" in response:
        return None
    return response


def balanced_group(text: str, open_index: int) -> str | None:
    """Contents of the brace group opening at ``text[open_index] == "{"``.

    Nested groups are followed; a backslash escapes the next character, so
    ``\\{``/``\\}`` (literal braces) and ``\\\\`` do not change the depth.
    Returns ``None`` if the group never closes.
    """
    depth = 0
    i = open_index
    while i < len(text):
        char = text[i]
        if char == "\\":
            i += 2
            continue
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                return text[open_index + 1 : i]
        i += 1
    return None


def last_boxed(text: str) -> tuple[bool, str | None]:
    """``(found, content)`` for the last ``\\boxed``/``\\fbox`` in ``text``.

    ``found`` says whether such a command occurs at all; ``content`` is ``None``
    when the last one is truncated (its brace group never closes, or nothing
    follows it). ``\\boxed 5`` (no braces) yields the next token.
    """
    last = None
    for last in _BOXED_RE.finditer(text):
        pass
    if last is None:
        return False, None
    rest = text[last.end() :]
    stripped = rest.lstrip()
    if stripped.startswith("{"):
        return True, balanced_group(text, len(text) - len(stripped))
    token = re.match(r"[^\s$]+", stripped)
    return True, (token.group(0) if token else None)


def last_answer_line(text: str) -> str | None:
    """Answer from the last line carrying an answer marker, or ``None``.

    Markers are ``Answer:``, ``Final Answer:``, ``the answer is`` (any case,
    markdown bold ignored); the answer is what follows the line's last marker.
    If the marker ends its line, the next non-empty line is the answer
    (``**Final Answer:**`` on its own line). If the answer contains inline math,
    the first ``$..$`` / ``\\(..\\)`` span is the answer, which handles
    ``The final answer is $\\frac{3}{4}$. I hope it is correct.`` and
    ``the answer is $42$ apples``.
    """
    lines = text.splitlines()
    for index in range(len(lines) - 1, -1, -1):
        line = lines[index].replace("**", "").replace("__", "")
        markers = list(_ANSWER_MARKER_RE.finditer(line))
        if not markers:
            continue
        answer = line[markers[-1].end() :].strip()
        if not answer:
            following = (l.replace("**", "").strip() for l in lines[index + 1 :])
            answer = next((l for l in following if l), "")
        span = _INLINE_MATH_RE.search(answer[:MAX_ANSWER_CHARS])  # bounded: the lazy \(..\) can be quadratic
        return (span.group(1) or span.group(2)) if span else answer
    return None


def extract_answer(response: str) -> str | None:
    """The model's final answer string, or ``None`` if there is none to grade."""
    section = final_section(response)
    if section is None:
        return None
    found, boxed = last_boxed(section)
    if found:
        return boxed
    return last_answer_line(section)


def extract_ground_truth(ground_truth: str) -> str:
    """Dataset answers are bare (``\\frac{3}{4}``) or a solution with ``\\boxed``."""
    found, boxed = last_boxed(ground_truth)
    return boxed if found and boxed is not None else ground_truth


def _strip_outer_braces(text: str) -> str:
    while text.startswith("{") and balanced_group(text, 0) == text[1:-1]:
        text = text[1:-1].strip()
    return text


def clean_answer(answer: str) -> str:
    """Remove presentation around an answer: whitespace, ``$``, ``\\[ \\]``, trailing period, outer braces.

    The result is still LaTeX as the model wrote it; this is what math-verify sees.
    """
    text = answer.replace("\\$", "").replace("$", "").strip()
    previous = None
    while text != previous:
        previous = text
        for opening, closing in _DISPLAY_DELIMITERS:
            if text.startswith(opening) and text.endswith(closing):
                text = text[len(opening) : -len(closing)].strip()
        text = text.rstrip(".").rstrip()
        text = _strip_outer_braces(text)
    return text


def _canonical_number(text: str) -> str | None:
    """``"007"`` -> ``"7"``, ``"+5.0"`` -> ``"5"``, ``"1,000"`` -> ``"1000"``; ``None`` if not a plain number.

    Done on the digits rather than with ``Decimal.normalize`` (which rounds to
    the context precision), so the canonical form is exact and unique: two
    plain numbers are equal iff their canonical strings are.
    """
    if _THOUSANDS_RE.fullmatch(text):
        text = text.replace(",", "")
    if not _NUMBER_RE.fullmatch(text):
        return None
    sign = "-" if text.startswith("-") else ""
    whole, _, fraction = text.lstrip("+-").partition(".")
    whole, fraction = whole.lstrip("0") or "0", fraction.rstrip("0")
    if whole == "0" and not fraction:
        return "0"
    return sign + whole + ("." + fraction if fraction else "")


def normalize_answer(answer: str) -> str:
    """Canonical string used for the exact-match and numeric fast paths.

    On top of :func:`clean_answer`: unwrap ``\\text{..}``-like commands, drop
    ``\\left``/``\\right`` and LaTeX spacing (``\\,`` ``\\!``), ``{,}`` -> ``,``,
    ``\\dfrac``/``\\tfrac`` -> ``\\frac``, unicode minus, all whitespace; and
    canonicalize plain numbers. Degrees, percent and units are left to math-verify.
    """
    text = clean_answer(answer)
    previous = None
    while text != previous:
        previous = text
        text = _TEXT_WRAPPER_RE.sub(r"\1", text)
    text = _LEFT_RIGHT_RE.sub("", text)
    text = _SPACING_RE.sub(lambda match: match.group(1) or "", text)
    text = text.replace("{,}", ",").replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    text = text.replace("\u2212", "-")
    text = "".join(text.split())
    text = clean_answer(text)
    return _canonical_number(text) or text


def _is_number(normalized: str) -> bool:
    return _NUMBER_RE.fullmatch(normalized) is not None


_T = TypeVar("_T")


def call_with_deadline(seconds: float, fn: Callable[..., _T], *args: Any, **kwargs: Any) -> _T:
    """``fn(*args, **kwargs)``, raising ``TimeoutException`` inside it once ``seconds`` have passed.

    In the main thread only (``SIGALRM``); elsewhere ``fn`` runs unbounded. The
    timeout is raised again every ``DEADLINE_RETRY_S`` until ``fn`` returns, so
    an exception swallowed on the way (a signal handled in a gc callback, a
    broad ``except`` in sympy) does not disarm the deadline. A tick that finds
    this call no longer on the stack (it returned between the tick and the
    disarm) disarms the timer instead of raising.
    """
    if threading.current_thread() is not threading.main_thread():
        return fn(*args, **kwargs)

    def on_alarm(signum: int, frame: Any) -> None:
        while frame is not None:
            if frame.f_code is call_with_deadline.__code__:
                raise TimeoutException(f"Operation timed out after {seconds} s")
            frame = frame.f_back
        signal.setitimer(signal.ITIMER_REAL, 0)

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds, DEADLINE_RETRY_S)
    try:
        return fn(*args, **kwargs)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


class _Unparsed(Exception):
    """Raised inside the cache so empty parses (possibly a timeout under load) are not memoized."""


@functools.lru_cache(maxsize=8192)
def _parse_cached(answer: str) -> tuple:
    parsed = tuple(
        call_with_deadline(
            PARSE_TIMEOUT_S,
            parse,
            f"${answer}$",
            extraction_config=_MATH_VERIFY_CONFIG,
            parsing_timeout=None,  # our deadline, not math-verify's one-shot alarm
        )
    )
    if not parsed:
        raise _Unparsed(answer)
    return parsed


def _parse(answer: str) -> tuple:
    """math-verify parse of an already-extracted answer, ``()`` on failure.

    Successful parses are cached: a GRPO group repeats its ground truth and often
    its answers. Failures are not, so one timeout on a busy host cannot zero
    every later reward for that prompt.
    """
    try:
        return _parse_cached(answer)
    except _Unparsed:
        return ()


def math_verify_equal(gold: str, prediction: str) -> bool:
    """math-verify equivalence of two extracted answers; any error or timeout is ``False``."""
    try:
        gold_parsed, prediction_parsed = _parse(gold), _parse(prediction)
        if not gold_parsed or not prediction_parsed:
            return False
        return bool(
            call_with_deadline(
                VERIFY_TIMEOUT_S,
                verify,
                list(gold_parsed),
                list(prediction_parsed),
                timeout_seconds=None,  # our deadline, not math-verify's one-shot alarm
            )
        )
    except (Exception, TimeoutException):
        return False


def answers_match(gold: str, prediction: str) -> bool:
    """Whether two extracted answers are equivalent (see the module docstring)."""
    if max(len(gold), len(prediction)) > MAX_ANSWER_CHARS:
        return gold.strip() == prediction.strip()
    gold_normalized, prediction_normalized = normalize_answer(gold), normalize_answer(prediction)
    if not gold_normalized or not prediction_normalized:
        return False
    gold_is_number, prediction_is_number = _is_number(gold_normalized), _is_number(prediction_normalized)
    if gold_normalized == prediction_normalized or (gold_is_number and prediction_is_number):
        return gold_normalized == prediction_normalized
    return math_verify_equal(
        gold_normalized if gold_is_number else clean_answer(gold),
        prediction_normalized if prediction_is_number else clean_answer(prediction),
    )


def math_reward(response: str, ground_truth: str) -> float:
    """1.0 if the final answer in ``response`` is equivalent to ``ground_truth``, else 0.0.

    Never raises: malformed input, truncation, parse failures and timeouts all give 0.0.
    """
    try:
        if not isinstance(response, str) or not isinstance(ground_truth, str):
            return 0.0
        prediction = extract_answer(response)
        if prediction is None:
            return 0.0
        return 1.0 if answers_match(extract_ground_truth(ground_truth), prediction) else 0.0
    except (Exception, TimeoutException):
        return 0.0
