"""Preference data (trainer/data/preference.py, ``training.dataset = "preference"``): a pair's
tokens and labels equal the chat template rendered by hand (and TRL's DPOTrainer tokenization);
samples 2k / 2k + 1 are one pair's chosen / rejected windows, and a pair is never split across
batch ranks (fsdp=2) or pipeline micro-batches (pp=2, split as torch's pipelining splits them);
a resume mid-stream continues bitwise (sequential and striped rows, another batch degree); the
too-long, identical and empty rules are counted in the first data line; bad rows are one-line
errors naming the row; a mixture keeps pairs whole and refuses other kinds.

Data and tokenizers are built locally (tests/preference_data.py, tests/chat_data.py)."""

from __future__ import annotations

import json

import pytest
import torch

from tests.preference_data import preference_rows, tokenizer_folder, write_jsonl, write_parquet_rows
from trainer.config import ConfigError, load_config
from trainer.data.chat_template import ChatError
from trainer.data.loader import build_dataloader, build_validation_dataloader
from trainer.data.packing import IGNORE_INDEX
from trainer.data.preference import PreferenceSource, PreferenceStream
from trainer.data.striped import merge_states
from trainer.data.tokenizer import DEFAULT_TOKENIZER_PATH, load_tokenizer
from trainer.plan import plan_job

pytestmark = pytest.mark.unit

SEQ, G = 128, 8


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    folder = tmp_path_factory.mktemp("preference")
    rows = preference_rows(44, seed=1)
    return {
        "rows": rows,
        "jsonl": write_jsonl(folder / "pairs.jsonl", rows),
        "parquet": write_parquet_rows(folder / "pairs.parquet", rows, row_group_size=6),
        "llama3": tokenizer_folder(folder / "llama3", "llama3"),
        "folder": folder,
    }


def _cfg(*args):
    return load_config(
        ["--config", "llama3.toml", "--training.seq_len", str(SEQ), "--training.global_batch_size", str(G)]
        + ["--training.local_batch_size", "2", "--training.dataset", "preference", *args]
    )


def _steps(loaders, n):
    """``n`` global batches, each the batch ranks' micro-batches in rank order: (inputs, labels)."""
    out = []
    for _ in range(n):
        parts = [mb for ld in loaders for mb in ld.next_step()]
        out.append((torch.cat([x for x, _ in parts]), torch.cat([y for _, y in parts])))
    return out


def _same(a, b) -> bool:
    return all(torch.equal(x[0], y[0]) and torch.equal(x[1], y[1]) for x, y in zip(a, b))


def _is_pair(inputs: torch.Tensor, labels: torch.Tensor, row: int) -> bool:
    """Rows ``row`` and ``row + 1`` are one pair: the same prompt (the tokens before the first
    label), then different completions."""
    starts = [int((labels[r] != IGNORE_INDEX).nonzero()[0]) for r in (row, row + 1)]
    return (
        starts[0] == starts[1]
        and torch.equal(inputs[row, : starts[0]], inputs[row + 1, : starts[0]])
        and not (torch.equal(inputs[row], inputs[row + 1]))
    )


