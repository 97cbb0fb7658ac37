"""The model zoo on the CPU: every preset builds (its tiny variant: the same code at toy sizes) and trains a
step; compiled with fullgraph; checkpointing at every granularity gives the gradients of none; the FLOP
formula agrees with PyTorch's counter; the memory estimator's arithmetic; bad configs name their key."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from adaattn_pipeline.config import ConfigError, load_params
from adaattn.models.config import ModelConfig
from adaattn.models.transformer import Transformer, build_model, tiny
from adaattn.models.card import counted_flops_per_token, estimate_memory, flops_per_token, model_card, param_counts

PARAMS = Path(__file__).parents[1] / "params.yaml"
PRESETS = load_params(PARAMS)[0].models


def _batch(cfg: ModelConfig, b: int = 2, s: int = 16, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    t = torch.randint(0, cfg.vocab_size, (b, s + 1), generator=g)
    return t[:, :-1], t[:, 1:]


VARIANTS = {
    "sdpa_rope_swiglu": {},
    "gqa_naive": {"attention": "naive", "n_kv_heads": 2},
    "flexible_qk_norm": {"attention": "flexible", "flexible_backend": "sdpa", "positions": "qk_norm_rope"},
    "ada_gelu_layernorm": {"attention": "ada", "positions": "learned", "mlp": "gelu", "norm": "layernorm"},
    "encoder_untied": {"kind": "encoder", "tie_embeddings": False, "bias": True},
}


def _small(**kw) -> ModelConfig:
    return ModelConfig(**{"vocab_size": 97, "dim": 64, "n_layers": 3, "n_heads": 4, "max_seq_len": 32, **kw})


# PyTorch's own layers: under TRITON_INTERPRET (the tests' setting) our kernels run interpreted on the CPU,
# slowly; the tests of steps, memory and the API need no kernel (the variants above run them)
PLAIN = {"mlp": "gelu", "norm": "layernorm", "positions": "learned"}


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_builds_and_trains_a_step_at_toy_size(name):
    cfg = tiny(PRESETS[name])
    model = build_model(cfg)
    tokens, targets = _batch(cfg)
    loss = model.loss(tokens, targets)
    loss.backward()
    assert model(tokens).shape == (*tokens.shape, cfg.vocab_size)
    assert abs(loss.item() - math.log(cfg.vocab_size)) < 0.5  # about uniform at initialisation
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_variants_run_and_a_decoder_is_causal(variant):
    cfg = _small(**VARIANTS[variant])
    model = Transformer(cfg).eval()
    tokens, _ = _batch(cfg)
    with torch.no_grad():
        out = model(tokens)
        changed = tokens.clone()
        changed[:, -1] = (changed[:, -1] + 1) % cfg.vocab_size
        out2 = model(changed)
    same_prefix = torch.allclose(out[:, :-1], out2[:, :-1], atol=1e-5)
    assert same_prefix == (cfg.kind == "decoder")  # an encoder's earlier positions see the last token


def test_rope_cache_is_shared_by_every_layer():
    model = Transformer(_small())
    ropes = {id(b.attn.rope) for b in model.blocks}
    assert ropes == {id(model.rope)}


def test_tied_head_is_the_embedding_and_counts_once():
    model = Transformer(_small())
    assert model.head.weight is model.embed.weight
    counts = param_counts(model)
    assert counts["total"] == sum(p.numel() for p in model.parameters())
    assert counts["matmul"] == counts["non_embedding"] - _norm_params(model) + 97 * 64


def _norm_params(model: Transformer) -> int:
    return sum(p.numel() for n, p in model.named_parameters() if "norm" in n)


@pytest.mark.parametrize("granularity", ["full", "selective", "every_k"])
def test_checkpointing_gives_the_gradients_of_none(granularity):
    torch.manual_seed(0)
    model = Transformer(_small(attention="naive"))
    tokens, targets = _batch(model.cfg)
    grads = []
    for g in ("none", granularity):
        model.zero_grad()
        model.set_checkpointing(g, every=2)
        model.loss(tokens, targets).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_checkpointing_recomputes_the_parts_it_names():
    """Forward calls of each sub-layer in one training step: a checkpointed part runs twice (counted as it starts:
    a recomputation stops once it has the last tensor the backward needs, before the sub-layer returns)."""
    model = Transformer(_small(n_layers=4, **PLAIN))
    calls = {"attn": 0, "mlp": 0}
    for block in model.blocks:
        block.attn.register_forward_pre_hook(lambda *_: calls.__setitem__("attn", calls["attn"] + 1))
        block.mlp.register_forward_pre_hook(lambda *_: calls.__setitem__("mlp", calls["mlp"] + 1))
    tokens, targets = _batch(model.cfg)
    expected = {"none": (4, 4), "full": (8, 8), "selective": (8, 4), "every_k": (6, 6)}  # every 2nd of 4 blocks
    for g, (attn, mlp) in expected.items():
        model.set_checkpointing(g, every=2)
        calls.update(attn=0, mlp=0)
        model.loss(tokens, targets).backward()
        assert (calls["attn"], calls["mlp"]) == (attn, mlp), g
    with pytest.raises(ValueError, match="not one of: none, full, selective, every_k"):
        model.set_checkpointing("blocks")


def test_compiles_with_fullgraph():
    cfg = _small()
    model = Transformer(cfg)
    tokens, _ = _batch(cfg)
    eager = model(tokens)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(tokens), eager, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("variant", ["sdpa_rope_swiglu", "gqa_naive", "ada_gelu_layernorm"])
def test_flop_formula_agrees_with_the_counter(variant):
    cfg = _small(**VARIANTS[variant])
    model = Transformer(cfg)
    formula = flops_per_token(cfg, param_counts(model), 32)
    counted = counted_flops_per_token(model, 32)
    assert counted["train"] == pytest.approx(formula["train"], rel=0.02)
    assert counted["forward"] == pytest.approx(formula["forward"], rel=0.02)


def test_memory_estimate_by_hand():
    """One layer, B=1, S=4, dim 8, 2 heads of 4, SwiGLU hidden 16, RoPE, vocab 10. fp32 (no autocast): per
    token each norm keeps 2 x 8 elements (its input and the matmul's), attention its qkv output (3 x 8), the
    rotated q and k (2 x 8), its output and the output's reshape (2 x 8) and a log-sum-exp per head, the MLP
    3 x 16; the final norm 2 x 8 and the loss's log-probabilities 10."""
    cfg = ModelConfig(vocab_size=10, dim=8, n_layers=1, n_heads=2, mlp_hidden=16, max_seq_len=4)
    params = {"total": 1000, "matmul": 700}
    m = estimate_memory(cfg, params, batch=1, seq_len=4, dtype="fp32")
    T = 4
    attn = T * ((2 * 8 + 3 * 8 + 2 * 8 + 2 * 8) * 4 + 2 * 4)
    mlp = T * (2 * 8 + 3 * 16) * 4
    assert m["activations"] == attn + mlp + T * 2 * 8 * 4 + T * 10 * 4
    assert (m["weights"], m["gradients"], m["optimizer"]) == (4000, 4000, 8000)
    assert m["total"] == 4000 + 8000 + max(m["activations"] + T * 10 * 8 + 10 * 8 * 4, 4000)
    full = estimate_memory(cfg, params, batch=1, seq_len=4, dtype="fp32", checkpointing="full")
    assert full["activations"] == T * 8 * 4 + attn + mlp + T * 2 * 8 * 4 + T * 10 * 4
    bf16 = estimate_memory(cfg, params, batch=1, seq_len=4, dtype="bf16")  # autocast: fp32 weights, bf16 activations
    assert (bf16["weights"], bf16["optimizer"]) == (4000, 8000)
    bf16_attn = T * ((8 * 4 + 8 * 2) + (3 * 8 + 2 * 8 + 2 * 8) * 2 + 2 * 4)  # norm: fp32 input, bf16 copy
    bf16_mlp = T * ((8 * 4 + 8 * 2) + 3 * 16 * 2)
    assert bf16["activations"] == bf16_attn + bf16_mlp + T * (8 * 4 + 8 * 2) + 700 * 2 + T * 10 * 4
    # full checkpointing: the block keeps its input and no weight copy (its recomputation casts again), the head
    # its copy; the block's activations come back in its recomputation, after the loss's tensors are freed
    ck = estimate_memory(cfg, params, batch=1, seq_len=4, dtype="bf16", checkpointing="full")
    kept = T * 8 * 4 + T * (8 * 4 + 8 * 2) + 10 * 8 * 2
    assert ck["activations"] == kept + T * 10 * 4 + bf16_attn + bf16_mlp
    assert ck["total"] == 4000 + 8000 + max(kept + T * 10 * 4 + T * 10 * 8 + 10 * 8 * 4,
                                            kept + bf16_attn + bf16_mlp + 10 * 8 * 4, 4000)


def test_model_card_holds_counts_flops_memory_and_a_step():
    card = model_card("toy", _small(**PLAIN))
    assert card["params"]["total"] > 0 and card["flops_per_token"]["counted_over_formula"] == pytest.approx(1, rel=0.02)
    assert set(card["memory_estimate_bytes"]["by_checkpointing"]) == {"none", "full", "selective", "every_k"}
    assert card["step_check"]["grads_finite"] and abs(card["step_check"]["loss_at_init"] - math.log(97)) < 0.5


@pytest.mark.parametrize("update, message", [
    ({"attention": "flash3"}, "attention"),
    ({"n_heads": 5}, "must divide dim"),
    ({"n_kv_heads": 3}, "must divide n_heads"),
    ({"dim": -8}, "dim"),
    ({"attention": "ada", "positions": "rope"}, "positions must be 'learned'"),
    ({"mlp": "relu"}, "mlp"),
])
def test_bad_model_configs_name_the_key(update, message, tmp_path):
    import yaml

    raw = yaml.safe_load(PARAMS.read_text())
    name = "g0_transformer"
    raw["models"][name] = {**raw["models"][name], **update}
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(ConfigError) as err:
        load_params(path)
    assert f"models.{name}" in str(err.value) and message in str(err.value)


def test_trainer_steps_lower_the_loss_and_a_checkpoint_loads_back(tmp_path):
    """A few AdamW steps on one tiny batch (fp32 and bf16 autocast) lower its loss; the saved model loads back
    into the same outputs."""
    from adaattn.models.train import create_optimized_training_setup, load_model, save_checkpoint

    for dtype in ("fp32", "bf16"):
        torch.manual_seed(0)
        model, optimizer, trainer = create_optimized_training_setup(
            _small(**PLAIN), lr=3e-3, compile_mode=None, dtype=dtype, device="cpu")
        tokens = torch.randint(0, 97, (4, 17), generator=torch.Generator().manual_seed(1))
        losses = [float(trainer.train_step(tokens)["loss"]) for _ in range(8)]
        assert losses[-1] < 0.8 * losses[0], (dtype, losses)
        assert trainer.steps == 8 and not trainer.scaler.is_enabled()
    path = tmp_path / "ckpt" / "model.pt"
    save_checkpoint(path, model, optimizer, step=8)
    loaded = load_model(path)
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded.eval()(tokens[:, :-1]), model(tokens[:, :-1]))
    assert not list(path.parent.glob(".*.tmp"))


