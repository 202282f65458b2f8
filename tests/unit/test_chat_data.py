"""Chat data (trainer/data/chat_template.py, chat.py, rows.py): rendering equals transformers'
``apply_chat_template`` token for token on real templates, the target mask covers exactly the
assistant turns, packing keeps conversations whole with no label crossing one, the loss's target
set ignores user turns (negative control: the mask off), resume and every row format give the
same windows, bad rows are one-line errors naming the row.

Templates and tokenizers are data (tests/chat_data.py): the shipped BPE plus each style's
special tokens, a Llama 3 and a Qwen3 style template, the built-in one."""

from __future__ import annotations

import json

import pytest
import torch

from tests.chat_data import conversations, tokenizer_folder, write_jsonl, write_parquet
from trainer.config import ConfigError
from trainer.data.batching import PackedDataLoader
from trainer.data.chat import ChatSource, ChatStream
from trainer.data.chat_template import BUILTIN_TEMPLATE, load_chat_template
from trainer.data.packing import IGNORE_INDEX
from trainer.data.tokenizer import DEFAULT_TOKENIZER_PATH, load_tokenizer

pytestmark = pytest.mark.unit

# what ends an assistant turn, and what a style renders in front of the last turn's content
END = {"llama3": "<|eot_id|>", "qwen3": "<|im_end|>", "builtin": "<|eos|>"}
LAST_PREFIX = {"llama3": "", "qwen3": "<think>\n\n</think>\n\n", "builtin": ""}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    out = {}
    for style in ("llama3", "qwen3"):
        out[style] = tokenizer_folder(tmp_path_factory.mktemp(style), style)
    builtin = tmp_path_factory.mktemp("builtin")  # the shipped tokenizer with the built-in template written out
    tokenizer_folder(builtin, "qwen3")
    from tokenizers import Tokenizer

    Tokenizer.from_file(DEFAULT_TOKENIZER_PATH).save(str(builtin / "tokenizer.json"))
    (builtin / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<|bos|>", "eos_token": "<|eos|>", "chat_template": BUILTIN_TEMPLATE})
    )
    out["builtin"] = str(builtin)
    return out


def _template(folder):
    return load_chat_template(load_tokenizer(folder), DEFAULT_TOKENIZER_PATH)


@pytest.mark.parametrize("style", ["llama3", "qwen3", "builtin"])
def test_rendering_equals_transformers_apply_chat_template(folders, style):
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast.from_pretrained(folders[style])
    template = _template(folders[style])
    convs = conversations(12, seed=3) + [
        [{"role": "user", "content": "ünïcödé ✓ 東京"}, {"role": "assistant", "content": " spaced  out \n"}]
    ]
    for msgs in convs:
        ref = hf.apply_chat_template(msgs, tokenize=True)
        ref = ref["input_ids"] if not isinstance(ref, list) else ref
        ids, _targets = template.encode(msgs)
        assert ids == ref, (style, msgs)


def test_builtin_template_is_the_shipped_tokenizers_default():
    template = load_chat_template(load_tokenizer(""), DEFAULT_TOKENIZER_PATH)
    assert template.source == BUILTIN_TEMPLATE and template.where == "the built-in template"


def _target_runs(tok, ids, targets):
    runs, cur = [], []
    for i, t in zip(ids, targets):
        if t:
            cur.append(i)
        elif cur:
            runs.append(tok.decode(cur))
            cur = []
    return runs + ([tok.decode(cur)] if cur else [])


@pytest.mark.parametrize("style", ["llama3", "qwen3", "builtin"])
def test_mask_covers_exactly_the_assistant_turns(folders, style):
    """Distinctive words per role: the target tokens decode to exactly each assistant content
    followed by its end-of-turn token (the last Qwen3 turn with the empty reasoning block the
    template writes into it), nothing of the system or user turns."""
    template = _template(folders[style])
    tok = template.tokenizer
    msgs = [
        {"role": "system", "content": "sys sys"},
        {"role": "user", "content": "user words"},
        {"role": "assistant", "content": "first reply"},
        {"role": "user", "content": "more user words"},
        {"role": "assistant", "content": "second reply here"},
    ]
    ids, targets = template.encode(msgs)
    runs = _target_runs(tok, ids, targets)
    assert runs == ["first reply" + END[style], LAST_PREFIX[style] + "second reply here" + END[style]]


