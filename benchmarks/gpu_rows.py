"""The arithmetic of ``make bench-gpu``'s rows once measured: the ratios of tokens/s of each row
(``add_ratios``) and of float8 rows over bf16 rows (``add_float8_ratios``), issue 39's goals
evaluated on the rows (``GOALS``, ``evaluate_goals``, ``GOALS_COMMAND``: how to measure them;
``benchmarks/report.py`` reads them too), and the table printed to stdout (``print_table``).
"""

from __future__ import annotations

from benchmarks.gpu_torchtitan import TORCHTITAN_REF_RUNS


def _ratio(a: dict | None, b: dict | None) -> float | None:
    if not a or not b or "error" in a or "error" in b or not a.get("tokens_per_s") or not b.get("tokens_per_s"):
        return None
    return a["tokens_per_s"] / b["tokens_per_s"]


# what each reference is (--references), the row key it writes
REFERENCES = {
    "mixed": "bare_mixed",
    "bf16": "bare_bf16",
    "torchtitan_model": "torchtitan_model",
    "torchtitan_trainer": "torchtitan_trainer",
}
MEASURED = ("trainer", *REFERENCES.values())  # the row keys of measurements (a failure: "error")


def add_ratios(row: dict) -> None:
    """The row's ratios of tokens/s (None where a side is missing, failed or skipped)."""
    row["trainer_over_bare_mixed"] = _ratio(row["trainer"], row.get("bare_mixed"))
    row["trainer_over_bare_bf16"] = _ratio(row["trainer"], row.get("bare_bf16"))
    row["bare_bf16_over_torchtitan_model"] = _ratio(row.get("bare_bf16"), row.get("torchtitan_model"))
    row["ours_over_torchtitan_trainer"] = _ratio(row["trainer"], row.get("torchtitan_trainer"))


def add_float8_ratios(rows: list[dict]) -> None:
    """Each float8 row's tokens/s over the bf16 row of the same model, mask and mode (trainer and
    bare loops; None when that row was not run or failed)."""
    same = ("model", "flavor", "n_layers", "seq_len", "attn_mask_type", "compile")
    for row in rows:
        if row["case"]["precision"] != "float8":
            continue
        key = tuple(row["case"][k] for k in same)
        bf16 = next(
            (r for r in rows if r["case"]["precision"] == "bf16" and tuple(r["case"][k] for k in same) == key), None
        )
        row["float8_over_bf16"] = {
            kind: _ratio(row.get(kind), bf16.get(kind)) if bf16 is not None else None
            for kind in ("trainer", "bare_mixed", "bare_bf16")
            if kind in row
        }


# ------------------------------------------------------------------ goals (issue 39)

# (id, what, threshold): each measured on the four bf16 causal rows of the GPU shapes (both
# models, eager and compiled) of one or more runs that had these references
GOALS = [
    ("ours_over_torchtitan_trainer", "ours / torchtitan's trainer (tokens/s, same shapes, same call), each row", 1.05),
    ("trainer_over_bare_mixed", "trainer / mixed-precision bare loop (tokens/s), each row", 0.97),
    ("deepseek_compiled_over_eager", "DeepSeek-V3 trainer compiled / eager (tokens/s)", 1.10),
]
GOAL_ROWS = [(m, c) for m in ("llama3", "deepseek_v3") for c in (False, True)]
# how to measure the goals: here, then on the GPU machine (one call per model: each is 2 rows of
# the trainer and 4 references), then the report here
GOALS_COMMAND = (
    "here: `make bench-gpu-prepare`; on the GPU machine (carry `.gpu`), from the repository root: "
    "`python -m benchmarks.gpu --models llama3 --masks causal --precisions bf16 "
    "--out bench_results/gpu_issue39_llama3.json`, then the same with `--models deepseek_v3` and "
    "`--out bench_results/gpu_issue39_deepseek_v3.json` (on a lent device machine: `--out $OUT/...`, "
    "then copy both files into bench_results/ here); then `python -m benchmarks.report` here"
)


def _row_label(model: str, compiled: bool) -> str:
    return f"{model} {'compiled' if compiled else 'eager'}"


