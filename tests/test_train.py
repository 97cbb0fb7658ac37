"""The train stage on the CPU at toy size: the corpus (the standard library's sources as bytes, a split by
file), the learning-rate schedule, a run that logs the loss curve and the validation loss, saves weights that
load back to the same validation loss, and a report; MLflow keeps a curve as one run's metric history."""

from __future__ import annotations

import copy
import math
import subprocess
from pathlib import Path

import pandas as pd
import pytest
import torch

from adaattn_pipeline.config import ConfigError, load_raw, validate

PARAMS = Path(__file__).parents[1] / "params.yaml"
pytestmark = pytest.mark.usefixtures("pytorch_kernels")  # RoPE and norms by PyTorch: no interpreted Triton
TOY = {"batch": 2, "seq_len": 32, "steps": 6, "lr": 0.003, "warmup": 2, "log_every": 2, "eval_every": 3,
       "eval_batches": 2, "dtype": "fp32"}


def _params(update=None, goals=None):
    raw = copy.deepcopy(load_raw(PARAMS))
    raw["train"]["goals"].update(goals or {})
    # PyTorch's MLP and norm: the zoo's kernels run interpreted under the tests' TRITON_INTERPRET
    for name in raw["train"]["cpu"]["models"]:
        raw["models"][name].update({"n_layers": 3, "mlp": "gelu", "norm": "layernorm"})
    raw["train"]["cpu"].update({**TOY, **(update or {})})
    return validate(raw)


