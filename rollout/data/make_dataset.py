"""Generate ``math_problems.jsonl`` (small word problems, integer answers) and ``corpus.jsonl``
(the retrieval tool's reference passages), deterministically from templates.

Run: ``python -m rollout.data.make_dataset`` (rewrites both files next to this script).
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path

NAMES = ["Ava", "Ben", "Chen", "Dara", "Eli", "Fatima", "Goro", "Hana", "Ivan", "Jia", "Kofi",
         "Lena", "Mateo", "Nia", "Omar", "Priya", "Quinn", "Rosa", "Sami", "Tara"]  # fmt: skip
ITEMS = [("apple", "apples"), ("notebook", "notebooks"), ("pencil", "pencils"),
         ("sticker", "stickers"), ("muffin", "muffins"), ("marble", "marbles"),
         ("ticket", "tickets"), ("book", "books")]  # fmt: skip

Problem = tuple[str, int, str]  # question, answer, solution
Template = Callable[[random.Random], Problem]


def _arith(r: random.Random) -> Problem:
    a, b, c = r.randint(12, 99), r.randint(2, 9), r.randint(5, 60)
    form = r.choice([
        (f"What is {a} times {b} plus {c}?", a * b + c, f"{a}*{b}+{c}"),
        (f"Compute ({a} + {c}) * {b}.", (a + c) * b, f"({a}+{c})*{b}"),
        (f"Subtract {c} from the product of {a} and {b}. What do you get?", a * b - c,
         f"{a}*{b}-{c}"),
    ])  # fmt: skip
    return form[0], form[1], f"{form[2]} = {form[1]}"


def _shopping(r: random.Random) -> Problem:
    name = r.choice(NAMES)
    (one, many), n, price, paid = r.choice(ITEMS), r.randint(2, 12), r.randint(2, 15), 0
    total = n * price
    paid = total + r.randint(1, 40)
    q = r.choice([
        f"{name} buys {n} {many} at ${price} each and pays with ${paid}. How much change, in "
        "dollars, does {name} get back?",
        f"Each {one} costs ${price}. {name} buys {n} {many} and hands the cashier ${paid}. "
        "How many dollars of change are returned?",
    ]).replace("{name}", name)  # fmt: skip
    return q, paid - total, f"{n}*{price} = {total}; {paid}-{total} = {paid - total}"


def _rate(r: random.Random) -> Problem:
    speed, hours = r.randint(3, 80), r.randint(2, 9)
    name = r.choice(NAMES)
    q = r.choice([
        f"A train travels at {speed} km per hour for {hours} hours. How many km does it go?",
        f"{name} cycles {speed} miles every hour. How far does {name} ride in {hours} hours?",
        f"A pump moves {speed} liters per hour. How many liters does it move in {hours} hours?",
    ])  # fmt: skip
    return q, speed * hours, f"{speed}*{hours} = {speed * hours}"


def _sharing(r: random.Random) -> Problem:
    people, each = r.randint(2, 9), r.randint(3, 25)
    extra = r.randint(0, people - 1)
    _one, many = r.choice(ITEMS)
    name = r.choice(NAMES)
    total = people * each + extra
    q = (f"{name} has {total} {many} and shares them equally among {people} friends, keeping "
         f"whatever is left over. How many {many} does each friend get?")  # fmt: skip
    return q, each, f"{total} // {people} = {each}"


def _multi_step(r: random.Random) -> Problem:
    name = r.choice(NAMES)
    start, gain, weeks, spend = (
        r.randint(10, 90),
        r.randint(5, 30),
        r.randint(2, 8),
        r.randint(5, 40),
    )
    end = start + gain * weeks - spend
    q = (f"{name} has ${start} saved, earns ${gain} per week for {weeks} weeks, then spends "
         f"${spend} on a gift. How many dollars does {name} have now?")  # fmt: skip
    return q, end, f"{start}+{gain}*{weeks}-{spend} = {end}"


def _percent(r: random.Random) -> Problem:
    price = r.choice([20, 40, 50, 60, 80, 100, 120, 150, 200, 250])
    pct = r.choice([p for p in (10, 20, 25, 50) if price * p % 100 == 0])
    q = r.choice([
        f"A jacket costs ${price}. It is on sale for {pct}% off. What is the sale price?",
        f"A ${price} game is discounted by {pct} percent. How many dollars does it cost now?",
    ])  # fmt: skip
    ans = price - price * pct // 100
    return q, ans, f"{price} - {price}*{pct}/100 = {ans}"


def _units(r: random.Random) -> Problem:
    kind = r.choice(["min", "cm", "dozen"])
    if kind == "min":
        h, m = r.randint(1, 6), r.randint(0, 59)
        return (f"How many minutes are in {h} hours and {m} minutes?", h * 60 + m,
                f"{h}*60+{m} = {h * 60 + m}")  # fmt: skip
    if kind == "cm":
        meters = r.randint(2, 40)
        return (f"A rope is {meters} meters long. How long is it in centimeters?", meters * 100,
                f"{meters}*100 = {meters * 100}")  # fmt: skip
    d = r.randint(2, 12)
    return f"How many eggs are in {d} dozen?", d * 12, f"{d}*12 = {d * 12}"


TEMPLATES: dict[str, Template] = {
    "arithmetic": _arith, "shopping": _shopping, "rates": _rate, "sharing": _sharing,
    "multi_step": _multi_step, "percent": _percent, "units": _units,
}  # fmt: skip

CORPUS = [
    ("Minutes in an hour", "One hour has 60 minutes and one minute has 60 seconds."),
    ("Hours in a day", "A day has 24 hours; a week has 7 days."),
    ("Dozen", "A dozen is 12 items; a baker's dozen is 13."),
    ("Meters and centimeters", "One meter is 100 centimeters; one kilometer is 1000 meters."),
    ("Miles and kilometers", "One mile is about 1.609 kilometers."),
    ("Percent", "A percent is a part per hundred: p% of x is x * p / 100."),
    ("Discount", "A sale price after a p% discount is price - price * p / 100."),
    ("Distance rate time", "Distance equals speed multiplied by time: d = v * t."),
    ("Change", "Change returned equals the amount paid minus the total cost."),
    ("Equal sharing", "Sharing n items among k people gives n // k each, with n % k left over."),
    ("Liters", "One liter is 1000 milliliters."),
    ("Kilograms", "One kilogram is 1000 grams; one pound is about 0.4536 kilograms."),
    ("Weeks in a year", "A year has 52 weeks and 365 days (366 in a leap year)."),
    ("Area of a rectangle", "The area of a rectangle is its length times its width."),
    ("Perimeter", "The perimeter of a rectangle is 2 * (length + width)."),
    ("Average", "The average (mean) of numbers is their sum divided by how many there are."),
    ("Order of operations", "Multiplication and division come before addition and subtraction."),
    ("Integer division", "Integer division discards the remainder: 17 // 5 is 3."),
    ("Savings", "Savings after w weeks: start + weekly_amount * w, minus any spending."),
    ("Triangle angles", "The angles of a triangle add up to 180 degrees."),
    ("Prime numbers", "A prime has exactly two divisors: 2, 3, 5, 7, 11, 13 are primes."),
    ("Even and odd", "An even number is divisible by 2; an odd number is not."),
    ("Feet and inches", "One foot is 12 inches; one yard is 3 feet."),
    ("Cents", "One dollar is 100 cents; a quarter is 25 cents, a dime 10 cents."),
]


def make_problems(n: int = 300, seed: int = 1234) -> list[dict[str, object]]:
    """``n`` problems cycling through the templates, reproducible for a given ``seed``."""
    r = random.Random(seed)
    names = list(TEMPLATES)
    out = []
    for i in range(n):
        category = names[i % len(names)]
        question, answer, work = TEMPLATES[category](r)
        out.append({"id": f"math-{i:04d}", "category": category, "question": question,
                    "answer": answer, "solution": f"{work}\n#### {answer}"})  # fmt: skip
    return out


def main() -> None:
    """Write both files next to this script."""
    here = Path(__file__).resolve().parent
    with open(here / "math_problems.jsonl", "w", encoding="utf-8") as f:
        for row in make_problems():
            f.write(json.dumps(row) + "\n")
    with open(here / "corpus.jsonl", "w", encoding="utf-8") as f:
        for i, (title, text) in enumerate(CORPUS):
            f.write(json.dumps({"id": f"doc-{i:03d}", "title": title, "text": text}) + "\n")


if __name__ == "__main__":
    main()
