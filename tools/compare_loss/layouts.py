"""Layouts: their syntax, parsing and validation, all before anything runs.

Layout syntax: comma-separated ``key=value`` over the ``[parallelism]`` degrees ``dp_replicate,
dp_shard (alias fsdp), cp, tp, pp, ep, etp`` (the long config names work too), plus ``nproc=N``
for the process count. Unspecified degrees are 1 -- including ``dp_shard``, so that a layout
string says everything that runs and ``nproc`` defaults to ``dp_replicate*dp_shard*cp*tp*pp``;
``dp_shard=-1`` infers it from an explicit ``nproc``. ``ep`` and ``etp`` add no processes (experts
fold over the dp_shard*cp*tp ranks). ``1`` or ``single`` is one process; ``NAME:SPEC`` names a
layout. The first layout is the baseline unless ``--baseline`` names another.

The keys come from ``parallel_dims/axes.py`` (AXES, DEGREE_NAMES, PROCESS_AXES); a layout that
cannot run raises :class:`UsageError` (exit status 2).
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass

from parallel_dims import validate_degrees
from parallel_dims.axes import AXES, DEGREE_NAMES, PROCESS_AXES
from trainer.config import PARALLELISM_ALIASES

DEGREE_KEYS = DEGREE_NAMES
# PROCESS_AXES (parallel_dims/axes.py): the degrees that multiply into the process count; ep
# and etp fold over dp_shard*cp*tp. Layout keys also accept each axis' aliases and config key.
KEY_ALIASES = {
    **{alias: a.name for a in AXES for alias in a.layout_aliases},
    **{a.config_key: a.name for a in AXES},
}
LAYOUT_KEYS = DEGREE_KEYS + ("nproc",)
SINGLE_PROCESS = ("1", "single")
# how a layout's ranks start (--launcher): torchrun, or forked from a server that imported torch
# and the trainer once (tools/forkserver.py; one host)
LAUNCHERS = ("torchrun", "fork")

# Config keys each run gets from this tool; setting them after `--` would silently fight it.
CONTROLLED_KEYS = {
    **{f"parallelism.{long}": "the layout strings (--layouts)" for long in PARALLELISM_ALIASES.values()},
    "training.steps": "--steps",
    "job.dump_folder": "--out",
    "metrics.log_freq": "compare_loss (every step is logged)",
    "metrics.enable_jsonl": "compare_loss (the comparison reads metrics.jsonl)",
    "checkpoint.enable": "compare_loss (runs do not save checkpoints)",
    "checkpoint.initial_load_path": "--seed-checkpoint (or the seed checkpoint compare_loss creates)",
    "checkpoint.create_seed_checkpoint": "compare_loss",
    "comm.mode": "--comm-mode (default or local_tensor; a fake-backend run's losses are meaningless)",
    "comm.fake_world_size": "compare_loss (--comm-mode local_tensor simulates the layout's ranks)",
}


class UsageError(ValueError):
    """Bad command line or a layout that cannot run: reported before any run starts (exit 2)."""


@dataclass(frozen=True)
class Layout:
    """One parallelism layout to train under. ``degrees`` are resolved (dp_shard never -1)."""

    name: str
    degrees: dict[str, int]
    nproc: int

    def train_args(self) -> list[str]:
        """Every degree explicitly, so nothing is inherited from the TOML (its dp_shard=-1 would
        otherwise silently absorb a typo in the layout)."""
        return [arg for k in DEGREE_KEYS for arg in (f"--parallelism.{k}", str(self.degrees[k]))]

    def describe(self) -> str:
        shown = [f"{k}={v}" for k, v in self.degrees.items() if v != 1]
        return f"{', '.join(shown) or 'no parallelism'}; {self.nproc} process{'es' if self.nproc > 1 else ''}"


def _canonical_key(key: str, spec: str) -> str:
    key = key.strip()
    if key in LAYOUT_KEYS:
        return key
    if key in KEY_ALIASES:
        return KEY_ALIASES[key]
    known = list(LAYOUT_KEYS) + list(KEY_ALIASES)
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.5)
    close = close or [k for k in known if key and k.startswith(key)][:1]  # 'tensor' -> tp
    if close:
        # suggest the short spelling: a near-miss of a long config name gets its alias
        suggestion = close[0] if close[0] in LAYOUT_KEYS or close[0] == "fsdp" else KEY_ALIASES[close[0]]
        hint = f"did you mean '{suggestion}'?"
    else:
        hint = f"valid keys: {', '.join(LAYOUT_KEYS)} (fsdp = dp_shard)"
    raise UsageError(f"layout '{spec}': unknown key '{key}'; {hint}")


def parse_layout(text: str) -> Layout:
    """``[NAME:]key=value,...``, ``1`` or ``single`` -> a validated :class:`Layout`."""
    name, sep, spec = text.partition(":")
    if not sep:
        name, spec = text, text
    name, spec = name.strip(), spec.strip()
    if not spec:
        raise UsageError(f"layout '{text}' is empty; write e.g. 'fsdp=4' or 'single'")
    if not name:
        raise UsageError(f"layout '{text}': empty name before ':'")
    values: dict[str, int] = {}
    if spec.lower() not in SINGLE_PROCESS:
        for item in spec.split(","):
            key, eq, value = item.partition("=")
            if not eq:
                raise UsageError(f"layout '{text}': '{item}' is not key=value (e.g. tp=2)")
            key = _canonical_key(key, text)
            if key in values:
                raise UsageError(f"layout '{text}': {key} is given twice (fsdp is an alias of dp_shard)")
            try:
                values[key] = int(value.strip())
            except ValueError:
                raise UsageError(f"layout '{text}': {key}={value.strip()!r} is not an integer") from None
    degrees = {k: values.get(k, 1) for k in DEGREE_KEYS}
    product = math.prod(degrees[k] for k in PROCESS_AXES)
    if "nproc" in values:
        nproc = values["nproc"]
        if nproc < 1:
            raise UsageError(f"layout '{text}': nproc={nproc} must be >= 1")
    elif degrees["dp_shard"] == -1:
        raise UsageError(f"layout '{text}': dp_shard=-1 infers the degree from the process count; add nproc=N")
    else:
        # a degree < 1 makes the product meaningless; validate_degrees then names that degree
        nproc = max(product, 1)
    try:
        resolved = validate_degrees(**degrees, world_size=nproc)
    except ValueError as exc:
        given = f" (nproc={nproc})" if "nproc" in values else ""
        raise UsageError(f"layout '{text}'{given}: {exc}") from None
    return Layout(name=name, degrees={k: getattr(resolved, k) for k in DEGREE_KEYS}, nproc=nproc)


def parse_layouts(texts: Iterable[str]) -> list[Layout]:
    """Parse all layouts; repeated names (e.g. the same layout twice for --assert-equal) get
    '#2', '#3' so every run has its own row and folder."""
    layouts, seen = [], {}
    for text in texts:
        layout = parse_layout(text)
        seen[layout.name] = seen.get(layout.name, 0) + 1
        if seen[layout.name] > 1:
            layout = dataclasses.replace(layout, name=f"{layout.name}#{seen[layout.name]}")
        layouts.append(layout)
    if not layouts:
        raise UsageError("give at least one layout")
    return layouts


def pick_baseline(layouts: list[Layout], name: str | None) -> Layout:
    if name is None:
        return layouts[0]
    for layout in layouts:
        if layout.name == name:
            return layout
    names = [l.name for l in layouts]
    close = difflib.get_close_matches(name, names, n=1, cutoff=0.5)
    hint = f"did you mean '{close[0]}'? " if close else ""
    raise UsageError(f"--baseline '{name}' is not one of the layouts; {hint}layouts: {', '.join(names)}")


def check_extra_overrides(extra: list[str]) -> None:
    """Refuse overrides after `--` that the tool sets itself, instead of letting one side win."""
    for arg in extra:
        if not arg.startswith("--"):
            continue
        name = arg[2:].partition("=")[0]
        if name in ("config", "job.config_file"):
            raise UsageError(f"'{arg}' after '--': pass the config as compare_loss --config")
        section, _, key = name.partition(".")
        if section == "parallelism":
            key = PARALLELISM_ALIASES.get(key, key)
        full = f"{section}.{key}"
        if full in CONTROLLED_KEYS:
            raise UsageError(f"'{arg}' after '--': {full} is set by {CONTROLLED_KEYS[full]}; remove it")


def slug(name: str) -> str:
    """A layout name as a folder name."""
    return re.sub(r"[^A-Za-z0-9_.#-]+", "_", name.replace("=", "")).strip("_") or "run"


@dataclass
class Plan:
    """What every run shares; ``run_argv`` adds one layout's degrees and folder."""

    config: str
    steps: int
    out: str
    extra: list[str]
    seed_checkpoint: str
    comm_mode: str = "default"  # or "local_tensor": every rank of a layout in one process
    launcher: str = "torchrun"  # or "fork" (LAUNCHERS); real ranks only, so comm_mode "default"

    def launch_args(self, layout: Layout) -> list[str]:
        """How a run of ``layout`` joins its ranks: real processes (torchrun, ``default``) or
        all of them simulated in one process (``local_tensor``: comm.fake_world_size = nproc)."""
        if self.comm_mode == "local_tensor":
            return ["--comm.mode", "local_tensor", "--comm.fake_world_size", str(layout.nproc)]
        return ["--comm.mode", "default"]

    def run_folder(self, index: int, layout: Layout) -> str:
        return os.path.join(self.out, f"{index:02d}-{slug(layout.name)}")

    def run_argv(self, layout: Layout, dump_folder: str) -> list[str]:
        return (
            ["--config", self.config]
            + layout.train_args()
            + [
                "--training.steps",
                str(self.steps),
                "--metrics.log_freq",
                "1",
                "--metrics.enable_jsonl",
                "true",
                *self.launch_args(layout),
                "--checkpoint.enable",
                "false",
                "--checkpoint.initial_load_path",
                self.seed_checkpoint,
                "--job.dump_folder",
                dump_folder,
            ]
            + self.extra
        )


