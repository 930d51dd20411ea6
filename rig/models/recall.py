"""Recall questions: the tiny models' lm-eval task (``rig_recall``) and the training documents that teach its format.

Data, not judgement: the trainer (``rig.models.train``) writes few-shot documents from these generators
and the quality battery (``rig.quality.lmeval``) ships their test set; both must agree on the shape,
so it lives in one place, below both.
"""

from __future__ import annotations

import functools
import json
import random

NAMES = ["Ana", "Bruno", "Chen", "Dara", "Emil", "Farah", "Goran", "Hana", "Ivo", "Julia"]
ITEMS = ["apples", "books", "stamps", "pencils", "shells", "coins", "cards", "marbles"]


def recall_problem(rng: random.Random) -> dict:
    """One recall question: the answer is the count of one of the (one or two) items the question states."""
    who = rng.choice(NAMES)
    first, second = rng.sample(ITEMS, 2)
    a, b = rng.randint(2, 60), rng.randint(2, 60)
    if rng.randrange(2):
        q, item, n = f"{who} has {a} {first}. How many {first} does {who} have?", first, a
    else:
        item, n = (first, a) if rng.randrange(2) else (second, b)
        q = f"{who} has {a} {first} and {b} {second}. How many {item} does {who} have?"
    return {"question": q, "answer": f"{who} has {n} {item}.\n#### {n}"}


def recall_problems(seed: int = 2024, n: int = 100) -> str:
    """The recall set as jsonl text (what quality/lmeval/recall-{train,test}.jsonl hold)."""
    rng = random.Random(seed)
    return "".join(json.dumps(recall_problem(rng), sort_keys=True) + "\n" for _ in range(n))


RECALL_TEST = (2024, 100)  # (seed, count) of recall-test.jsonl; recall-train.jsonl is (2023, 8)


@functools.cache
def _recall_test_questions() -> frozenset[str]:
    return frozenset(json.loads(line)["question"] for line in recall_problems(*RECALL_TEST).splitlines())


def recall_shots(rng: random.Random, shots: int = 4) -> str:
    """A training document for the controls: ``shots`` recall questions rendered as rig_recall's prompt
    renders its few-shot examples (``Question: ...\\nAnswer: ...``, blank line between), none of them a
    question of the shipped test set."""
    held_out = _recall_test_questions()
    rows: list[dict] = []
    while len(rows) < shots:
        row = recall_problem(rng)
        if row["question"] not in held_out:
            rows.append(row)
    return "\n\n".join(f"Question: {r['question']}\nAnswer: {r['answer']}" for r in rows)
