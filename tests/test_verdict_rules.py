"""The verdict rules of docs/methods.md ("Verdicts"), each enforced in ``report.common`` or ``report.render`` and each
checked here on a case the old reading got wrong."""

import shutil
from pathlib import Path

import pandas as pd
import pytest
import yaml

from adaattn_pipeline.codegraph import study_code_hash
from adaattn_pipeline.config import load_params, param_values, params_hash, validate
from adaattn_pipeline.registry import studies
from adaattn_pipeline.report.common import interval_text, judge, same_row, tolerance_for, use_knobs
from adaattn_pipeline.report.render import render_all

REPO = Path(__file__).resolve().parents[1]


def test_an_interval_is_named_for_what_it_is():
    """Five readings or fewer: their range, not a confidence interval; one reading: the reading alone (it read
    "0.969 (CI 0.967-0.971) over 2 rounds" before)."""
    assert interval_text([0.967, 0.971], unit="") == "median 0.969 (range 0.967-0.971)"
    assert interval_text([1.5]) == "1.5x"
    many = interval_text([1.0 + i / 100 for i in range(20)])
    assert many.startswith("median ") and "x (CI " in many and "range" not in many


def test_a_table_joins_on_the_whole_key():
    """Another metric of the same measurement matches on target, case, provider and mode: two targets that share a
    case id keep their own values (the all-reduce table showed one target's times on the other's rows)."""
    frame = pd.DataFrame([
        {"target": t, "case_id": "all_reduce/x2/16MiB", "provider": "all_reduce", "mode": "all_reduce",
         "metric": m, "value": v}
        for t, us in (("h100x2", 84.7), ("h200x2", 77.5)) for m, v in (("allreduce_us", us), ("busbw_gbps", 1.0))])
    for _, row in frame[frame["metric"] == "busbw_gbps"].iterrows():
        (us,) = same_row(frame, row, "allreduce_us")
        assert us == {"h100x2": 84.7, "h200x2": 77.5}[row["target"]]


def test_a_ratio_takes_the_ratio_tolerance_whatever_it_measures():
    """G4-T3 is read on memory with / without checkpointing: a ratio, so 10%, not the 25% of a memory figure from
    other hardware (a 100M row 20% over the guide's ratio read `holds` before)."""
    from adaattn_experiments.checkpointing.report import _g4_t3

    params, _ = load_params(REPO / "params.yaml")
    claimed = 2.5 / 4.2  # the guide's 100M row
    peak = pd.Series({("h100", "m", "none"): 1000.0, ("h100", "m", "full"): 1000.0 * claimed * 1.2})
    with use_knobs(params.verdicts):
        (row,) = _g4_t3("h100", "m", "H100", peak, 100.0)
        assert tolerance_for("ratio") == params.verdicts.guide_ratio_tolerance
        old = judge((claimed * 1.2,) * 2, (claimed, claimed), higher_is_better=False,
                    tolerance=params.verdicts.guide_memory_tolerance)
    assert row.verdict == "worse than claimed" and old == "holds"
    with pytest.raises(ValueError, match="allowed: ratio, memory"):
        tolerance_for("speed")


def test_a_verdict_is_counted_under_the_table_it_is_about(tmp_path):
    """The precision study shows its G2-T2 claims in its G2-T3 section: they count under G2-T2 in the index and in
    DVC's metrics, beside the scaling study's (they counted under G2-T3 before)."""
    _, raw = load_params(REPO / "params.yaml")
    results, reports = tmp_path / "results", tmp_path / "reports"
    shutil.copytree(REPO / "results" / "precision", results / "precision")
    study = studies()["precision"]
    for path in (results / "precision").glob("*.csv"):  # current: the rule under test, not the repository's state
        df = pd.read_csv(path)
        df["params_hash"] = params_hash(param_values(raw, study.param_keys(raw, path.stem)))
        df["code_hash"] = study_code_hash("precision", study.data_deps)
        df.to_csv(path, index=False)
    render_all({"precision": study}, validate(raw), raw, results, reports, tmp_path / "metrics.json")
    table = pd.read_csv(reports / "verdicts" / "precision.csv")
    metrics = pd.read_json(tmp_path / "metrics.json")
    for table_id in ("G2-T2", "G2-T3"):
        assert (table["table_id"] == table_id).sum() == metrics[table_id].sum(), table_id
    (row,) = [ln for ln in (reports / "README.md").read_text().splitlines() if ln.startswith("| G2-T2 ")]
    assert "[precision](precision.md)" in row and "not measured yet" not in row


def test_a_goal_gets_its_verdict_rows_failing_or_not(tmp_path):
    """The kernels' two goals (at least 0.97x the best peer, at least 0.9 of the copy bandwidth) are verdicts on
    every GPU target and time, not only tables (they were tables alone before)."""
    from adaattn_experiments.kernels.report import render

    params, _ = load_params(REPO / "params.yaml")
    df = pd.concat([pd.read_csv(p, low_memory=False) for p in sorted((REPO / "results/kernels").glob("*.csv"))])
    with use_knobs(params.verdicts):
        (g4_t1,) = [s for s in render(df, tmp_path) if s.table_id == "G4-T1"]
    gpu = [t for t in df["target"].unique() if df[df["target"] == t]["cuda"].notna().any()]
    assert gpu
    for target in gpu:
        hw = df[df["target"] == target]["hardware"].iloc[0]
        mine = [v for v in g4_t1.verdicts if v.hardware == hw]
        for goal in ("the best peer's speed at every size", "of the copy bandwidth at 64 MB and more"):
            for time in ("time per call", "kernel time"):
                (v,) = [v for v in mine if goal in v.claim and f"({time})" in v.claim]
                assert v.verdict in ("holds", "worse than claimed") and "sizes x kernels below" in v.measured


