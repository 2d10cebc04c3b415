"""``turnrl lab``: the course labs as commands."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from turnrl.terminal import make_console, styled

lab_app = typer.Typer(help="Course labs: small CPU experiments.", no_args_is_help=True)
console = make_console()


@lab_app.callback()
def _lab() -> None:
    """Course labs (a group, so each lab is a subcommand even when more are added)."""


@lab_app.command("keydoor")
def keydoor(
    profile: Annotated[
        str,
        typer.Option(help="smoke (3 seeds, 8 × 16, 20 eval) or full (5 seeds, 30 × 48, 100 eval)."),
    ] = "smoke",
    out: Annotated[Path, typer.Option(help="Output directory (plot, table, trace, contract checks).")] = Path(
        "runs/lab_keydoor"
    ),
) -> None:
    """A recurrent actor–critic on the key-door game: sparse reward against potential shaping."""
    from turnrl.lab.keydoor import PROFILES, run_lab
    from turnrl.lab.report import write_outputs

    if profile not in PROFILES:
        console.print(
            styled(("error:", "bold red"), f" --profile must be one of {sorted(PROFILES)}, got {profile!r}"),
            highlight=False,
        )
        raise typer.Exit(2)
    cfg = PROFILES[profile]
    console.print(
        f"lab keydoor \\[{profile}]: {len(cfg.seeds)} seeds × {len(cfg.modes)} modes, "
        f"{cfg.updates} updates × {cfg.episodes_per_update} episodes, {cfg.eval_episodes} eval episodes"
    )
    result = run_lab(cfg)
    paths = write_outputs(result, out, profile)
    from turnrl.lab.report import table_rich

    console.print(table_rich(result))
    for name, path in paths.items():
        console.print(f"wrote {name}: {path}")
