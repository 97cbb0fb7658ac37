"""The cpu_baseline study (G2-T1): the guide's three CPU points, every module provider (``modules.py``)
side by side, adaattn's time read round by round against each of the others."""

from __future__ import annotations



from adaattn_pipeline.bench.harness import Case
from adaattn_pipeline.config import Params, Target
from adaattn_experiments.common.modules import ModuleStudy


class CpuBaseline(ModuleStudy):
    name = "cpu_baseline"
    section_id = "G2-T1"
    table_ids = ("G2-T1",)
    sections = ("G2-T1",)

    def section(self, params: Params, target: Target):
        sec = getattr(params.g2_t1, target.profile, None)
        if sec is None:
            raise ValueError(f"G2-T1 has no {target.profile!r} profile (it is a CPU table)")
        return sec

    def shapes(self, sec) -> list[tuple[str, int, int, bool]]:
        return [("point", b, s, False) for b, s in sec.points]

    def side_by_side_names(self, case: Case) -> list[str]:
        return [p for p in case.providers if self.unavailable(p, self.device) is None]  # none left out

    def side_by_side_keep(self, case: Case) -> list[str]:
        return self.side_by_side_names(case)



STUDY = CpuBaseline()