def test_a_pair_is_the_template_rendered_by_hand_with_labels_on_the_completion(data, tmp_path):
    """Llama 3's template, a prompt with an earlier exchange (its assistant turn is not a label):
    sample 0 = prompt + chosen, sample 1 = prompt + rejected, labels exactly the completion's
    tokens (end-of-turn included), IGNORE_INDEX elsewhere; the string form renders the same as
    one user / one assistant turn, and the implicit-prompt form the same as the explicit one."""
    tok = load_tokenizer(data["llama3"])
    head = "<|start_header_id|>{}<|end_header_id|>\n\n"
    prompt_text = (
        "<|begin_of_text|>" + head.format("user") + "q one<|eot_id|>" + head.format("assistant") + "a one<|eot_id|>"
    ) + (head.format("user") + "q two<|eot_id|>" + head.format("assistant"))
    completions = {"chosen": "yes indeed<|eot_id|>", "rejected": "no<|eot_id|>"}
    prompt = [
        {"role": "user", "content": "q one"},
        {"role": "assistant", "content": "a one"},
        {"role": "user", "content": "q two"},
    ]
    explicit = {"prompt": prompt, "chosen": [{"role": "assistant", "content": "yes indeed"}]}
    explicit["rejected"] = [{"role": "assistant", "content": "no"}]
    implicit = {k: prompt + explicit[k] for k in ("chosen", "rejected")}
    p_ids = tok.encode_chat(prompt_text)[0]
    full = {k: tok.encode_chat(prompt_text + text)[0] for k, text in completions.items()}
    # the prompt's closing "\n\n" merges with the completion's first word in this BPE: the
    # completion starts where the tokens diverge (TRL's rule), one token before the prompt's end
    n = min(next(i for i, (a, b) in enumerate(zip(p_ids, ids)) if a != b) for ids in full.values())
    assert n == len(p_ids) - 1
    for i, row in enumerate((explicit, implicit)):
        path = write_jsonl(tmp_path / f"one{i}.jsonl", [row])
        (ld,) = [build_dataloader(_cfg("--training.dataset_path", path), tok, batch_rank=0, batch_degree=1)]
        inputs, labels = ld.next_step()[0]
        for r, which in enumerate(("chosen", "rejected")):
            ids = full[which]
            assert inputs[r, : len(ids)].tolist() == ids and (inputs[r, len(ids) :] == ld._stream.source.pad_id).all()
            want = [IGNORE_INDEX] * (n - 1) + ids[n:]
            assert labels[r].tolist() == want + [IGNORE_INDEX] * (SEQ - len(want)), (i, which)
    # control: chat SFT's mask of the same conversation also trains on the prompt's assistant turn
    sft = ld._stream.source.template.encode(prompt + explicit["chosen"])[1]
    assert sum(sft) > len(full["chosen"]) - n
    # strings: the built-in template, one user turn and one assistant turn
    tok = load_tokenizer("")
    path = write_jsonl(tmp_path / "s.jsonl", [{"prompt": "hi there", "chosen": "yo", "rejected": "nope"}])
    src = PreferenceSource(path, tok, DEFAULT_TOKENIZER_PATH)
    toks, tgt = PreferenceStream(src, SEQ, too_long="truncate").take(2)
    p_ids = tok.encode_chat("<|bos|><|user|>\nhi there<|eos|><|assistant|>\n")[0]
    for r, text in enumerate(("yo", "nope")):
        ids = tok.encode_chat(f"<|bos|><|user|>\nhi there<|eos|><|assistant|>\n{text}<|eos|>")[0]
        assert ids[: len(p_ids)] == p_ids  # here no token crosses the prompt's end
        assert toks[r, : len(ids)].tolist() == ids
        assert tgt[r].nonzero().flatten().tolist() == list(range(len(p_ids), len(ids)))


