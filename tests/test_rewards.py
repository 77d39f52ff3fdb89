"""Tests for fp8rl_jax.rewards: the math reward on realistic model outputs.

The table mimics how reasoning models end their responses: DeepSeek-R1 /
Qwen3 thinking mode (``<think>..</think>`` then a short summary with a boxed
answer), Qwen3 through its chat template (the prompt opens ``<think>``, so the
response holds only ``</think>``), Qwen2.5-Math (``The final answer is
$\\boxed{..}$``) and Minerva-style few-shot (``Final Answer: The final answer
is $..$. I hope it is correct.``). Ground truths are written the way
AIME / AMC23 / MATH500 write them (see /work/shared/data/*.jsonl).
"""

import json
import random
import sys
import threading
import time
from pathlib import Path

import pytest

from fp8rl_jax.rewards import (
    RewardKind,
    extract_answer,
    get_reward_fn,
    math_reward,
    normalize_answer,
    register_reward_fn,
)

DATA_DIR = Path(__file__).resolve().parents[1].parent / "shared" / "data"


def r1(thinking: str, summary: str) -> str:
    """DeepSeek-R1 / Qwen3 thinking-mode shape: a think block, then the visible answer."""
    return f"<think>\n{thinking}\n</think>\n\n{summary}"


def qwen3_template(thinking: str, summary: str) -> str:
    """Qwen3 via its chat template: ``<think>`` is in the prompt, only ``</think>`` is generated."""
    return f"{thinking}\n</think>\n\n{summary}"