def test_setup_groups_decay_and_rejects_bad_arguments():
    from adaattn.models.train import Trainer, create_optimized_training_setup, optimize_model, param_groups

    model = Transformer(_small(bias=True))
    decay, rest = param_groups(model, 0.1)
    assert all(p.dim() == 2 for p in decay["params"]) and id(model.embed.weight) not in map(id, decay["params"])
    n = len({id(p) for p in model.parameters()})
    assert len(decay["params"]) + len(rest["params"]) == n and rest["weight_decay"] == 0.0
    with pytest.raises(ValueError, match="compile_mode 'max_performance' is not one of: default"):
        optimize_model(model, compile_mode="max_performance")
    with pytest.raises(ValueError, match="dtype 'int8' is not one of: fp32, bf16, fp16"):
        create_optimized_training_setup(_small(), dtype="int8", compile_mode=None, device="cpu")
    with pytest.raises(ValueError, match="checkpointing 'some' is not one of"):
        create_optimized_training_setup(_small(), checkpointing="some", compile_mode=None, device="cpu")
    with pytest.raises(ValueError, match="compile_scope 'layers' is not one of: model, blocks"):
        create_optimized_training_setup(_small(), compile_scope="layers", device="cpu")
    with pytest.raises(ValueError, match="compile_scope 'blocks' needs a model with a `blocks` ModuleList"):
        optimize_model(torch.nn.Linear(4, 4), compile_scope="blocks")
    opt = torch.optim.AdamW(model.parameters())
    assert Trainer(model, opt, dtype="fp16").scaler.is_enabled()  # fp16's range needs loss scaling
    with pytest.raises(ValueError, match="grad_clip must be > 0"):
        Trainer(model, opt, grad_clip=0)