def _stream(path, folder, seq_len=96, packing="packed", too_long="truncate"):
    source = ChatSource(path, load_tokenizer(folder), DEFAULT_TOKENIZER_PATH)
    return source, ChatStream(source, seq_len, packing=packing, too_long=too_long)


@pytest.mark.parametrize("packing", ["packed", "padded"])
def test_windows_hold_whole_conversations_and_no_label_crosses_one(tmp_path, folders, packing):
    convs = conversations(24, seed=5)
    path = write_jsonl(tmp_path / "c.jsonl", convs)
    source, stream = _stream(path, folders["qwen3"], seq_len=256, packing=packing)
    encoded = [source.template.encode(m) for m in convs]
    toks, tgt = stream.take(6)
    placed = stream.conversations
    assert stream.truncated == 0 and placed >= (12 if packing == "packed" else 6)
    sep = source.separator
    expect_targets = sum(sum(t[1:]) for _ids, t in encoded[:placed])  # a conversation's first token never is one
    assert int(tgt.sum()) == expect_targets  # every target of every placed conversation, once
    for row, mask in zip(toks.tolist(), tgt.tolist()):
        ends = [j for j, t in enumerate(row) if t == sep]
        assert ends, "every window ends a conversation"
        if packing == "padded":
            assert len(ends) == 1
        for j in ends:  # the separator is never a target, nor the token after it
            assert not mask[j] and (j + 1 >= len(mask) or not mask[j + 1])
    # the windows are the conversations in order, each followed by the separator, then padding
    assert toks[0, : len(encoded[0][0])].tolist() == encoded[0][0]
    assert int(toks[0, len(encoded[0][0])]) == sep
    # labels: IGNORE_INDEX except at targets
    loader = PackedDataLoader(
        source, None, seq_len=256, global_batch_size=2, local_batch_size=2, batch_rank=0, batch_degree=1, stream=stream
    )
    _inputs, labels = loader.next_step()[0]
    assert loader.masked and (labels == IGNORE_INDEX).any() and (labels != IGNORE_INDEX).any()


def test_too_long_conversations_are_truncated_or_dropped(tmp_path, folders):
    long = [{"role": "user", "content": "alpha " * 5}, {"role": "assistant", "content": "beta " * 40}]
    short = [[{"role": "user", "content": w}, {"role": "assistant", "content": w + " " + w}] for w in ("hi", "yo")]
    convs = [short[0], long, short[1]]
    path = write_jsonl(tmp_path / "c.jsonl", convs)
    _, cut = _stream(path, folders["llama3"], seq_len=48, packing="padded", too_long="truncate")
    toks, tgt = cut.take(3)
    assert (cut.truncated, cut.dropped, cut.conversations) == (1, 0, 3)
    assert int(toks[1, -1]) == cut.source.separator and bool(tgt[1].any())
    _, drop = _stream(path, folders["llama3"], seq_len=48, packing="padded", too_long="drop")
    toks2, _ = drop.take(2)
    assert (drop.truncated, drop.dropped, drop.conversations) == (0, 1, 2)
    assert torch.equal(toks2[0], toks[0]) and torch.equal(toks2[1], toks[2])
    assert "1 truncated and 0 dropped" in cut.notes()
    _, none_fit = _stream(write_parquet(tmp_path / "long.parquet", {"messages": [long] * 3}), folders["llama3"], 48)
    none_fit.too_long = "drop"
    with pytest.raises(ConfigError, match="no conversation of .*long.parquet fits in seq_len"):
        none_fit.take(1)


def _bigram_loss(tokens, labels, vocab):
    """A model whose logits depend only on the input token: the loss of a target depends on
    nothing but the token before it, so changing a user turn cannot move a masked loss."""
    table = torch.randn(vocab, vocab, generator=torch.Generator().manual_seed(0))
    logits = table[tokens]
    count = (labels != IGNORE_INDEX).sum().clamp_min(1)
    ce = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")
    return ce / count