CASES = [
    # --- boxed integers (AIME / AMC) -------------------------------------------------
    pytest.param(
        r1(
            "Let the speed be s. Then 9/s + t/60 = 4 and 9/(s+2) + t/60 = 2.4.\n"
            "Subtracting: 9/s - 9/(s+2) = 1.6, so s^2 + 2s - 11.25 = 0, s = 2.5, t = 24.\n"
            "At s + 1/2 = 3 km/h the walk takes 3 hours = 180 minutes, plus 24 minutes.",
            "The walk takes $180 + 24 = 204$ minutes.\n\n$$\\boxed{204}$$",
        ),
        "204",
        1.0,
        id="r1-boxed-integer",
    ),
    pytest.param(
        "We expand $(x+1)^2 = x^2 + 2x + 1$ and compare coefficients.\n"
        "This gives $a = 7$ and $b = 29$, so $a + b = 36$.\n\n"
        "Therefore, the final answer is $\\boxed{36}$.",
        "36",
        1.0,
        id="qwen-math-boxed-integer",
    ),
    pytest.param(
        qwen3_template(
            "Okay, so I need the number of residues. Let me list them... I get 113.\n"
            "Wait, let me double check the case k = 0. Yes, still 113.",
            "**Step 1.** Count the residues.\n**Step 2.** Exclude k = 0.\n\n"
            "**Final Answer**\n\\[\n\\boxed{113}\n\\]",
        ),
        "113",
        1.0,
        id="qwen3-template-only-closing-think",
    ),
    pytest.param(
        "We need $N \\bmod 1000$. Computing, $N = 3025$.\n\\[\n\\fbox{25}\n\\]",
        "025",
        1.0,
        id="fbox-and-aime-leading-zero-ground-truth",
    ),
    pytest.param(
        r1("The remainder is 73.", "The remainder is $\\boxed{073}$."),
        "073",
        1.0,
        id="leading-zeros-both-sides",
    ),
    pytest.param(
        "Checking each case gives 7 solutions.\n\nThe answer is $\\boxed{007}$.",
        "7",
        1.0,
        id="leading-zeros-prediction",
    ),
    pytest.param(
        "After simplification, the expression evaluates to $+5$.\n\n\\boxed{+5}",
        "5",
        1.0,
        id="explicit-plus-sign",
    ),
    pytest.param(
        "The average is $\\frac{10}{2} = 5.0$.\n\nSo the answer is $\\boxed{5.0}$.",
        "5",
        1.0,
        id="trailing-decimal-zero",
    ),
    pytest.param(
        r1(
            "The quotient polynomial has constant term -1... the sum of coefficients is -1.",
            "Summing the coefficients gives $\\boxed{-1}$.",
        ),
        "-1",
        1.0,
        id="negative-integer",
    ),
    pytest.param(
        r1("I computed |-1| by mistake; the sum is negative.", "The sum is $\\boxed{1}$."),
        "-1",
        0.0,
        id="negative-sign-dropped-is-wrong",
    ),
    # --- thousands separators --------------------------------------------------------
    pytest.param(
        "There are $10 \\times 1008 = 10{,}080$ arrangements.\n\n\\boxed{10{,}080}",
        "10,\\!080",
        1.0,
        id="thousands-braced-comma-vs-math500-style",
    ),
    pytest.param(
        "Multiplying out, the total is\n$$\\boxed{11\\,111\\,111\\,100}$$",
        "11,\\! 111,\\! 111,\\! 100",
        1.0,
        id="thousands-thin-space",
    ),
    pytest.param(
        "The number of paths is 1,000.\n\nAnswer: 1,000",
        "1000",
        1.0,
        id="thousands-comma-answer-line",
    ),
    pytest.param(
        "The total cost is $\\$32{,}348$.\n\nThe final answer is $\\boxed{\\$32,348}$.",
        "\\$32,\\!348",
        1.0,
        id="currency-sign-and-thousands",
    ),
    # --- fractions, decimals, radicals, pi --------------------------------------------
    pytest.param(
        r1(
            "f(-2) = 8/4 = 2, f(-1) = 5/3, f(0) = 1. Sum = 2 + 5/3 + 1 = 14/3.",
            "Adding the three values:\n$$f(-2)+f(-1)+f(0) = \\boxed{\\frac{14}{3}}$$",
        ),
        "\\frac{14}{3}",
        1.0,
        id="nested-boxed-fraction",
    ),
    pytest.param(
        "So the probability is one half.\n\n$\\boxed{{3}}$ is the number of heads, and the answer is\n\\boxed{{\\frac{1}{2}}}",
        "0.5",
        1.0,
        id="double-braced-boxed-fraction-vs-decimal",
    ),
    pytest.param(
        "The probability is $\\dfrac{17}{50}$.\n\n\\boxed{\\dfrac{17}{50}}",
        "0.34",
        1.0,
        id="dfrac-vs-decimal",
    ),
    pytest.param(
        "Hence the ratio is\n\\[\\boxed{0.75}\\]",
        "\\frac{3}{4}",
        1.0,
        id="decimal-vs-frac",
    ),
    pytest.param(
        "The ratio of the areas is 1/2.\n\nFinal Answer: 1/2",
        "\\dfrac12",
        1.0,
        id="slash-fraction-vs-dfrac-no-braces",
    ),
    pytest.param(
        "The probability is approximately $0.33$.\n\n\\boxed{0.33}",
        "\\frac{1}{3}",
        0.0,
        id="rounded-decimal-is-not-the-fraction",
    ),
    pytest.param(
        r1(
            "sin 45 = sqrt2/2, so the distance is sqrt(2)/2.",
            "The distance is $\\boxed{\\sqrt{2}/2}$.",
        ),
        "\\frac{\\sqrt2}{2}",
        1.0,
        id="sqrt-slash-vs-frac-sqrt",
    ),
    pytest.param(
        "Rationalizing, $\\tan 30^\\circ = \\frac{1}{\\sqrt{3}}$.\n\n\\boxed{\\frac{1}{\\sqrt{3}}}",
        "\\frac{\\sqrt{3}}{3}",
        1.0,
        id="unrationalized-radical",
    ),
    pytest.param(
        "The circumference is $2\\pi r$ with $r = 1$, giving\n\\[\\boxed{2\\pi}\\]",
        "2 \\pi",
        1.0,
        id="pi-spacing",
    ),
    pytest.param(
        "The area is $\\pi r^2 = 6\\pi$.\n\n\\boxed{6\\pi}",
        "12\\pi",
        0.0,
        id="pi-wrong-coefficient",
    ),
    pytest.param(
        "So $x = \\sqrt{51}$.\n\n\\boxed{\\sqrt{51}}",
        "\\sqrt{53}",
        0.0,
        id="sqrt-wrong-radicand",
    ),
    pytest.param(
        "By the quadratic formula the roots are $1+\\sqrt{19}$ and $1-\\sqrt{19}$.\n\n\\boxed{1+\\sqrt{19}, 1-\\sqrt{19}}",
        "1 \\pm \\sqrt{19}",
        1.0,
        id="plus-minus-vs-listed-roots",
    ),
    pytest.param(
        "Combining, $z = 6 - 5i$.\n\nThe final answer is $\\boxed{6-5i}$.",
        "6 - 5i",
        1.0,
        id="complex-number",
    ),
    # --- intervals, tuples, sets, matrices --------------------------------------------
    pytest.param(
        r1(
            "The function is defined for x <= 0 only.",
            "The domain is $\\boxed{\\left(-\\infty, 0\\right]}$.",
        ),
        "(-\\infty, 0]",
        1.0,
        id="interval-left-right",
    ),
    pytest.param(
        "So the solution set is $x < 0$, i.e.\n\\boxed{(-\\infty,0)}",
        "(-\\infty, 0]",
        0.0,
        id="interval-wrong-endpoint",
    ),
    pytest.param(
        "Solving the system gives $a = 6$, $b = 31$, $c = -1$.\n\n\\boxed{(6, 31, -1)}",
        "(6,31,-1)",
        1.0,
        id="tuple",
    ),
    pytest.param(
        "Solving the system gives $a = 6$, $c = 31$, $b = -1$.\n\n\\boxed{(6,-1,31)}",
        "(6,31,-1)",
        0.0,
        id="tuple-wrong-order",
    ),
    pytest.param(
        "The polar coordinates are $r = 3$, $\\theta = \\pi/2$.\n\n\\boxed{\\left(3,\\dfrac{\\pi}{2}\\right)}",
        "\\left( 3, \\frac{\\pi}{2} \\right)",
        1.0,
        id="tuple-with-left-right-and-dfrac",
    ),
    pytest.param(
        "The solutions are $x = -2$ and $x = 1$.\n\nAnswer: $-2, 1$",
        "1,-2",
        1.0,
        id="unordered-solution-list",
    ),
    pytest.param(
        "Projecting, we get\n$$\\boxed{\\begin{pmatrix} -\\frac13 \\\\ \\frac23 \\\\ \\frac53 \\end{pmatrix}}$$",
        "\\begin{pmatrix} -1/3 \\\\ 2/3 \\\\ 5/3 \\end{pmatrix}",
        1.0,
        id="column-vector",
    ),
    pytest.param(
        "Combining both branches:\n\\boxed{f(x) = \\left\\{ \\begin{array}{ll} x & x > 0 \\\\ 0 & \\text{otherwise} \\end{array} \\right.}",
        "f(x) = \\left\\{ \\begin{array}{ll} x & x > 0 \\\\ 0 & \\text{otherwise} \\end{array} \\right.",
        1.0,
        id="piecewise-with-unmatched-escaped-brace",
    ),
    # --- answer lines (no box) -------------------------------------------------------
    pytest.param(
        r1(
            "Alicia covers 18/(18+12) of the distance: 45 * 0.6 = 27.",
            "They meet 27 miles from City A.\n\n**Answer:** 27",
        ),
        "27",
        1.0,
        id="markdown-bold-answer-line",
    ),
    pytest.param(
        "Thus the product is 3/56.\n\nFinal Answer: The final answer is $\\frac{3}{56}$. I hope it is correct.",
        "\\frac{3}{56}",
        1.0,
        id="minerva-final-answer-line",
    ),
    pytest.param(
        "Each of the 12 edges contributes 3, so the answer is 36.",
        "36",
        1.0,
        id="the-answer-is-sentence",
    ),
    pytest.param(
        r1("The sum is 45 degrees.", "The acute angle is therefore:\n\n**Final Answer:**\n\n$45$"),
        "45",
        1.0,
        id="answer-on-line-after-marker",
    ),
    pytest.param(
        "Step 1: we first compute 40.\nStep 2: double it to get 80.\n\nAnswer: 80\n\n"
        "Hmm, wait, step 2 should add 1, not double.\n\nAnswer: 41",
        "80",
        0.0,
        id="answer-line-wrong-last-line-wins",
    ),
    # --- \text{}, $..$, degrees, units --------------------------------------------------
    pytest.param(
        "Evelyn's average speed is the largest.\n\n\\boxed{\\text{Evelyn}}",
        "\\text{Evelyn}",
        1.0,
        id="text-wrapper-name",
    ),
    pytest.param(
        "Comparing slopes, Bob runs fastest.\n\n\\boxed{\\text{Bob}}",
        "\\text{Evelyn}",
        0.0,
        id="text-wrapper-wrong-name",
    ),
    pytest.param(
        "Only option (C) satisfies both inequalities.\n\nThe answer is $\\boxed{\\text{(C)}}$.",
        "\\text{(C)}",
        1.0,
        id="text-wrapper-multiple-choice",
    ),
    pytest.param(
        "The stamp costs 5.4 cents.\n\n\\boxed{5.4}",
        "5.4 \\text{ cents}",
        1.0,
        id="unit-in-text-ground-truth",
    ),
    pytest.param(
        "The interior angle is $180 - 150 = 30$ degrees.\n\n\\boxed{30^\\circ}",
        "30",
        1.0,
        id="degrees-prediction",
    ),
    pytest.param(
        "The remainder is 4.\n\nAnswer: $4$.",
        "\\boxed{4}",
        1.0,
        id="dollar-wrapped-answer-and-boxed-ground-truth",
    ),
    pytest.param(
        "So $x = 5$.\n\n\\boxed{5}",
        "x=5",
        1.0,
        id="assignment-ground-truth",
    ),
    # --- which answer counts ---------------------------------------------------------
    pytest.param(
        "First attempt: $\\boxed{42}$.\nWait, I forgot the case n = 0. Redoing it:\n\n$\\boxed{43}$",
        "43",
        1.0,
        id="multiple-boxed-last-correct",
    ),
    pytest.param(
        "First attempt: $\\boxed{42}$.\nHmm, let me recount... I now get a different total.\n\n$\\boxed{43}$",
        "42",
        0.0,
        id="multiple-boxed-last-wrong",
    ),
    pytest.param(
        "If we ignored the constraint the answer is 42, but the constraint removes two cases.\n\n"
        "Therefore the count is $\\boxed{40}$.",
        "42",
        0.0,
        id="right-number-mid-text-different-final-box",
    ),
    pytest.param(
        r1(
            "Let me try: the total is \\boxed{18}. Hmm, actually I double counted one.",
            "After removing the double count, the total is $\\boxed{17}$.",
        ),
        "18",
        0.0,
        id="boxed-in-thinking-ignored-final-box-wrong",
    ),
    pytest.param(
        r1(
            "Count again: 5 + 7 + 6 = 18. So \\boxed{18}.",
            "Adding the three cases, the total number of outfits is 18.",
        ),
        "18",
        0.0,
        id="answer-only-in-thinking-and-prose",
    ),
    pytest.param(
        r1("Scratch work: maybe \\boxed{9}? No, it is 18.", "**Final Answer:** 18"),
        "18",
        1.0,
        id="thinking-box-ignored-answer-line-used",
    ),
    # --- no gradable answer ----------------------------------------------------------
    pytest.param(
        "We have $f(1) = 3$, $f(2) = 7$, and in general $f(n) = n^2 + n + 1$, so\n$$f(12) = \\boxed{15",
        "157",
        0.0,
        id="truncated-inside-box",
    ),
    pytest.param(
        "Checking small cases, the answer is 157.\n\nLet me verify once more:\n$$f(12) = 12^2 + 12 + 1 = \\boxed{1",
        "157",
        0.0,
        id="truncated-box-does-not-fall-back-to-earlier-answer-line",
    ),
    pytest.param(
        "<think>\nLet me compute the sum. 1 + 2 + ... + 20 = 210. So \\boxed{210}. But wait, we need only",
        "210",
        0.0,
        id="truncated-inside-thinking",
    ),
    pytest.param("", "42", 0.0, id="empty-response"),
    pytest.param("  \n\t \n  ", "42", 0.0, id="whitespace-only-response"),
    pytest.param(
        "We have 42 apples and 17 oranges. Combining them carefully and accounting for the ones\n"
        "that were eaten, we can now determine the total number of fruits left.",
        "42",
        0.0,
        id="no-answer-at-all-never-guess-numbers",
    ),
    pytest.param(
        "I could not finish the computation.\n\n\\boxed{}",
        "0",
        0.0,
        id="empty-box",
    ),
]


