"""The math rewards on the cases that trip parsers up: several numbers, signs, thousands separators,
fractions, units, LaTeX spellings, no answer at all."""
import pytest

from rlbench_nb.rewards import (
    boxed_answer,
    boxed_math,
    combine,
    equivalent,
    gsm8k,
    gsm8k_format,
    gsm8k_with_format,
    last_number,
    think_format,
    to_number,
)

GSM8K_SOLUTION = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips.\n#### 72"


@pytest.mark.parametrize("response, answer, expected", [
    ("She sold 48 in April and 24 in May, so 72 in all.\n#### 72", "72", 1.0),
    ("48 + 24 = 72. The answer is 72.", GSM8K_SOLUTION, 1.0),       # no ####: the last number; truth from ####
    ("#### 72\nI first thought 70.", "72", 1.0),                       # #### wins over a later number
    ("48 + 24 = 72, minus 2 is 70", "72", 0.0),                        # the last number is the answer given
    ("The total is $1,200.", "1200", 1.0),                             # currency, thousands comma, period
    ("#### 1,200.00", "1200", 1.0),
    ("#### -5", "-5", 1.0),
    ("The temperature fell to −5 degrees", "-5", 1.0),                 # a Unicode minus and a unit
    ("#### 5", "-5", 0.0),
    ("#### 3/4", "0.75", 1.0),                                        # fractions compare by value
    ("#### 0.5", "1/2", 1.0),
    ("#### 18 dollars", "18", 1.0),
    ("#### 75%", "75", 1.0),
    ("I don't know.", "72", 0.0),                                     # no number at all
    ("", "72", 0.0),
    ("#### seventy-two", "72", 0.0),
    ("version 1.2.3 says 4", "4", 1.0),                               # 1.2.3 is not a number; 4 is the last
])
def test_gsm8k(response, answer, expected):
    assert gsm8k("q", response, answer) == expected


def test_gsm8k_strict_needs_the_hashes():
    assert gsm8k("q", "so the answer is 72", "72", strict=True) == 0.0
    assert gsm8k("q", "so the answer is\n#### 72", "72", strict=True) == 1.0


@pytest.mark.parametrize("text, expected", [
    ("a 1,234 b 5", "5"), ("1,234", "1,234"), ("x=-3.5.", "-3.5"), ("no digits", None), ("3/4 of 8 is 6", "6"),
])
def test_last_number(text, expected):
    assert last_number(text) == expected


@pytest.mark.parametrize("text, expected", [
    ("so \\boxed{\\frac{1}{2}}.", "\\frac{1}{2}"),
    ("first \\boxed{3} then \\boxed{4}", "4"),                         # the last box
    ("\\boxed{\\{1, 2\\}}", "\\{1, 2\\}"),
    ("\\boxed{x^{2}+1}", "x^{2}+1"),                                   # nested braces
    ("\\boxed {7}", "7"),
    ("\\fbox{7}", "7"),
    ("\\boxed{never closed", None),
    ("no box, 7", None),
])
def test_boxed_answer(text, expected):
    assert boxed_answer(text) == expected


@pytest.mark.parametrize("predicted, truth, same", [
    ("\\frac{1}{2}", "0.5", True), ("\\dfrac{1}{2}", "\\frac12", True), ("1/2", ".5", True),
    ("-\\frac{3}{4}", "-0.75", True), ("10\\%", "10", True), ("90^\\circ", "90", True),
    ("\\text{(A)}", "(A)", True), ("\\left( 1, 2 \\right)", "(1,2)", True), ("3", "4", False),
    ("x^{2}+1", "x^2+1", False),  # the string compare does not know these are equal (math-verify does)
])
def test_equivalent_without_math_verify(monkeypatch, predicted, truth, same):
    import sys
    monkeypatch.setitem(sys.modules, "math_verify", None)  # the documented fallback, whatever is installed
    assert equivalent(predicted, truth) is same


@pytest.mark.parametrize("predicted, truth, same", [
    ("x^{2}+1", "x^2+1", True), ("\\frac{1}{2}", "0.5", True), ("\\sqrt{4}", "2", True), ("3", "4", False),
    ("(1,2)", "\\left( 1, 2 \\right)", True), ("\\frac{\\pi}{2}", "\\pi/2", True),
])
def test_equivalent_with_math_verify_in_a_reward_thread(predicted, truth, same):
    """math-verify's own timeout needs the main thread; reward calls run in threads (reward.isolation)."""
    import threading
    pytest.importorskip("math_verify")
    out = {}
    worker = threading.Thread(target=lambda: out.update(same=equivalent(predicted, truth)))
    worker.start()
    worker.join()
    assert out["same"] is same


