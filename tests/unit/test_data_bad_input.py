"""Bad input in the data path ends in one error that names the file, the row or the option and
the fix (a ValueError: one ``error:`` line and exit code 2 through train.py, trainer/runtime/cli_errors.py):

- data with nothing to read in a whole pass (files of blank lines) instead of starting over
  forever, for every kind that reads lines (jsonl, text by line or paragraph, hf and chat rows
  from .jsonl, a mixture's source);
- a chat template that fails with any Python error on a row (not only ``jinja2.TemplateError``),
  or that renders no assistant token at all (refused at start-up), and a step whose whole global
  batch has no target (trainer/step.py ``check_targets``);
- a parquet data page that cannot be decoded (named by file and row group);
- a truncated tokenizer_config.json, a mixture's missing chat path (named by its own key),
  ``WANDB_MODE`` with a value W&B does not know.

Through train.py (exit code 2, the line on stderr, 1 and 2 ranks): tests/e2e/test_user_errors.py
``test_bad_data_is_one_line``."""

from __future__ import annotations

import contextlib
import json
import logging
import signal

import pytest
import torch

from tests.chat_data import conversations, tokenizer_folder, write_jsonl, write_parquet
from trainer.config import ConfigError, load_config
from trainer.data.chat import ChatSource, ChatStream
from trainer.data.chat_template import ChatError
from trainer.data.tokenizer import DEFAULT_TOKENIZER_PATH, load_tokenizer

pytestmark = pytest.mark.unit

BLANK = "\n  \n\t\n\n"


@contextlib.contextmanager
def _within(seconds: int):
    """Fail instead of hanging: the old code looped forever on these inputs."""

    def expired(_signum, _frame):
        raise AssertionError(f"still reading after {seconds} s: the source starts over forever")

    old = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def _cfg(*args: str):
    return load_config(["--config", "llama3.toml", "--training.seq_len", "32", *args])


def _read_blank(kind: str, tmp_path):
    """A source of ``kind`` over files of blank lines only, read from its start."""
    from trainer.data.loader import build_dataloader
    from trainer.data.rows import RowFiles
    from trainer.data.sources import FileSource, RowTextSource

    jsonl = tmp_path / "blank.jsonl"
    jsonl.write_text(BLANK)
    if kind in ("line", "blank_line"):
        (tmp_path / "blank.txt").write_text(BLANK)
        src = FileSource(str(tmp_path / "blank.txt"), "text", documents=kind)
        return src.read(src.start())
    if kind == "jsonl":
        src = FileSource(str(jsonl), "jsonl")
        return src.read(src.start())
    if kind == "jsonl folder":
        folder = tmp_path / "rows"
        folder.mkdir()
        for name in ("a.jsonl", "b.jsonl"):
            (folder / name).write_text(BLANK)
        rows = RowFiles(str(folder), "messages")
        return rows.read(rows.start())
    if kind == "hf":
        src = RowTextSource(str(jsonl))
        return src.read(src.start())
    if kind == "chat":
        source = ChatSource(str(jsonl), load_tokenizer(""), DEFAULT_TOKENIZER_PATH)
        return ChatStream(source, 32, packing="packed", too_long="truncate").take(2)
    assert kind == "mixture"
    cfg = _cfg("--training.sources", f"jsonl:1:{jsonl},synthetic:1:")
    return build_dataloader(cfg, load_tokenizer(""), batch_rank=0, batch_degree=1).next_step()


@pytest.mark.parametrize(
    "kind, words",
    [
        ("jsonl", "training.dataset_path '{tmp}/blank.jsonl' has no rows (only blank lines)"),
        ("line", "training.dataset_path '{tmp}/blank.txt' has no documents (only blank lines; text_documents = line)"),
        ("blank_line", "has no documents (only blank lines; text_documents = blank_line)"),
        ("jsonl folder", "training.dataset_path '{tmp}/rows' has no rows (its 2 .jsonl files hold only blank lines)"),
        ("hf", "'{tmp}/blank.jsonl' has no rows (only blank lines); write one JSON object per line with a field 'text'"),
        ("chat", "'{tmp}/blank.jsonl' has no rows (only blank lines); write one JSON object per line with a field 'messages'"),
        ("mixture", "training.sources 'jsonl' path '{tmp}/blank.jsonl' has no rows"),
    ],
)  # fmt: skip
def test_a_source_without_rows_is_one_error_not_an_endless_loop(tmp_path, caplog, kind, words):
    """The first read of a source whose whole pass yields nothing raises, before saying it
    starts over (the old loop said so ~29,000 times a second)."""
    with caplog.at_level(logging.WARNING), _within(5), pytest.raises(ConfigError) as info:
        _read_blank(kind, tmp_path)
    assert words.format(tmp=tmp_path) in str(info.value), str(info.value)
    assert not [r for r in caplog.records if "starting over" in r.getMessage()]