@pytest.mark.parametrize("response, ground_truth, expected", CASES)
def test_math_reward_table(response: str, ground_truth: str, expected: float) -> None:
    reward = math_reward(response, ground_truth)
    assert reward == expected, f"extracted {extract_answer(response)!r} vs {ground_truth!r}"
    assert type(reward) is float


def test_table_is_balanced() -> None:
    """The brief asks for >= 40 cases, roughly a third of them 0.0."""
    zeros = sum(1 for case in CASES if case.values[2] == 0.0)
    assert len(CASES) >= 40
    assert 0.25 <= zeros / len(CASES) <= 0.45, (zeros, len(CASES))


@pytest.mark.parametrize(
    "raw, normalized",
    [
        ("007", "7"),
        ("+5.0", "5"),
        ("-0.50", "-0.5"),
        (".5", "0.5"),
        ("1,000", "1000"),
        ("1{,}000", "1000"),
        ("1\\,000", "1000"),
        ("\\$32,\\!348", "32348"),
        ("$42$.", "42"),
        ("{{3}}", "3"),
        ("\\text{ 12 }", "12"),
        ("\\left( 3, \\dfrac{\\pi}{2} \\right)", "(3,\\frac{\\pi}{2})"),
        ("123456789012345678901234567890.000", "123456789012345678901234567890"),
    ],
)
def test_normalize_answer(raw: str, normalized: str) -> None:
    assert normalize_answer(raw) == normalized