def test_the_corpus_is_the_stdlib_split_by_file(tmp_path):
    from adaattn.models.data import batch, load_corpus, stdlib_files

    for rel in ("a.py", "pkg/b.py", "site-packages/x.py", "test/t.py", "pkg/tests/u.py", "c.txt"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(f"# {rel}\n" * 50)
    assert [p.relative_to(tmp_path).as_posix() for p in stdlib_files(tmp_path)] == ["a.py", "pkg/b.py"]
    corpus = load_corpus(val_percent=50, root=tmp_path)
    again = load_corpus(val_percent=50, root=tmp_path)
    assert corpus.info == again.info and torch.equal(corpus.val, again.val)  # the split is the files' paths'
    assert corpus.info["files"] == 2 and corpus.train.numel() + corpus.val.numel() == sum(
        p.stat().st_size + 1 for p in stdlib_files(tmp_path))
    g = torch.Generator().manual_seed(0)
    b = batch(corpus.train, 3, 16, g)
    assert b.shape == (3, 17) and b.dtype == torch.long and int(b.max()) < 256
    with pytest.raises(ValueError, match="cannot hold a window"):
        batch(corpus.train[:10], 1, 16, g)


def test_the_schedule_warms_up_then_decays_to_a_tenth():
    from adaattn_experiments.common.fit import lr_factor

    assert [lr_factor(s, 4, 20) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_factor(4, 4, 20) == 1.0 and lr_factor(19, 4, 20) > 0.1 and lr_factor(20, 4, 20) == pytest.approx(0.1)
    assert all(lr_factor(s, 4, 20) >= lr_factor(s + 1, 4, 20) for s in range(4, 20))


def test_a_run_logs_curves_and_its_weights_load_back_to_the_same_validation_loss(tmp_path):
    from adaattn.models.data import VOCAB, batch, load_corpus
    from adaattn.models.train import Trainer, load_model
    from adaattn_pipeline.tracking.mlflow_log import _child_runs
    from adaattn_experiments.common.fit import evaluate
    from adaattn_experiments.train.study import Train
    from adaattn_experiments.train.report import render

    params = _params()
    study = Train("cpu", tmp_path / "weights")
    assert study.cases(params, params.targets["cpu"]) == []
    rows = study.extra_rows(params, params.targets["cpu"])
    df = pd.DataFrame([{"p20": None, "p80": None, **r, "target": "cpu", "hardware": "test cpu"} for r in rows])
    # FP8's price is a GPU's: one row that says why, no bf16 twin trained for nothing
    fp8 = df[df.precision == "fp8_rowwise"]
    assert len(fp8) == 1 and fp8.status.item() == "unavailable" and "compute capability" in fp8.reason.item()
    assert not (df.provider == "dense_small-fp32").any()
    df = df.drop(fp8.index)
    assert (df.status == "ok").all(), df[df.status != "ok"]
    run = params.train.cpu
    for model in run.models:
        mine = df[df.provider == model]
        assert set(mine.precision.dropna()) == {"fp32"}
        assert list(mine[mine.metric == "train_loss"].step) == [2, 4, 6]
        assert list(mine[mine.metric == "val_loss"].step) == [3, 6]
        assert mine[mine.metric == "tokens_per_s"].value.item() > 0
        # the weights load back: the same validation loss on the same held-out windows
        loaded = load_model(tmp_path / "weights" / "cpu" / f"{model}.pt")
        assert loaded.cfg.vocab_size == VOCAB
        held = torch.Generator().manual_seed(run.seed + 1)
        corpus = load_corpus(run.val_percent)
        val = [batch(corpus.val, run.batch, run.seq_len, held) for _ in range(run.eval_batches)]
        logged = mine[(mine.metric == "val_loss") & (mine.step == 6)].value.item()
        optimizer = torch.optim.AdamW(loaded.parameters())
        assert evaluate(Trainer(loaded, optimizer, dtype="fp32"), val) == pytest.approx(logged, rel=1e-5)
    section, price, hydra = render(pd.concat([df, fp8]), tmp_path)
    assert all(m in section.markdown for m in run.models) and (tmp_path / "train_loss_cpu.png").exists()
    (verdict,) = price.verdicts
    assert verdict.verdict == "not measurable here" and "compute capability" in verdict.reason
    # HYDRA's goals name GPU presets: on a CPU each is a row that says why, none judged
    assert {v.verdict for v in hydra.verdicts} == {"not measurable here"} and len(hydra.verdicts) == 4
    # MLflow: one run per model, each curve a metric's history over the steps
    runs = list(_child_runs(df[df.provider != "corpus"], study.config_columns))
    assert sorted(name.split(" · ")[0] for name, *_ in runs) == sorted(run.models)
    (_, _, metrics, _) = runs[0]
    assert [step for _, step in metrics["step.train_loss"]] == [2, 4, 6]
    assert math.isfinite(metrics["eval.val_loss"][-1][0])


def test_fp8s_price_trains_twins_from_the_same_weights_on_the_same_batches(tmp_path, monkeypatch):
    """FP8's price reads the FP8 run against a bf16 twin that differs in nothing else: with the conversion an
    identity (no FP8 GEMM on a CPU), the twins' losses are equal step for step, and the report's ratio is 1."""
    from adaattn_experiments.train import study as train_study
    from adaattn_experiments.train import report

    converted, options, compile_ = [], [], train_study.optimize_model
    monkeypatch.setattr(train_study, "optimize_model",
                        lambda model, **k: options.append(k["compile_options"]) or compile_(model, **k))
    monkeypatch.setattr(train_study, "float8_unavailable", lambda device: None)
    monkeypatch.setattr(train_study, "to_float8", lambda model, recipe: converted.append(recipe) or model)
    params = _params({"models": ["dense_small"],
                      "float8": {"models": ["dense_small"], **TOY, "steps": 4, "log_every": 2, "eval_every": 2}})
    rows = train_study.Train("cpu", tmp_path / "weights").extra_rows(params, params.targets["cpu"])
    df = pd.DataFrame([{"p20": None, "p80": None, **r, "target": "cpu", "hardware": "test cpu", "cuda": "13.0"}
                       for r in rows])
    assert converted == ["rowwise"] and (df.status == "ok").all()
    # the preset's own run, the bf16 twin, the FP8 twin: only the last has its casts rounded as eager's
    assert options == [None, None, {"emulate_precision_casts": True}]
    twin, fp8 = (df[df.provider == p].set_index(["metric", "step"])["value"]
                 for p in ("dense_small-fp32", "dense_small-fp8_rowwise"))
    losses = [m for m in twin.index if m[0] in ("train_loss", "val_loss")]
    assert len(losses) == 4 and all(twin[m] == fp8[m] for m in losses)
    assert not (tmp_path / "weights" / "cpu" / "dense_small-fp32.pt").exists()  # the price keeps no weights
    _, price, _ = report.render(df, tmp_path)
    (verdict,) = price.verdicts
    assert verdict.verdict == "holds" and verdict.measured.startswith("1.0000") and "dense_small-fp8_rowwise" in price.markdown
    # the band is params.yaml's, either way: 2% worse, or 2% better, is outside 1%
    for factor, expected in ((1.02, "worse than claimed"), (0.98, "better than claimed")):
        moved = df.copy()
        moved.loc[moved.provider == "dense_small-fp8_rowwise", "value"] *= factor
        assert report.render(moved, tmp_path)[1].verdicts[0].verdict == expected
    monkeypatch.setattr(report, "goals", lambda: report.TrainGoals(fp8_val_loss=0.05))
    assert report.render(moved, tmp_path)[1].verdicts[0].verdict == "holds"


def test_a_schedules_compile_settings_compile_every_run(tmp_path, monkeypatch):
    from adaattn_experiments.train import study as train_study

    seen, compile_ = [], train_study.optimize_model
    monkeypatch.setattr(train_study, "optimize_model",
                        lambda model, **k: seen.append(k) or compile_(model, **{**k, "compile_mode": None}))
    params = _params({"models": ["dense_small"], "steps": 2, "log_every": 1, "eval_every": 2, "warmup": 0,
                      "compile_mode": "default", "compile_scope": "model"})
    train_study.Train("cpu", tmp_path).extra_rows(params, params.targets["cpu"])
    assert [(k["compile_mode"], k["compile_scope"]) for k in seen] == [("default", "model")]
    params = _params({"models": ["dense_small"], "steps": 2, "log_every": 1, "eval_every": 2, "warmup": 0})
    seen.clear()
    train_study.Train("cpu", tmp_path).extra_rows(params, params.targets["cpu"])
    assert [(k["compile_mode"], k["compile_scope"]) for k in seen] == [(None, "blocks")]  # eager by default


@pytest.mark.parametrize("mode, eval_compiled", [("reduce-overhead", False), ("max-autotune", False),
                                                  ("default", True)])
def test_blocks_compiled_under_cuda_graphs_run_eagerly_outside_autograd(monkeypatch, mode, eval_compiled):
    """Blocks sharing one graph under CUDA graphs run their code eagerly in a ``no_grad`` forward (graph trees
    outside autograd would free one block's output when the shared graph replays for the next); with autograd
    on, and in a mode without CUDA graphs, the compiled graph runs. The output is the same either way."""
    from adaattn.models import train

    runs = []

    def backend(gm, _):
        return lambda *args: runs.append(1) or gm.forward(*args)

    monkeypatch.setattr(train, "_compile_kwargs", lambda *_: {"backend": backend})

    class Block(torch.nn.Module):  # a module of its own: dynamo does not trace torch.nn's own forwards
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(16, 16)

        def forward(self, x):
            return x + torch.relu(self.proj(x))

    class Toy(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = torch.nn.ModuleList(Block() for _ in range(3))

        def forward(self, x):
            for block in self.blocks:
                x = block(x)
            return x

    torch.manual_seed(0)
    model, _ = train.optimize_model(Toy(), compile_mode=mode, compile_scope="blocks")
    x = torch.randn(2, 16)
    with torch.no_grad():
        evaluated = model(x)
    assert bool(runs) == eval_compiled
    runs.clear()
    trained = model(x)
    assert len(runs) == 3  # each block's call, through the compiled graph
    torch.testing.assert_close(evaluated, trained.detach())


def test_equal_quality_reads_each_models_wall_clock_to_the_loss_both_reach(tmp_path):
    from adaattn_experiments.train.report import render

    base = {"target": "h200", "hardware": "test gpu", "table_id": "train", "batch": 4, "seq_len": 250, "mode": "eval",
            "status": "ok", "reason": "", "cuda": "13.0", "precision": "bf16", "kernel": ""}
    rows = []
    # slow: 1,000 tokens a step at 1,000 tokens/s (1 s a step), reaching 1.5 halfway between steps 100 and 200;
    # fast: 10 ms a step, ending at 1.5 at step 400 (4 s); an FP8 twin is left out of the reading
    for run, rate, curve in (("slow", 1e3, [(100, 2.0), (200, 1.0)]), ("fast", 1e5, [(200, 1.8), (400, 1.5)]),
                             ("fast-fp8_rowwise", 1e5, [(400, 9.0)])):
        model = run.split("-")[0]
        one = {**base, "provider": run, "model": model, "case_id": f"train/{run}"}
        rows += [{**one, "metric": "val_loss", "step": s, "value": v} for s, v in curve]
        rows.append({**one, "mode": "step", "metric": "tokens_per_s", "value": rate})
    m = render(pd.DataFrame(rows), tmp_path)[0].markdown
    table = m[m.index("Equal quality"):].split("![")[0]
    slow = next(line for line in table.splitlines() if "| slow " in line)
    fast = next(line for line in table.splitlines() if "| fast " in line)
    assert [c.strip() for c in slow.split("|")][3:8] == ["1.5", "150", "1000", "150", "37.5"]
    assert [c.strip() for c in fast.split("|")][3:8] == ["1.5", "400", "10", "4", "1"]
    assert "fast-fp8_rowwise" not in table


def test_hydras_goals_read_each_pair_trained_in_one_run(tmp_path, monkeypatch):
    """HYDRA against its dense peer: the tokens/s ratio and the wall-clock ratio to the loss both reach, judged
    against params.yaml's bounds; a pair the run did not train is a row that says so, not a verdict."""
    from adaattn_experiments.train import report

    base = {"target": "h200", "hardware": "test gpu", "table_id": "train", "batch": 4, "seq_len": 250,
            "mode": "eval", "status": "ok", "reason": "", "cuda": "13.0", "precision": "bf16", "kernel": ""}

    def rows(hydra_rate):
        out = []
        for run, rate, curve in (("hydra_100m", hydra_rate, [(100, 2.0), (200, 1.0)]),
                                 ("dense_100m", 1e5, [(200, 1.8), (400, 1.5)])):
            one = {**base, "provider": run, "model": run, "case_id": f"train/{run}"}
            out += [{**one, "metric": "val_loss", "step": s, "value": v} for s, v in curve]
            out.append({**one, "mode": "step", "metric": "tokens_per_s", "value": rate})
        return pd.DataFrame(out)

    monkeypatch.setattr(report, "goals", lambda: report.TrainGoals(
        hydra_pairs={"hydra_100m": "dense_100m", "hydra_1b": "llama_1b"}))
    # HYDRA at 1,000 tokens/s reaches 1.5 at step 150 (150 s), dense at step 400 at 10 ms a step (4 s)
    speed, time, *missing = report.render(rows(1e3), tmp_path)[2].verdicts
    assert (speed.measured, speed.verdict) == ("0.010x", "worse than claimed")
    assert (time.measured, time.verdict) == ("37.50x", "worse than claimed")
    assert [v.verdict for v in missing] == ["not measured yet"] * 2 and "hydra_1b, llama_1b" in missing[0].reason
    # 200x faster: 2x dense's tokens/s, 0.19x its wall-clock
    speed, time, *_ = report.render(rows(2e5), tmp_path)[2].verdicts
    assert (speed.verdict, time.verdict) == ("holds", "holds") and time.measured == "0.19x"
    monkeypatch.setattr(report, "goals", lambda: report.TrainGoals(hydra_pairs={"hydra_100m": "dense_100m"},
                                                                   hydra_tokens_ratio=2.5))
    assert report.render(rows(2e5), tmp_path)[2].verdicts[0].verdict == "worse than claimed"


def test_hydra_pairs_name_presets():
    with pytest.raises(ConfigError) as err:
        _params(goals={"hydra_pairs": {"hydra_7b": "dense_small"}})
    assert "train.goals.hydra_pairs: 'hydra_7b' is not a preset of models" in str(err.value)


@pytest.mark.parametrize("update, message", [
    ({"warmup": 6}, "warmup=6 must be below steps=6"),
    ({"models": ["hydra_7b"]}, "train.cpu.models: 'hydra_7b' is not a preset of models"),
    ({"lr": 0}, "lr"),
    ({"compile_mode": "max-autotune"}, "compile_mode"),
    ({"float8": {"models": ["dense_small"], **TOY, "recipe": "blockwise"}}, "recipe"),
    ({"float8": {"models": ["hydra_7b"], **TOY}}, "train.cpu.float8.models: 'hydra_7b' is not a preset"),
])
def test_bad_runs_name_the_key(update, message):
    with pytest.raises(ConfigError) as err:
        _params(update)
    assert message in str(err.value)


def test_weights_stay_out_of_git_and_dvc(repo):
    """A run's weights stay on the machine that trained them: not a DVC output (a fresh clone has no DVC cache
    to restore them from, and would train again) and not tracked (git ignores the folder)."""
    import yaml

    stage = yaml.safe_load((repo / "dvc.yaml").read_text())["stages"]["train"]["do"]
    assert [next(iter(o)) for o in stage["outs"]] == ["results/train/${key}.csv"]
    ignored = subprocess.run(["git", "check-ignore", "-q", "models/weights/cpu/dense_small.pt"], cwd=repo)
    assert ignored.returncode == 0



@pytest.mark.gpu
def test_on_the_gpu_float8_rowwise_trains_the_blocks_linears():
    pytest.importorskip("torchao")
    from adaattn.models.train import create_optimized_training_setup
    from adaattn.models.transformer import build_model
    from adaattn_experiments.common.float8 import float8_unavailable, to_float8

    if float8_unavailable("cuda"):
        pytest.skip(float8_unavailable("cuda"))
    cfg = _params().models["dense_small"]
    model = to_float8(build_model(cfg, device="cuda"), "rowwise")
    kinds = {name: type(m).__name__ for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    assert any(k == "Float8Linear" for n, k in kinds.items() if n.startswith("blocks."))
    assert all(k != "Float8Linear" for n, k in kinds.items() if not n.startswith("blocks."))  # the head stays
    _, _, trainer = create_optimized_training_setup(model, compile_mode=None, dtype="bf16", device="cuda")
    tokens = torch.randint(0, cfg.vocab_size, (4, 129), device="cuda")
    losses = [float(trainer.train_step((tokens[:, :-1], tokens[:, 1:]))["loss"]) for _ in range(4)]
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]
