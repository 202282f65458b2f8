"""Regenerate assets/tokenizer/tokenizer.json offline and deterministically.

A byte-level BPE with 2048 entries (special tokens <|bos|>, <|eos|>, <|pad|> first, so
their ids are 0, 1, 2) trained on the built-in synthetic corpus plus generated generic
English-like prose. The prose gives the merges coverage of ordinary text (capitals,
punctuation, common words) so the shipped tokenizer is also usable on small local .txt /
.jsonl datasets; byte-level fallback keeps any input encodable.

Run from the repo root:  python scripts/train_tokenizer.py [--out PATH] [--check]
``--check`` retrains in memory and fails if the committed file differs (CI guard against
a corpus change without a tokenizer refresh).
"""

from __future__ import annotations

import argparse
import os
import random

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from trainer.data.synthetic import synthetic_document
from trainer.data.tokenizer import DEFAULT_TOKENIZER_PATH, SPECIAL_TOKENS
from trainer.runtime.cli_errors import run_command
from trainer.runtime.files import atomic_write

VOCAB_SIZE = 2048
SYNTHETIC_DOCS = 20000
PROSE_DOCS = 6000
SEED = 0

_SUBJECTS = [
    "The committee",
    "A farmer",
    "Our neighbour",
    "The old teacher",
    "Every student",
    "The government",
    "My brother",
    "This company",
    "The doctor",
    "A young woman",
    "The children",
    "Most people",
    "The city council",
    "Her father",
    "The scientist",
]
_VERBS = [
    "decided to build",
    "wanted to find",
    "was able to see",
    "could not explain",
    "agreed to support",
    "started to write",
    "tried to understand",
    "planned to visit",
    "refused to sell",
    "helped to repair",
    "learned how to make",
    "forgot to bring",
]
_OBJECTS = [
    "a new house",
    "the answer",
    "an important letter",
    "the small bridge",
    "a better way",
    "the missing book",
    "some fresh water",
    "the evening train",
    "a long report",
    "the public library",
    "their first garden",
    "a simple machine",
]
_TAILS = [
    "before the winter came",
    "after a long discussion",
    "in the north of the country",
    "during the summer",
    "because it was necessary",
    "without telling anyone",
    "for the first time",
    "at the end of the year",
    "with great care",
    "in the morning",
]
_CONNECTIVES = [
    "However,",
    "Meanwhile,",
    "In addition,",
    "As a result,",
    "Later,",
    "Unfortunately,",
    "Of course,",
    "For example,",
    "Still,",
    "Finally,",
]
_QUESTIONS = [
    "Why did it happen?",
    "What would you do?",
    "Is that really true?",
    "How many were there?",
    "Where did they go?",
]


def prose_document(rng: random.Random) -> str:
    sentences = []
    for i in range(rng.randint(3, 9)):
        s = f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)} {rng.choice(_TAILS)}."
        if i and rng.random() < 0.3:
            s = f"{rng.choice(_CONNECTIVES)} {s[0].lower()}{s[1:]}"
        if rng.random() < 0.1:
            s += f" {rng.choice(_QUESTIONS)}"
        if rng.random() < 0.15:
            s += f" It cost {rng.randint(2, 2000)} dollars in {rng.randint(1900, 2024)}."
        sentences.append(s)
    paragraph = " ".join(sentences)
    return paragraph + ("\n\n" if rng.random() < 0.5 else "\n")


def corpus() -> list[str]:
    rng = random.Random(SEED)
    docs = [synthetic_document(SEED, i) for i in range(SYNTHETIC_DOCS)]
    docs += [prose_document(rng) for _ in range(PROSE_DOCS)]
    return docs


def train() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    return tok


def _check_out(path: str, check: bool) -> None:
    """Before the minutes of training: ``--check`` needs a readable file, writing a folder that
    exists or can be created."""
    if check:
        if not os.path.isfile(path):
            raise ValueError(f"--out {path} is not a file: --check compares with an existing tokenizer.json")
        return
    if os.path.isdir(path):
        raise ValueError(
            f"--out {path} is a folder: pass the file to write, e.g. {os.path.join(path, 'tokenizer.json')}"
        )
    probe = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe) or not os.access(probe, os.W_OK | os.X_OK):
        raise ValueError(f"--out {path} cannot be created ({probe} is not a writable folder): choose another path")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=DEFAULT_TOKENIZER_PATH)
    parser.add_argument("--check", action="store_true", help="compare with --out instead of writing")
    args = parser.parse_args(argv)
    # a bad --out (or one that cannot be read or written): one line, exit 2
    return run_command(lambda: _run(args), kinds=(ValueError, OSError))


def _run(args: argparse.Namespace) -> int:
    _check_out(args.out, args.check)
    tok = train()
    text = tok.to_str(pretty=True)
    if args.check:
        with open(args.out) as f:
            same = f.read() == text
        print(f"{args.out}: {'up to date' if same else 'OUT OF DATE - rerun without --check'}")
        return 0 if same else 1
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    atomic_write(args.out, text)  # an interrupted run leaves the old file
    print(
        f"wrote {args.out}: vocab_size={tok.get_vocab_size()} "
        f"special ids={[tok.token_to_id(t) for t in SPECIAL_TOKENS]}"
    )
    return 0
