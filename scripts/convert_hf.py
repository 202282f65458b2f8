"""Convert weights between Hugging Face folders and our DCP checkpoints, offline, one process.

    python scripts/convert_hf.py to-dcp HF_DIR OUT_DIR [--model llama3] [--flavor 8B]
    python scripts/convert_hf.py to-hf DCP_STEP_DIR OUT_DIR [--model llama3] [--flavor 8B | --hf-config HF_DIR]
    python scripts/convert_hf.py lora-peft STEP_DIR OUT_DIR [--model llama3] [--flavor 8B | --hf-config HF_DIR]
    python scripts/convert_hf.py lora-merge STEP_DIR OUT_DIR [--flavor 8B | --hf-config HF_DIR] [--base DIR]

``lora-peft`` / ``lora-merge`` read a LoRA run's step checkpoint (adapters, options, the base's
identity; trainer/checkpoint/lora_offline.py) and write a PEFT adapter folder, or the base with
the adapters merged as a Hugging Face folder (the base from the folder the run recorded, or
``--base``, its fingerprint checked).

The model's sizes: ``--hf-config`` (a model sized by a config.json, any size), else ``--flavor``
(with the run's overrides), else the record every step checkpoint of a run holds (model, args,
the Hugging Face folder it started from, its tokenizer: trainer/checkpoint/hf_extras.py), else
(``to-hf`` only) the flavor inferred from the stored shapes. Every Hugging Face folder written
holds the tokenizer files (``--tokenizer``, default the run's), a generation_config.json and the
config.json fields of the folder the run started from (or of ``--hf-config``).

``to-dcp`` reads a Hugging Face folder (config.json + model.safetensors, or
model.safetensors.index.json + shards) and writes a DCP folder that
``--checkpoint.initial_load_path OUT_DIR`` accepts (model weights only, float32 like our master
weights). Without ``--flavor`` every size comes from config.json, whatever it is (each field the
model reads is checked, each field it does not model refused by name); without ``--model`` the
model is the one that loads config.json's architecture. With ``--flavor`` config.json is checked
against the flavor. All before any weight is read. Tensors are converted one at a time as DCP
writes them (about one tensor in memory; the safetensors files are memory-mapped).

``to-hf`` reads the model weights of a DCP folder (a run's ``checkpoint/step-N`` or a to-dcp
output) and writes a folder ``transformers.AutoModelForCausalLM.from_pretrained`` loads:
config.json, sharded safetensors (``--max-shard-size``) with an index. The sizes come from
``--hf-config`` (a Hugging Face folder or config.json: a model trained with ``model.flavor =
'hf'``), else the flavor, inferred from the stored shapes when ``--flavor`` is omitted. It holds
one layer (ours and Hugging Face's) plus one shard file's tensors in memory at a time.

``--n-layers``, ``--vocab-size``, ``--mtp-layers`` and ``--max-seq-len`` are the overrides a run may have used
(``model.n_layers``, ``model.vocab_size``, ``training.seq_len`` longer than the flavor's
``max_seq_len``, which decides DeepSeek's YaRN in config.json; ``model.mtp_layers``, by default
the DeepSeek-V3 MTP layers the folder stores (of config.json's ``num_nextn_predict_layers``), so
they come along; ``--mtp-layers 0`` drops them).

Progress goes to stderr. Bad input is one ``error:`` line on stderr, exit code 2, and nothing is
written (OUT_DIR is created only when the conversion completes: the work happens in
``OUT_DIR.tmp``).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from models.registry import HF_FLAVOR, flavor_names, get_model_spec, model_for_hf_config, model_names
from trainer.checkpoint.convert import convert_hf_to_dcp
from trainer.checkpoint.hf_format import DEFAULT_MAX_SHARD_BYTES, parse_size, read_hf_config
from trainer.checkpoint.hf_reader import open_hf_checkpoint
from trainer.checkpoint.hf_write import dcp_model_meta, export_dcp_to_hf
from trainer.runtime.cli_errors import run_command


class UsageError(ValueError):
    """Bad input: printed as one line, exit code 2."""


def _progress(start: float):
    def say(msg: str) -> None:
        print(f"[{time.monotonic() - start:7.1f}s] {msg}", file=sys.stderr, flush=True)

    return say


def _adapter_cls(model: str):
    cls = get_model_spec(model, flavor_names(model)[0]).hf_state_dict_adapter
    if cls is None:
        raise UsageError(f"model {model!r} has no Hugging Face adapter; models with one: {_hf_models()}")
    return cls


def _hf_models() -> str:
    return ", ".join(m for m in model_names() if get_model_spec(m, flavor_names(m)[0]).hf_state_dict_adapter)


def _args(model: str, flavor: str, ns: argparse.Namespace, **extra):
    spec = get_model_spec(model, flavor)
    overrides = dict(extra)
    if ns.n_layers is not None:
        overrides["n_layers"] = ns.n_layers
    if ns.vocab_size is not None:
        overrides["vocab_size"] = ns.vocab_size
    if getattr(ns, "mtp_layers", None) is not None:
        if not any(f.name == "mtp_layers" for f in dataclasses.fields(spec.args)):
            raise UsageError(f"--mtp-layers: multi-token prediction is a DeepSeek-V3 feature; {model} has none")
        overrides["mtp_layers"] = ns.mtp_layers
    if ns.max_seq_len is not None:
        overrides["max_seq_len"] = max(spec.args.max_seq_len, ns.max_seq_len)
    args = dataclasses.replace(spec.args, **overrides)
    try:
        args.validate()
    except ValueError as exc:
        raise UsageError(f"{model}/{flavor} with overrides {overrides}: {exc}") from None
    return args


def _derived_spec(model: str, config: dict, where: str):
    """Model ``model`` with every size from ``config`` (flavor 'hf'), or one UsageError line."""
    try:
        return get_model_spec(model, HF_FLAVOR, config)
    except ValueError as exc:
        raise UsageError(f"{where}: {exc}") from None


def _check_model_and_flavor(ns) -> None:
    if ns.flavor == HF_FLAVOR:
        ns.flavor = None  # the same as no flavor: sizes from config.json
    if ns.model not in model_names():
        raise UsageError(f"unknown --model {ns.model!r}; choose one of {', '.join(model_names())}")
    if ns.flavor is not None and ns.flavor not in flavor_names(ns.model):
        raise UsageError(
            f"unknown --flavor {ns.flavor!r} for {ns.model}; choose one of {', '.join(flavor_names(ns.model))}"
        )


def _check_out_dir(out_dir: str) -> None:
    """OUT_DIR must not exist (or be an empty folder) and its parent must be writable."""
    out = os.path.abspath(out_dir)
    if os.path.exists(out) and not (os.path.isdir(out) and not os.listdir(out)):
        raise UsageError(f"OUT_DIR {out_dir} already exists and is not empty: choose a new folder or delete it")
    parent = os.path.dirname(out)
    probe = parent
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe) or not os.access(probe, os.W_OK | os.X_OK):
        raise UsageError(f"OUT_DIR {out_dir} cannot be created ({probe} is not a writable folder): choose another")


def to_dcp(ns) -> str:
    if ns.model is not None:
        _check_model_and_flavor(ns)
        _adapter_cls(ns.model)
    _check_out_dir(ns.out_dir)
    ckpt = open_hf_checkpoint(ns.hf_dir)  # structure and headers; no weights
    where = f"{ns.hf_dir}/config.json"
    if ns.model is None:
        try:
            ns.model = model_for_hf_config(ckpt.config)
        except ValueError as exc:
            raise UsageError(f"{where}: {exc}") from None
        _check_model_and_flavor(ns)
    cls = _adapter_cls(ns.model)
    if ns.mtp_layers is None and ns.model == "deepseek_v3":
        # DeepSeek-V3's MTP layers come along when the folder stores them (--mtp-layers 0 drops
        # them): config.json's num_nextn_predict_layers alone is not enough, since transformers
        # writes it (default 1) into folders whose model has no MTP layer
        ns.mtp_layers = _stored_mtp_layers(ckpt)
    if ns.flavor is None:
        args = _derived_spec(ns.model, ckpt.config, where).args
        args = _overridden(args, ns, f"{ns.model} sized by {where}")
        preset = cls.infer_flavor(ckpt.config, get_model_spec(ns.model, flavor_names(ns.model)[0]).flavors)
        label = f"{HF_FLAVOR} (sizes from config.json{f'; those of flavor {preset}' if preset else ''})"
    else:
        args = _args(ns.model, ns.flavor, ns)
        label = ns.flavor
    say = _progress(time.monotonic())
    context = f"{ns.model}/{ns.flavor} (--flavor)" if ns.flavor else f"{ns.model} sized by config.json"
    out = convert_hf_to_dcp(ns.hf_dir, ns.out_dir, ns.model, args, context=context, progress=say)
    train = (
        f"model.flavor = '{HF_FLAVOR}' with model.hf_config = {ns.hf_dir}" if ns.flavor is None else f"flavor {label}"
    )
    say(f"done: {out} (use it as --checkpoint.initial_load_path; model {ns.model}, flavor {label}; train with {train})")
    return out


def _stored_mtp_layers(ckpt) -> int:
    """How many of config.json's ``num_nextn_predict_layers`` MTP layers the folder stores
    (layer ``num_hidden_layers + k`` with its ``eh_proj``)."""
    n, nextn = ckpt.config.get("num_hidden_layers"), int(ckpt.config.get("num_nextn_predict_layers") or 0)
    if not isinstance(n, int):
        return 0
    return sum(1 for k in range(nextn) if f"model.layers.{n + k}.eh_proj.weight" in ckpt.tensors)


def _overridden(args, ns: argparse.Namespace, what: str):
    """``args`` with the run overrides --n-layers / --vocab-size / --max-seq-len."""
    overrides: dict = {}
    if ns.n_layers is not None:
        overrides["n_layers"] = ns.n_layers
    if ns.vocab_size is not None:
        overrides["vocab_size"] = ns.vocab_size
    if getattr(ns, "mtp_layers", None) is not None:
        if not any(f.name == "mtp_layers" for f in dataclasses.fields(args)):
            raise UsageError(f"--mtp-layers: multi-token prediction is a DeepSeek-V3 feature; {what} has none")
        overrides["mtp_layers"] = ns.mtp_layers
    if ns.max_seq_len is not None:
        overrides["max_seq_len"] = max(args.max_seq_len, ns.max_seq_len)
    args = dataclasses.replace(args, **overrides)
    try:
        args.validate()
    except ValueError as exc:
        raise UsageError(f"{what} with overrides {overrides}: {exc}") from None
    return args


def _infer_flavor_from_dcp(ns, meta) -> tuple[str, dict]:
    """The flavor whose tensor shapes equal the checkpoint's, with vocab_size and n_layers
    taken from the checkpoint (runs override both)."""
    extra: dict = {}
    if "tok_embeddings.weight" in meta and ns.vocab_size is None:
        extra["vocab_size"] = int(meta["tok_embeddings.weight"][0][0])
    layers = [int(m.group(1)) for k in meta if (m := re.match(r"^layers\.(\d+)\.", k))]
    if layers and ns.n_layers is None:
        extra["n_layers"] = max(layers) + 1
    depths = {int(m.group(1)) for k in meta if (m := re.match(r"^mtp\.(\d+)\.", k))}
    if depths and ns.mtp_layers is None:
        ns.mtp_layers = max(depths) + 1  # DeepSeek-V3's MTP depths
    cls = _adapter_cls(ns.model)
    candidates = [ns.flavor] if ns.flavor else flavor_names(ns.model)
    matches = []
    for flavor in candidates:
        try:
            args = _args(ns.model, flavor, ns, **extra)
            keys = cls(args).our_keys()
        except (UsageError, ValueError):
            continue
        if getattr(args, "tie_word_embeddings", False):
            # a tied model's step checkpoint holds the shared weight once, as the embedding (an
            # untied checkpoint of the same shapes has its own output.weight)
            keys = {k: v for k, v in keys.items() if k != "output.weight"}
        if keys.keys() == meta.keys() and all(tuple(meta[k][0]) == tuple(s) for k, s in keys.items()):
            matches.append(flavor)
    if ns.flavor:
        return ns.flavor, extra
    if len(matches) != 1:
        found = "no flavor matches" if not matches else f"several flavors match ({', '.join(matches)})"
        raise UsageError(
            f"cannot infer the {ns.model} flavor of {ns.dcp_dir}: {found} its tensor shapes; pass --flavor (one of "
            f"{', '.join(flavor_names(ns.model))})"
        )
    return matches[0], extra


def _step_record(ns):
    """The model record the step checkpoint stores (trainer/checkpoint/hf_extras.py), or None."""
    from trainer.checkpoint.lora_offline import read_step_record

    return read_step_record(getattr(ns, "dcp_dir", None) or ns.step_dir)


def _export_args(ns, meta=None):
    """(model, flavor label, args, record) of a checkpoint to export: ``--hf-config`` (every size
    from that config.json), else ``--flavor``, else the model the checkpoint records, else (to-hf
    only, ``meta`` given) the flavor whose shapes match."""
    from trainer.checkpoint.hf_extras import ModelRecord, abs_tokenizer, record_for_folder

    record = _step_record(ns)
    if ns.model is None:
        if ns.hf_config is not None:
            try:
                ns.model = model_for_hf_config(read_hf_config(ns.hf_config))
            except ValueError as exc:
                raise UsageError(f"{ns.hf_config}: {exc}") from None
        elif record is not None:
            ns.model = record.model
        else:
            raise UsageError(
                f"{ns.command} needs --model (or --hf-config, whose architecture names the model): "
                f"{getattr(ns, 'dcp_dir', None) or ns.step_dir} records no model"
            )
    _check_model_and_flavor(ns)
    _adapter_cls(ns.model)
    tokenizer = record.tokenizer if record is not None else None
    if ns.tokenizer is not None:
        tokenizer = abs_tokenizer(ns.tokenizer)
    if ns.hf_config is not None:
        if ns.flavor is not None:
            raise UsageError("pass --flavor or --hf-config, not both: --hf-config gives every size")
        what = f"{ns.model} sized by {ns.hf_config}"
        args = _overridden(_derived_spec(ns.model, read_hf_config(ns.hf_config), ns.hf_config).args, ns, what)
        sized = record_for_folder(ns.model, args, ns.hf_config, tokenizer)
        sized.seq_len = record.seq_len if record is not None else 0
        return ns.model, HF_FLAVOR, args, sized
    if ns.flavor is None and record is not None:
        if record.model != ns.model:
            raise UsageError(
                f"{ns.command}: the checkpoint records model {record.model!r}, not {ns.model!r}: drop --model"
            )
        args = _overridden(record.model_args(), ns, f"{ns.model} as the checkpoint records it")
        flavor = record.flavor or "recorded"
    elif ns.flavor is None and meta is None:
        raise UsageError(
            f"{ns.command} needs --flavor (one of {', '.join(flavor_names(ns.model))}) or --hf-config (a model "
            f"sized by a config.json), and the run's overrides: {ns.step_dir} records no model (saved by an older "
            "run)"
        )
    elif meta is not None:
        flavor, extra = _infer_flavor_from_dcp(ns, meta)
        args = _args(ns.model, flavor, ns, **extra)
    else:
        flavor = ns.flavor
        args = _args(ns.model, flavor, ns)
    if record is not None:
        record = dataclasses.replace(record, model=ns.model, args=dataclasses.asdict(args), tokenizer=tokenizer)
    elif tokenizer is not None:
        record = ModelRecord(model=ns.model, args=dataclasses.asdict(args), flavor=flavor, tokenizer=tokenizer)
    return ns.model, flavor, args, record


def to_hf(ns) -> str:
    if ns.model is not None:
        _check_model_and_flavor(ns)
        _adapter_cls(ns.model)
    _check_out_dir(ns.out_dir)
    try:
        max_shard = parse_size(ns.max_shard_size)
    except ValueError as exc:
        raise UsageError(f"--max-shard-size: {exc}") from None
    meta = dcp_model_meta(ns.dcp_dir)
    model, flavor, args, record = _export_args(ns, meta)
    say = _progress(time.monotonic())
    say(f"{ns.dcp_dir} -> {ns.out_dir}: {model}/{flavor}, {len(meta)} tensors, {ns.dtype}")
    out = export_dcp_to_hf(
        ns.dcp_dir, ns.out_dir, model, args, dtype=ns.dtype, max_shard_bytes=max_shard, progress=say, record=record
    )
    say(f"done: {out} (transformers.AutoModelForCausalLM.from_pretrained loads it)")
    return out


def _lora_args(ns):
    if ns.model is not None:
        _check_model_and_flavor(ns)
        _adapter_cls(ns.model)
    _check_out_dir(ns.out_dir)
    return _export_args(ns)


def lora_peft(ns) -> str:
    from trainer.checkpoint.lora_offline import peft_from_step

    model, _, args, record = _lora_args(ns)
    out = peft_from_step(ns.step_dir, ns.out_dir, model, args, ns.dtype, record)
    print(f"done: {out} (peft.PeftModel.from_pretrained(base, '{out}') loads it)", file=sys.stderr)
    return out


def lora_merge(ns) -> str:
    from trainer.checkpoint.lora_offline import merged_from_step

    model, _, args, record = _lora_args(ns)
    try:
        max_shard = parse_size(ns.max_shard_size)
    except ValueError as exc:
        raise UsageError(f"--max-shard-size: {exc}") from None
    say = _progress(time.monotonic())
    out = merged_from_step(
        ns.step_dir,
        ns.out_dir,
        model,
        args,
        base=ns.base,
        dtype=ns.dtype,
        max_shard_bytes=max_shard,
        progress=say,
        record=record,
    )
    say(f"done: {out} (transformers.AutoModelForCausalLM.from_pretrained loads it)")
    return out


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="Convert between Hugging Face folders and meshtrain DCP checkpoints (one process).",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "--model",
            default=None,
            help=f"registered model: {', '.join(model_names())} (to-dcp: the one loading config.json's architecture)",
        )
        p.add_argument(
            "--flavor", default=None, help="model flavor; omitted: to-dcp sizes from config.json, to-hf infers it"
        )
        p.add_argument("--n-layers", type=int, default=None, help="model.n_layers override of the run")
        p.add_argument("--vocab-size", type=int, default=None, help="model.vocab_size override of the run")
        p.add_argument(
            "--mtp-layers",
            type=int,
            default=None,
            help="deepseek_v3 model.mtp_layers; default: the MTP layers the folder stores (to-dcp), "
            "the checkpoint's MTP depths (to-hf)",
        )
        p.add_argument(
            "--max-seq-len", type=int, default=None, help="training.seq_len of the run, if above the flavor's"
        )

    def export_options(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "--hf-config",
            default=None,
            help="Hugging Face folder (or its config.json) giving every size: for a model trained with "
            "model.flavor = 'hf'; its config.json fields and generation_config.json are carried into the export",
        )
        p.add_argument(
            "--tokenizer",
            default=None,
            help="tokenizer to put in the folder (a tokenizer.json or its folder; '' the shipped one); default: "
            "the one the run recorded in the checkpoint",
        )

    p = sub.add_parser("to-dcp", help="Hugging Face folder -> DCP folder for checkpoint.initial_load_path")
    p.add_argument("hf_dir", metavar="HF_DIR")
    p.add_argument("out_dir", metavar="OUT_DIR")
    common(p)
    p.set_defaults(run=to_dcp)

    p = sub.add_parser("to-hf", help="DCP step folder -> Hugging Face folder")
    p.add_argument("dcp_dir", metavar="DCP_STEP_DIR")
    p.add_argument("out_dir", metavar="OUT_DIR")
    common(p)
    export_options(p)
    p.add_argument(
        "--dtype",
        default="bfloat16",
        choices=("float32", "bfloat16", "float16"),
        help="dtype of the written weights (default bfloat16, as Hugging Face publishes them; "
        "float32 keeps the training run's float32 weights bit for bit)",
    )
    p.add_argument(
        "--max-shard-size",
        default=str(DEFAULT_MAX_SHARD_BYTES),
        help="largest safetensors file, e.g. 5GB, 500MB (default 5 GiB)",
    )
    p.set_defaults(run=to_hf)

    for name, run, what in (
        ("lora-peft", lora_peft, "LoRA step folder -> PEFT adapter folder"),
        ("lora-merge", lora_merge, "LoRA step folder + its base -> merged Hugging Face folder"),
    ):
        p = sub.add_parser(name, help=what)
        p.add_argument("step_dir", metavar="STEP_DIR")
        p.add_argument("out_dir", metavar="OUT_DIR")
        common(p)
        export_options(p)
        p.add_argument("--dtype", default="float32" if name == "lora-peft" else "bfloat16",
                       choices=("float32", "bfloat16", "float16"), help="dtype of the written weights")  # fmt: skip
        if name == "lora-merge":
            p.add_argument("--base", default=None, help="the base folder (default: the one the run recorded)")
            p.add_argument("--max-shard-size", default=str(DEFAULT_MAX_SHARD_BYTES), help="largest safetensors file")
        p.set_defaults(run=run)
    return parser


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)

    def run() -> None:
        ns.run(ns)

    # UsageError, CheckpointError, ConfigError (ValueErrors, also when DCP wraps them): one line, exit 2
    return run_command(run)


if __name__ == "__main__":
    sys.exit(main())
