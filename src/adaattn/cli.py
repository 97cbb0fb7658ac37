"""The ``adaattn`` command line, built around an explicit registry of studies.

``src/`` never imports ``experiments/``: the registry is passed in by ``experiments/cli.py``.
"""


import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from adaattn.config import ConfigError, load_params

PARAMS = Annotated[Path, typer.Option("--params", help="params.yaml to read")]


def build_app(studies: Mapping[str, Any]) -> typer.Typer:
    app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                      help="AdaAttn: regenerate the performance guides' tables on this machine.")
    console = Console(stderr=True)

    def fail(message: str) -> None:
        console.print(f"[bold red]error:[/] {message}")
        raise typer.Exit(2)

    @app.command()
    def env() -> None:
        """Print hardware, software, and which attention providers can run here (and why not)."""
        import torch

        from adaattn.attention.providers import PROVIDERS
        from adaattn.bench.provenance import hardware, triton_version

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
        results: Annotated[Path, typer.Option(help="results root")] = Path("results"),
    ) -> None:
        """Measure one study on one hardware target; writes results/<study>/<target>.csv."""
        from adaattn.bench.runner import run_study

        if study not in studies:
            fail(f"unknown study {study!r}; allowed: {', '.join(studies)}")
        try:
            cfg, raw = load_params(params, set_)
            run_study(studies[study], cfg, raw, target, results, console)
        except ConfigError as err:
            fail(str(err))

    @app.command()
    def report(
        params: PARAMS = Path("params.yaml"),
        results: Annotated[Path, typer.Option(help="results root")] = Path("results"),
        out: Annotated[Path, typer.Option(help="reports folder")] = Path("reports"),
    ) -> None:
        """Render reports/ (figures, tables, README index with verdicts) from results/ only."""
        from adaattn.report.render import render_all

        try:
            cfg, raw = load_params(params)
        except ConfigError as err:
            fail(str(err))
        console.print(f"wrote {render_all(studies, cfg, raw, results, out)}")

    @app.command()
    def log(
        results: Annotated[Path, typer.Option(help="results root")] = Path("results"),
        reports: Annotated[Path, typer.Option(help="reports folder (figures become artifacts)")] = Path("reports"),
        manifest: Annotated[Path, typer.Option(help="sync manifest (the DVC output)")] = Path("mlflow_sync.json"),
    ) -> None:
        """Log every results file to MLflow (idempotent); MLFLOW_TRACKING_URI picks a remote server."""
        from adaattn.tracking.mlflow_log import sync, tracking_uri

        actions = sync(studies, results, reports, Path.cwd(), manifest)
        for key, action in actions.items():
            console.print(f"{key}: {action}")
        console.print(f"MLflow store: {tracking_uri(Path.cwd())}")

    return app
