"""A deterministic text corpus, generated from templates: English prose, German, Python code, chat.

rig ships no data and fetches none; the tokenizer of the tiny models (and any model rig trains)
is trained on this. Same seed -> same text, byte for byte, on any host.
"""

from __future__ import annotations

import random

PLACES = ["Lisbon", "Oslo", "Kyoto", "Quito", "Nairobi", "Perth", "Tallinn", "Lima", "Hanoi", "Porto"]
THINGS = ["river", "market", "bridge", "library", "harbour", "garden", "station", "museum", "tower", "bakery"]
ADJ = ["quiet", "old", "busy", "narrow", "bright", "small", "famous", "green", "windy", "ancient"]
VERBS = ["visited", "painted", "described", "crossed", "photographed", "measured", "mapped", "repaired"]
PEOPLE = ["Ana", "Bruno", "Chen", "Dara", "Emil", "Farah", "Goran", "Hana", "Ivo", "Julia"]
DE_NOUNS = ["der Fluss", "der Markt", "die Brücke", "die Bibliothek", "der Hafen", "der Garten"]
DE_ADJ = ["ruhig", "alt", "belebt", "schmal", "hell", "klein", "berühmt", "grün"]
DE_PLACES = ["Berlin", "Wien", "Zürich", "Hamburg", "Graz", "Bremen", "Köln", "Basel"]
FUNCS = ["total", "average", "largest", "count_words", "reverse", "clamp", "merge", "unique"]
TOOLS = ["get_weather", "convert_currency", "search_books", "book_table"]


def english(rng: random.Random) -> str:
    p, t, a, v, who = (rng.choice(x) for x in (PLACES, THINGS, ADJ, VERBS, PEOPLE))
    n = rng.randint(2, 40)
    return rng.choice([
        f"In {p}, the {a} {t} is {n} minutes from the centre, and {who} {v} it last spring.",
        f"{who} {v} the {a} {t} of {p} and wrote that it was worth the {n}-hour journey.",
        f"The {t} in {p} opened {n} years ago; locals still call it the {a} {t}.",
        f"When it rains in {p}, the {a} {t} fills with people who have nowhere else to go.",
    ])


def german(rng: random.Random) -> str:
    noun, adj, place = rng.choice(DE_NOUNS), rng.choice(DE_ADJ), rng.choice(DE_PLACES)
    n = rng.randint(2, 30)
    return rng.choice([
        f"In {place} ist {noun} sehr {adj}, und man erreicht ihn in {n} Minuten zu Fuß.",
        f"Am Morgen war {noun} in {place} {adj}, aber am Abend kamen viele Besucher.",
        f"Seit {n} Jahren gilt {noun} von {place} als {adj} und schön.",
    ])


def python_code(rng: random.Random) -> str:
    name, n = rng.choice(FUNCS), rng.randint(1, 9)
    return rng.choice([
        f"def {name}(values):\n    result = 0\n    for v in values:\n        result += v * {n}\n    return result\n",
        f"def {name}(items, limit={n}):\n    \"\"\"Return at most {n} items.\"\"\"\n    return sorted(items)[:limit]\n",
        f"class {name.title().replace('_', '')}:\n    def __init__(self, size={n}):\n        self.size = size\n",
    ])


def chat(rng: random.Random) -> str:
    p, who = rng.choice(PLACES), rng.choice(PEOPLE)
    tool = rng.choice(TOOLS)
    return rng.choice([
        f"<|im_start|>user\nWhat is there to see in {p}?<|im_end|>\n<|im_start|>assistant\n{english(rng)}<|im_end|>\n",
        f"<|im_start|>user\nHi, I am {who}.<|im_end|>\n<|im_start|>assistant\nHello {who}! How can I help?<|im_end|>\n",
        f"<|im_start|>assistant\n<tool_call>\n<function={tool}>\n<parameter=city>\n{p}\n</parameter>\n"
        f"</function>\n</tool_call><|im_end|>\n",
    ])


GENERATORS = {"english": english, "german": german, "code": python_code, "chat": chat}


def generate(seed: int = 0, lines_per_domain: int = 2000) -> str:
    """The corpus as one string; domains interleaved so every slice is mixed."""
    rng = random.Random(seed)
    out = []
    for _ in range(lines_per_domain):
        for gen in GENERATORS.values():
            out.append(gen(rng))
    return "\n".join(out) + "\n"
