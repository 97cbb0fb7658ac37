"""The ``adaattn`` command line: the pipeline's commands over the studies the registry finds in ``experiments/``.
Each command imports what it needs when it runs (``--help`` imports no study)."""


import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from adaattn_pipeline.config import ConfigError, load_params
from adaattn_pipeline.registry import studies as registered

PARAMS = Annotated[Path, typer.Option("--params", help="params.yaml to read")]


def build_app(studies: Mapping[str, Any] | None = None) -> typer.Typer:
    studies = registered() if studies is None else studies
    app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                      help="AdaAttn: regenerate the performance guides' tables on this machine.")
    console = Console(stderr=True)

    def fail(message: str) -> None:
        # one line, as long as it is: a terminal wraps it, a log or grep reads it whole
        console.print(f"[bold red]error:[/] {escape(message)}", soft_wrap=True, highlight=False)
        raise typer.Exit(2)

    @app.command()
    def env() -> None:
        """Print hardware, software, and which attention providers can run here (and why not)."""
        import torch

        from adaattn.attention.providers import PROVIDERS
        from adaattn_pipeline.bench.provenance import hardware, triton_version

        device = "cuda" if torch.cuda.is_available() else "cpu"
        out = Console()
        info = Table(title="machine", show_header=False)
        for key, value in {**hardware(device), "torch": torch.__version__, "triton": triton_version(),
                           "python": sys.version.split()[0]}.items():
            info.add_row(key, str(value))
        out.print(info)
        prov = Table(title=f"attention providers on {device}")
        prov.add_column("provider")
        prov.add_column("status")
        prov.add_column("detail")
        for name, p in PROVIDERS.items():
            reason = p.unavailable(device)
            prov.add_row(name, "[green]available[/]" if reason is None else "[red]unavailable[/]",
                         reason or p.description)
        out.print(prov)

    @app.command()
    def run(
        study: Annotated[str, typer.Argument(help=f"one of: {', '.join(studies)}")],
        target: Annotated[str, typer.Option(help="hardware target from params.yaml `targets`")] = "cpu",
        set_: Annotated[list[str] | None, typer.Option(
            "--set", help="override a param, KEY=VALUE (YAML value), e.g. G1-T1.cpu.seq_lens=[128,256]")] = None,
        params: PARAMS = Path("params.yaml"),
        results: Annotated[Path | None, typer.Option(
            help="results root (default: results; with --set it must be given)")] = None,
    ) -> None:
        """Measure one study on one hardware target; writes <results>/<study>/<target>.csv."""
        from adaattn_pipeline.bench.runner import run_study

        if study not in studies:
            fail(f"unknown study {study!r}; allowed: {', '.join(studies)}")
        if set_ and results is None:  # a one-off run never silently replaces the committed results
            fail(f"--set changes params: say where its results go, --results DIR (e.g. --results runs/mine), or "
                 f"--results results to replace the committed results/{study}/{target}.csv")
        results = results or Path("results")
        try:
            cfg, raw = load_params(params, set_)
            run_study(studies[study], cfg, raw, target, results, console)
        except ConfigError as err:
            fail(str(err))

    @app.command()
    def tune(
        shape: Annotated[list[str], typer.Option("--shape", help="BxS or BxLxS; repeat for several")],
        embed_dim: Annotated[int, typer.Option(help="model width E")],
        heads: Annotated[int, typer.Option(help="query heads")],
        kv_heads: Annotated[int | None, typer.Option(help="kv heads (GQA); default: heads")] = None,
        dtype: Annotated[str, typer.Option(help="fp32, bf16 or fp16: the dtype attention computes in")] = "bf16",
        mask: Annotated[str, typer.Option(help="none, causal or padding (a key padding mask)")] = "none",
        mode: Annotated[str, typer.Option(help="fwd (inference), fwd_bwd (training) or both")] = "both",
        cache: Annotated[Path | None, typer.Option(help="cache file; default $ADAATTN_KERNEL_CACHE")] = None,
        device: Annotated[str | None, typer.Option(help="cpu or cuda; default cuda where there is one")] = None,
    ) -> None:
        """Rank AdaAttention's attention backends for these shapes into the persisted cache, so that compiled
        models find every decision made (what was ranked, and how long it took, is printed)."""
        from adaattn.attention.tune import Shape, cache_path, tune_shapes

        try:
            shapes = [Shape.parse(s) for s in shape]
            path = cache_path(cache)
            rows = tune_shapes(embed_dim, heads, shapes, path, kv_heads=kv_heads, dtype=dtype, mask=mask, mode=mode,
                               device=device)
        except ValueError as err:
            fail(str(err))
        table = Table(title=f"attention backends ranked into {path}")
        for col in ("shape", "mode", "ranking (median GPU ms)", "s"):
            table.add_column(col)
        for r in rows:
            sh = r["shape"]
            ranked = " > ".join(f"{b} ({r['ms'][b]:.3g})" for b in r["ranking"]) or r["signature"]
            table.add_row(f"{sh.batch}x{sh.q_len}x{sh.k_len}", "fwd_bwd" if r["grad"] else "fwd", ranked,
                          f"{r['seconds']:.2f}")
        Console().print(table)

    @app.command()
    def card(
        preset: Annotated[str, typer.Argument(help="a preset of params.yaml `models`")],
        params: PARAMS = Path("params.yaml"),
        out: Annotated[Path, typer.Option(help="folder of the model cards")] = Path("models"),
        check: Annotated[bool, typer.Option(help="run the forward and backward check (fp32, on the CPU)")] = True,
    ) -> None:
        """Build one preset of the model zoo and write its card, models/<preset>.json: parameters, FLOPs per
        token (formula and PyTorch's counter), a training step's memory by component, a step's check."""
        from adaattn_pipeline.cards import write_card

        try:
            cfg, _ = load_params(params)
        except ConfigError as err:
            fail(str(err))
        if preset not in cfg.models:
            fail(f"unknown model preset {preset!r}; allowed: {', '.join(cfg.models) or '(none in params.yaml)'}")
        console.print(write_card(preset, cfg.models[preset], out, check=check))

    @app.command()
    def report(
        params: PARAMS = Path("params.yaml"),
        results: Annotated[Path, typer.Option(help="results root")] = Path("results"),
        out: Annotated[Path, typer.Option(help="reports folder")] = Path("reports"),
        metrics: Annotated[Path, typer.Option(help="verdict counts per table id (the DVC metrics file)")] = Path(
            "metrics/verdicts.json"),
    ) -> None:
        """Render reports/ (figures, tables, README index with verdicts) from results/ only."""
        from adaattn_pipeline.report.render import render_all

        try:
            cfg, raw = load_params(params)
        except ConfigError as err:
            fail(str(err))
        console.print(f"wrote {render_all(studies, cfg, raw, results, out, metrics)}")

    @app.command()
    def stale(
        params: PARAMS = Path("params.yaml"),
        results: Annotated[Path, typer.Option(help="results root")] = Path("results"),
        check: Annotated[bool, typer.Option("--check", help="exit 1 if any result is stale")] = False,
    ) -> None:
        """List the results that cast no verdict (measured under other code or params than today's, or for a target
        the study no longer has: the reports' rule) and the command that measures each again. `dvc status` can miss
        them: `dvc commit` rewrites dvc.lock without measuring, as a GPU stage measured elsewhere is committed."""
        from adaattn_pipeline.report.render import stale_results

        try:
            cfg, raw = load_params(params)
        except ConfigError as err:
            fail(str(err))
        table = Table("stage", "why", "measure it again", title="stale results", title_justify="left")
        for stage, why in stale_results(studies, cfg, raw, results).items():
            target = stage.split("@")[1]
            here = target in cfg.targets and cfg.targets[target].device == "cpu"
            again = f"dvc repro -f {stage}" if here else \
                f"adaattn run {stage.replace('@', ' --target ')} there; dvc commit -f {stage}"
            table.add_row(stage, why, again)
        out = Console(width=None if sys.stdout.isatty() else 200)  # a pipe or a log reads each row on one line
        out.print(table if table.row_count else "no stale results: every committed result votes")
        if check and table.row_count:
            raise typer.Exit(1)

    @app.command()
    def log(
        results: Annotated[Path, typer.Option(help="results root")] = Path("results"),
        reports: Annotated[Path, typer.Option(help="reports folder (figures become artifacts)")] = Path("reports"),
        manifest: Annotated[Path, typer.Option(help="sync manifest (the DVC output)")] = Path("mlflow_sync.json"),
        workers: Annotated[int, typer.Option(min=1, help="runs logged at once to a tracking server")] = 16,
    ) -> None:
        """Log every results file to MLflow (idempotent); MLFLOW_TRACKING_URI picks a remote server."""
        from adaattn_pipeline.tracking.mlflow_log import sync, tracking_uri

        if not any(results.glob("*/*.csv")):  # before MLflow makes a store here: nothing to log is an error
            fail(f"no results under {results.resolve()}: run from the repository root, or name them with --results")
        actions = sync(studies, results, reports, Path.cwd(), manifest, workers)
        for key, action in actions.items():
            console.print(f"{key}: {action}")
        console.print(f"MLflow store: {tracking_uri(Path.cwd())}")

    @app.command()
    def stages(
        params: PARAMS = Path("params.yaml"),
        check: Annotated[bool, typer.Option("--check", help="only say whether dvc.yaml is what it would write")] = False,
    ) -> None:
        """Write dvc.yaml from the studies in experiments/ and params.yaml: each stage's deps are the files its code
        reaches through imports. Run it after adding a study or changing what one imports."""
        from adaattn_pipeline.stages import render, write

        try:
            _, raw = load_params(params)
        except ConfigError as err:
            fail(str(err))
        if check:
            if Path("dvc.yaml").is_file() and Path("dvc.yaml").read_text() == render(raw):
                console.print("dvc.yaml is up to date")
                return
            fail("dvc.yaml differs from what `adaattn stages` writes: run it and commit the result")
        console.print("wrote dvc.yaml" if write(raw) else "dvc.yaml is up to date")

    return app


def main() -> None:
    build_app()()


if __name__ == "__main__":
    main()