def test_tokens_equal_trl_dpo_trainer_tokenization(data):
    """TRL's DPOTrainer dataset preparation (prompt_ids, chosen_ids, rejected_ids) on the same
    conversational rows (explicit and implicit prompt, Qwen3 and Llama 3 templates): our chosen
    window = prompt_ids + chosen_ids with targets exactly on chosen_ids (rejected likewise)."""
    import types

    from datasets import Dataset
    from transformers import PreTrainedTokenizerFast
    from trl.trainer.dpo_trainer import DataCollatorForPreference, DPOTrainer

    for style in ("qwen3", "llama3"):
        folder = data["llama3"] if style == "llama3" else tokenizer_folder(data["folder"] / style, style)
        hf = PreTrainedTokenizerFast.from_pretrained(folder)
        fake = types.SimpleNamespace(_tokenizer=hf, _is_vision_dataset=False)
        args = types.SimpleNamespace(dataset_num_proc=None, max_length=None, truncation_mode="keep_start")
        for form in ("explicit", "implicit"):
            rows = preference_rows(6, seed=4, form=form)
            ref = DPOTrainer._prepare_dataset(fake, Dataset.from_list(rows), hf, args, "train")
            src = PreferenceSource(
                write_jsonl(data["folder"] / f"{style}{form}.jsonl", rows), load_tokenizer(folder), ""
            )
            toks, tgt = PreferenceStream(src, 256, too_long="truncate").take(2 * len(rows))
            for k, r in enumerate(ref):
                for j, which in enumerate(("chosen_ids", "rejected_ids")):
                    ids = r["prompt_ids"] + r[which]
                    assert toks[2 * k + j, : len(ids)].tolist() == ids, (style, form, k, which)
                    assert tgt[2 * k + j].nonzero().flatten().tolist() == list(range(len(r["prompt_ids"]), len(ids)))
    # truncation (the last rows above: Llama 3, implicit prompt): TRL's collator with max_length =
    # seq_len + 1 and keep_start (its dataset preparation drops a row
    # whose prompt fills max_length) cuts the same windows and completion masks
    window = 56
    examples = [r for r in ref if len(r["prompt_ids"]) < window]
    assert 0 < len(examples) < len(ref) and any(len(r["prompt_ids"] + r["chosen_ids"]) > window for r in examples)
    out = DataCollatorForPreference(pad_token_id=0, max_length=window)(examples)
    toks, tgt = PreferenceStream(src, window - 1, too_long="truncate").take(2 * len(examples))
    b = len(examples)
    for j in range(2):  # TRL: chosen rows first, then rejected; here pair k = rows 2k, 2k + 1
        n = out["input_ids"].shape[1]
        mask = out["attention_mask"][j * b : (j + 1) * b].bool()
        ours = toks[j::2]
        assert torch.equal(
            torch.where(mask, out["input_ids"][j * b : (j + 1) * b], -1), torch.where(mask, ours[:, :n], -1)
        )
        lengths = mask.sum(1)
        assert all((ours[k, int(lengths[k]) :] == src.pad_id).all() for k in range(b))  # padded after
        assert torch.equal(out["completion_mask"][j * b : (j + 1) * b].bool(), tgt[j::2, :n])


