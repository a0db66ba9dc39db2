"""Writes the small shipped samples in each public data set's own format (run it to regenerate them).

Every problem here was written for this project (templated or by hand); none is copied from the public
data sets. They exist so that the preparation scripts and the loaders are tested on real-looking records.

    python datasets/samples/make_samples.py    # -> datasets/samples/{gsm8k,math,math500,countdown,dapo_math,deepmath}.jsonl
"""

from __future__ import annotations

import json
import random
from pathlib import Path

HERE = Path(__file__).parent

GSM8K_TEMPLATES = [
    ("{name} bakes {a} muffins every day for {d} days and gives away {g} of them. How many muffins does {name} "
     "have left?", "{name} bakes {a} * {d} = <<{a}*{d}={ad}>>{ad} muffins.\nAfter giving away {g}, {name} has "
     "{ad} - {g} = <<{ad}-{g}={r}>>{r} muffins left.", lambda a, d, g: (a * d, a * d - g)),
    ("A shop sells pens at ${a} each. {name} buys {d} pens and also pays a ${g} repair bill. How many dollars "
     "does {name} spend in all?", "The pens cost {d} * ${a} = $<<{d}*{a}={ad}>>{ad}.\n{name} spends "
     "{ad} + {g} = $<<{ad}+{g}={r}>>{r} in all.", lambda a, d, g: (a * d, a * d + g)),
    ("A train carries {a} passengers in each of its {d} cars. At the first stop {g} passengers get off. How many "
     "passengers are still on the train?", "The train carries {a} * {d} = <<{a}*{d}={ad}>>{ad} passengers.\n"
     "Then {ad} - {g} = <<{ad}-{g}={r}>>{r} passengers remain.", lambda a, d, g: (a * d, a * d - g)),
    ("{name} saves ${a} a week for {d} weeks, then spends ${g} on a bike. How much money does {name} have now?",
     "{name} saves {a} * {d} = $<<{a}*{d}={ad}>>{ad}.\nAfter the bike: {ad} - {g} = $<<{ad}-{g}={r}>>{r}.",
     lambda a, d, g: (a * d, a * d - g)),
]
NAMES = ["Maya", "Tom", "Aisha", "Lukas", "Priya", "Diego", "Mei", "Omar"]

# (problem, solution with a final \boxed{}, level, type): written here, answers in many forms
MATH = [
    ("Compute $\\frac{3}{4} - \\frac{1}{6}$.", "With denominator $12$: $\\frac{9}{12}-\\frac{2}{12}=\\boxed{\\frac{7}{12}}$.", "Level 1", "Prealgebra"),
    ("Solve for $x$: $2x + 7 = 19$.", "Subtract $7$: $2x = 12$, so $x = \\boxed{6}$.", "Level 1", "Algebra"),
    ("What is the domain of $f(x)=\\sqrt{x-2}+\\frac{1}{x-5}$? Express your answer in interval notation.", "We need $x\\ge 2$ and $x\\neq 5$, so the domain is $\\boxed{[2,5)\\cup(5,\\infty)}$.", "Level 4", "Algebra"),
    ("Simplify $\\sqrt{72}$.", "$\\sqrt{72}=\\sqrt{36\\cdot 2}=\\boxed{6\\sqrt{2}}$.", "Level 2", "Prealgebra"),
    ("A circle has radius $3$. What is its area? Express your answer in terms of $\\pi$.", "The area is $\\pi r^2 = \\boxed{9\\pi}$.", "Level 1", "Geometry"),
    ("What is the sum of the interior angles of a hexagon, in degrees?", "It is $180(6-2)=\\boxed{720^\\circ}$.", "Level 2", "Geometry"),
    ("Find all $x$ with $x^2 - 5x + 6 < 0$.", "The roots are $2$ and $3$ and the parabola opens upward, so $x\\in\\boxed{(2,3)}$.", "Level 3", "Algebra"),
    ("How many positive divisors does $36$ have?", "$36 = 2^2 3^2$ has $(2+1)(2+1)=\\boxed{9}$ divisors.", "Level 2", "Number Theory"),
    ("What is the remainder when $2^{10}$ is divided by $7$?", "$2^3\\equiv 1$, so $2^{10}=2\\cdot(2^3)^3\\equiv\\boxed{2}\\pmod 7$.", "Level 3", "Number Theory"),
    ("Two fair dice are rolled. What is the probability that the sum is $7$? Express your answer as a common fraction.", "Six of the $36$ outcomes sum to $7$: $\\boxed{\\dfrac{1}{6}}$.", "Level 2", "Counting & Probability"),
    ("In how many ways can $5$ books be arranged on a shelf?", "$5! = \\boxed{120}$.", "Level 1", "Counting & Probability"),
    ("Find the midpoint of the segment from $(1,4)$ to $(7,-2)$.", "Average the coordinates: $\\boxed{(4,1)}$.", "Level 2", "Algebra"),
    ("Evaluate $\\log_2 64$.", "$2^6=64$, so the answer is $\\boxed{6}$.", "Level 1", "Algebra"),
    ("What is $0.\\overline{3}$ as a common fraction?", "Let $x=0.\\overline3$; then $10x-x=3$ and $x=\\boxed{\\frac13}$.", "Level 2", "Prealgebra"),
    ("Find the value of $\\sin 30^\\circ + \\cos 60^\\circ$.", "Both are $\\frac12$, so the sum is $\\boxed{1}$.", "Level 1", "Precalculus"),
    ("Solve $|x-3| = 5$. Enter all solutions, separated by commas.", "$x-3=\\pm5$, so $x=\\boxed{-2, 8}$.", "Level 2", "Algebra"),
    ("What is $15\\%$ of $80$?", "$0.15\\cdot 80=\\boxed{12}$.", "Level 1", "Prealgebra"),
    ("Compute $\\dbinom{8}{3}$.", "$\\frac{8\\cdot7\\cdot6}{3\\cdot2\\cdot1}=\\boxed{56}$.", "Level 1", "Counting & Probability"),
    ("Rationalize the denominator of $\\frac{2}{\\sqrt{3}}$.", "Multiply by $\\frac{\\sqrt3}{\\sqrt3}$: $\\boxed{\\frac{2\\sqrt{3}}{3}}$.", "Level 2", "Algebra"),
    ("The lengths of the legs of a right triangle are $5$ and $12$. What is the hypotenuse?", "$\\sqrt{25+144}=\\boxed{13}$.", "Level 1", "Geometry"),
    ("What is the slope of the line $3x - 4y = 8$?", "$y=\\frac34x-2$, so the slope is $\\boxed{\\frac{3}{4}}$.", "Level 2", "Algebra"),
    ("Find $x$ if $3^{x+1} = 81$.", "$81=3^4$ so $x+1=4$ and $x=\\boxed{3}$.", "Level 1", "Algebra"),
    ("What is the least common multiple of $12$ and $18$?", "$\\text{lcm}(12,18)=\\boxed{36}$.", "Level 1", "Number Theory"),
    ("Which is larger, $2^{30}$ or $3^{20}$? Enter (A) for $2^{30}$ or (B) for $3^{20}$.", "$2^{30}=8^{10}<9^{10}=3^{20}$, so the answer is $\\boxed{\\text{(B)}}$.", "Level 3", "Intermediate Algebra"),
]

