"""The LM head fused with the cross-entropy (``models.loss``): its value and gradients are the plain head's, with
ignored targets and a ragged last chunk; a training step through it (the mfu study's ``fused_loss``: the head
taken out of the forward, applied by the criterion) is the plain step's."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from adaattn.models.config import ModelConfig
from adaattn.models.loss import chunk_rows, linear_cross_entropy
from adaattn.models.train import create_optimized_training_setup
from adaattn.models.transformer import build_model


@pytest.mark.parametrize("rows", [5, 8, 64])
def test_value_and_gradients_are_the_plain_heads(rows):
    torch.manual_seed(0)
    B, S, E, V = 3, 13, 16, 50
    h = torch.randn(B, S, E, dtype=torch.float64, requires_grad=True)
    w = torch.randn(V, E, dtype=torch.float64, requires_grad=True)
    t = torch.randint(0, V, (B, S))
    t[0, 3] = t[2, 0] = -100  # ignored, as F.cross_entropy ignores them: out of the mean's count too
    ref = F.cross_entropy((h @ w.t()).flatten(0, 1), t.flatten())
    gh, gw = torch.autograd.grad(3 * ref, (h, w))
    out = linear_cross_entropy(h, w, t, dtype=torch.float64, rows=rows)
    fh, fw = torch.autograd.grad(3 * out, (h, w))
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=0)
    torch.testing.assert_close(fh, gh, rtol=1e-10, atol=1e-14)
    torch.testing.assert_close(fw, gw, rtol=1e-10, atol=1e-14)


def test_chunks_follow_the_shapes_and_bad_shapes_name_them():
    assert chunk_rows(8192, 2048, 32000) == 2048  # Liger's 512 rows, four times over
    assert chunk_rows(10, 2048, 32000) == 4 and chunk_rows(3, 2048, 32000) == 3  # never more rows than there are
    with pytest.raises(ValueError, match="do not match"):
        linear_cross_entropy(torch.zeros(4, 8), torch.zeros(10, 7), torch.zeros(4, dtype=torch.long))


@pytest.mark.parametrize("tied", [False, True])
def test_a_step_through_the_fused_head_is_the_plain_step(tied):
    from adaattn_experiments.mfu.study import head_loss

    cfg = ModelConfig(dim=32, n_layers=2, n_heads=2, vocab_size=64, max_seq_len=32, tie_embeddings=tied)
    torch.manual_seed(0)
    initial = build_model(cfg).state_dict()
    tokens = torch.randint(0, 64, (2, 17))
    steps = []
    for fused in (False, True):
        model = build_model(cfg)
        model.load_state_dict(initial)
        criterion = head_loss(model, "ours", "fp32") if fused else None
        model, _, trainer = create_optimized_training_setup(model, compile_mode=None, dtype="fp32", device="cpu",
                                                            tf32=False)
        out = trainer.train_step(tokens, criterion) if fused else trainer.train_step(tokens)
        params = {n.removeprefix("loss_"): p.detach().clone() for n, p in model.named_parameters()}
        steps.append((out, params))
    (plain, p0), (fused, p1) = steps
    torch.testing.assert_close(fused["loss"], plain["loss"], rtol=1e-5, atol=0)
    torch.testing.assert_close(fused["grad_norm"], plain["grad_norm"], rtol=1e-4, atol=0)
    assert p0.keys() == p1.keys()
    for name, p in p0.items():
        torch.testing.assert_close(p1[name], p, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.gpu
def test_on_the_gpu_the_compiled_chunks_match_the_bf16_head():
    torch.manual_seed(0)
    N, E, V = 3000, 256, 5000  # a ragged last chunk: the compiled softmax sees two shapes
    h = torch.randn(N, E, device="cuda", requires_grad=True)
    w = (torch.randn(V, E, device="cuda") / E**0.5).requires_grad_()
    t = torch.randint(0, V, (N,), device="cuda")
    t[::7] = -100
    with torch.autocast("cuda", dtype=torch.bfloat16):
        logits = h @ w.t()
    ref = F.cross_entropy(logits.float(), t)
    gh, gw = torch.autograd.grad(ref, (h, w))
    out = linear_cross_entropy(h, w, t, rows=1024)
    fh, fw = torch.autograd.grad(out, (h, w))
    torch.testing.assert_close(out, ref, rtol=2e-3, atol=0)
    for got, want in ((fh, gh), (fw, gw)):
        assert got.dtype == want.dtype
        assert ((got - want).norm() / want.norm()).item() < 2e-2
