"""The tokenizers (trainer/data/tokenizer.py): the shipped BPE, the byte tokenizer, and Meta's
Llama 3 ``tokenizer.model`` (tiktoken BPE ranks) against its ``tokenizer.json`` form.

No downloads: a small rank file is trained here with tiktoken's educational BPE trainer, and
the Hugging Face form of the same ranks is produced by transformers' own ``TikTokenConverter``.
The split pattern and the special-token list below are written out independently of
``trainer.data.tokenizer`` so that a wrong constant there makes the equality tests fail.
"""

import base64
import json
import random

import pytest
import tiktoken.load
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trainer.config import ConfigError, load_config
from trainer.data.loader import build_dataloader
from trainer.data.synthetic import synthetic_document
from trainer.data.tokenizer import ByteTokenizer, HFTokenizer, TiktokenTokenizer, load_tokenizer

# ---------------------------------------------------------------- shipped and byte tokenizers


def test_shipped_tokenizer():
    shipped = load_tokenizer()
    assert shipped.vocab_size == 2048 and (shipped.bos_id, shipped.eos_id, shipped.pad_id) == (0, 1, 2)
    text = "Hello, world! The quick brown fox.\n"
    assert shipped.decode(shipped.encode(text)) == text
    doc = synthetic_document(0, 5)
    assert len(shipped.encode(doc)) <= len(doc.split()) + 2  # corpus words are single tokens


def test_byte_tokenizer_and_missing_path():
    bt = load_tokenizer("bytes")
    assert isinstance(bt, ByteTokenizer) and bt.vocab_size == 259
    assert bt.decode(bt.encode("héllo") + [bt.eos_id]) == "héllo<|eos|>"
    with pytest.raises(ConfigError, match="model.tokenizer_path: no tokenizer at '/nonexistent'"):
        load_tokenizer("/nonexistent")


# ---------------------------------------------------------------- Llama 3 tokenizer.model

# Meta's llama3/tokenizer.py pattern, verbatim.
META_PATTERN = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
META_SPECIALS = (
    ["<|begin_of_text|>", "<|end_of_text|>"]
    + [f"<|reserved_special_token_{i}|>" for i in range(4)]
    + ["<|start_header_id|>", "<|end_header_id|>", "<|reserved_special_token_4|>", "<|eot_id|>"]
    + [f"<|reserved_special_token_{i}|>" for i in range(5, 251)]
)
assert len(META_SPECIALS) == 256

SAMPLES = [
    "Hello, world! The quick brown fox jumps over the lazy dog.\n",
    "I don't think they'll say it's fine; we've seen what you'd do. DON'T SHOUT, I'M HERE.",
    "LLAMA LLAMA REALLY REALLY DEVIL DEVIL: THEY'LLAMA, WE'REALLY, SHE'DEVIL, I'MMM, IT'SSS, 'TIS",
    "digits 1234567890 0.5 3.14159 2024-06-01 1,000,000 and x=12345678901234567890",
    "spaces:   three,     five,\ttab\t\ttwo tabs, trailing   \n\n\nnewlines\r\nCRLF\r\n\r\n",
    "unicode: café naïve Straße Ελληνικά русский 日本語のテキスト 한국어 مرحبا emoji 😀🎉👩‍👩‍👧 é\u0301",
    "def f(x):\n    return {'a': [1, 2, 3], \"b\": x ** 2}  # comment\n\nif __name__ == '__main__':\n\tf(3)\n",
    "fake specials: <|begin_of_text|> <|end_of_text|><|eot_id|> <|start_header_id|>user<|end_header_id|> "
    "<|reserved_special_token_7|> <|eos|> <|endoftext|> <s></s>",
    "   leading spaces and trailing spaces   ",
    "",
    "\n",
    "a",
    "!!!???...---___***",
    "mixed123abc456DEF 7up 99bottles o'clock rock'n'roll l'été",
]


def _training_corpus() -> str:
    rng = random.Random(0)
    parts = SAMPLES * 3
    rng.shuffle(parts)
    return "".join(parts)


@pytest.fixture(scope="module")
def ranks() -> dict[bytes, int]:
    from tiktoken._educational import bpe_train

    trained = bpe_train(_training_corpus(), vocab_size=256 + 400, pat_str=META_PATTERN, visualise=None)
    # Meta's file does not rank single bytes by their value; neither does ours.
    singles = [bytes([b]) for b in range(256)]
    random.Random(1).shuffle(singles)
    out = {tok: i for i, tok in enumerate(singles)}
    for tok, _ in sorted(((t, r) for t, r in trained.items() if len(t) > 1), key=lambda x: x[1]):
        out[tok] = len(out)
    return out