def _garbage_inputs() -> list[str]:
    rng = random.Random(0)
    random_unicode = "".join(chr(rng.randrange(32, 0x2FFF)) for _ in range(5_000))
    return [
        random_unicode,
        "\\boxed{" + random_unicode + "}",
        "}" * 1_000 + "\\boxed{" + "{" * 1_000,
        "\\boxed{" + "{" * 5_000 + "}" * 5_000 + "}",
        "\\boxed{" + "\\frac" * 200 + "}",
        "\\boxed{" + "(" * 300 + "}",
        "\\boxed{" + "x^" * 150 + "2}",
        "\\boxed{10^{10^{10^{10}}}}",  # sympy cannot compare this: math-verify's timeout fires
        "\\boxed{" + "9" * 100_000 + "}",
        "Answer: " + "\\(" * 20_000,
        "final " * 50_000 + "answer is " + "$" * 10_000,
        "<think>" * 1_000 + "</think>" * 1_000 + "\\boxed",
        "\\boxed{\\}" + "\\\\" * 1_000,
        "the answer is \x00\x01\ud800 \\boxed{\x00}",
        "a" * 2_000_000,
    ]


# a deadline that fires inside JAX's gc callback is swallowed there (and reported as unraisable): the case
# the retry tick exists for
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_never_raises_and_is_fast_on_garbage(monkeypatch) -> None:
    import importlib

    module = importlib.import_module("fp8rl_jax.rewards.math_reward")  # the package exports a function of that name
    # shorter deadlines than the defaults keep the test quick; the contract scales with them
    monkeypatch.setattr(module, "PARSE_TIMEOUT_S", 0.5)
    monkeypatch.setattr(module, "VERIFY_TIMEOUT_S", 0.5)
    # a deadline that fires inside a gc callback is swallowed there and reported to sys.unraisablehook
    # (the retry tick then fires again: test_deadline_fires_again_when_its_exception_is_swallowed); pytest's
    # hook is Python code that formats a traceback, and a retry tick landing inside it made pytest fail this
    # test with "Failed to process unraisable exception" (seen once in a full-suite run). Reports go to a
    # builtin append here, which no tick can interrupt; the contract below is about what math_reward returns.
    monkeypatch.setattr(sys, "unraisablehook", [].append)
    module._parse_cached.cache_clear()
    # the contract: bounded by our deadlines (two parses and one comparison, each of which may run to
    # its deadline and one retry tick on a loaded 2-core CI machine) plus a second of our own work
    bound = 2 * module.PARSE_TIMEOUT_S + module.VERIFY_TIMEOUT_S + 3 * module.DEADLINE_RETRY_S + 1.0
    for response in _garbage_inputs():
        for ground_truth in ("5", "\\frac{1}{2}", response[:1000]):
            start = time.perf_counter()
            reward = math_reward(response, ground_truth)
            elapsed = time.perf_counter() - start
            assert reward in (0.0, 1.0)
            assert elapsed < bound, f"{elapsed:.1f}s on {response[:60]!r}"
    assert math_reward(None, "5") == 0.0  # type: ignore[arg-type]
    assert math_reward("\\boxed{5}", None) == 0.0  # type: ignore[arg-type]


