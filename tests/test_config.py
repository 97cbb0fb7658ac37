"""params.yaml validation: every bad input stops with the key and the allowed values."""

import copy

import pytest
import yaml

from adaattn_pipeline.bench.runner import check_hardware, check_study_target, resolve_target
from adaattn.params import parse_override, set_override
from adaattn_pipeline.config import ConfigError, load_params, params_hash, validate


@pytest.fixture
def raw(repo):
    return yaml.safe_load((repo / "params.yaml").read_text())


def test_repo_params_validate(repo):
    params, _ = load_params(repo / "params.yaml")
    assert "cpu" in params.targets and params.g1_t2.gpu.batch == 32


def _error(raw) -> str:
    with pytest.raises(ConfigError) as info:
        validate(raw)
    return str(info.value)


def test_wrong_type_names_key(raw):
    raw["G1-T2"]["gpu"]["batch"] = "thirty-two"
    msg = _error(raw)
    assert "G1-T2.gpu.batch" in msg and "integer" in msg


def test_the_verdict_knobs_are_parameters_checked_by_name(raw):
    """The reports judge by params.yaml's verdicts section (docs/methods.md, Verdicts); a bad value names its key."""
    from adaattn_pipeline.report.common import knobs, use_knobs

    assert validate(raw).verdicts.goal_overhead == raw["verdicts"]["goal_overhead"]
    raw["verdicts"]["goal_overhead"] = 0.97
    assert "verdicts.goal_overhead" in _error(raw)
    raw["verdicts"]["goal_overhead"] = 1.05
    raw["verdicts"]["goal_overhaed"] = 1.05
    assert "verdicts.goal_overhaed" in _error(raw)
    del raw["verdicts"]["goal_overhaed"]
    with use_knobs(validate(raw).verdicts):
        assert knobs().goal_overhead == 1.05
    assert knobs().goal_overhead == 1.03  # the defaults outside a rendering


def test_unknown_provider_lists_allowed(raw):
    raw["G1-T1"]["cpu"]["providers"] = ["sdpa", "magic_attention"]
    msg = _error(raw)
    assert "G1-T1.cpu.providers" in msg and "magic_attention" in msg and "sdpa_flash" in msg


@pytest.mark.parametrize("value", [0, -4])
def test_non_positive_size(raw, value):
    raw["G1-T1"]["gpu"]["tokens"] = value
    assert "G1-T1.gpu.tokens" in _error(raw)


def test_unknown_key_lists_allowed_keys(raw):
    raw["G1-T2"]["cpu"]["bach"] = 3
    msg = _error(raw)
    assert "G1-T2.cpu.bach" in msg and "allowed keys here" in msg and "batch" in msg


def test_unknown_section(raw):
    raw["G9-T9"] = {}
    assert "G9-T9" in _error(raw)


def test_bad_dtype_lists_allowed(raw):
    raw["G1-T1"]["gpu"]["dtypes"] = ["bf32"]
    msg = _error(raw)
    assert "'bf16'" in msg and "'fp16'" in msg


def test_seq_len_must_divide_tokens(raw):
    raw["G1-T1"]["cpu"]["seq_lens"] = [300]
    assert "must divide tokens" in _error(raw)


def test_cuda_target_needs_gpu_name(raw):
    raw["targets"]["a100"] = {"device": "cuda", "profile": "gpu"}
    assert "gpu_name" in _error(raw)


def test_overrides(repo):
    params, raw = load_params(repo / "params.yaml", ["G1-T1.cpu.seq_lens=[128, 256]", "bench.cpu.repeats=2"])
    assert params.g1_t1.cpu.seq_lens == [128, 256] and params.bench.cpu.repeats == 2
    with pytest.raises(ConfigError, match="no key 'seqlens'.*allowed: tokens, seq_lens"):
        load_params(repo / "params.yaml", ["G1-T1.cpu.seqlens=[1]"])
    with pytest.raises(ConfigError, match="KEY=VALUE"):
        parse_override("G1-T1.cpu.seq_lens")
    with pytest.raises(ConfigError, match="G1-T1.cpu.seq_lens"):
        load_params(repo / "params.yaml", ["G1-T1.cpu.seq_lens=[0]"])
    with pytest.raises(ConfigError, match=r"override 'G1-T1.cpu.seq_lens=\[128, 256': VALUE is not valid YAML"):
        parse_override("G1-T1.cpu.seq_lens=[128, 256")


def test_a_broken_params_file_is_one_line_naming_the_file_and_line(tmp_path):
    path = tmp_path / "params.yaml"
    path.write_text("targets:\n  cpu: {device: cpu\nbench: 1\n")
    with pytest.raises(ConfigError, match=r"params.yaml is not valid YAML: .* at line \d+") as info:
        load_params(path)
    assert "\n" not in str(info.value)