def test_changing_a_user_turn_keeps_the_target_set_negative_control_mask_off(tmp_path, folders):
    convs = conversations(6, seed=9)
    changed = json.loads(json.dumps(convs))
    user = next(m for m in changed[0] if m["role"] == "user")
    user["content"] = " ".join("kilo" for _ in user["content"].split())  # same words count, other words
    tok = load_tokenizer(folders["llama3"])
    losses = {}
    for name, data in (("orig", convs), ("changed", changed)):
        path = write_jsonl(tmp_path / f"{name}.jsonl", data)
        _, stream = _stream(path, folders["llama3"], seq_len=128, packing="padded")
        toks, tgt = stream.take(6)
        labels = torch.where(tgt[:, 1:], toks[:, 1:], torch.full_like(toks[:, 1:], IGNORE_INDEX))
        masked = _bigram_loss(toks[:, :-1], labels, tok.vocab_size)
        unmasked = _bigram_loss(toks[:, :-1], toks[:, 1:], tok.vocab_size)  # the mask off
        losses[name] = (masked.item(), unmasked.item(), labels[labels != IGNORE_INDEX].tolist())
    assert losses["orig"][2] == losses["changed"][2]  # the same targets
    assert losses["orig"][0] == losses["changed"][0]  # bitwise: the same values summed in the same order
    assert abs(losses["orig"][1] - losses["changed"][1]) > 1e-3  # negative control: the user tokens count