def write_ranks(path, ranks: dict[bytes, int]) -> None:
    with open(path, "wb") as f:
        for tok, rank in sorted(ranks.items(), key=lambda x: x[1]):
            f.write(base64.b64encode(tok) + b" " + str(rank).encode() + b"\n")


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory, ranks):
    """A Hugging Face-style folder: tokenizer.json (converted) + original/tokenizer.model."""
    from transformers.convert_slow_tokenizer import TikTokenConverter

    root = tmp_path_factory.mktemp("llama3tok")
    (root / "original").mkdir()
    model = root / "original" / "tokenizer.model"
    write_ranks(model, ranks)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TIKTOKEN_CACHE_DIR", "")  # the converter reads via tiktoken's (caching) loader
        converted = TikTokenConverter(
            vocab_file=str(model), pattern=META_PATTERN, extra_special_tokens=META_SPECIALS
        ).converted()
    converted.save(str(root / "tokenizer.json"))
    return root


@pytest.fixture(scope="module")
def tk(tok_dir) -> TiktokenTokenizer:
    return TiktokenTokenizer(str(tok_dir / "original" / "tokenizer.model"))


@pytest.fixture(scope="module")
def hf(tok_dir) -> HFTokenizer:
    return HFTokenizer(str(tok_dir / "tokenizer.json"))


def test_same_ids_as_tokenizer_json_and_round_trip(tk, hf, ranks):
    texts = SAMPLES + ["".join(SAMPLES), "".join(reversed(SAMPLES))]
    for text in texts:
        ids = tk.encode(text)
        assert ids == hf.encode(text), text
        assert tk.decode(ids) == text and hf.decode(ids) == text
        assert all(0 <= i < len(ranks) for i in ids)  # special-looking text stays plain text
    assert tk.encode_batch(texts) == hf.encode_batch(texts) == [tk.encode(t) for t in texts]
    # the comparison is not vacuous: merges are used, not just single bytes
    whole = "".join(SAMPLES)
    assert len(tk.encode(whole)) < 0.6 * len(whole.encode())


@settings(max_examples=150, deadline=None)
@given(
    st.text(
        alphabet=st.sampled_from(list("ab AB1234567890'’\t\n\r .,!?-_<|>éß日本😀\u0301\u00a0\u2028"))
        | st.characters(exclude_categories=("Cs",)),
        max_size=80,
    )
)
def test_same_ids_on_random_text(tk, hf, text):
    ids = tk.encode(text)
    assert ids == hf.encode(text)
    assert tk.decode(ids) == text


def test_special_ids_sizes_and_meta_order(tk, hf, ranks):
    n = len(ranks)
    assert tk.num_base_tokens == n
    assert tk.vocab_size == hf.vocab_size == n + 256
    assert (tk.bos_id, tk.eos_id, tk.pad_id) == (hf.bos_id, hf.eos_id, hf.pad_id) == (n, n + 1, None)
    for i, name in enumerate(META_SPECIALS):
        assert hf._tok.token_to_id(name) == n + i
        assert tk.decode([n + i]) == hf.decode([n + i]) == name
    # Meta's published ids for its 128000 ranks, relative to the end of the ranks
    assert [META_SPECIALS[i - 128000] for i in (128000, 128001, 128006, 128007, 128009, 128255)] == [
        "<|begin_of_text|>",
        "<|end_of_text|>",
        "<|start_header_id|>",
        "<|end_header_id|>",
        "<|eot_id|>",
        "<|reserved_special_token_250|>",
    ]
    assert tk.decode([tk.bos_id, *tk.encode("hi"), tk.eos_id]) == "<|begin_of_text|>hi<|end_of_text|>"


def test_special_token_text_in_documents_is_plain_text(tk):
    shipped = load_tokenizer()
    assert shipped.eos_id not in shipped.encode("a <|eos|> b")
    assert shipped.decode(shipped.encode("a <|eos|> b")) == "a <|eos|> b"
    ids = tk.encode("<|end_of_text|>")
    assert tk.eos_id not in ids and len(ids) > 1