def test_set_override_only_existing_paths():
    raw = {"a": {"b": 1}}
    set_override(raw, "a.b", 2)
    assert raw == {"a": {"b": 2}}
    with pytest.raises(ConfigError):
        set_override(raw, "a.c", 1)


def test_params_hash_is_stable_and_sensitive(raw):
    other = copy.deepcopy(raw)
    assert params_hash(raw) == params_hash(other)
    other["G1-T2"]["cpu"]["batch"] += 1
    assert params_hash(raw) != params_hash(other)


def test_target_checks(repo):
    params, _ = load_params(repo / "params.yaml")
    with pytest.raises(ConfigError, match="allowed: cpu"):
        resolve_target(params, "tpu")
    resolve_target(params, "cpu")
    with pytest.raises(ConfigError, match=r"study 'cpu_baseline' has no target 'h200' .*its targets: cpu"):
        check_study_target("cpu_baseline", params, "h200")
    check_study_target("kernels", params, "h100")
    check_study_target("attention_backends", params, "h200")
    with pytest.raises(ConfigError, match=r"study .attention_backends. has no target .h100x2."):
        check_study_target("attention_backends", params, "h100x2")


def test_gpu_target_refused_without_that_gpu(repo, monkeypatch):
    import torch

    params, _ = load_params(repo / "params.yaml")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match=r"needs a CUDA GPU.*`dvc repro -f kernels@h100`"):
        check_hardware("h100", params.targets["h100"], "kernels")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *_: "NVIDIA A100-SXM4-80GB")
    with pytest.raises(ConfigError, match="this machine has 'NVIDIA A100"):
        check_hardware("h100", params.targets["h100"])
    # a multi-GPU target on a machine with fewer of its GPUs
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *_: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    check_hardware("h100", params.targets["h100"])
    with pytest.raises(ConfigError, match=r"target 'h100x2' needs 2 GPUs \(targets.h100x2.gpus\); this machine has 1"):
        check_hardware("h100x2", params.targets["h100x2"])


def test_config_checks_names_without_importing_what_runs_them():
    """params.yaml's provider and backend names live in adaattn.names; the registries check them at import."""
    import subprocess
    import sys

    code = "import sys, adaattn_pipeline.config; print(sorted(m for m in sys.modules if m.startswith('adaattn.attention')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
    from adaattn.attention.backends import BACKENDS
    from adaattn.attention.providers import PROVIDERS
    from adaattn.names import ATTENTION_PROVIDERS, check_registry
    from adaattn.names import BACKENDS as BACKEND_NAMES

    assert tuple(PROVIDERS) == ATTENTION_PROVIDERS and tuple(BACKENDS) == BACKEND_NAMES
    with pytest.raises(RuntimeError, match="change both"):
        check_registry({"sdpa": None}, ("sdpa", "flex"), "attention provider")


def test_a_one_off_override_never_replaces_the_committed_results(repo, tmp_path, monkeypatch):
    """`adaattn run ... --set` wrote over the tracked results/<study>/<target>.csv; now it names where, or stops."""
    from typer.testing import CliRunner

    from adaattn_pipeline.cli import build_app

    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(build_app(), ["run", "precision", "--target", "cpu", "--set",
                                              "G2-T3.cpu.batch=1", "--params", str(repo / "params.yaml")])
    assert result.exit_code != 0 and "--results DIR" in result.output
    assert not (tmp_path / "results").exists()


def test_an_error_is_one_line_whatever_the_terminal(tmp_path, monkeypatch):
    """Rich wrapped a one-line error over three lines at 80 columns; brackets in it are text, not markup."""
    from typer.testing import CliRunner

    from adaattn_pipeline.cli import build_app

    monkeypatch.setenv("COLUMNS", "80")
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(build_app(), ["run", "precision", "--target", "cpu", "--set",
                                              "G1-T1.cpu.seq_lens=[128,512]"])
    (line,) = [ln for ln in result.output.splitlines() if ln.strip()]
    assert line.startswith("error: --set changes params") and len(line) > 80


def test_log_with_nothing_to_log_is_an_error(tmp_path, monkeypatch):
    """`adaattn log` in an empty directory made an mlflow.db there and exited 0."""
    from typer.testing import CliRunner

    from adaattn_pipeline.cli import build_app

    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(build_app(), ["log"])
    assert result.exit_code == 2 and "no results under" in result.output
    assert list(tmp_path.iterdir()) == []