def test_one_claim_one_verdict_on_one_machine():
    """SDPA's "10-15x faster than naive attention" is the attention op's claim: the attention_backends study judges
    it; the training study's whole-step gain from its sdpa rung is a table entry, not a second verdict on another
    reading of the same claim (it was "worse than claimed" there beside "not measurable here" on the same CPU)."""
    from adaattn_experiments.training.report import _g0_c1

    step = pd.DataFrame({"value": {("h100", "naive"): 2.0, ("h100", "sdpa"): 1.0, ("h100", "compile"): 0.8}})
    verdicts = _g0_c1("h100", "H100", step, ["naive", "sdpa", "compile"], cpu=False)
    assert [v.claim for v in verdicts] == ["torch.compile 10-30% more (whole training step)"]
    table = pd.concat([pd.read_csv(REPO / f"reports/verdicts/{s}.csv").assign(study=s)
                       for s in ("attention_backends", "training")])
    sdpa = table[table["claim"].str.startswith("SDPA 10-15x faster than naive attention")]
    assert set(sdpa["study"]) <= {"attention_backends"}


def test_every_mode_gets_its_verdict_and_the_goal_means_the_filed_one(tmp_path):
    """CCGQA's goal failed in the default compile mode, then was read on "the last mode's pair", where it held:
    now every pair measured (eager and each compile mode) is a verdict of its own, and the one the goal means is
    the pair params.yaml files (`verdicts.ccgqa_mode`), whatever the sweep's order."""
    from adaattn_experiments.ccgqa.report import render

    params, raw = load_params(REPO / "params.yaml")
    df = pd.read_csv(REPO / "results/ccgqa/h100.csv")
    shapes = df[df["case_id"] != "machine"].groupby(["model", "seq_len"]).ngroups
    for mode in ("default", "reduce-overhead"):
        knobs = params.verdicts.model_copy(update={"ccgqa_mode": mode})
        with use_knobs(knobs):
            (section,) = render(df, tmp_path)
        assert len(section.verdicts) == 3 * shapes  # eager, default, reduce-overhead
        filed = [v for v in section.verdicts if "the goal's pair" in v.reason]
        assert len(filed) == shapes and all(v.claim.endswith(f", {mode})") for v in filed)
    raw["verdicts"]["ccgqa_mode"] = "max-autotune"  # a mode the sweep does not measure
    with pytest.raises(Exception, match="verdicts.ccgqa_mode='max-autotune' is not a pair G4-C1.gpu measures"):
        validate(raw)


def test_a_bf16_goal_is_judged_on_bf16_configs():
    """llama_1b's 60% MFU goal is a bf16 goal: FP8 linears counted against the bf16 GEMM rate met it where no bf16
    config did. The goal reads the best bf16 config; an fp8 config's MFU is against the FP8 rate of the same run."""
    from adaattn_experiments.mfu.report import _goals

    params, _ = load_params(REPO / "params.yaml")
    ratios = pd.DataFrame(columns=["target", "case_id", "vs", "ci_low", "ci_high"])
    with use_knobs(params.verdicts):
        mfu = _goals("h100", "c", "llama_1b", "H100", "fp8", ("kernels", 0.56), 800.0, ratios, cpu=False)[0]
    assert mfu.measured == "56.0% (kernels)" and mfu.verdict == "worse than claimed"


def test_dvc_metrics_show_is_one_narrow_row():
    """DVC's metrics file holds the claims per verdict (a handful of columns); the counts per table id (some 50
    columns in `dvc metrics show`) are a tracked file beside it, and the two agree."""
    import json

    totals = json.loads((REPO / "metrics/verdict_totals.json").read_text())
    per_table = json.loads((REPO / "metrics/verdicts.json").read_text())
    assert all(isinstance(n, int) for n in totals.values()) and len(totals) <= 8
    assert totals == {v: sum(c.get(v, 0) for c in per_table.values()) for v in totals}
    dvc = yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]["report"]
    assert [list(m)[0] for m in dvc["metrics"]] == ["metrics/verdict_totals.json"]


def test_two_targets_of_one_profile_keep_their_own_cases(tmp_path):
    """Two GPUs of one profile run the same case ids: the rank report reads each target's policy and kernels from its
    own rows (it looked cases up by id alone and failed once the H100 and H200 targets both had results)."""
    from adaattn_experiments.rank.report import render

    params, _ = load_params(REPO / "params.yaml")
    one = pd.read_csv(REPO / "results" / "rank" / "h200.csv", low_memory=False)
    other = one.assign(target="h200b")
    policy = (other["provider"] == "policy") & (other["metric"] == "policy_rank")
    other.loc[policy, "kernel"] = "other-path"  # what the second target's policy ran, as its rows say
    (tmp_path / "rank").mkdir()
    with use_knobs(params.verdicts):
        (section,) = render(pd.concat([one, other], ignore_index=True), tmp_path / "rank")
    rows = [line for line in section.markdown.splitlines() if line.startswith("| h200")]
    assert any(r.startswith("| h200b ") and "other-path" in r for r in rows)
    assert not any(r.startswith("| h200 ") and "other-path" in r for r in rows)