DAPO_INSTRUCTION = ("Solve the following math problem step by step. The last line of your response should be of the "
                    "form Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n{problem}\n\n"
                    "Remember to put your answer on its own line after \"Answer:\".")


def gsm8k(rng: random.Random) -> list[dict]:
    records = []
    for i in range(32):
        question, solution, values = GSM8K_TEMPLATES[i % len(GSM8K_TEMPLATES)]
        a, d = rng.randint(12, 60), rng.randint(3, 40)
        g = rng.randint(1, a * d - 1)
        ad, r = values(a, d, g)
        fields = dict(name=NAMES[i % len(NAMES)], a=a, d=d, g=g, ad=ad, r=r)
        final = f"{r:,}" if i % 3 == 0 else str(r)  # some final answers with thousands separators
        records.append({"question": question.format(**fields), "answer": solution.format(**fields) + f"\n#### {final}"})
    return records


def math_records() -> list[dict]:
    return [{"problem": p, "solution": s, "level": lv, "type": t} for p, s, lv, t in MATH]


def math500() -> list[dict]:
    from prepare_math import last_boxed  # the answer field, as MATH-500 has it

    subjects = {"Counting & Probability": "counting_and_probability", "Number Theory": "number_theory",
                "Intermediate Algebra": "intermediate_algebra"}
    return [{"problem": p, "solution": s, "answer": last_boxed(s), "subject": t, "level": int(lv.split()[-1]),
             "unique_id": f"test/{subjects.get(t, t.lower())}/{100 + i}.json"} for i, (p, s, lv, t) in enumerate(MATH[:16])]


def countdown(rng: random.Random) -> list[dict]:
    records = []
    while len(records) < 32:
        nums = [rng.randint(1, 99) for _ in range(rng.choice([3, 4]))]
        a, b, *rest = rng.sample(nums, len(nums))
        value = a + b if rng.random() < 0.5 else a * b
        for n in rest:
            value = value + n if rng.random() < 0.6 else value - n
        if 1 <= value <= 200:
            records.append({"target": value, "nums": nums})
    return records


def dapo_math() -> list[dict]:
    integer_answers = [(p, s) for p, s, _, _ in MATH if s.split("\\boxed{")[-1].split("}")[0].lstrip("-").isdigit()]
    rows = []
    for i, (problem, solution) in enumerate(integer_answers[:14]):
        answer = solution.split("\\boxed{")[-1].split("}")[0]
        rows.append({"data_source": "math_dapo", "prompt": [{"role": "user", "content": DAPO_INSTRUCTION.format(problem=problem)}],
                     "ability": "MATH", "reward_model": {"ground_truth": answer, "style": "rule-lighteval/MATH_v2"},
                     "extra_info": {"index": f"sample-{i:04d}"}})
    return rows + rows[:6]  # the published file repeats its problems: the script removes duplicates


def deepmath() -> list[dict]:
    from prepare_math import last_boxed  # DeepMath-103K's final_answer

    return [{"question": p, "final_answer": last_boxed(s), "difficulty": 2.0 + int(lv.split()[-1]) / 2,
             "topic": f"Mathematics -> {t}", "r1_solution_1": s, "r1_solution_2": s, "r1_solution_3": s}
            for p, s, lv, t in MATH[8:]]


def main() -> None:
    rng = random.Random(2025)
    for name, records in [("gsm8k", gsm8k(rng)), ("math", math_records()), ("math500", math500()),
                          ("countdown", countdown(rng)), ("dapo_math", dapo_math()), ("deepmath", deepmath())]:
        (HERE / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        print(f"{name}: {len(records)} records")


if __name__ == "__main__":
    import sys

    sys.path.insert(0, str(HERE.parent))
    main()