def test_accumulated_micro_batches_make_the_whole_batchs_step():
    from adaattn.models.train import Trainer

    cfg = _small(**PLAIN)
    tokens = torch.randint(0, cfg.vocab_size, (4, 17), generator=torch.Generator().manual_seed(0))
    weights, losses = [], []
    for parts in (1, 2, 4):
        torch.manual_seed(0)
        model = Transformer(cfg)
        # SGD: a step proportional to the gradient (Adam's first step is not: it divides a scale away)
        trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), dtype="fp32", grad_clip=None)
        out = trainer.train_step(tokens, micro_batches=parts)
        losses.append(float(out["loss"]))
        assert out["tokens"] == 4 * 16
        weights.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    assert losses[1] == pytest.approx(losses[0], rel=1e-6) and losses[2] == pytest.approx(losses[0], rel=1e-6)
    torch.testing.assert_close(weights[1], weights[0], rtol=1e-5, atol=1e-6)
    # every part adds into one gradient allocated before the first, never into a tensor a backward returned (under
    # CUDA graphs that is the graph's output, overwritten by the next part: pytorch/pytorch#169545)
    grads, backward = {}, torch.Tensor.backward

    def spy(loss, *args, **kwargs):
        for p in model.parameters():
            grads.setdefault(p, set()).add(None if p.grad is None else p.grad.data_ptr())
        return backward(loss, *args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.Tensor, "backward", spy)
        trainer.train_step(tokens, micro_batches=4)
    assert all(len(ptrs) == 1 and None not in ptrs for ptrs in grads.values())
    torch.testing.assert_close(weights[2], weights[0], rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="micro_batches=3 must be a positive int dividing the batch"):
        trainer.train_step(tokens, micro_batches=3)
    with pytest.raises(ValueError, match=r"batch must be tokens \(B, S \+ 1\).*got shape \(17,\)"):
        trainer.train_step(tokens[0])


