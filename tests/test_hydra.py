"""HYDRA on the CPU: CCGQA attention, MoD and MoR routing. Each block takes the tokens the card says; a
decoder stays causal at inference (routing by the routers' own scores); routing gives the same gradients under
every checkpointing granularity; the FLOP formula agrees with PyTorch's counter; the trainer adds the routers'
auxiliary loss; bad HYDRA configs name their key."""

from __future__ import annotations

import pytest
import torch

from adaattn.models.config import ModelConfig
from adaattn.models.transformer import Transformer
from adaattn.models.card import applications, counted_flops_per_token, flops_per_token, param_counts

# PyTorch's MLP and norm keep the tests fast (the zoo's kernels run interpreted under TRITON_INTERPRET)
BASE = {"vocab_size": 97, "dim": 64, "n_layers": 4, "n_heads": 2, "n_kv_heads": 1, "attention": "ccgqa",
        "compression": 2, "max_seq_len": 64, "mlp": "gelu", "norm": "layernorm"}
ROUTINGS = {
    "mor": {"recursions": 3},
    "mod": {"mod_capacity": 0.25},
    "mor_mod": {"recursions": 3, "mod_capacity": 0.5},
}


def _hydra(**kw) -> ModelConfig:
    return ModelConfig(**{**BASE, **kw})