@pytest.mark.parametrize("layout", ["fsdp2", "pp2", "pp2_fsdp2"])
def test_pairs_stay_whole_on_every_batch_rank_and_pipeline_micro_batch(data, layout):
    """The job plan's batch (fsdp=2: 2 batch ranks; pp=2: one batch rank, 2 pipeline
    micro-batches; pp=2 x fsdp=2): batch rank b of step s gets global samples
    [s*G + b*G/D, s*G + (b+1)*G/D), their first even, so every micro-batch, and every pipeline
    micro-batch torch's pipelining cuts from it, holds whole pairs (chosen at even rows)."""
    from torch.distributed.pipelining.microbatch import TensorChunkSpec, split_args_kwargs_into_chunks

    tok = load_tokenizer("")
    args, world = {"fsdp2": (["--parallelism.fsdp", "2"], 2), "pp2": (["--parallelism.pp", "2"], 2)}.get(
        layout, (["--parallelism.pp", "2", "--parallelism.fsdp", "2"], 4)
    )
    lbs = ["--training.local_batch_size", "4" if "pp" in layout else "2"]
    cfg = _cfg("--training.dataset_path", data["jsonl"], *lbs, *args)
    plan = plan_job(cfg, world)
    b = plan.batch
    ref = _steps([build_dataloader(cfg, tok, 0, 1)], 2)  # one rank: global samples in order
    loaders = [build_dataloader(cfg, tok, r, batch=b) for r in range(b.batch_degree)]
    per_rank = G // b.batch_degree
    for s in range(2):
        for r, ld in enumerate(loaders):
            mbs = ld.next_step()
            first = r * per_rank  # this rank's first global sample within the step
            assert first % 2 == 0 and len(mbs) == b.grad_accum_steps
            got_x, got_y = torch.cat([x for x, _ in mbs]), torch.cat([y for _, y in mbs])
            assert torch.equal(got_x, ref[s][0][first : first + per_rank])
            assert torch.equal(got_y, ref[s][1][first : first + per_rank])
            m = plan.stages.n_microbatches if plan.stages is not None else 1
            for x, y in mbs:
                chunks, _ = split_args_kwargs_into_chunks((x, y), None, m, [TensorChunkSpec(0)] * 2)
                for cx, cy in chunks:
                    assert cx.shape[0] % 2 == 0 and all(_is_pair(cx, cy, i) for i in range(0, cx.shape[0], 2))
    assert all(_is_pair(*ref[0], i) for i in range(0, G, 2)) and not _is_pair(*ref[0], 1)  # control: 1, 2 differ
    # odd rows per micro-batch, or per pipeline micro-batch, are refused in one line
    with pytest.raises(ConfigError, match=r"training.local_batch_size \(3\) must be even"):
        _cfg(
            "--training.dataset_path",
            data["jsonl"],
            "--training.local_batch_size",
            "3",
            "--training.global_batch_size",
            "6",
        )
    with pytest.raises(ConfigError, match="2 = 1 rows per pipeline micro-batch, which must be even"):
        _cfg("--training.dataset_path", data["jsonl"], "--parallelism.pp", "2")
    val = ["--validation.enable", "true", "--validation.dataset", "preference", "--validation.steps", "2"]
    val += ["--validation.dataset_path", data["jsonl"], "--validation.seq_len", str(SEQ)]
    with pytest.raises(ConfigError, match=r"validation.local_batch_size \(3\) must be even"):
        _cfg("--training.dataset_path", data["jsonl"], *val, "--validation.local_batch_size", "3")
    v = build_validation_dataloader(
        _cfg("--training.dataset_path", data["jsonl"], *val, "--validation.local_batch_size", "2"), tok, 0, 1
    )
    assert v.masked and all(_is_pair(x, y, 0) for x, y in v.next_step())
    with pytest.raises(ConfigError, match="ends at an odd sample"):
        _cfg("--training.dataset_path", data["jsonl"], "--training.skip_samples", "8:11")


@pytest.mark.parametrize("kind", ["jsonl", "parquet"])
def test_resume_mid_stream_continues_bitwise(data, kind):
    """Steps 1-2, the state through JSON (as the checkpoint keeps it; parquet: striped on 2 batch
    ranks, merged), steps 3-5 on a fresh loader (parquet: 1 batch rank): the uninterrupted
    run's batches; a state of another step does not continue them (control). A raw stream saved
    between a pair's chosen and rejected windows continues with the rejected one."""
    tok = load_tokenizer("")
    cfg = _cfg("--training.dataset_path", data[kind])
    ref = _steps([build_dataloader(cfg, tok, 0, 1)], 5)
    first = [build_dataloader(cfg, tok, r, 2) for r in range(2)]
    _steps(first, 2)
    states = [ld.state_dict() for ld in first]
    state = json.loads(json.dumps(merge_states(states) if kind == "parquet" else states[0]))
    again = build_dataloader(cfg, tok, 0, 1)
    again.load_state_dict(state)
    assert _same(ref[2:], _steps([again], 3))
    wrong = build_dataloader(cfg, tok, 0, 1)
    wrong.load_state_dict(json.loads(json.dumps(build_dataloader(cfg, tok, 0, 1).state_dict())))
    assert not _same(ref[2:3], _steps([wrong], 1))
    # epochs: 44 rows = 11 steps of 4 pairs; the pass completes with step 11, every stripe wrapped
    passes = []
    for _ in range(6):
        again.next_step()
        passes.append(again.passes(again.state_dict())[0])
    assert passes == [0, 0, 0, 0, 0, 1]
    if kind == "jsonl":
        src = PreferenceSource(data["jsonl"], tok, DEFAULT_TOKENIZER_PATH)
        whole = PreferenceStream(src, SEQ, too_long="truncate").take(6)
        half = PreferenceStream(src, SEQ, too_long="truncate")
        half.take(3)
        resumed = PreferenceStream(src, SEQ, too_long="truncate")
        resumed.restore(json.loads(json.dumps(half.state())))
        assert torch.equal(torch.cat([half.take(3)[0]]), whole[0][3:])
        assert torch.equal(resumed.take(3)[0], whole[0][3:])