def test_rows_after_blank_files_and_a_wrapped_read_still_read(tmp_path):
    """Negative control: blank files beside one with rows, and a read that wraps from the end of
    the last file to the rows of the first, are no error."""
    from trainer.data.rows import RowFiles

    folder = tmp_path / "rows"
    folder.mkdir()
    write_jsonl(folder / "a.jsonl", conversations(1))
    (folder / "b.jsonl").write_text(BLANK)
    (folder / "c.jsonl").write_text(BLANK)
    rows = RowFiles(str(folder), "messages")
    first, _where, cursor = rows.read(rows.start())
    again, _where, cursor = rows.read(cursor)  # past b and c, into the next epoch's a
    assert again == first and cursor[0] == 1


def _template_folder(tmp_path, template: str) -> str:
    folder = tmp_path / "tok"
    tokenizer_folder(folder, "llama3")
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    cfg["chat_template"] = template
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    return str(folder)


# each fails only on a row whose content is 'boom', so the start-up probe passes
FAILING = {
    "TypeError": ("{{ messages + 1 }}", "TypeError: can only concatenate list"),
    "ZeroDivisionError": ("{{ 1 / 0 }}", "ZeroDivisionError: division by zero"),
    "RecursionError": ("{{ f(1) }}", "RecursionError: maximum recursion depth exceeded"),
    "sandbox range": ("{% for i in range(10**6) %}{% endfor %}", "OverflowError: Range too big"),
}


@pytest.mark.parametrize("error", list(FAILING))
def test_a_template_failing_with_any_python_error_names_template_and_row(tmp_path, error):
    expression, words = FAILING[error]
    template = (
        "{% macro f(n) %}{{ f(n) }}{% endmacro %}{% for m in messages %}{% if m['content'] == 'boom' %}"
        + expression
        + "{% endif %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>{{ m['content'] }}<|eot_id|>{% endfor %}"
        "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>{% endif %}"
    )
    folder = _template_folder(tmp_path, template)
    bad = [{"role": "user", "content": "boom"}, {"role": "assistant", "content": "b"}]
    path = write_jsonl(tmp_path / "c.jsonl", [conversations(1)[0], bad])
    stream = ChatStream(ChatSource(path, load_tokenizer(folder), ""), 64, packing="padded", too_long="truncate")
    with pytest.raises(ChatError) as info:
        stream.take(2)
    msg = str(info.value)
    second_row = len((tmp_path / "c.jsonl").read_text().splitlines()[0]) + 1
    assert msg.startswith(f"{path} (byte {second_row}): the chat template ({folder}/tokenizer_config.json) failed"), msg
    assert words in msg and msg.endswith("; fix the template") and "\n" not in msg, msg


def test_a_template_failing_on_every_conversation_is_refused_at_start_up(tmp_path):
    folder = _template_folder(tmp_path, "{{ messages[0]['content'] / 2 }}")
    with pytest.raises(
        ConfigError, match=r"tokenizer_config.json\) fails on a user/assistant conversation: .*TypeError"
    ):
        ChatSource(write_jsonl(tmp_path / "c.jsonl", conversations(2)), load_tokenizer(folder), "")


def test_a_template_rendering_no_assistant_token_is_refused_at_start_up(tmp_path):
    """Every assistant message left out: no target anywhere, so training would run at loss 0."""
    folder = _template_folder(
        tmp_path,
        "{% for m in messages %}{% if m['role'] != 'assistant' %}<|start_header_id|>{{ m['role'] }}"
        "<|end_header_id|>{{ m['content'] }}<|eot_id|>{% endif %}{% endfor %}",
    )
    with pytest.raises(ConfigError, match=r"tokenizer_config.json\) renders no assistant tokens"):
        ChatSource(write_jsonl(tmp_path / "c.jsonl", conversations(2)), load_tokenizer(folder), "")


