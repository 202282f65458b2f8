"""Tokenize a corpus once into token shards that training reads by address
(``--training.dataset tokens --training.dataset_path OUT``).

    python scripts/tokenize_dataset.py INPUT... --out DIR [--tokenizer PATH] [--workers N]
                                       [--shard-tokens N] [--kind auto|text|jsonl|hf]
                                       [--text-field text] [--split train]
                                       [--text-documents file|blank_line|line] [--verify]
    python scripts/tokenize_dataset.py --verify --out DIR     # check a finished folder

INPUT: .txt / .jsonl files or folders (read exactly as training.dataset = text / jsonl reads
them, so the tokens equal the streaming path's; --text-documents as training.text_documents), local Hugging Face datasets (a save_to_disk
folder, or .parquet / .arrow / .json files or folders), or synthetic:SEED:DOCS (the first DOCS
documents of the built-in corpus for training.seed = SEED). Inputs are concatenated in the
order given. --tokenizer takes model.tokenizer_path's values ('' = the shipped tokenizer).

Progress goes to stderr. An interrupted run resumes when rerun with the same arguments; the
folder has index.json only once it is complete. Bad input: one line on stderr, exit code 2.
The format is described in trainer/data/token_shards.py.
"""

from __future__ import annotations

import argparse
import sys

from tools.tokenize.writer import DEFAULT_SHARD_TOKENS, tokenize_to_shards, verify_folder
from trainer.config.schema import TEXT_DOCUMENTS
from trainer.runtime.cli_errors import run_command


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="tokenize_dataset.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("inputs", nargs="*", metavar="INPUT", help="files, folders or synthetic:SEED:DOCS, in order")
    p.add_argument("--out", required=True, help="output folder (created; an unfinished one is resumed)")
    p.add_argument("--tokenizer", default="", help="as model.tokenizer_path: '' (shipped), 'bytes', a file or folder")
    p.add_argument("--workers", type=int, default=0, help="tokenizer processes (default: every usable core)")
    p.add_argument("--shard-tokens", type=int, default=DEFAULT_SHARD_TOKENS, help="tokens per shard")
    p.add_argument("--kind", default="auto", choices=("auto", "text", "jsonl", "hf", "synthetic"))
    p.add_argument("--text-field", default="text", help="column holding the text (Hugging Face inputs)")
    p.add_argument("--split", default="train", help="split of a Hugging Face DatasetDict folder")
    p.add_argument(
        "--text-documents",
        default="file",
        choices=TEXT_DOCUMENTS,
        help="what one document of a .txt input is, as training.text_documents: the whole file (default), "
        "paragraphs between blank lines, or each line",
    )
    p.add_argument("--verify", action="store_true", help="check every shard's sha256 (reads everything)")
    args = p.parse_args(argv)
    if not args.inputs and not args.verify:
        p.error("give one or more INPUTs, or --verify --out DIR to check a finished folder")

    def run() -> None:
        if not args.inputs:
            verify_folder(args.out)
            return
        tokenize_to_shards(
            args.inputs,
            args.out,
            tokenizer_path=args.tokenizer,
            workers=args.workers,
            shard_tokens=args.shard_tokens,
            kind=args.kind,
            text_field=args.text_field,
            split=args.split,
            text_documents=args.text_documents,
            verify=args.verify,
        )

    try:  # bad input, config or output folder (OSError included): one line, exit 2
        return run_command(run, kinds=(ValueError, OSError))
    except KeyboardInterrupt:
        print("interrupted: rerun the same command to resume", file=sys.stderr)
        return 130