def test_resume_and_another_layout_continue_the_same_windows(tmp_path, folders):
    path = write_jsonl(tmp_path / "c.jsonl", conversations(40, seed=2))

    def loader(rank, degree, local):
        source, stream = _stream(path, folders["qwen3"], seq_len=64)
        kw = dict(seq_len=64, global_batch_size=4, local_batch_size=local, batch_rank=rank, batch_degree=degree)
        return PackedDataLoader(source, None, stream=stream, **kw)

    ref = loader(0, 1, 4)
    steps = [ref.next_step() for _ in range(4)]
    first = loader(0, 1, 4)
    first.next_step(), first.next_step()
    state = json.loads(json.dumps(first.state_dict()))
    for degree in (1, 2):  # resumed on 1 rank, and on 2 ranks of 2 samples each
        parts = [loader(r, degree, 4 // degree) for r in range(degree)]
        for p in parts:
            p.load_state_dict(state)
        for step in steps[2:]:
            got = [mb for p in parts for mb in p.next_step()]
            assert torch.equal(torch.cat([x for x, _ in got]), step[0][0])
            assert torch.equal(torch.cat([y for _, y in got]), step[0][1])


def test_jsonl_parquet_and_save_to_disk_give_the_same_windows(tmp_path, folders):
    import datasets

    convs = conversations(30, seed=4)
    paths = {"jsonl": write_jsonl(tmp_path / "c.jsonl", convs)}
    (tmp_path / "pq").mkdir()  # a folder of two parquet files, several row groups each
    write_parquet(tmp_path / "pq" / "a.parquet", {"messages": convs[:13]}, row_group_size=4)
    write_parquet(tmp_path / "pq" / "b.parquet", {"messages": convs[13:]}, row_group_size=5)
    paths["parquet"] = str(tmp_path / "pq")
    datasets.Dataset.from_list([{"messages": m} for m in convs]).save_to_disk(str(tmp_path / "disk"))
    paths["arrow"] = str(tmp_path / "disk")
    windows = {}
    for name, path in paths.items():
        source, stream = _stream(path, folders["llama3"], seq_len=64)
        assert source.rows.format == name
        windows[name] = stream.take(12)  # more than the 30 rows: wraps into the second epoch
    for name in ("parquet", "arrow"):
        assert torch.equal(windows[name][0], windows["jsonl"][0]) and torch.equal(windows[name][1], windows["jsonl"][1])


def _first_error(path, folder, packing="padded"):
    _, stream = _stream(path, folder, packing=packing)
    with pytest.raises(ValueError) as info:
        stream.take(4)
    return str(info.value)


def test_bad_rows_name_the_row(tmp_path, folders):
    good = conversations(1)[0]
    (tmp_path / "nomsg.jsonl").write_text(json.dumps({"messages": good}) + "\n" + json.dumps({"text": "x"}) + "\n")
    msg = _first_error(str(tmp_path / "nomsg.jsonl"), folders["llama3"])
    assert "nomsg.jsonl (byte " in msg and "'messages'" in msg and "\n" not in msg
    bad_role = [{"role": "robot", "content": "x"}]
    msg = _first_error(write_jsonl(tmp_path / "role.jsonl", [good, bad_role]), folders["llama3"])
    assert "role.jsonl (byte " in msg and "unknown role 'robot'" in msg
    pq = write_parquet(tmp_path / "role.parquet", {"messages": [good, bad_role]})
    assert "role.parquet (row 1)" in _first_error(pq, folders["llama3"])


def test_template_that_fails_to_render_names_the_row(tmp_path, folders):
    folder = tmp_path / "tok"
    tokenizer_folder(folder, "llama3")
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    cfg["chat_template"] = (
        "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system turns') }}"
        "{% endif %}{{ m['content'] }}<|eot_id|>{% endfor %}"
    )
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    convs = [[{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}], conversations(1)[0]]
    msg = _first_error(write_jsonl(tmp_path / "c.jsonl", convs), str(folder))
    assert "c.jsonl (byte " in msg and "failed to render it: no system turns" in msg


def test_missing_column_and_missing_template_are_config_errors(tmp_path, folders):
    pq = write_parquet(tmp_path / "t.parquet", {"text": ["a", "b"]})
    with pytest.raises(ConfigError, match=r"t.parquet has no column 'messages' \(columns: text\)"):
        ChatSource(pq, load_tokenizer(folders["llama3"]), DEFAULT_TOKENIZER_PATH)
    folder = tmp_path / "plain"
    tokenizer_folder(folder, "llama3")
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|eot_id|>"}))
    with pytest.raises(ConfigError, match="has no chat template"):
        ChatSource(write_jsonl(tmp_path / "c.jsonl", conversations(2)), load_tokenizer(str(folder)), "")


def test_target_count_and_pretraining_keeps_its_constant_denominator():
    """``global_target_count`` (one process: no batch mesh) counts the labels that are targets
    over every micro-batch, at least 1; pre-training loaders are not masked, so the trainer
    keeps dividing by the constant tokens_per_step (the pre-training step is unchanged)."""
    from trainer.config import load_config
    from trainer.data.loader import build_dataloader
    from trainer.step import global_target_count

    class OneProcess:
        def get_optional_mesh(self, name):
            return None

    labels = [torch.tensor([[1, IGNORE_INDEX, 3], [IGNORE_INDEX] * 3]), torch.tensor([[5, 6, IGNORE_INDEX]])]
    count = global_target_count(labels, OneProcess(), torch.device("cpu"))
    assert count.dtype == torch.int64 and int(count) == 4
    assert int(global_target_count([torch.full((2, 3), IGNORE_INDEX)], OneProcess(), torch.device("cpu"))) == 1
    cfg = load_config(["--config", "llama3.toml", "--training.seq_len", "32"])
    loader = build_dataloader(cfg, load_tokenizer(""), batch_rank=0, batch_degree=1)
    assert not loader.masked and loader.notes() == ""
    assert all((y != IGNORE_INDEX).all() for _x, y in loader.next_step())


def test_padded_parquet_ranks_read_only_their_rows(tmp_path, folders):
    """Padded windows with truncation are one row each, so on parquet a rank moves its cursor
    past the other ranks' rows by arithmetic: each of 4 ranks reads exactly its own rows (6
    steps x 2 samples, across files and epochs), and together they give the windows of one
    rank reading everything from a .jsonl file of the same rows; a resumed rank continues."""
    convs = conversations(19, seed=6)
    (tmp_path / "pq").mkdir()
    write_parquet(tmp_path / "pq" / "a.parquet", {"messages": convs[:7]}, row_group_size=3)
    write_parquet(tmp_path / "pq" / "b.parquet", {"messages": convs[7:]}, row_group_size=5)
    jsonl = write_jsonl(tmp_path / "c.jsonl", convs)

    def loader(path, rank, degree):
        source, stream = _stream(path, folders["llama3"], seq_len=64, packing="padded")
        kw = dict(seq_len=64, global_batch_size=8, local_batch_size=8 // degree, batch_rank=rank, batch_degree=degree)
        return PackedDataLoader(source, None, stream=stream, **kw)

    ref = loader(jsonl, 0, 1)
    assert not ref._stream.addressable
    expected = [ref.next_step()[0] for _ in range(6)]  # 48 windows: the 19 rows 2.5 times
    ranks = [loader(str(tmp_path / "pq"), r, 4) for r in range(4)]
    assert ranks[0]._stream.addressable
    for step in expected:
        got = [p.next_step()[0] for p in ranks]
        assert torch.equal(torch.cat([x for x, _ in got]), step[0]) and torch.equal(
            torch.cat([y for _, y in got]), step[1]
        )
    assert [p._stream.source.rows.rows_read for p in ranks] == [12, 12, 12, 12]  # 6 steps x its 2 samples
    resumed = loader(str(tmp_path / "pq"), 1, 4)
    resumed.load_state_dict(json.loads(json.dumps(ranks[1].state_dict())))
    assert torch.equal(resumed.next_step()[0][0], ranks[1].next_step()[0][0])
