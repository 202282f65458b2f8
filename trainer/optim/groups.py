"""Parameter groups: which optimizer and which hyperparameters each parameter gets.

``[[optimizer.param_groups]]`` tables are tried in order against each parameter's canonical FQN
(wrapper components such as ``_checkpoint_wrapped_module`` dropped; the names after float8
conversion and parallelization, which keep the model's names); the first whose ``pattern``
``re.search``-es the name wins. Parameters no table matches form the default groups:

- AdamW: weight decay ``optimizer.weight_decay`` for matrices (>= 2-D), none for 1-D parameters
  (norm scales, biases), because shrinking a norm scale towards 0 fights the normalisation it
  implements. A table's ``weight_decay`` applies to every parameter the table matches.
- Muon (``optimizer.name = "Muon"``): every >= 2-D parameter except the embedding and the output
  head (the decoder shell's ``tok_embeddings`` and ``output``: Muon's orthogonalised update is
  for hidden matrices, Jordan et al. and Moonlight keep AdamW for those two); a table's
  ``optimizer`` key routes its parameters either way (Muon only takes >= 2-D parameters).

A table's ``lr_mult`` scales ``optimizer.lr`` (the schedule multiplies the product); its
``betas``/``eps`` replace AdamW's. The grouping (each table's pattern and optimizer, and the
optimizer's name) is part of the optimizer's checkpoint (:data:`GROUPING_KEY`), and a resume
whose grouping differs is refused (:func:`check_grouping`); the hyperparameters themselves come
from the config on resume, as the learning rate does.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "GROUPING_KEY",
    "GroupChoice",
    "check_grouping",
    "check_patterns",
    "choose",
    "grouping_signature",
    "is_hidden_matrix",
    "summary_lines",
]

# the key of the grouping in Optimizers.state_dict() (and "optimizer.<key>" in a checkpoint)
GROUPING_KEY = "meshtrain_param_grouping"
_OUTER = ("tok_embeddings", "output")  # the decoder shell's embedding and head (models/common/decoder.py)


@dataclass(frozen=True)
class GroupChoice:
    """What one parameter gets: its table (``index`` -1 = no table matched), optimizer and
    hyperparameters (``weight_decay`` resolved for this parameter)."""

    index: int
    optimizer: str
    lr_mult: float
    weight_decay: float
    betas: tuple[float, float]
    eps: float

    @property
    def name(self) -> str:
        return "default" if self.index < 0 else f"param_groups[{self.index}]"


def is_hidden_matrix(fqn: str, ndim: int) -> bool:
    """What Muon takes by default: >= 2-D parameters outside the embedding and the head."""
    return ndim >= 2 and fqn.split(".", 1)[0] not in _OUTER


def _match(fqn: str, tables: Sequence[dict[str, Any]]) -> int:
    for i, t in enumerate(tables):
        if re.search(t["pattern"], fqn):
            return i
    return -1


def choose(fqn: str, ndim: int, cfg: Any) -> GroupChoice:
    """The group of parameter ``fqn`` (``ndim`` dimensions) under the optimizer section ``cfg``."""
    i = _match(fqn, cfg.param_groups)
    table = cfg.param_groups[i] if i >= 0 else {}
    default_opt = "Muon" if cfg.name == "Muon" and is_hidden_matrix(fqn, ndim) else "AdamW"
    optimizer = table.get("optimizer", default_opt)
    if optimizer == "Muon" and ndim < 2:
        raise ValueError(
            f"optimizer.param_groups[{i}] (pattern {table['pattern']!r}) routes {fqn} ({ndim}-D) to Muon, "
            "which orthogonalises matrices only: narrow the pattern or route the group to AdamW"
        )
    decay = table.get("weight_decay", cfg.weight_decay if ndim >= 2 else 0.0)
    betas = tuple(table.get("betas", cfg.betas))
    return GroupChoice(i, optimizer, table.get("lr_mult", 1.0), decay, betas, table.get("eps", cfg.eps))


def check_patterns(fqns: Iterable[str], cfg: Any, frozen: Iterable[str] = ()) -> None:
    """Every table must get at least one trainable parameter of the whole model (all pipeline
    stages, after the converters): one that matches no name, only frozen ones (``frozen``: the
    base of a LoRA model), or whose every match an earlier table took, is an error naming it."""
    fqns, frozen = list(fqns), list(frozen)
    taken = {_match(f, cfg.param_groups) for f in fqns}
    for i, t in enumerate(cfg.param_groups):
        if i in taken:
            continue
        if any(re.search(t["pattern"], f) for f in fqns):
            why = "every parameter it matches is taken by an earlier group (the first match wins)"
        elif any(re.search(t["pattern"], f) for f in frozen):
            why = (
                f"it matches frozen parameters only (model.converters froze them; the trainable ones look like "
                f"{', '.join(fqns[:3])})"
            )
        else:
            why = f"it matches no parameter (names look like {', '.join(fqns[:3])})"
        raise ValueError(
            f"optimizer.param_groups[{i}].pattern {t['pattern']!r}: {why}; fix the pattern or drop the group"
        )


def _numel(shape: Sequence[int]) -> int:
    numel = 1
    for d in shape:
        numel *= d
    return numel


def summary_lines(
    params: Iterable[tuple[str, Sequence[int]]], cfg: Any, frozen: Iterable[tuple[str, Sequence[int]]] = ()
) -> list[str]:
    """One start-up log line per group of the whole model (``params``: FQN and global shape of
    every trainable parameter): its pattern, optimizer, parameter count (tensors and elements),
    lr and weight decay; then, when some are frozen (``frozen``), one line counting them."""
    stats: dict[tuple[int, str, float], list[int]] = {}
    for fqn, shape in params:
        c = choose(fqn, len(shape), cfg)
        numel = _numel(shape)
        s = stats.setdefault((c.index, c.optimizer, c.weight_decay), [0, 0, c.lr_mult])
        s[0] += 1
        s[1] += numel
    lines = []
    for (index, opt, wd), (tensors, numel, mult) in sorted(stats.items(), key=lambda kv: (kv[0][0] < 0, kv[0])):
        pattern = f" {cfg.param_groups[index]['pattern']!r}" if index >= 0 else ""
        name = "default" if index < 0 else f"param_groups[{index}]"
        lines.append(
            f"optimizer group {name}{pattern}: {opt}, {tensors} tensors, {numel:,} parameters, "
            f"lr {cfg.lr * mult:g} (x{mult:g}), weight_decay {wd:g}"
        )
    frozen = list(frozen)
    if frozen:
        trained = sum(s[1] for s in stats.values())
        lines.append(
            f"optimizer: {trained:,} trainable parameters in the groups above; {len(frozen)} frozen tensors, "
            f"{sum(_numel(s) for _, s in frozen):,} parameters, in no group (model.converters)"
        )
    return lines


def grouping_signature(cfg: Any) -> str:
    """The grouping as one string (the optimizer, each table's pattern and optimizer routing):
    equal on every rank and layout, so DCP stores it once and a resume on any layout reads it."""
    tables = [{"pattern": t["pattern"], "optimizer": t.get("optimizer", "")} for t in cfg.param_groups]
    return json.dumps({"optimizer": cfg.name, "groups": tables}, sort_keys=True)


# what a checkpoint written before parameter groups existed holds: plain AdamW
LEGACY_SIGNATURE = json.dumps({"optimizer": "AdamW", "groups": []}, sort_keys=True)


def check_grouping(saved: str | None, current: str) -> None:
    """Refuse a resume whose grouping differs from the checkpoint's, in one line."""
    saved = LEGACY_SIGNATURE if saved is None else saved
    if saved == current:
        return
    raise ValueError(
        f"the checkpoint's optimizer state was saved with another parameter grouping ({_brief(saved)}) than "
        f"this config's ({_brief(current)}): restore the grouping, or set checkpoint.exclude_from_loading = "
        '["optimizer"] to start the optimizer state fresh'
    )


def _brief(signature: str) -> str:
    s = json.loads(signature)
    groups = ", ".join(f"{g['pattern']!r}" + (f"->{g['optimizer']}" if g["optimizer"] else "") for g in s["groups"])
    return f"{s['optimizer']}; groups [{groups}]"