def preflight(plan: Plan, layouts: list[Layout]) -> None:
    """Every check train.py would make before its first collective, for every layout, now:
    config and override errors, degrees vs the model (heads % tp, experts % ep, seq_len vs cp*tp,
    layers vs pp) and vs the batch (global batch % batch degree * local batch). ``plan`` gives
    each run's train.py argv (:meth:`Plan.run_argv`)."""
    from trainer.config import load_config
    from trainer.data.tokenizer import load_tokenizer
    from trainer.plan import plan_job

    try:  # the TOML and the overrides after `--` on their own, so their errors read as such
        base = load_config(["--config", plan.config, *plan.extra])
    except ValueError as exc:
        raise UsageError(f"config {plan.config} with overrides {' '.join(plan.extra) or '(none)'}: {exc}") from None
    if base.training.global_batch_size == -1:
        raise UsageError(
            "training.global_batch_size = -1 means local_batch_size x batch degree, a different global "
            "batch for each layout, so the losses would not be comparable; set it, e.g. "
            f"-- --training.global_batch_size {base.training.local_batch_size * 4}"
        )
    if base.validation.enable and base.validation.global_batch_size == -1:
        raise UsageError(
            "validation.global_batch_size = -1 means validation.local_batch_size x batch degree, a "
            "different validation set for each layout, so the validation losses would not be "
            "comparable; set it, e.g. -- --validation.global_batch_size "
            f"{base.validation.local_batch_size * 4}"
        )
    try:
        tokenizer = load_tokenizer(base.model.tokenizer_path)
    except ValueError as exc:
        raise UsageError(f"config {plan.config}: {exc}") from None
    for layout in layouts:
        try:
            # the trainer's own job plan: every check train.py makes before any process group
            cfg = load_config(plan.run_argv(layout, os.path.join(plan.out, "preflight")))
            plan_job(cfg, layout.nproc, tokenizer.vocab_size, tokenizer_eos=tokenizer.eos_id)
        except ValueError as exc:
            raise UsageError(f"layout '{layout.name}' ({layout.describe()}): {exc}") from None