def test_load_tokenizer_picks_the_format(tok_dir, tmp_path):
    model = tok_dir / "original" / "tokenizer.model"
    assert isinstance(load_tokenizer(str(model)), TiktokenTokenizer)
    assert isinstance(load_tokenizer(str(tok_dir / "original")), TiktokenTokenizer)
    # both forms present: tokenizer.json wins
    assert isinstance(load_tokenizer(str(tok_dir)), HFTokenizer)
    assert isinstance(load_tokenizer(str(tok_dir / "tokenizer.json")), HFTokenizer)
    # Meta-download layout (no tokenizer.json) and HF layout without tokenizer.json
    (tmp_path / "meta").mkdir()
    (tmp_path / "meta" / "tokenizer.model").write_bytes(model.read_bytes())
    assert isinstance(load_tokenizer(str(tmp_path / "meta")), TiktokenTokenizer)
    (tmp_path / "hf" / "original").mkdir(parents=True)
    (tmp_path / "hf" / "original" / "tokenizer.model").write_bytes(model.read_bytes())
    loaded = load_tokenizer(str(tmp_path / "hf"))
    assert isinstance(loaded, TiktokenTokenizer) and loaded.path.endswith("original/tokenizer.model")
    # any other file name: JSON by content, else tiktoken ranks
    (tmp_path / "llama3.tiktoken").write_bytes(model.read_bytes())
    assert isinstance(load_tokenizer(str(tmp_path / "llama3.tiktoken")), TiktokenTokenizer)
    (tmp_path / "tok.bin").write_bytes((tok_dir / "tokenizer.json").read_bytes())
    assert isinstance(load_tokenizer(str(tmp_path / "tok.bin")), HFTokenizer)
    (tmp_path / "broken.json").write_text('{"version": ')
    with pytest.raises(ConfigError, match=r"broken\.json is not a readable tokenizer\.json \(.+\); point"):
        load_tokenizer(str(tmp_path / "broken.json"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match=r"no tokenizer at .*tokenizer\.model"):
        load_tokenizer(str(tmp_path / "empty"))


def _good_lines(n=256):
    return [base64.b64encode(bytes([b])) + b" " + str(b).encode() for b in range(n)]


@pytest.mark.parametrize(
    "content, problem",
    [
        (b"\n\x0e\n\x05<unk>\x15\x00\x00\x00\x00\x18\x02\n\x0b\n\x03<s>\x15\x00\x00", "is not '<base64 token> <rank>'"),
        (b"hello world\n", "line 1 is not"),
        (b'{"a .model file": "is never read as JSON"}', "line 1 is not"),
        (b"\n".join(_good_lines()) + b"\nQUJD notanumber\n", "line 257 is not"),
        (b"\n".join(_good_lines()) + b"\nQUJD 300\n", "ranks are not 0..256"),
        (b"\n".join(_good_lines() + [_good_lines()[3].split()[0] + b" 256"]), "repeats a token"),
        (b"\n".join(_good_lines(200)), "56 of the 256 single bytes have no rank"),
        (b"", "it is empty"),
    ],
)
def test_not_a_rank_file_is_one_line_error(tmp_path, content, problem):
    path = tmp_path / "tokenizer.model"
    path.write_bytes(content)
    with pytest.raises(ConfigError) as exc:
        load_tokenizer(str(tmp_path))
    msg = str(exc.value)
    assert "\n" not in msg and problem in msg, msg
    assert msg.startswith(f"model.tokenizer_path: {path} is not a tiktoken BPE rank file")
    assert "point it at Meta's Llama 3 tokenizer.model" in msg


def test_reads_the_file_itself_no_fetch_no_stale_cache(tmp_path, ranks, monkeypatch):
    def no_network(*a, **k):
        raise AssertionError("tiktoken's fetching/caching loader must not be used")

    monkeypatch.setattr(tiktoken.load, "read_file_cached", no_network)
    monkeypatch.setattr(tiktoken.load, "read_file", no_network)
    path = tmp_path / "tokenizer.model"
    write_ranks(path, ranks)
    first = load_tokenizer(str(path))
    assert first.vocab_size == len(ranks) + 256
    # replaced in place (same path, fewer ranks): the new file is what loads
    fewer = {t: r for t, r in ranks.items() if r < 300}
    write_ranks(path, fewer)
    assert load_tokenizer(str(path)).vocab_size == 300 + 256


def test_dataloader_batches_with_tiktoken_tokenizer(tk, tmp_path):
    docs = SAMPLES[:7]
    with open(tmp_path / "c.jsonl", "w") as f:
        for d in docs * 4:
            f.write(json.dumps({"text": d}) + "\n")
    cfg = load_config(
        [
            "--config",
            "llama3.toml",
            "--training.dataset",
            "jsonl",
            "--training.dataset_path",
            str(tmp_path),
            "--training.seq_len",
            "16",
        ]
    )
    ld = build_dataloader(cfg, tk, batch_rank=0, batch_degree=1)
    stream = []
    for _ in range(3):
        x, y = next(ld)
        assert x.shape == y.shape and x.shape[1] == 16 and x.dtype == torch.long
        assert torch.equal(x[:, 1:], y[:, :-1])
        assert int(x.min()) >= 0 and int(x.max()) < tk.vocab_size
        stream += x.flatten().tolist()
    assert tk.eos_id in stream  # documents are separated by <|end_of_text|>
    text = tk.decode(stream)
    assert any(d.strip() and d in text for d in docs)
