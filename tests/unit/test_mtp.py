"""DeepSeek-V3 multi-token prediction (models/deepseek_v3/mtp.py, trainer/mtp.py): the module
against the report's equations, the shifted targets (documents, context parallelism), MTP off
leaving the model as it was, the embedding copies staying one parameter, Hugging Face import and
export of the MTP layer, the published 671B checkpoint's parameter count, and the refusals.

Shapes: the debug flavor cut to 2 main layers (layer 0 dense, layer 1 and the MTP block MoE, as in
the 671B where layer 61 is MoE), sequences of 16-32 tokens: every claim here is per position or
per tensor, so more tokens prove nothing more. The layout invariance (fsdp x ep, pp=2, cp=2
against one process) is tests/e2e/test_mtp_train.py.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from models.common.norms import RMSNorm
from models.deepseek_v3.block import TransformerBlock
from models.parallel.pipeline.tied import sync_tied_embedding_grads, tied_copies
from models.registry import build_model
from trainer.data.packing import IGNORE_INDEX
from trainer.forward import cross_entropy_sum
from trainer.mtp import MTPLoss, mtp_batch

pytestmark = pytest.mark.unit

SMALL = dict(n_layers=2, vocab_size=256, max_seq_len=64)


def _model(mtp_layers: int = 1, seed: int = 0, perturb: bool = True):
    torch.manual_seed(seed)
    model = build_model("deepseek_v3", "debugmodel", device="cpu", mtp_layers=mtp_layers, **SMALL)
    model.init_weights(seed)
    if perturb:  # norms start at 1: make them distinct so a swapped norm cannot hide
        g = torch.Generator().manual_seed(seed + 1)
        with torch.no_grad():
            for m in model.modules():
                if isinstance(m, RMSNorm):
                    m.weight.copy_(1 + 0.3 * torch.randn(m.weight.shape, generator=g))
    return model


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _paper_mtp_logits(model, tokens: torch.Tensor, swap: bool = False) -> torch.Tensor:
    """Depth 1 from the report's equations (section 2.2, eq. 21-23) on the model's weights:
    h'_i = M [RMSNorm(h_i); RMSNorm(Emb(t_{i+1}))] with the checkpoint's column order (embedding
    half first, ``swap`` = the report's written order), h = TRM(h'), P = OutHead(RMSNorm(h)).
    h_i is the main model's last block output (before its final norm); Emb is the MAIN
    embedding, OutHead the MAIN head (shared)."""
    eps = model.args.norm_eps
    block = model.mtp["0"]
    with torch.no_grad():
        h, rope, mask = model.trunk(tokens)
        nxt = torch.zeros_like(tokens)
        nxt[:, :-1] = tokens[:, 1:]
        emb = model.tok_embeddings.weight[nxt]
        parts = [_rms(emb, block.enorm.weight, eps), _rms(h, block.hnorm.weight, eps)]
        if swap:
            parts.reverse()
        x = torch.cat(parts, dim=-1) @ block.eh_proj.weight.T
        out = TransformerBlock.forward(block, x, rope, mask)
        return _rms(out, block.shared_head.norm.weight, eps) @ model.output.weight.T


def test_mtp_module_matches_the_report_equations():
    """Our depth-1 logits equal the equations on the same weights (fp32: measured max abs diff
    ~1e-6 on logits of magnitude ~1, tolerance 1e-5, the HF parity tests' one). Negative
    control: the concatenation in the report's written order [h; Emb] is off by orders of
    magnitude (0.1-1), so the test tells the two orders apart."""
    model = _model()
    s = 24
    tokens = torch.randint(0, 256, (2, s), generator=torch.Generator().manual_seed(3))
    mtp_tokens, _ = mtp_batch(tokens, torch.roll(tokens, -1, 1), 1)
    with torch.no_grad():
        ours = model(tokens, mtp_tokens=mtp_tokens)
        main = model(tokens)
    assert ours.shape == (2, 2 * s, 256)
    assert torch.equal(ours[:, :s], main)  # the main logits are the model's as without MTP
    ref = _paper_mtp_logits(model, tokens)
    assert ref.abs().max() > 0.5
    torch.testing.assert_close(ours[:, s:], ref, rtol=1e-5, atol=1e-5)
    wrong = _paper_mtp_logits(model, tokens, swap=True)
    assert (ours[:, s:] - wrong).abs().max() > 1e-2


def _paper_chain_logits(model, tokens: torch.Tensor, chained: bool = True) -> list[torch.Tensor]:
    """Every depth's logits from the report's equations (section 2.2, eq. 21-23): depth k
    combines the PREVIOUS depth's output h^{k-1} (h^0: the main model's last block output) with
    Emb(t_{i+k}) (token 0 past the row's end). ``chained=False`` (negative control) feeds every
    depth h^0 instead."""
    eps = model.args.norm_eps
    outs = []
    with torch.no_grad():
        h0, rope, mask = model.trunk(tokens)
        h = h0
        for k, block in enumerate(model.mtp.values(), start=1):
            nxt = torch.zeros_like(tokens)
            nxt[:, :-k] = tokens[:, k:]
            emb = model.tok_embeddings.weight[nxt]
            prev = h if chained else h0
            x = torch.cat([_rms(emb, block.enorm.weight, eps), _rms(prev, block.hnorm.weight, eps)], -1)
            h = TransformerBlock.forward(block, x @ block.eh_proj.weight.T, rope, mask)
            outs.append(_rms(h, block.shared_head.norm.weight, eps) @ model.output.weight.T)
    return outs


def test_depth_two_chains_the_depths_and_weights_their_loss():
    """D = 2: depth 2's logits equal the equations on the same weights with depth 1's output as
    its hidden input and t_{i+2} embedded (fp32, tolerance 1e-5 as above; negative control:
    depth 2 fed the main model's states instead is off by > 1e-2); the loss over mtp_batch's
    depth-2 targets is CE_main + 0.3 / 2 x (CE_1 + CE_2) (each a token sum), and ``take`` hands
    the depths' sum CE_1 + CE_2 for the metrics (trainer/trainer.py divides by D x tokens)."""
    model = _model(2)
    s = 24
    tokens = torch.randint(0, 256, (2, s), generator=torch.Generator().manual_seed(4))
    labels = torch.roll(tokens, -1, 1)
    mtp_tokens, targets = mtp_batch(tokens, labels, 2)
    with torch.no_grad():
        ours = model(tokens, mtp_tokens=mtp_tokens)
    assert ours.shape == (2, 3 * s, 256)
    ref1, ref2 = _paper_chain_logits(model, tokens)
    torch.testing.assert_close(ours[:, s : 2 * s], ref1, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours[:, 2 * s :], ref2, rtol=1e-5, atol=1e-5)
    assert (ours[:, 2 * s :] - _paper_chain_logits(model, tokens, chained=False)[1]).abs().max() > 1e-2

    # depth 2 at position i predicts t_{i+3} = labels[i + 2]; its last two positions have none
    assert torch.equal(targets[:, : s - 2, 2], labels[:, 2:])
    assert (targets[:, s - 2 :, 2] == IGNORE_INDEX).all()
    loss = MTPLoss(cross_entropy_sum, 2, 0.3)
    total = loss(ours, targets)
    ce = [cross_entropy_sum(ours[:, k * s : (k + 1) * s], targets[..., k]) for k in range(3)]
    torch.testing.assert_close(total, ce[0] + 0.15 * (ce[1] + ce[2]), rtol=1e-6, atol=0)
    torch.testing.assert_close(loss.take(torch.device("cpu")), ce[1] + ce[2], rtol=1e-6, atol=0)
    assert loss.take(torch.device("cpu")) == 0  # reset after take


def test_mtp_batch_shifts_stay_in_the_row_and_the_document():
    """Depth k embeds t_{i+k} and predicts t_{i+k+1}; past the row's end the input is token 0 and
    the target IGNORE; with an EOS among t_i..t_{i+k} the target is IGNORE (block-causal)."""
    x = torch.tensor([[10, 11, 2, 13, 14, 15, 2, 17]])
    y = torch.tensor([[11, 2, 13, 14, 15, 2, 17, 18]])
    tok, tgt = mtp_batch(x, y, 2, eos_id=2)
    n = IGNORE_INDEX
    assert tok[0].T.tolist() == [[11, 2, 13, 14, 15, 2, 17, 0], [2, 13, 14, 15, 2, 17, 0, 0]]
    assert tgt[0].T.tolist() == [
        [11, 2, 13, 14, 15, 2, 17, 18],
        [2, n, n, 15, 2, n, n, n],
        [n, n, n, 2, n, n, n, n],
    ]
    _, plain = mtp_batch(x, y, 1)  # causal attention: only the row's end is cut
    assert plain[0, :, 1].tolist() == [2, 13, 14, 15, 2, 17, 18, n]


def test_mtp_targets_are_built_before_the_cp_shard():
    """What a cp rank gets (trainer/forward.py: mtp_batch on the whole row, then the load-balanced
    shard) is each of its positions' global targets. Negative control: shifting after the shard
    (each rank's chunks shifted locally) gives other targets at the chunk edges."""
    from models.common.sequence import load_balanced_shard

    g = torch.Generator().manual_seed(5)
    x = torch.randint(3, 50, (2, 16), generator=g)
    y = torch.randint(3, 50, (2, 16), generator=g)
    tok, tgt = mtp_batch(x, y, 1)
    cp = 2
    for rank in range(cp):
        pos = load_balanced_shard(torch.arange(16).unsqueeze(0), 1, rank, cp)[0]
        got = load_balanced_shard(tgt, 1, rank, cp)
        for j, i in enumerate(pos.tolist()):
            want = y[:, i + 1] if i + 1 < 16 else torch.full((2,), IGNORE_INDEX)
            assert torch.equal(got[:, j, 1], want)
            assert torch.equal(
                load_balanced_shard(tok, 1, rank, cp)[:, j, 0], x[:, i + 1] if i + 1 < 16 else 0 * x[:, 0]
            )
        _, local = mtp_batch(load_balanced_shard(x, 1, rank, cp), load_balanced_shard(y, 1, rank, cp), 1)
        assert not torch.equal(local, got)


def test_mtp_off_leaves_the_model_and_loss_bitwise_unchanged():
    """mtp_layers = 0 (the default) builds the model it always did: the same parameters, drawn the
    same (FQN-seeded), and the same logits, bitwise equal to the main logits of the same model
    with an MTP depth; the MTP loss with weight 0 (validation) is the plain loss bitwise."""
    off, on = _model(0, perturb=False), _model(1, perturb=False)
    assert off.mtp is None and build_model("deepseek_v3", "debugmodel").args.mtp_layers == 0
    on_params = dict(on.named_parameters())
    for name, p in off.named_parameters():
        assert torch.equal(p, on_params[name]), name
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    labels = torch.roll(tokens, -1, 1)
    mtp_tokens, targets = mtp_batch(tokens, labels, 1)
    with torch.no_grad():
        main = off(tokens)
        both = on(tokens, mtp_tokens=mtp_tokens)
    assert torch.equal(main, both[:, :16])
    assert torch.equal(MTPLoss(cross_entropy_sum, 1, 0.0)(both, targets), cross_entropy_sum(main, labels))
    loss = MTPLoss(cross_entropy_sum, 1, 0.3)
    total = loss(both, targets)
    depth1 = cross_entropy_sum(both[:, 16:], targets[..., 1])
    torch.testing.assert_close(total, cross_entropy_sum(main, labels) + 0.3 * depth1, rtol=1e-6, atol=0)
    assert torch.equal(loss.take(torch.device("cpu")), depth1)


def _step(model, sync: bool) -> None:
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(2))
    mtp_tokens, targets = mtp_batch(tokens, torch.roll(tokens, -1, 1), 1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    loss = MTPLoss(cross_entropy_sum, 1, 0.3)(model(tokens, mtp_tokens=mtp_tokens), targets) / targets[..., 0].numel()
    loss.backward()
    if sync:
        sync_tied_embedding_grads([model], pd=None)
    opt.step()


def test_embedding_copies_stay_one_parameter():
    """The MTP depth's copy of the embedding (drawn equal to it) gets the summed gradient of both
    uses and stays bitwise equal to the embedding after an AdamW step; it is the one copy the
    gradient norm leaves out. Negative control: without the sum the two split after one step."""
    model = _model()
    copy = model.mtp["0"].embed_tokens.weight
    assert torch.equal(copy, model.tok_embeddings.weight)
    assert tied_copies([model]) == [copy]
    _step(model, sync=True)
    assert torch.equal(copy, model.tok_embeddings.weight)
    control = _model()
    _step(control, sync=False)
    assert (control.mtp["0"].embed_tokens.weight - control.tok_embeddings.weight).abs().max() > 1e-4


# ------------------------------------------------------------------ Hugging Face


@pytest.fixture(scope="module")
def mtp_folder(tmp_path_factory):
    """A DeepSeek-V3 folder with one MTP layer: transformers' random DeepseekV3 (which has no MTP
    layer) and, as the real checkpoint stores it, ``model.layers.{n}`` with the decoder-layer
    tensors (MoE, named as layer n-1's), enorm, hnorm, eh_proj, shared_head.norm and the copies
    of the embedding and the head."""
    hf = pytest.importorskip("tests.unit.test_hf_adapters")
    cfg, cls = hf._ds_hf("v3")
    torch.manual_seed(0)
    model = cls(cfg).float().eval()
    hf.randomize_hf_(model, 2)
    folder = tmp_path_factory.mktemp("mtp_hf")
    sd = hf._save_hf(model, folder)
    n = cfg.num_hidden_layers
    g = torch.Generator().manual_seed(9)
    last = f"model.layers.{n - 1}."
    for k, t in list(sd.items()):
        if k.startswith(last):
            sd[f"model.layers.{n}." + k[len(last) :]] = torch.randn(t.shape, generator=g)
    dim = cfg.hidden_size
    m = f"model.layers.{n}."
    for name, shape in (("enorm.weight", (dim,)), ("hnorm.weight", (dim,)), ("shared_head.norm.weight", (dim,))):
        sd[m + name] = 1 + 0.1 * torch.randn(shape, generator=g)
    sd[m + "eh_proj.weight"] = torch.randn(dim, 2 * dim, generator=g) * 0.05
    sd[m + "embed_tokens.weight"] = sd["model.embed_tokens.weight"].clone()
    sd[m + "shared_head.head.weight"] = sd["lm_head.weight"].clone()
    config = json.loads((folder / "config.json").read_text())
    config["num_nextn_predict_layers"] = 1
    hf._write_folder(folder, sd, config)
    args = build_model("deepseek_v3", "debugmodel", device="meta", **hf._ds_overrides("v3"), mtp_layers=1).args
    return folder, sd, args


def test_hf_mtp_layer_round_trips_bitwise(mtp_folder, tmp_path):
    """HF -> DCP -> HF (float32) through the converter's functions: every tensor of the folder,
    the MTP layer and its copies of the embedding and head included, comes back bit for bit, and
    config.json says num_nextn_predict_layers = 1. The MTP layer lands in our MTP block."""
    safetensors_torch = pytest.importorskip("safetensors.torch")
    from models.registry import get_hf_adapter
    from trainer.checkpoint.convert import convert_hf_to_dcp
    from trainer.checkpoint.hf_write import export_dcp_to_hf

    folder, sd, args = mtp_folder
    ours = get_hf_adapter("deepseek_v3", args).from_hf(sd)
    n = args.n_layers
    assert torch.equal(ours["mtp.0.eh_proj.weight"], sd[f"model.layers.{n}.eh_proj.weight"])
    assert torch.equal(ours["mtp.0.moe.experts.w2"][3], sd[f"model.layers.{n}.mlp.experts.3.down_proj.weight"])
    assert torch.equal(ours["mtp.0.embed_tokens.weight"], sd["model.embed_tokens.weight"])
    convert_hf_to_dcp(str(folder), str(tmp_path / "dcp"), "deepseek_v3", args)
    export_dcp_to_hf(str(tmp_path / "dcp"), str(tmp_path / "back"), "deepseek_v3", args, dtype="float32")
    back = {}
    for f in sorted((tmp_path / "back").glob("*.safetensors")):
        back.update(safetensors_torch.load_file(str(f)))
    assert set(back) == set(sd)
    assert all(torch.equal(back[k], sd[k]) for k in sd)
    assert json.loads((tmp_path / "back" / "config.json").read_text())["num_nextn_predict_layers"] == 1


def test_hf_mtp_import_checks(mtp_folder):
    """An MTP layer whose embedding copy differs from the model's is refused (we share one
    tensor), naming the key; a checkpoint without the MTP layer cannot fill mtp_layers = 1
    (config check names num_nextn_predict_layers); a model without MTP loads the folder and
    skips the layer, as transformers does."""
    from models.common.hf_adapter import HFConfigMismatch
    from models.registry import get_hf_adapter

    folder, sd, args = mtp_folder
    adapter = get_hf_adapter("deepseek_v3", args)
    n = args.n_layers
    bad = dict(sd, **{f"model.layers.{n}.embed_tokens.weight": sd["model.embed_tokens.weight"] + 1})
    with pytest.raises(ValueError, match=rf"model\.layers\.{n}\.embed_tokens\.weight.*differs"):
        adapter.from_hf(bad)
    config = json.loads((folder / "config.json").read_text())
    with pytest.raises(HFConfigMismatch, match="num_nextn_predict_layers=0 in config.json vs 1"):
        adapter.check_hf_config(dict(config, num_nextn_predict_layers=0))
    adapter.check_hf_config(config)
    plain = get_hf_adapter("deepseek_v3", build_model("deepseek_v3", "debugmodel", mtp_layers=0, **_plain(args)).args)
    assert not any(k.startswith("mtp.") for k in plain.from_hf(sd))


def _plain(args) -> dict:
    keep = ("n_layers", "vocab_size", "dim", "inter_dim", "moe_inter_dim", "n_heads", "q_lora_rank", "kv_lora_rank")
    return {k: getattr(args, k) for k in keep} | {
        k: getattr(args, k)
        for k in (
            "n_dense_layers", "n_routed_experts", "n_shared_experts", "n_activated_experts", "n_expert_groups",
            "n_limited_groups", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "route_scale",
            "rope_factor", "original_seq_len", "mscale", "max_seq_len",
        )
    }  # fmt: skip


def test_published_deepseek_v3_config_with_mtp_counts_exactly():
    """The published DeepSeek-V3 config.json (tests/unit/test_hf_adapters.py DEEPSEEK_V3, FP8 config
    aside) passes the config check with mtp_layers = 1 and builds on meta: main model
    671,026,404,352 parameters (the report's 671B); the checkpoint's tensors, MTP layer 61 with its
    copies of the embedding and head included, 684,489,845,504, plus the FP8 weights' block scales
    (one float per 128 x 128 block of every quantized matrix: 41,540,496) = 684,531,386,000, the
    parameter count of the published safetensors (the report's 685B = 671B + 14B MTP). Our model
    holds the head once (shared), so it has 926,679,040 (vocab x dim) fewer than the checkpoint."""
    hf = pytest.importorskip("tests.unit.test_hf_adapters")
    from models.deepseek_v3.hf_adapter import DeepSeekV3HFAdapter

    config = {k: v for k, v in hf.DEEPSEEK_V3.items() if k != "quantization_config"}
    main = build_model("deepseek_v3", "671B")
    model = build_model("deepseek_v3", "671B", mtp_layers=config["num_nextn_predict_layers"])
    adapter = DeepSeekV3HFAdapter(model.args)
    adapter.check_hf_config(config)
    assert model.mtp["0"].moe_enabled and model.mtp["0"].layer_id == 61
    n_main = sum(p.numel() for p in main.parameters())
    n_ours = sum(p.numel() for p in model.parameters())
    assert n_main == 671_026_404_352
    keys = adapter.hf_keys()
    n_ckpt = sum(math.prod(s) for s in keys.values())
    # the checkpoint also stores the head's copy and the routers' e_score_correction_bias (our
    # moe.expert_bias, a buffer: 256 per MoE layer, 58 + 1 MoE layers)
    biases = sum(moe.expert_bias.numel() for moe in model.moe_layers())
    assert n_ckpt == 684_489_845_504 and n_ckpt - n_ours == model.args.vocab_size * model.args.dim + biases
    no_fp8 = ("embed_tokens", "lm_head", "shared_head.head", "mlp.gate.weight", "norm", "eh_proj")
    scales = sum(
        math.ceil(s[0] / 128) * math.ceil(s[1] / 128)
        for k, s in keys.items()
        if len(s) == 2 and not any(x in k for x in no_fp8)
    )
    assert n_ckpt + scales == 684_531_386_000


# ------------------------------------------------------------------ refusals


def _plan(*argv: str):
    from trainer.config.loader import load_config
    from trainer.plan import plan_job

    return plan_job(load_config(list(argv)), 2, 2048, tokenizer_eos=1)


def test_mtp_refused_where_unsupported():
    """model.mtp_layers asked of Llama 3 / Qwen3: one line naming the problem and the fix
    (ConfigError: exit 2 from train.py, trainer/runtime/cli_errors.py); tp = 2 and pp = 2 plan."""
    from trainer.config.errors import ConfigError

    for name in ("llama3", "qwen3"):
        with pytest.raises(ConfigError) as info:
            _plan("--config", f"{name}.toml", "--model.mtp_layers", "1")
        msg = str(info.value)
        assert "\n" not in msg and "model.mtp_layers=1" in msg and "DeepSeek-V3" in msg, msg
    _plan("--config", "deepseek_v3.toml", "--model.mtp_layers", "1", "--parallelism.tensor_parallel_degree", "2")
    _plan("--config", "deepseek_v3.toml", "--model.mtp_layers", "1", "--parallelism.pipeline_parallel_degree", "2")
    with pytest.raises(ValueError, match="mtp_loss_weight must be >= 0"):
        _plan("--config", "deepseek_v3.toml", "--model.mtp_layers", "1", "--training.mtp_loss_weight", "-1")


def test_mtp_flops_count_the_depth():
    """Training FLOPs per token grow by the MTP block, its attention and one more use of the
    output head (the embedding copy is a lookup)."""
    off, on = (
        build_model("deepseek_v3", "debugmodel", **SMALL),
        build_model("deepseek_v3", "debugmodel", mtp_layers=1, **SMALL),
    )
    a = on.args
    block = on.mtp["0"]
    routed = sum(p.numel() for p in block.moe.experts.parameters())
    active_block = sum(p.numel() for p in block.parameters()) - block.embed_tokens.weight.numel()
    active_block -= routed * (1 - a.n_activated_experts / a.n_routed_experts)
    extra = 6 * (active_block + a.vocab_size * a.dim) + 12 * a.attention_dim * 64
    assert on.flops_per_token(64) == pytest.approx(off.flops_per_token(64) + extra, rel=1e-12)


def _dcp_tensors(folder) -> dict[str, torch.Tensor]:
    """Every ``model.<fqn>`` tensor of a DCP folder, read in one process."""
    import torch.distributed.checkpoint as dcp

    from trainer.checkpoint.hf_write import dcp_model_meta

    state = {k: torch.empty(shape, dtype=dtype) for k, (shape, dtype) in dcp_model_meta(str(folder)).items()}
    dcp.load({"model": state}, storage_reader=dcp.FileSystemReader(str(folder)), no_dist=True)
    return state


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_convert_hf_cli_mtp_layers(tmp_path):
    """scripts/convert_hf.py with MTP: ``to-hf`` of a checkpoint holding one MTP depth writes it
    (layer ``n_layers`` and num_nextn_predict_layers = 1, read off the checkpoint's keys, no flag);
    ``to-dcp`` of that folder takes it back by default (config.json's num_nextn_predict_layers),
    every tensor bit for bit; ``--mtp-layers 0`` drops it (the main tensors unchanged), and a
    to-hf of that has no MTP layer; ``--mtp-layers`` for Llama 3 is one line, exit 2."""
    import sys
    from pathlib import Path

    import torch.distributed.checkpoint as dcp

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
    import convert_hf

    shape = dict(n_layers=2, vocab_size=256)
    model = build_model("deepseek_v3", "debugmodel", device="cpu", mtp_layers=1, **shape)
    model.init_weights(3)
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    dcp.save({"model": sd}, storage_writer=dcp.FileSystemWriter(str(tmp_path / "ours")), no_dist=True)
    flags = ["--model", "deepseek_v3", "--flavor", "debugmodel", "--n-layers", "2", "--vocab-size", "256"]

    assert convert_hf.main(["to-hf", str(tmp_path / "ours"), str(tmp_path / "hf"), *flags, "--dtype", "float32"]) == 0
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["num_nextn_predict_layers"] == 1 and config["num_hidden_layers"] == 2
    safetensors_torch = pytest.importorskip("safetensors.torch")
    hf_keys = {k for f in (tmp_path / "hf").glob("*.safetensors") for k in safetensors_torch.load_file(str(f))}
    assert {"model.layers.2.eh_proj.weight", "model.layers.2.embed_tokens.weight"} <= hf_keys

    assert convert_hf.main(["to-dcp", str(tmp_path / "hf"), str(tmp_path / "back"), *flags]) == 0
    back = _dcp_tensors(tmp_path / "back")
    assert set(back) == set(sd) and any(k.startswith("mtp.0.") for k in back)
    assert all(torch.equal(back[k], sd[k]) for k in sd)

    assert convert_hf.main(["to-dcp", str(tmp_path / "hf"), str(tmp_path / "main"), *flags, "--mtp-layers", "0"]) == 0
    main = _dcp_tensors(tmp_path / "main")
    assert set(main) == {k for k in sd if not k.startswith("mtp.")}
    assert all(torch.equal(main[k], sd[k]) for k in main)
    assert convert_hf.main(["to-hf", str(tmp_path / "main"), str(tmp_path / "hf0"), *flags]) == 0
    assert json.loads((tmp_path / "hf0" / "config.json").read_text())["num_nextn_predict_layers"] == 0

    rc = convert_hf.main(
        ["to-dcp", str(tmp_path / "hf"), str(tmp_path / "bad"), "--model", "llama3", "--mtp-layers", "1"]
    )
    assert rc == 2 and not (tmp_path / "bad").exists()
