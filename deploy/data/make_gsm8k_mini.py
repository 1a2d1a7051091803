"""Writes gsm8k_mini.jsonl: GSM8K-style grade-school word problems, generated here (no download).

Each line is TRL's conversational format plus GSM8K's answer convention::

    {"prompt": [{"role": "user", "content": "<question>"}],
     "answer": "<worked solution, one step per line>\\n#### <number>",
     "topic": "shopping", "num_steps": 2}

``answer`` is a worked solution whose final line is ``#### <number>``, as in GSM8K: the built-in
``loraflow:exact_match`` extracts the number from it and from the model's completion. ``topic`` and
``num_steps`` are extra columns that reach reward functions as keyword arguments. Problems come from a few
templates with numbers drawn by a seeded generator, so the file is the same on every machine::

    python deploy/data/make_gsm8k_mini.py            # rewrites deploy/data/gsm8k_mini.jsonl
"""

from __future__ import annotations

import json
import random
import sys
from collections.abc import Callable
from pathlib import Path

NUM_PROBLEMS = 120
SEED = 0
PATH = Path(__file__).with_name("gsm8k_mini.jsonl")

NAMES = ["Ava", "Ben", "Chloe", "Dev", "Emma", "Farid", "Grace", "Hiro", "Ines", "Jonas", "Kira", "Leo", "Maya",
         "Noor", "Omar", "Priya", "Quinn", "Rosa", "Sam", "Tariq"]
ITEMS = [("apples", 2), ("notebooks", 3), ("pencils", 1), ("stickers", 1), ("muffins", 4), ("comic books", 5)]

Problem = tuple[str, list[str], int, str]  # question, solution steps, answer, topic


def shopping(r: random.Random) -> Problem:
    name, (item, price) = r.choice(NAMES), r.choice(ITEMS)
    count = r.randint(3, 12)
    cost = count * price
    paid = cost + r.randint(1, 20)
    change = paid - cost
    question = (f"{name} buys {count} {item} at ${price} each and pays with ${paid}. "
                f"How many dollars of change does {name} get?")
    steps = [f"The {item} cost {count} * {price} = {cost} dollars.", f"The change is {paid} - {cost} = {change} dollars."]
    return question, steps, change, "shopping"


def sharing(r: random.Random) -> Problem:
    name, friends = r.choice(NAMES), r.randint(2, 6)
    each, left = r.randint(2, 9), r.randint(0, friends - 1)
    total = friends * each + left
    question = (f"{name} has {total} marbles and shares them equally among {friends} friends, keeping whatever is "
                "left over. How many marbles does each friend get?")
    steps = [f"{total} = {friends} * {each} + {left}.", f"Each friend gets {each} marbles."]
    return question, steps, each, "sharing"


def ages(r: random.Random) -> Problem:
    a, b = r.sample(NAMES, 2)
    age_b, gap, years = r.randint(4, 15), r.randint(2, 30), r.randint(2, 10)
    age_a = age_b + gap
    total = age_a + years + age_b + years
    question = (f"{a} is {gap} years older than {b}, who is {age_b}. What will the sum of their ages be in "
                f"{years} years?")
    steps = [f"{a} is {age_b} + {gap} = {age_a}.", f"In {years} years: {age_a + years} and {age_b + years}.",
             f"Their sum is {age_a + years} + {age_b + years} = {total}."]
    return question, steps, total, "ages"


def travel(r: random.Random) -> Problem:
    name, speed, hours = r.choice(NAMES), r.randint(3, 15) * 5, r.randint(2, 6)
    back = r.randint(1, hours)
    distance = speed * hours
    question = (f"{name} drives at {speed} km per hour for {hours} hours, then drives back {back * speed} km. "
                f"How many km from the start is {name} now?")
    steps = [f"Out: {speed} * {hours} = {distance} km.", f"Back: {back * speed} km, so {distance} - {back * speed} = "
             f"{distance - back * speed} km."]
    return question, steps, distance - back * speed, "travel"


def savings(r: random.Random) -> Problem:
    name, weekly, weeks = r.choice(NAMES), r.randint(3, 25), r.randint(3, 12)
    spent = r.randint(1, weekly * weeks // 2)
    saved = weekly * weeks
    question = (f"{name} saves ${weekly} every week for {weeks} weeks, then spends ${spent} on a gift. "
                "How many dollars are left?")
    steps = [f"Saved: {weekly} * {weeks} = {saved} dollars.", f"Left: {saved} - {spent} = {saved - spent} dollars."]
    return question, steps, saved - spent, "savings"


TEMPLATES: list[Callable[[random.Random], Problem]] = [shopping, sharing, ages, travel, savings]


def rows(num_problems: int = NUM_PROBLEMS, seed: int = SEED) -> list[dict]:
    """The dataset's rows: deterministic for a seed, no question repeated."""
    rng = random.Random(seed)
    out, seen = [], set()
    while len(out) < num_problems:
        question, steps, answer, topic = rng.choice(TEMPLATES)(rng)
        if question in seen:
            continue
        seen.add(question)
        out.append({"prompt": [{"role": "user", "content": question}],
                    "answer": "\n".join(steps) + f"\n#### {answer}", "topic": topic, "num_steps": len(steps)})
    return out


def text(num_problems: int = NUM_PROBLEMS, seed: int = SEED) -> str:
    return "".join(json.dumps(row) + "\n" for row in rows(num_problems, seed))


if __name__ == "__main__":
    path = Path(sys.argv[1]) if len(sys.argv) > 1 else PATH
    path.write_text(text())
    print(f"wrote {NUM_PROBLEMS} problems to {path}")