def test_deadline_fires_again_when_its_exception_is_swallowed() -> None:
    """The case a one-shot alarm lost in CI: the timeout raised in a gc callback is swallowed, the parse runs on."""
    import signal

    from math_verify.errors import TimeoutException

    from fp8rl_jax.rewards.math_reward import DEADLINE_RETRY_S, call_with_deadline

    swallowed = []

    def stubborn() -> None:  # swallows the first two timeouts, as a gc callback or a broad except would
        while True:
            try:
                while True:
                    pass
            except TimeoutException:
                swallowed.append(time.perf_counter())
                if len(swallowed) == 3:
                    raise

    previous = signal.getsignal(signal.SIGALRM)
    start = time.perf_counter()
    with pytest.raises(TimeoutException):
        call_with_deadline(0.3, stubborn)
    elapsed = time.perf_counter() - start
    assert len(swallowed) == 3
    assert 0.3 + 2 * DEADLINE_RETRY_S - 0.05 < elapsed < 0.3 + 2 * DEADLINE_RETRY_S + 1.0, elapsed
    # disarmed and restored: no tick left to hit later code, the caller's handler back
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
    assert signal.getsignal(signal.SIGALRM) == previous
    assert call_with_deadline(0.3, lambda x: x + 1, 1) == 2
    time.sleep(0.5)  # a stale tick would raise here


