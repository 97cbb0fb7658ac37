"""What the runner and the stage generator ask of a study. A study's ``study.py`` subclasses ``StudyDef`` and gets
the optional hooks' defaults (nothing to compile ahead, no extra rows, the harness's default options, its sections'
profile entries as its params). Its report is ``report.py`` beside it (``render``), which the report stage finds."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rich.console import Console

if TYPE_CHECKING:  # the report's imports (matplotlib, seaborn) stay out of a measuring run
    from adaattn_pipeline.bench.compile_cache import WarmItem
    from adaattn_pipeline.bench.harness import Case
    from adaattn_pipeline.config import Params, Target

_NOTES = Console(stderr=True)


class StudyDef:
    name: str = ""
    table_ids: tuple[str, ...] = ()
    config_columns: list[str] = []
    sections: tuple[str, ...] = ()  # the params.yaml sections it reads, its own (schema.py SECTIONS)
    extra_params: tuple[str, ...] = ()  # other dotted params keys its measurements read ("parallel", ...)
    data_deps: tuple[str, ...] = ()  # files (not code) its measurements read, relative to the repository root

    def profile(self, raw: dict, target_name: str, section: str) -> str:
        """Which profile of ``section`` a target runs (its target's; a study may pick another, e.g. by GPU count)."""
        return raw["targets"][target_name]["profile"]

    def presets(self, raw: dict, section: str, profile: str) -> list[str]:
        """The model presets one profile of one of its sections names (their configs are params it reads)."""
        return []

    def param_keys(self, raw: dict, target_name: str) -> list[str]:
        """The dotted params.yaml keys a target's results depend on: what its params hash covers and what its DVC
        stage lists."""
        profile = raw["targets"][target_name]["profile"]
        keys = [f"targets.{target_name}", f"bench.{profile}"]
        presets: list[str] = []
        for sid in self.sections:
            own = self.profile(raw, target_name, sid)
            keys.append(f"{sid}.{own}")
            presets += self.presets(raw, sid, own)
        return keys + list(self.extra_params) + [f"models.{m}" for m in dict.fromkeys(presets)]

    def cases(self, params: Params, target: Target) -> list[Case]: ...

    def bind(self, device: str) -> StudyDef: ...

    def harness_options(self, params: Params, target: Target) -> dict[str, Any]:
        """Keyword arguments of ``Harness`` (host_calls, kernel_calls, utilization_s, ...)."""
        return {}

    def compile_groups(self, cases: list[Case]) -> list[list[WarmItem]]:
        """torch.compile'd calls to compile in worker processes before anything is timed."""
        return []

    def host_warm_items(self, cases: list[Case]) -> list[WarmItem]:
        """First calls whose cost is on the host, made here while the workers compile."""
        return []

    def extra_rows(self, params: Params, target: Target) -> list[dict]:
        """Measurements outside the harness, after it."""
        return []

    def extra_stages(self, raw: dict) -> dict[str, dict]:
        """DVC stages of its own besides its measuring ones (name -> ``cmd``, ``modules``, ``params``, ``outs``):
        a capture its measurements read, say."""
        return {}

    def note(self, message: str) -> None:
        """A line of progress from a long ``extra_rows`` (no bar there), with the time of day: where a run
        that ran out of time stopped, and what each part took."""
        _NOTES.log(message)
