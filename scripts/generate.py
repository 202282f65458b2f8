"""Generate from a checkpoint on the training mesh.

    python scripts/generate.py --config X --checkpoint DIR --prompt "..." [--prompt "..."]
        [--prompts_file F] [--chat] [--max_new_tokens N] [--temperature T] [--top_p P]
        [--seed S] [--stop STR] [--no_cache] [--output F.jsonl] [--section.key value ...]

``DIR``: a step folder of a run (``<dump_folder>/checkpoint/step-N``; LoRA runs: their
adapters, on the base the config names), the run's checkpoint folder (its newest step), or a
Hugging Face folder. The model is built and parallelized as the config's ``[parallelism]`` says
(``--parallelism.tp 2`` ...; pp and cp are refused), on as many processes as train.py would
run: torchrun's flags (``--nproc_per_node N`` ...) start the workers through the trainer's
launcher (trainer/lifecycle/launch.py), which checks the job before any starts; plain
``python scripts/generate.py`` is one process; torchrun runs it as it runs train.py.

Prompts: every ``--prompt``, then ``--prompts_file`` (one prompt a line, or JSONL with
``"prompt"`` (text) or ``"messages"`` (a chat) per line). ``--chat`` renders text prompts as one
user message through the model's chat template (``messages`` always are). Text is encoded as
the tokenizer encodes it (no BOS added). Rank 0 prints each completion, and with ``--output``
writes one JSON line per prompt (``prompt``, ``completion``, ``prompt_tokens``, ``tokens``).
Bad input (flags, config, checkpoint, prompts) is one ``error:`` line and exit code 2.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# as train.py: a Ctrl-C while torch imports is one line; a launcher's worker ends with it
from trainer.lifecycle.start_signals import quiet_start

quiet_start()

from trainer.lifecycle.parent_death import die_with_launcher  # noqa: E402

die_with_launcher()

import argparse  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402

gc.disable()  # the imports' objects go to the permanent generation, as in train.py
try:
    from trainer.config import load_config
    from trainer.inference.session import InferenceSession
    from trainer.lifecycle.script import UsageError, rank, run_script, script_parser
finally:
    gc.freeze()
    gc.enable()

SCRIPT = os.path.abspath(__file__)


def build_parser() -> argparse.ArgumentParser:
    p = script_parser(
        "python scripts/generate.py",
        "Generate from a checkpoint on the training mesh; config keys as --section.key, "
        "torchrun's flags start the workers.",
    )
    p.add_argument("--checkpoint", required=True, help="step-N folder, checkpoint folder, or Hugging Face folder")
    p.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    p.add_argument("--prompts_file", default="", help="prompts, one a line, or JSONL with 'prompt' or 'messages'")
    p.add_argument("--chat", action="store_true", help="render text prompts through the chat template")
    p.add_argument("--max_new_tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p.add_argument("--top_p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stop", action="append", default=[], help="a stop string, cut from the output (repeatable)")
    p.add_argument("--no_cache", action="store_true", help="run every token's forward over the whole sequence")
    p.add_argument("--output", default="", help="JSONL file of the completions (rank 0 writes it)")

    return p


def read_prompts(ns) -> list[dict]:
    """Every prompt as ``{"prompt": text}`` or ``{"messages": [...]}``."""
    items = [{"prompt": text} for text in ns.prompt]
    if ns.prompts_file:
        if not os.path.isfile(ns.prompts_file):
            raise UsageError(f"--prompts_file {ns.prompts_file} does not exist")
        with open(ns.prompts_file, encoding="utf-8") as f:
            lines = [line.rstrip("\n") for line in f]
        jsonl = ns.prompts_file.endswith(".jsonl")
        for n, line in enumerate(lines, 1):
            if not line.strip():
                continue
            if not jsonl:
                items.append({"prompt": line})
                continue
            try:
                row = json.loads(line)
            except ValueError as exc:
                raise UsageError(f"{ns.prompts_file} line {n} is not JSON ({exc})") from None
            if not isinstance(row, dict) or not ({"prompt", "messages"} & row.keys()):
                raise UsageError(f"{ns.prompts_file} line {n} needs a 'prompt' (text) or 'messages' (a chat)")
            items.append({"messages": row["messages"]} if "messages" in row else {"prompt": str(row["prompt"])})
    if not items:
        raise UsageError("no prompt: give --prompt TEXT or --prompts_file F")
    return items


def encode(session: InferenceSession, item: dict, chat: bool) -> list[int]:
    if "messages" in item:
        return session.render_chat(item["messages"])
    if chat:
        return session.render_chat([{"role": "user", "content": item["prompt"]}])
    return session.tokenizer.encode(item["prompt"])


def check_job(ns, cfg, world_size: int) -> None:
    """The launcher's check before any worker starts: the prompts, the checkpoint and the
    layout (trainer/inference/loading.py ``preflight``)."""
    from parallel_dims import default_device_type
    from trainer.inference.loading import preflight

    read_prompts(ns)
    preflight(cfg, ns.checkpoint, world_size, default_device_type())


def generate(ns, config_args: list[str]) -> int:
    """Build the session, generate; rank 0 prints (and writes ``--output``)."""
    cfg = load_config(config_args)
    items = read_prompts(ns)
    session = InferenceSession.from_checkpoint(cfg, ns.checkpoint)
    prompts = [encode(session, item, ns.chat) for item in items]
    outs = session.generate(
        prompts,
        ns.max_new_tokens,
        temperature=ns.temperature,
        top_p=ns.top_p,
        seed=ns.seed,
        stop_strings=ns.stop,
        use_cache=not ns.no_cache,
    )
    if rank() != 0:
        return 0
    rows = []
    for item, prompt, out in zip(items, prompts, outs):
        text = session.tokenizer.decode(out)
        shown = item.get("prompt", json.dumps(item.get("messages"), ensure_ascii=False))
        print(f"--- prompt: {shown}\n{text}", flush=True)
        rows.append({**item, "completion": text, "prompt_tokens": prompt, "tokens": out})
    if ns.output:
        with open(ns.output, "w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
        print(f"wrote {len(rows)} completions to {ns.output}", flush=True)
    return 0


def main(argv: list[str]) -> int:
    return run_script(argv, build_parser(), script=SCRIPT, check_flags=read_prompts, check_job=check_job, run=generate)


if __name__ == "__main__":
    code = main(sys.argv[1:])
    sys.exit(code)
