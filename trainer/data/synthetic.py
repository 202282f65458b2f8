"""The built-in synthetic corpus (``training.dataset = "synthetic"``) and the entropy bars a
model trained on it must go below.

Small closed vocabularies and rigid templates give the corpus low conditional entropy (bigram
structure, copyable key/value pairs, arithmetic, counting, cyclic sequences), so a debug-size
model can drive its loss well below the unigram entropy in a few hundred steps - a quick
end-to-end signal that training actually learns.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Iterable

NAMES = [
    "alice",
    "bob",
    "carol",
    "dave",
    "erin",
    "frank",
    "grace",
    "heidi",
    "ivan",
    "judy",
    "mallory",
    "oscar",
    "peggy",
    "trent",
    "victor",
    "wendy",
]
NOUNS = [
    "apple",
    "river",
    "stone",
    "window",
    "garden",
    "letter",
    "candle",
    "bridge",
    "forest",
    "mirror",
    "basket",
    "hammer",
    "ladder",
    "pencil",
    "rocket",
    "violin",
    "castle",
    "island",
    "lantern",
    "meadow",
    "engine",
    "feather",
    "jacket",
    "kettle",
]
ADJS = [
    "red",
    "small",
    "quiet",
    "bright",
    "old",
    "heavy",
    "green",
    "tiny",
    "warm",
    "broken",
    "golden",
    "silent",
    "strange",
    "gentle",
    "sharp",
    "round",
]
VERBS = [
    "found",
    "carried",
    "painted",
    "opened",
    "lost",
    "cleaned",
    "watched",
    "built",
    "moved",
    "dropped",
    "counted",
    "named",
]
PLACES = ["kitchen", "market", "harbor", "library", "village", "tower", "school", "station", "cellar", "valley"]
ANIMALS = ["cat", "dog", "fox", "owl", "horse", "rabbit", "goat", "crow"]
DAYS = ["monday", "tuesday", "wednesday", "thursday", "friday", "saturday", "sunday"]
MONTHS = [
    "january",
    "february",
    "march",
    "april",
    "may",
    "june",
    "july",
    "august",
    "september",
    "october",
    "november",
    "december",
]
LETTERS = list("abcdefghijklmnopqrstuvwxyz")


def _story(rng: random.Random) -> str:
    name, animal = rng.choice(NAMES), rng.choice(ANIMALS)
    templates = [
        lambda: f"{name} {rng.choice(VERBS)} the {rng.choice(ADJS)} {rng.choice(NOUNS)} in the {rng.choice(PLACES)} .",
        lambda: f"the {rng.choice(NOUNS)} was {rng.choice(ADJS)} and {rng.choice(ADJS)} .",
        lambda: f"{name} went to the {rng.choice(PLACES)} with the {animal} .",
        lambda: f"the {animal} {rng.choice(VERBS)} a {rng.choice(NOUNS)} .",
        lambda: f"then {name} saw {rng.randint(2, 9)} {rng.choice(NOUNS)}s near the {rng.choice(PLACES)} .",
    ]
    return "story : " + " ".join(rng.choice(templates)() for _ in range(rng.randint(3, 7)))


def _arithmetic(rng: random.Random) -> str:
    facts = []
    for _ in range(rng.randint(5, 12)):
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        if rng.random() < 0.5:
            facts.append(f"{a} + {b} = {a + b} .")
        else:
            a, b = max(a, b), min(a, b)
            facts.append(f"{a} - {b} = {a - b} .")
    return "math : " + " ".join(facts)


def _lookup(rng: random.Random) -> str:
    keys = rng.sample(NOUNS, rng.randint(3, 6))
    table = {k: rng.randint(10, 99) for k in keys}
    defs = " ; ".join(f"{k} = {v}" for k, v in table.items())
    queries = " ; ".join(f"{k} = {table[k]}" for k in rng.sample(keys, len(keys)))
    return f"lookup : {defs} ? {queries} ."


def _count(rng: random.Random) -> str:
    start, n = rng.randint(0, 80), rng.randint(8, 16)
    return "count : " + " ".join(str(i) for i in range(start, start + n)) + " ."


def _echo(rng: random.Random) -> str:
    phrase = " ".join(rng.choice(NOUNS + ADJS + ANIMALS) for _ in range(rng.randint(3, 6)))
    return "echo : " + " | ".join([phrase] * rng.randint(2, 4)) + " ."


def _cycle(rng: random.Random) -> str:
    name, seq = rng.choice([("days", DAYS), ("months", MONTHS), ("letters", LETTERS)])
    start, n = rng.randrange(len(seq)), rng.randint(6, 14)
    return f"{name} : " + " ".join(seq[(start + i) % len(seq)] for i in range(n)) + " ."


_GENERATORS = [(_story, 0.3), (_arithmetic, 0.15), (_lookup, 0.2), (_count, 0.1), (_echo, 0.15), (_cycle, 0.1)]


def synthetic_document(seed: int, index: int) -> str:
    """Document ``index`` of the corpus for ``seed``; random access, so a resume or a rank
    can jump anywhere without generating the prefix (str seeds hash via SHA-512, stable
    across processes regardless of PYTHONHASHSEED)."""
    rng = random.Random(f"synthetic:{seed}:{index}")
    gens, weights = zip(*_GENERATORS)
    return rng.choices(gens, weights=weights)[0](rng)


def unigram_entropy(tokens: Iterable[int]) -> float:
    """Entropy (nats, like cross-entropy loss) of the token frequency distribution: the
    loss of the best context-free predictor, the bar a learning model must go below."""
    counts = Counter(tokens)
    total = sum(counts.values())
    return -sum(c / total * math.log(c / total) for c in counts.values())


def bigram_conditional_entropy(tokens: Iterable[int]) -> float:
    """H(x_t | x_{t-1}) in nats: what a model using only the previous token can reach."""
    toks = list(tokens)
    pairs = Counter(zip(toks, toks[1:]))
    prev = Counter(toks[:-1])
    total = len(toks) - 1
    return -sum(c / total * math.log(c / prev[a]) for (a, _), c in pairs.items())
