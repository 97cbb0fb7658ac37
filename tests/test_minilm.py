"""Real attention inputs (all-MiniLM-L6-v2 over Python's language reference): the captured q, k, v
are what the model's own attention consumes, and the rank study runs on them. The model comes
with the ``real`` extra, which CI installs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from adaattn_pipeline.config import ConfigError
from adaattn_experiments.rank import minilm

from test_g2_studies import _params, _run


def test_captured_qkv_reproduce_the_models_attention():
    """SDPA over the captured q, k, v equals the context each layer's attention hands on (the
    input of its output projection): the right tensors, split into heads the model's way."""
    q5 = minilm.qkv(64)
    tokenizer, model = minilm._model()
    enc = tokenizer(minilm.text(), truncation=True, max_length=64, return_tensors="pt")
    contexts = {}
    hooks = [layer.attention.output.dense.register_forward_pre_hook(
        lambda _m, args, i=i: contexts.__setitem__(i, args[0].detach())) for i, layer in enumerate(model.encoder.layer)]
    try:
        with torch.no_grad():
            model(**enc)
    finally:
        for h in hooks:
            h.remove()
    assert len(q5) == minilm.LAYERS and len(contexts) == minilm.LAYERS
    for i, (q, k, v) in enumerate(q5):
        assert q.shape == k.shape == v.shape == (1, minilm.HEADS, 64, minilm.HEAD_DIM) and q.dtype == torch.float32
        ours = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(1, 64, -1)
        torch.testing.assert_close(ours, contexts[i], rtol=1e-4, atol=1e-5)
    assert not torch.equal(q5[0][0], q5[1][0])  # layers differ


def test_windows_are_real_text_and_bad_lengths_are_rejected():
    tokenizer, _ = minilm._model()
    ids = tokenizer(minilm.text(), truncation=True, max_length=32)["input_ids"]
    words = tokenizer.convert_ids_to_tokens(ids)
    assert words[0] == "[CLS]" and words[-1] == "[SEP]" and "[UNK]" not in words
    lines = [line.strip() for line in minilm.text().splitlines()]
    assert not [line for line in lines if len(line) > 2 and set(line) in ({"*"}, {"="}, {"-"})]  # reST underlines
    for bad in (1, 513, 64.0):
        with pytest.raises(ValueError, match="seq_len"):
            minilm.qkv(bad)


@pytest.fixture
def capture(tmp_path, monkeypatch):
    """A capture file of 64-token windows where the rank study reads it."""
    path = minilm.capture([64], [0, 5], tmp_path / "minilm_qkv.pt")
    monkeypatch.setattr(minilm, "CAPTURE", path)
    return path


def test_capture_holds_the_models_qkv_and_names_its_source(tmp_path):
    path = minilm.capture([64, 32, 64], [4, 1], tmp_path / "c.pt")
    for S in (32, 64):
        got, source = minilm.captured(S, path)
        assert sorted(got) == [1, 4]
        for i in (1, 4):
            for a, b in zip(got[i], minilm.qkv(S)[i], strict=True):
                assert torch.equal(a, b)
    assert source["package"].startswith(minilm.PACKAGE) and len(source["text_sha256"]) == 64
    assert "windows of [32, 64], not [128]" in minilm.captured_unavailable([128], [1], path)
    assert "layers [1, 4], not [0]" in minilm.captured_unavailable([32], [0, 1], path)
    with pytest.raises(ValueError, match="layers must be in"):
        minilm.capture([32], [6], tmp_path / "bad.pt")
    with pytest.raises(RuntimeError, match="missing: run `dvc repro real_inputs`"):
        minilm.captured(64, tmp_path / "absent.pt")


def test_an_interrupted_capture_leaves_the_earlier_file(tmp_path, monkeypatch):
    path = minilm.capture([32], [0], tmp_path / "c.pt")
    before = path.read_bytes()

    def broken_save(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(torch, "save", broken_save)
    with pytest.raises(KeyboardInterrupt):
        minilm.capture([32, 64], [0], path)
    assert path.read_bytes() == before and [p.name for p in tmp_path.iterdir()] == ["c.pt"]


def test_capture_command_takes_every_profiles_lengths(tmp_path):
    from typer.testing import CliRunner

    from adaattn_experiments.rank.capture import app

    out = tmp_path / "c.pt"
    result = CliRunner().invoke(app, ["--out", str(out)])
    assert result.exit_code == 0, result.output
    cfg = _params()[0].g2_c1
    want = {*cfg.cpu.real_seq_lens, *cfg.gpu.real_seq_lens}
    layers = {*cfg.cpu.real_layers, *cfg.gpu.real_layers}
    assert want and layers and minilm.captured_unavailable(sorted(want), sorted(layers), out) is None


def test_rank_study_on_real_inputs(capture):
    from adaattn_experiments.rank.study import STUDY

    params, _ = _params(**{"G2-C1.cpu.seq_lens": [128], "G2-C1.cpu.true_ranks": [8], "G2-C1.cpu.ranks": [8, 16],
                           "G2-C1.cpu.exact_providers": ["sdpa"], "G2-C1.cpu.random_inputs": False,
                           "G2-C1.cpu.cluster_layouts": ["contiguous"], "G2-C1.cpu.real_layers": [0, 5],
                           "G2-C1.cpu.real_seq_lens": [64]})
    df = _run(STUDY, params)
    real = df[df.inputs.str.startswith("minilm-l", na=False)]
    assert set(real.inputs) == {"minilm-l0", "minilm-l5"} and set(real.seq_len) == {64}
    assert set(real.heads) == {minilm.HEADS} and set(real.head_dim) == {minilm.HEAD_DIM}
    err = real[real.metric == "rel_l2"].pivot_table(index="inputs", columns="provider", values="value")
    assert (err["sdpa"] < 1e-5).all() and (err["nystrom-8"] > err["sdpa"]).all()
    est = real[real.provider == "estimator"].pivot_table(index=["inputs", "head"], columns="metric", values="value")
    assert len(est) == 2 * minilm.HEADS and (est["spectrum_rank_full"] <= 64).all()
    assert len(real[real.metric == "policy_rank"]) == 2
    src = df[df.metric == "real_inputs_source"]
    assert len(src) == 1 and "text_sha256" in src.kernel.iloc[0]
    assert str(capture) in src.reason.iloc[0] and src.unit.iloc[0] == "windows"


def test_rank_study_without_the_capture_says_how_to_make_it(capture):
    from adaattn_experiments.rank.study import STUDY

    params, _ = _params(**{"G2-C1.cpu.real_layers": [0], "G2-C1.cpu.real_seq_lens": [64, 128]})
    with pytest.raises(ConfigError, match=r"G2-C1\.cpu\.real_layers: .*not \[128\]: run `dvc repro real_inputs`"):
        STUDY.bind("cpu").cases(params, params.targets["cpu"])


def test_real_layers_and_lengths_come_together():
    with pytest.raises(ConfigError, match="real_layers and real_seq_lens"):
        _params(**{"G2-C1.cpu.real_layers": [0], "G2-C1.cpu.real_seq_lens": []})