def evaluate_goals(rows: list[dict]) -> list[dict]:
    """:data:`GOALS` on ``rows`` (later rows of the same case replace earlier ones): per goal its
    threshold, the measured values by row and its status: ``met``, ``missed``, or ``UNMEASURED``
    when a value is missing (not run, failed, skipped)."""
    four: dict[tuple[str, bool], dict] = {}
    for r in rows:
        c = r["case"]
        shapes = TORCHTITAN_REF_RUNS.get(c["model"], (None, None))[:2]
        if (c["precision"], c["attn_mask_type"], c["device"]) == ("bf16", "causal", "cuda") and (
            c["flavor"],
            c["n_layers"],
        ) == shapes:
            four[(c["model"], c["compile"])] = r
    out = []
    for gid, what, threshold in GOALS:
        if gid == "deepseek_compiled_over_eager":
            eager, compiled = four.get(("deepseek_v3", False)), four.get(("deepseek_v3", True))
            value = _ratio(compiled["trainer"], eager["trainer"]) if eager and compiled else None
            measured = {"deepseek_v3": value}
        else:
            measured = {_row_label(*k): (four[k].get(gid) if k in four else None) for k in GOAL_ROWS}
        values = list(measured.values())
        if any(v is None for v in values):
            status = "UNMEASURED"
        else:
            status = "met" if all(v >= threshold for v in values) else "missed"
        out.append({"goal": gid, "what": what, "threshold": threshold, "status": status, "measured": measured})
    return out


# ------------------------------------------------------------------ the table


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


# (header, width, value of a row, format)
_COLUMNS = [
    ("trainer tok/s", 14, lambda r: r["trainer"].get("tokens_per_s"), ",.0f"),
    ("MFU%", 7, lambda r: r["trainer"].get("mfu_pct"), ".1f"),
    ("GiB", 7, lambda r: r["trainer"].get("peak_memory_gib"), ".1f"),
    ("mixed tok/s", 12, lambda r: r.get("bare_mixed", {}).get("tokens_per_s"), ",.0f"),
    ("tr/mixed", 9, lambda r: r.get("trainer_over_bare_mixed"), ".3f"),
    ("bf16 tok/s", 12, lambda r: r.get("bare_bf16", {}).get("tokens_per_s"), ",.0f"),
    ("tr/bf16", 9, lambda r: r.get("trainer_over_bare_bf16"), ".3f"),
    ("titan-tr tok/s", 15, lambda r: r.get("torchtitan_trainer", {}).get("tokens_per_s"), ",.0f"),
    ("ours/titan-tr", 14, lambda r: r.get("ours_over_torchtitan_trainer"), ".3f"),
    ("titan-model", 12, lambda r: r.get("torchtitan_model", {}).get("tokens_per_s"), ",.0f"),
    ("bf16/t-model", 13, lambda r: r.get("bare_bf16_over_torchtitan_model"), ".3f"),
    ("bf16 GEMM", 10, lambda r: r.get("bare_mixed", {}).get("matmul_bf16_share"), ".3f"),
    ("f8 GEMM", 8, lambda r: r.get("bare_mixed", {}).get("matmul_float8_share"), ".3f"),
    ("f8/bf16 tr", 11, lambda r: r.get("float8_over_bf16", {}).get("trainer"), ".3f"),
    ("plan/meas s", 12, lambda r: r.get("planner", {}).get("predicted_over_measured"), ".3f"),
    ("plan/meas GiB", 14, lambda r: r.get("planner", {}).get("memory_predicted_over_measured"), ".3f"),
]


def print_table(rows: list[dict]) -> None:
    header = f"{'case':<60}" + "".join(f"{h:>{w}}" for h, w, _v, _f in _COLUMNS)
    print(header)
    print("-" * len(header))
    for r in rows:
        print(f"{r['name']:<60}" + "".join(f"{_fmt(v(r), f):>{w}}" for _h, w, v, f in _COLUMNS))
    for r in rows:
        for kind in MEASURED:
            if "error" in r.get(kind, {}):
                print(f"\n{r['name']} / {kind} failed:\n{r[kind]['error']}")
    skipped = {r[kind]["skipped"] for r in rows for kind in MEASURED if "skipped" in r.get(kind, {})}
    for reason in sorted(skipped):
        print(f"skipped: {reason}")