def _tokens(cfg: ModelConfig, b: int = 2, s: int = 24, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, cfg.vocab_size, (b, s + 1), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("routing", sorted(ROUTINGS))
def test_blocks_take_the_tokens_the_card_counts(routing):
    cfg = _hydra(**ROUTINGS[routing])
    model = Transformer(cfg).train()
    runs: list[tuple[int, int]] = []
    for i, block in enumerate(model.blocks):  # the MLP: a MoD block routes in its forward, before its layers
        block.mlp.register_forward_pre_hook(lambda mod, args, i=i: runs.append((i, args[0].shape[1])))
    t = _tokens(cfg)
    model.loss(t[:, :-1], t[:, 1:]).backward()
    assert runs == applications(cfg, 24)
    assert all(p.grad is not None for p in model.parameters())  # every router learns (gate and auxiliary loss)


@pytest.mark.parametrize("routing", sorted(ROUTINGS))
def test_inference_routing_is_causal_and_per_sequence(routing):
    torch.manual_seed(0)
    model = Transformer(_hydra(**ROUTINGS[routing])).eval()
    t = _tokens(model.cfg)[:, :-1]
    with torch.no_grad():
        out = model(t)
        changed = t.clone()
        changed[:, -1] = (changed[:, -1] + 1) % 97
        torch.testing.assert_close(model(changed)[:, :-1], out[:, :-1], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(model(t[1:]), out[1:], rtol=1e-5, atol=1e-5)  # a row alone as in the batch


def test_ccgqa_without_routing_is_causal_in_training_too():
    model = Transformer(_hydra()).train()
    t = _tokens(model.cfg)[:, :-1]
    changed = t.clone()
    changed[:, -1] = (changed[:, -1] + 1) % 97
    torch.testing.assert_close(model(changed)[:, :-1], model(t)[:, :-1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("granularity", ["full", "selective", "every_k"])
def test_routed_checkpointing_gives_the_gradients_of_none(granularity):
    torch.manual_seed(0)
    model = Transformer(_hydra(recursions=3, mod_capacity=0.5))
    t = _tokens(model.cfg)
    grads = []
    for g in ("none", granularity):
        model.zero_grad()
        model.set_checkpointing(g, every=2)
        model.loss(t[:, :-1], t[:, 1:]).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_a_routed_block_compiles_with_its_routing_in_one_graph():
    """A MoD block routes in its forward, so that compiling the block (``compile_scope="blocks"``) takes its
    router, top-k, gathers, gate and scatter with it: fullgraph fails on any graph break."""
    torch.manual_seed(0)
    model = Transformer(_hydra(mod_capacity=0.25)).train()
    block = next(b for b in model.blocks if b.router is not None)
    x, pos = torch.randn(2, 24, 64), torch.arange(24).expand(2, 24)
    compiled = torch.compile(block, backend="eager", fullgraph=True)
    for got, want in zip(compiled(x, pos), block(x, pos), strict=True):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("routing", ["none", "mor_mod"])
def test_flop_formula_agrees_with_the_counter(routing):
    # width 256: PyTorch's counter charges a grouped convolution's backward about twice over; at a real
    # preset's width the convolutions are well under 1% of a block's FLOPs, here about 1%
    cfg = _hydra(dim=256, compression=4, n_heads=2, n_kv_heads=1, **ROUTINGS.get(routing, {}))
    model = Transformer(cfg)
    formula = flops_per_token(cfg, param_counts(model), 64)
    counted = counted_flops_per_token(model, 64)
    assert counted["train"] == pytest.approx(formula["train"], rel=0.02)


def test_trainer_adds_the_routers_loss_and_lowers_the_loss():
    from adaattn.models.train import create_optimized_training_setup

    torch.manual_seed(0)
    model, _, trainer = create_optimized_training_setup(_hydra(recursions=3, mod_capacity=0.5), lr=3e-3,
                                                        compile_mode=None, dtype="fp32", device="cpu")
    t = _tokens(model.cfg, b=4, s=16, seed=1)
    logits, aux = trainer.forward(t[:, :-1], return_aux=True)
    assert aux.item() > 0  # the routers' binary cross-entropy against their own top k
    losses = [float(trainer.train_step(t)["loss"]) for _ in range(8)]
    assert losses[-1] < 0.8 * losses[0], losses


@pytest.mark.parametrize("update, message", [
    ({"positions": "learned"}, "positions 'rope'"),
    ({"recursions": 2, "n_layers": 2}, "n_layers must be >= 3"),
    ({"attention": "sdpa"}, "compression=2 needs attention='ccgqa'"),
    ({"mod_capacity": 1.5}, "mod_capacity"),
    ({"mod_capacity": 0.5, "attention": "ada", "compression": 1, "positions": "learned"}, "does not take routed"),
    ({"n_heads": 3}, "must divide dim=64 / compression=2 = 32"),
])
def test_bad_hydra_configs_name_the_key(update, message):
    with pytest.raises(ValueError, match=message):
        _hydra(**update)


def test_ccgqa_gives_sdpa_what_its_fused_kernels_take(monkeypatch):
    """q, k and v in one low-precision dtype with a contiguous head dim, routed or not: an fp32 q or k (autocast
    runs F.normalize's norm in fp32) or a strided head dim (the convolutions' channels-first output) sends SDPA
    to its math path on a GPU, which keeps the fp32 (B, H, S, S) scores."""
    import torch.nn.functional as F

    seen = []
    sdpa, normalize = F.scaled_dot_product_attention, F.normalize

    def spy(q, k, v, **kw):
        seen.append((q.dtype, k.dtype, v.dtype, q.stride(-1), k.stride(-1), v.stride(-1)))
        return sdpa(q, k, v, **kw)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    # as CUDA's autocast does it (its norm is on the fp32 list); the CPU's keeps bf16
    monkeypatch.setattr(F, "normalize", lambda x, **kw: normalize(x.float(), **kw))
    for routing in ({}, {"recursions": 3, "mod_capacity": 0.5}):
        model = Transformer(_hydra(**routing)).train()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model(_tokens(model.cfg)[:, :-1])
    assert seen and set(seen) == {(torch.bfloat16,) * 3 + (1, 1, 1)}


@pytest.mark.parametrize("channels,groups,taps", [(12, 12, 3), (12, 3, 3), (8, 2, 4), (6, 1, 2)])
@pytest.mark.parametrize("compiled_form", [False, True])
def test_causal_conv_is_conv1d_padded_on_the_left(channels, groups, taps, compiled_form):
    """CCGQA's convolutions, eager (cuDNN's) and in the form a compiled model takes (shifted multiply-adds, one
    grouped GEMM), give F.conv1d's causal result and gradients: position t sees t - K + 1 .. t."""
    import torch.nn.functional as F

    from adaattn.models.hydra import _causal_conv, _causal_conv_taps

    conv = _causal_conv_taps if compiled_form else _causal_conv

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 9, channels, dtype=torch.float64, generator=gen, requires_grad=True)
    w = torch.randn(channels, channels // groups, taps, dtype=torch.float64, generator=gen, requires_grad=True)
    got = conv(x, w, groups)
    want = F.conv1d(F.pad(x.transpose(1, 2), (taps - 1, 0)), w, groups=groups).transpose(1, 2)
    torch.testing.assert_close(got, want)
    g = torch.randn_like(got)
    torch.testing.assert_close(torch.autograd.grad(got, (x, w), g), torch.autograd.grad(want, (x, w), g))