@pytest.mark.gpu
def test_on_the_gpu_micro_batches_accumulate_under_cuda_graphs():
    """Blocks compiled under CUDA graphs, a step in 4 micro-batches: the same step as eager (pytorch/pytorch#169545:
    without gradients allocated before the first part this raises, or accumulates a wrong gradient)."""
    from adaattn.models.train import Trainer, optimize_model

    cfg = _small(n_layers=4)
    tokens = torch.randint(0, cfg.vocab_size, (8, 33), generator=torch.Generator().manual_seed(0)).cuda()
    runs = []
    for mode in (None, "reduce-overhead"):
        torch.manual_seed(0)
        model = Transformer(cfg).cuda()
        optimize_model(model, compile_mode=mode, tf32=False, compile_scope="blocks")
        trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), dtype="fp32", grad_clip=None)
        losses = [float(trainer.train_step(tokens, micro_batches=4)["loss"]) for _ in range(3)]
        runs.append((losses, torch.cat([p.detach().flatten() for p in model.parameters()])))
    assert runs[1][0] == pytest.approx(runs[0][0], rel=1e-4)
    torch.testing.assert_close(runs[1][1], runs[0][1], rtol=1e-4, atol=1e-5)


def test_optimize_says_what_it_set_and_keeps_the_models_parameters():
    from adaattn.models.train import optimize_for_h200, optimize_model

    model = Transformer(_small(**PLAIN))
    tokens, _ = _batch(model.cfg)
    same, settings = optimize_model(model, compile_mode=None, tf32=False)
    assert same is model and (settings.compile_mode, settings.tf32, settings.dtype) == (None, False, "fp32")
    half, settings = optimize_model(Transformer(_small(**PLAIN)), compile_mode=None, dtype="bf16", tf32=False)
    assert settings.dtype == "bf16" and next(half.parameters()).dtype == torch.bfloat16
    compiled, settings = optimize_for_h200(model, compile_mode=None)
    assert compiled is model and settings.memory_fraction is None  # no CUDA here: said, not set
    assert settings.notes == ["no CUDA device: TF32 and the memory fraction do not apply"] and not settings.tf32