def test_works_off_the_main_thread() -> None:
    """math-verify's SIGALRM timeouts only work in the main thread; we disable them elsewhere."""
    results: list[float] = []
    worker = threading.Thread(
        target=lambda: results.extend(
            [math_reward("\\boxed{\\dfrac{2}{4}}", "0.5"), math_reward("\\boxed{0.4}", "\\frac{1}{2}")]
        )
    )
    worker.start()
    worker.join(timeout=30)
    assert results == [1.0, 0.0]


def test_registry() -> None:
    assert get_reward_fn(RewardKind.MATH) is math_reward
    assert get_reward_fn(RewardKind.MATH)("so \\boxed{7}", "7") == 1.0
    with pytest.raises(TypeError, match="RewardKind"):
        get_reward_fn("math")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="replace=True"):
        register_reward_fn(RewardKind.MATH, lambda response, ground_truth: 0.0)
    register_reward_fn(RewardKind.MATH, math_reward, replace=True)
    assert get_reward_fn(RewardKind.MATH) is math_reward


def _ground_truths(name: str) -> list[str]:
    with open(DATA_DIR / f"{name}.jsonl", encoding="utf-8") as f:
        return [json.loads(line)["answer"] for line in f if line.strip()]


requires_data = pytest.mark.skipif(
    not DATA_DIR.is_dir(), reason=f"benchmark data dir {DATA_DIR} absent (it only exists on project machines)"
)


@requires_data
@pytest.mark.parametrize(
    "dataset, min_accuracy",
    # MATH500 answers are free-form LaTeX, so a few may not round-trip: require 98%.
    # AIME/AMC answers are integers (AIME24 writes "025"): every one must.
    [("math500", 0.98), ("aime24", 1.0), ("aime25", 1.0), ("amc23", 1.0)],
)
def test_ground_truths_round_trip(dataset: str, min_accuracy: float) -> None:
    """A response that boxes the ground truth verbatim (or states it on an answer line) scores 1.0."""
    ground_truths = _ground_truths(dataset)
    assert ground_truths
    for make_response in (
        lambda gt: "... so the answer is \\boxed{" + gt + "}",
        lambda gt: "<think>\nok\n</think>\n\n**Final Answer:** $" + gt + "$",
    ):
        failures = [gt for gt in ground_truths if math_reward(make_response(gt), gt) != 1.0]
        accuracy = 1 - len(failures) / len(ground_truths)
        assert accuracy >= min_accuracy, f"{dataset}: {accuracy:.3f}, failures {failures[:10]}"


@requires_data
def test_math500_ground_truths_do_not_match_each_other() -> None:
    """False-positive check on real formats: box row i+1's answer, grade against row i.

    Neighbouring MATH500 answers differ except where two problems share an answer
    (e.g. "3" and "3", or "5" and "x=5", which math-verify deems equal);
    allow at most 1% matches.
    """
    ground_truths = _ground_truths("math500")
    matches = [
        (gt, other)
        for gt, other in zip(ground_truths, ground_truths[1:] + ground_truths[:1])
        if math_reward("so \\boxed{" + other + "}", gt) == 1.0
    ]
    assert len(matches) <= 0.01 * len(ground_truths), matches
