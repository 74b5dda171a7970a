"""miles' rule-based reward types (`--rm-type NAME`), scoring a response's text against the sample's label.

    math         1.0 when HuggingFace math-verify finds the answer equal to the label (LaTeX, fractions,
                 percentages, a \\boxed{} answer, units in \\text{} dropped: `\\boxed{1/2}` = `0.5`), else 0.0
    deepscaler   the text after the last `</think>` (or after `###Response`; neither: 0.0), its last
                 \\boxed{} answer graded like `math` (0.0 without one)
    dapo         DAPO's rule (miles' math_dapo_utils): the last "Answer: ..." of the response's last 300
                 characters, normalized (units, \\text{}, $ and spacing removed), equal to the label's
                 integer: 1.0, else -1.0 (miles returns {"score": ...}; this is its score)
    f1           token F1 of the normalized response against the label (SQuAD's normalization: lower
                 case, punctuation and articles removed); 0 when exactly one of them is yes/no/noanswer
    boxed_NAME   NAME scored on the response's last \\boxed{} content only (empty without one)

Where miles' own graders differ: its `math` and `deepscaler` grade with its port of verl's
mathd/sympy checks; here both use math-verify, the verifier open-r1 and several anchors use
(docs/algorithms.md#reward-types). math-verify's own timeout uses signals, which only work on a main
thread; rewards run on the Rewarder's threads, so it runs without it and `--reward-timeout-seconds`
bounds a reward that hangs, as for any reward function.
"""

from __future__ import annotations

import logging
import re
import string
from collections import Counter
from typing import Callable

from miles_core.config.miles_flags import BOXED, RM_TYPES


def rm_type_reward(name: str) -> Callable:
    """The reward function `(sample, text) -> float` of `--rm-type NAME`; ValueError for an unknown one."""
    base = name.removeprefix(BOXED)
    if base not in RM_TYPES:
        raise ValueError(f"--rm-type={name}: not supported; supported: {', '.join(RM_TYPES)} (each also as "
                         f"{BOXED}NAME)")
    score = {"math": math_score, "deepscaler": deepscaler_score, "dapo": dapo_score, "f1": f1_score}[base]
    boxed = name.startswith(BOXED)

    def reward(sample, text: str) -> float:
        if boxed:
            text = boxed_content(text) or ""
        return score(text, str(sample.label))

    reward.needs_text = True
    reward.__name__ = f"rm_type_{name}"
    return reward


# ----------------------------------------------------------------------------- \boxed{}


def last_boxed(text: str) -> str | None:
    """The last `\\boxed{...}` of `text` with its braces balanced, or None."""
    at = text.rfind("\\boxed{")
    if at < 0:
        return None
    depth = 0
    for i in range(at, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[at:i + 1]
    return None


def boxed_content(text: str) -> str | None:
    box = last_boxed(text)
    return None if box is None else box[len("\\boxed{"):-1]


# ----------------------------------------------------------------------------- math (math-verify)


def _quiet_math_verify() -> None:
    # it warns on every call made without its signal timeout (the only way it runs on a thread)
    for name in ("math_verify", "math_verify.parser", "math_verify.grader", "math_verify.utils"):
        logging.getLogger(name).setLevel(logging.ERROR)


def math_equal(answer: str, label: str) -> bool:
    """math-verify's verdict on `answer` (any text: the last math it finds) against `label`."""
    from math_verify import parse, verify

    _quiet_math_verify()
    gold = parse(label if "$" in label or "\\" in label else f"${label}$", parsing_timeout=None)
    predicted = parse(answer, parsing_timeout=None)
    if not gold or not predicted:
        return False
    return bool(verify(gold, predicted, timeout_seconds=None))


def math_score(text: str, label: str) -> float:
    return float(math_equal(text, label))


def deepscaler_score(text: str, label: str) -> float:
    if "</think>" in text:
        solution = text.split("</think>")[-1]
    elif "###Response" in text:
        solution = text.split("###Response")[1]
    else:
        return 0.0
    answer = boxed_content(solution)
    if answer is None or label == "":
        return 0.0
    truth = boxed_content(label) if "\\boxed" in label else label
    return float(truth is not None and math_equal(f"${answer}$", truth))


# ----------------------------------------------------------------------------- dapo (miles' math_dapo_utils)

_SUBSTITUTIONS = [("an ", ""), ("a ", ""), (".$", "$"), ("\\$", ""), (r"\ ", ""), (" ", ""), ("mbox", "text"),
                  (",\\text{and}", ","), ("\\text{and}", ","), ("\\text{m}", "\\text{}")]
_REMOVED = ["square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units", "\\ldots", "sue",
            "points", "feet", "minutes", "digits", "cents", "degrees", "cm", "gm", "pounds", "meters", "meals",
            "edges", "students", "childrentickets", "multiples", "\\text{s}", "\\text{.}", "\\text{\ns}",
            "\\text{}^2", "\\text{}^3", "\\text{\n}", "\\text{}", r"\mathrm{th}", r"^\circ", r"^{\circ}", r"\;",
            r",\!", "{,}", '"', "\\dots", "<|im_end|>", "<|endoftext|>"]


def normalize_final_answer(answer: str) -> str:
    """DAPO's (Minerva's) normalization of a final answer."""
    answer = str(answer).split("=")[-1]
    for before, after in _SUBSTITUTIONS:
        answer = answer.replace(before, after)
    for expr in _REMOVED:
        answer = answer.replace(expr, "")
    answer = re.sub(r"(.*?)(\$)(.*?)(\$)(.*)", "$\\3$", answer)
    answer = re.sub(r"(\\text\{)(.*?)(\})", "\\2", answer)
    answer = re.sub(r"(\\textbf\{)(.*?)(\})", "\\2", answer)
    answer = re.sub(r"(\\overline\{)(.*?)(\})", "\\2", answer)
    answer = re.sub(r"(\\boxed\{)(.*)(\})", "\\2", answer)
    answer = re.sub(r"(frac)([^{])(.)", "frac{\\2}{\\3}", answer)
    answer = re.sub(r"(sqrt)([^{])", "sqrt{\\2}", answer)
    answer = answer.replace("$", "")
    if answer.replace(",", "").isdigit():
        answer = answer.replace(",", "")
    return answer.strip()


def dapo_score(text: str, label: str) -> float:
    """1.0 when the last "Answer: ..." of the last 300 characters, normalized, is the label's integer;
    else -1.0. A label that is not a number raises (a reward failure, counted)."""
    found = re.findall(r"(?i)Answer\s*:\s*([^\n]+)", text[-300:])
    predicted = normalize_final_answer(found[-1] if found else "[INVALID]")
    truth = str(int(float(normalize_final_answer(label))))  # DAPO's answers are integers
    return 1.0 if predicted == truth else -1.0


# ----------------------------------------------------------------------------- f1


def normalize_text(s: str) -> str:
    s = "".join(ch for ch in s.lower() if ch not in set(string.punctuation))
    s = re.sub(r"\b(a|an|the)\b", " ", s)
    return " ".join(s.split())


def f1_score(text: str, label: str) -> float:
    predicted, truth = normalize_text(text), normalize_text(label)
    special = ("yes", "no", "noanswer")
    if (predicted in special or truth in special) and predicted != truth:
        return 0.0
    common = Counter(predicted.split()) & Counter(truth.split())
    same = sum(common.values())
    if same == 0:
        return 0.0
    precision, recall = same / len(predicted.split()), same / len(truth.split())
    return 2 * precision * recall / (precision + recall)