def test_a_step_without_any_target_stops_and_one_with_some_does_not():
    """The step's global count (trainer/step.py): 0 over the whole batch stops the run; a
    micro-batch without targets beside one with targets is a normal step."""
    from trainer.step import NoTargets, check_targets, global_target_count

    class OneProcess:
        def get_optional_mesh(self, name):
            return None

    none = torch.full((2, 5), -100)
    some = torch.tensor([[-100, -100, 3, -100, -100]] * 2)
    count = global_target_count([none, some], OneProcess(), torch.device("cpu"), at_least_one=False)
    check_targets(float(count), 1, "d")  # 2 targets: no error
    zero = global_target_count([none, none], OneProcess(), torch.device("cpu"), at_least_one=False)
    assert int(zero) == 0
    with pytest.raises(NoTargets, match=r"^step 7: the whole global batch holds no target token \(data: chat x\)"):
        check_targets(float(zero), 7, "chat x")


def test_a_corrupt_parquet_data_page_names_file_and_row_group(tmp_path):
    """Opening reads only the footer; a damaged page is found when its row group is read."""
    import pyarrow.parquet as pq

    path = write_parquet(tmp_path / "c.parquet", {"messages": conversations(32)}, row_group_size=8)
    raw = bytearray(open(path, "rb").read())
    start = pq.ParquetFile(path).metadata.row_group(2).column(0).data_page_offset
    raw[start + 2 : start + 60] = bytes(b ^ 0x5A for b in raw[start + 2 : start + 60])
    open(path, "wb").write(bytes(raw))
    source = ChatSource(path, load_tokenizer(""), DEFAULT_TOKENIZER_PATH)
    stream = ChatStream(source, 512, packing="padded", too_long="truncate")
    stream.take(16)  # row groups 0 and 1 are intact
    with pytest.raises(ValueError) as info:
        stream.take(1)
    msg = str(info.value)
    assert msg.startswith(f"{path} (row group 2, rows 16-23): column 'messages' cannot be read ("), msg
    assert msg.endswith("the file is damaged: write it again, or point training.dataset_path at data without it")


def test_a_truncated_tokenizer_config_names_the_file(tmp_path):
    folder = tmp_path / "tok"
    tokenizer_folder(folder, "llama3")
    config = folder / "tokenizer_config.json"
    config.write_text(config.read_text()[:40])
    with pytest.raises(ConfigError) as info:
        load_tokenizer(str(folder))
    msg = str(info.value)
    assert msg.startswith(f"model.tokenizer_path: {config} is not valid JSON (Unterminated string"), msg
    assert msg.endswith("restore the model's own copy of the file")


def test_a_mixtures_missing_chat_path_is_named_by_its_own_key(tmp_path):
    from trainer.data.loader import document_separator

    cfg = _cfg(
        "--model.attn_mask_type", "block_causal", "--training.sources", f"synthetic:1:,chat:1:{tmp_path / 'nope.jsonl'}"
    )  # fmt: skip
    with pytest.raises(ConfigError, match=rf"^training.sources 'chat' path '{tmp_path}/nope.jsonl' does not exist"):
        document_separator(cfg, load_tokenizer(""))


@pytest.mark.parametrize("mode", ["sometimes", ""])
def test_an_unknown_wandb_mode_names_the_variable_and_its_values(monkeypatch, mode):
    pytest.importorskip("wandb")
    from trainer.reporting.wandb_log import check_wandb_mode

    monkeypatch.setenv("WANDB_MODE", mode)
    with pytest.raises(ConfigError) as info:
        check_wandb_mode()
    assert str(info.value) == (
        f"environment variable WANDB_MODE={mode!r} is not a W&B mode; set it to one of online, offline, shared, "
        "disabled, dryrun, run (offline: no account needed) or unset it"
    )
    monkeypatch.setenv("WANDB_MODE", "offline")
    check_wandb_mode()
