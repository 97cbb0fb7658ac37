"""The ``real_inputs`` stage: capture all-MiniLM-L6-v2's q, k, v over real text for every G2-C1 profile's
``real_layers`` and ``real_seq_lens`` (needs the ``real`` extra), the file the rank study reads on every target.

    python -m adaattn_experiments.rank.capture [--params params.yaml]
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from adaattn.errors import ConfigError
from adaattn_experiments.rank import minilm
from adaattn_pipeline.config import load_params

app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)


@app.command()
def main(
    params: Annotated[Path, typer.Option("--params", help="params.yaml to read")] = Path("params.yaml"),
    out: Annotated[Path, typer.Option(help="capture file the rank study reads")] = minilm.CAPTURE,
) -> None:
    """Capture q, k, v of the G2-C1 profiles' real layers and lengths into ``--out``."""
    try:
        cfg, _ = load_params(params)
    except ConfigError as err:
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(2) from err
    profiles = [getattr(cfg.g2_c1, name) for name in ("cpu", "gpu")]
    lens = sorted({S for p in profiles for S in p.real_seq_lens})
    layers = sorted({i for p in profiles for i in p.real_layers})
    why = minilm.unavailable() if lens else None
    if why:
        typer.echo(f"error: G2-C1.*.real_seq_lens asks for real inputs {lens}; the model {why}", err=True)
        raise typer.Exit(2)
    typer.echo(f"wrote {minilm.capture(lens, layers, out)} (layers {layers}, windows of {lens} word pieces)")


if __name__ == "__main__":
    app()