def test_blocks_scope_compiles_each_block_in_place_and_one_graph_serves_them(monkeypatch):
    """Regional compilation: the model is not wrapped, each block is compiled, identical blocks share one graph;
    the compiled loss gives the eager loss."""
    from torch._dynamo.testing import CompileCounter

    from adaattn.models.train import create_optimized_training_setup, optimize_model

    counter = CompileCounter()
    compile_ = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, *a, **k: compile_(fn, backend=counter))
    torch._dynamo.reset()
    model = Transformer(_small(**PLAIN, n_layers=3))
    tokens, _ = _batch(model.cfg)
    expected = model(tokens)
    same, _ = optimize_model(model, compile_scope="blocks", tf32=False)
    assert same is model and all(b._compiled_call_impl is not None for b in model.blocks)
    torch.testing.assert_close(model(tokens), expected)
    assert counter.frame_count == 1  # three blocks, one graph
    losses = []
    for compile_loss in (False, True):
        torch.manual_seed(0)
        _, _, trainer = create_optimized_training_setup(_small(**PLAIN), compile_mode=None, dtype="fp32",
                                                        device="cpu", compile_loss=compile_loss)
        losses.append(trainer.loss(tokens[:, :-1], tokens[:, 1:])[0])
    torch.testing.assert_close(losses[1], losses[0])
    assert counter.frame_count == 2  # the loss's graph
    torch._dynamo.reset()


def test_compile_options_reach_inductor_over_the_modes_own_and_bad_names_fail_first(monkeypatch):
    """torch.compile takes a mode or options, not both: with options, each block compiles with the mode's table
    and the options over it; without, with the mode alone; a name inductor lacks fails before a model is built."""
    from adaattn.models.train import create_optimized_training_setup, optimize_model

    seen = []
    monkeypatch.setattr(torch, "compile", lambda fn, *a, **k: seen.append(k) or fn)
    model = Transformer(_small(**PLAIN, n_layers=2))
    optimize_model(model, compile_mode="max-autotune-no-cudagraphs", compile_scope="blocks", tf32=False,
                   compile_options={"emulate_precision_casts": True})
    assert seen == 2 * [{"options": {"max_autotune": True, "coordinate_descent_tuning": True,
                                     "emulate_precision_casts": True}}]
    seen.clear()
    optimize_model(Transformer(_small(**PLAIN)), compile_mode="default", tf32=False)
    assert seen == [{"mode": "default"}]
    built = []
    monkeypatch.setattr(Transformer, "__init__", lambda *a, **k: built.append(a))
    with pytest.raises(ValueError, match=r"compile_options \['emulate_casts'\] are not inductor options"):
        create_optimized_training_setup(_small(), device="cpu", compile_options={"emulate_casts": True})
    assert not built and len(seen) == 1


def test_card_command_writes_a_card_and_names_an_unknown_preset(tmp_path):
    import json

    from typer.testing import CliRunner

    from adaattn_pipeline.cli import build_app

    app = build_app()
    result = CliRunner().invoke(app, ["card", "g0_small", "--out", str(tmp_path), "--no-check", "--params",
                                      str(PARAMS)])
    assert result.exit_code == 0, result.output
    card = json.loads((tmp_path / "g0_small.json").read_text())
    assert card["name"] == "g0_small" and card["step_check"] is None and not list(tmp_path.glob(".*.tmp"))
    result = CliRunner().invoke(app, ["card", "gpt5", "--out", str(tmp_path), "--params", str(PARAMS)])
    assert result.exit_code == 2 and "unknown model preset 'gpt5'; allowed: g0_transformer, g0_small" in result.output