def test_every_row_format_and_form_gives_the_same_windows(data, tmp_path):
    """jsonl, parquet and save_to_disk rows, and the implicit-prompt form of the same rows: the
    same windows; the string form of one row is its one-turn messages form."""
    import datasets

    tok = load_tokenizer("")
    disk = str(tmp_path / "disk")
    datasets.Dataset.from_list(data["rows"]).save_to_disk(disk)
    implicit = write_jsonl(tmp_path / "implicit.jsonl", preference_rows(44, seed=1, form="implicit"))
    got = []
    for path in (data["jsonl"], data["parquet"], disk, implicit):
        got.append(PreferenceStream(PreferenceSource(path, tok, DEFAULT_TOKENIZER_PATH), SEQ, too_long="drop").take(20))
    assert all(torch.equal(g[0], got[0][0]) and torch.equal(g[1], got[0][1]) for g in got[1:])
    turns = {"prompt": [{"role": "user", "content": "q"}], "chosen": [{"role": "assistant", "content": "a"}]}
    turns["rejected"] = [{"role": "assistant", "content": "b"}]
    pair = [
        PreferenceStream(
            PreferenceSource(write_jsonl(tmp_path / f"{i}.jsonl", [row]), tok, DEFAULT_TOKENIZER_PATH),
            SEQ,
            too_long="drop",
        )
        for i, row in enumerate(({"prompt": "q", "chosen": "a", "rejected": "b"}, turns))
    ]
    assert torch.equal(pair[0].take(2)[0], pair[1].take(2)[0])


def test_rules_are_counted_in_the_first_data_line(tmp_path):
    """Rows 0-9 (every third answer 60-90 words, longer than the window), then an identical pair
    and an empty completion: truncate cuts both sequences at the window (prompt kept), drop
    skips the pair; identical and empty pairs are skipped; the counts in the data line."""
    tok = load_tokenizer("")
    rows = preference_rows(9, seed=2, long_every=3)
    rows.insert(4, {"prompt": "same", "chosen": "twin", "rejected": "twin"})
    rows.insert(6, {"prompt": "nothing", "chosen": " ", "rejected": "something"})
    path = write_jsonl(tmp_path / "rules.jsonl", rows)
    src = PreferenceSource(path, tok, DEFAULT_TOKENIZER_PATH)
    cut = PreferenceStream(src, SEQ, too_long="truncate")
    toks, tgt = cut.take(14)
    assert cut.notes() == (
        "preference: 7 pairs in 14 windows (chosen, rejected), 3 truncated and 0 dropped as longer than 129 tokens "
        "(training.chat_too_long = truncate), 1 identical and 1 with an empty completion skipped"
    )
    assert toks.shape == (14, SEQ + 1) and bool(tgt[0, -1]) and bool(tgt[1, -1])  # the long pair: both cut, to the end
    assert _is_pair(toks[:2], torch.where(tgt, toks, IGNORE_INDEX)[:2, 1:], 0)
    drop = PreferenceStream(src, SEQ, too_long="drop")
    toks_d, _ = drop.take(8)
    assert "4 pairs in 8 windows" in drop.notes() and "0 truncated and 2 dropped" in drop.notes()
    assert torch.equal(toks_d[:2], toks[2:4])  # pair 0 was the long one: drop starts at pair 1
    # a prompt that fills the window leaves no completion token: dropped under truncate too
    row = {"prompt": "alpha beta " * 100, "chosen": "a", "rejected": "b"}
    long_prompt = write_parquet_rows(tmp_path / "lp.parquet", [row] * 2)
    with pytest.raises(ConfigError, match="no row of .* gives a preference pair .* 3 too long"):
        PreferenceStream(PreferenceSource(long_prompt, tok, DEFAULT_TOKENIZER_PATH), SEQ, too_long="truncate").take(1)