def test_boxed_math_reads_the_truth_from_a_solution():
    solution = "We get $x = 2$, so the answer is $\\boxed{\\frac{2}{4}}$."
    assert boxed_math("q", "The answer is \\boxed{0.5}.", solution) == 1.0
    assert boxed_math("q", "The answer is 0.5.", solution) == 0.0    # no box, no reward
    assert boxed_math("q", "\\boxed{1} or rather \\boxed{0.5}", "1/2") == 1.0


@pytest.mark.parametrize("prompt, response, expected", [
    ("q", "<think>2+2 is 4</think> 4", 1.0),
    ("q", "<think>\n2+2\n</think>\n\n#### 4", 1.0),
    ("q <think>", "2+2 is 4</think> 4", 1.0),                         # the template opened the thought
    ("q", "<think></think> 4", 0.0),                                   # an empty thought
    ("q", "<think>2+2 is 4</think>", 0.0),                             # no answer after it
    ("q", "4 <think>why</think> 4", 0.0),                              # not at the start
    ("q", "<think>a</think> 4 <think>b</think> 5", 0.0),               # a second thought
    ("q", "4", 0.0),
])
def test_think_format(prompt, response, expected):
    assert think_format(prompt, response) == expected


@pytest.mark.parametrize("response, expected", [
    ("48 + 24 = 72\n#### 72", 1.0),
    ("#### $1,200.50", 1.0),
    ("so #### 7 apples", 1.0),
    ("The answer is 72.", 0.0),                                        # the right number, not the asked format
    ("#### seventy-two", 0.0),                                         # no number after the hashes
    ("####", 0.0),
])
def test_gsm8k_format(response, expected):
    assert gsm8k_format("q", response) == expected


def test_gsm8k_with_format_adds_a_fifth_for_the_format():
    assert gsm8k_with_format("q", "48+24=72\n#### 72", answer="72") == pytest.approx(1.2)
    assert gsm8k_with_format("q", "#### 70", answer="72") == pytest.approx(0.2)
    assert gsm8k_with_format("q", "The answer is 72", answer="#### 72") == pytest.approx(1.0)
    assert gsm8k_with_format("q", "no idea", answer="72") == 0.0


def test_combine_weighs_parts_and_keeps_failures_loud():
    reward = combine((gsm8k, 1.0), (think_format, 0.2))
    assert reward("q", "<think>48+24</think> #### 72", answer="72") == pytest.approx(1.2)
    assert reward("q", "#### 72", answer="72") == pytest.approx(1.0)
    assert reward("q", "<think>hm</think> 70", answer="72") == pytest.approx(0.2)
    assert reward.__name__ == "1*gsm8k+0.2*think_format"
    assert reward.__module__.startswith("rlbench_nb.")  # the package's own: trusted in-process
    assert combine((gsm8k, 1.0), (test_think_format, 0.0)).__module__ == __name__  # code of yours: isolated
    with pytest.raises(KeyError):  # a part that fails fails the sample; it does not score 0 quietly
        combine((lambda prompt, response, **row: row["missing"], 1.0))("q", "r", answer="1")
    with pytest.raises(TypeError, match="pairs"):
        combine(gsm8k)


def test_combine_keeps_each_part_before_its_weight_and_travels_with_them():
    import pickle

    from rlbench_nb.rewards import Scored
    score = gsm8k_with_format("q", "so 70\n#### 70", answer="72")  # the format, not the answer
    assert isinstance(score, Scored) and score == pytest.approx(0.2)
    assert score.parts == {"gsm8k": 0.0, "gsm8k_format": 1.0}  # each part's own score, not 0.2
    back = pickle.loads(pickle.dumps(score))  # to and from a reward process
    assert back == score and back.parts == score.parts and isinstance(back, Scored)
    twice = combine((gsm8k, 1.0), (gsm8k, 0.5))("q", "#### 72", answer="72")
    assert twice == pytest.approx(1.5) and twice.parts == {"gsm8k": 1.0, "gsm8k_2": 1.0}


def test_to_number_refuses_what_is_not_one_number():
    assert to_number("1,2") is None and to_number("3 4") is None and to_number("5/0") is None
    assert to_number("$1,234.50.") == to_number("1234.5")