def test_bad_rows_are_one_line_errors_naming_the_row(tmp_path):
    tok = load_tokenizer("")
    good = {"prompt": "q", "chosen": "a", "rejected": "b"}
    at = f"pairs.jsonl (byte {len(json.dumps(good)) + 1})"  # the second row
    cases = [
        ({"prompt": "q", "chosen": "a"}, "each row needs a field 'rejected'"),
        ({"prompt": "q", "rejected": "b"}, "each row needs a field 'chosen'"),
        ({"chosen": "a", "rejected": "b"}, "the row has no 'prompt', and string completions hold none"),
        (
            {"chosen": [{"role": "user", "content": "x"}], "rejected": [{"role": "user", "content": "y"}]},
            "share no leading message",
        ),
        (
            {"prompt": "q", "chosen": [{"role": "user", "content": "x"}], "rejected": "b"},
            "'chosen' starts with a user turn",
        ),
        ({"prompt": "q", "chosen": [], "rejected": "b"}, "'chosen' must be a string or a non-empty list"),
        (
            {"prompt": "q", "chosen": "a", "rejected": [{"role": "bot", "content": "b"}]},
            "'rejected': messages\\[0\\] has",
        ),
    ]
    for row, message in cases:
        path = write_jsonl(tmp_path / "pairs.jsonl", [good, row])
        stream = PreferenceStream(PreferenceSource(path, tok, DEFAULT_TOKENIZER_PATH), SEQ, too_long="truncate")
        with pytest.raises(ValueError, match=message) as err:
            stream.take(4)
        assert "\n" not in str(err.value) and str(err.value).startswith(str(tmp_path / at)), str(err.value)
    # parquet: a file without the column is refused at start-up; a null value names the row
    with pytest.raises(ConfigError, match=r"bad.parquet has no column 'rejected'"):
        PreferenceSource(write_parquet_rows(tmp_path / "bad.parquet", [{"prompt": "q", "chosen": "a"}]), tok, "")
    nulls = write_parquet_rows(tmp_path / "null.parquet", [good, {"prompt": "q", "chosen": None, "rejected": "b"}])
    with pytest.raises(ChatError, match=r"null.parquet \(row 1\): the row has no 'chosen' \(null\)"):
        PreferenceStream(PreferenceSource(nulls, tok, DEFAULT_TOKENIZER_PATH), SEQ, too_long="truncate").take(4)


def test_mixtures_keep_pairs_whole_and_refuse_other_kinds(data, tmp_path):
    """Two preference sources (a parquet one striped, a jsonl one): each pair's two samples come
    from one source, the same batches on 1 and 2 batch ranks; preference beside chat is refused."""
    tok = load_tokenizer("")
    other = write_jsonl(tmp_path / "other.jsonl", preference_rows(30, seed=9, form="strings"))
    cfg = load_config(
        ["--config", "llama3.toml", "--training.seq_len", str(SEQ), "--training.global_batch_size", str(G)]
        + [
            "--training.local_batch_size",
            "2",
            "--training.sources",
            f"preference:1:{data['parquet']},preference:1:{other}",
        ]
    )
    one = build_dataloader(cfg, tok, 0, 1)
    ref = _steps([one], 4)
    picks = one._stream.schedule.choices(0, 4 * G)
    assert (picks[0::2] == picks[1::2]).all() and len(set(picks.tolist())) == 2
    assert one._stream.schedule.counts(4 * G - 1) == [int((picks[:-1] == j).sum()) for j in (0, 1)]
    assert all(_is_pair(x, y, i) for x, y in ref for i in range(0, G, 2))
    assert _same(ref, _steps([build_dataloader(cfg, tok, r, 2) for r in range(2)], 4))
    assert "this rank reads stripes 0-3 of 4" in one.notes() and "preference: this rank's" in one.notes()
    with pytest.raises(ConfigError, match="training.sources mixes 'preference' with 'chat'"):
        load_config(["--config", "llama3.toml", "--training.sources", f"preference:1:{other},chat:1:{other}"])
