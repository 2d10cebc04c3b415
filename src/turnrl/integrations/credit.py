"""``turnrl credit RECORDS --estimator NAME [--set credit.x=v] --out FILE``: any registered credit
estimator's per-turn advantages for episodes recorded anywhere (turnrl, TRL, verl, verifiers).

The records are read and checked whole (:func:`turnrl.records.read_records`: a bad line is one error
naming it), the estimator and its own parameters are validated as the config's ``credit`` section is
(``--set credit.gamma=0.9``: each by the estimator's own model; an unknown key or a bad value is one
error naming it), :func:`turnrl.credit.
assign_credit` writes every turn's advantage (null = not trained in that episode: a tree's shared
prefix, trained in a sibling), and the records go back out with only ``advantage`` changed, each with
the ``source`` it came with. A token's advantage is its turn's (docs/integrations.md).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import ValidationError

from turnrl.bounded import short_repr
from turnrl.configfile import apply_overrides
from turnrl.credit import CreditSettings, assign_credit, get_estimator
from turnrl.records import episode_of, iter_records, write_records
from turnrl.sections import ConfigError, error_lines, strict_validate


def credit_settings(estimator: str, overrides: list[str]) -> CreditSettings:
    """The estimator ``estimator`` with ``credit.*`` overrides, validated as the config's ``credit`` section."""
    data = apply_overrides({"credit": {"estimator": estimator}}, overrides)
    other = sorted(k for k in data if k != "credit")
    if other:
        raise ConfigError(
            f"--set {short_repr(other[0])}...: turnrl credit takes credit.* keys only (the estimator's parameters)"
        )
    if not isinstance(data["credit"], dict):
        raise ConfigError("--set credit=...: set the estimator's keys one by one, e.g. --set credit.gamma=0.9")
    return settings_from_mapping(data["credit"])


def settings_from_mapping(section: dict[str, Any]) -> CreditSettings:
    """``{"estimator": name, **its own parameters}``, each validated by the estimator's own model under the
    config's strict rules (an unknown key is refused); ConfigError names each bad key (``credit.gamma: ...``)."""
    params = dict(section)
    name = params.pop("estimator", None)
    if not isinstance(name, str):
        raise ConfigError(f"credit.estimator: give a registered estimator name (got {short_repr(name)})")
    spec = get_estimator(name)
    try:
        return CreditSettings(name, strict_validate(spec.params, params))
    except ValidationError as exc:
        raise ConfigError("; ".join(error_lines(exc, "credit"))) from None


def credit_records(records: Path, settings: CreditSettings, out: Path) -> dict[str, Any]:
    """Read ``records``, assign ``settings``' advantages, write ``out``; returns counts and the estimator's metrics."""
    read = list(iter_records(records))
    if not read:
        raise ValueError(f"{records}: holds no record; nothing to assign credit to")
    episodes = [episode_of(rec) for _, rec in read]
    metrics = assign_credit(episodes, settings)
    write_records(out, episodes, source=[rec.source for _, rec in read])
    turns = [t for e in episodes for t in e.turns]
    return {
        "episodes": len(episodes),
        "groups": len({e.group_id for e in episodes}),
        "turns": len(turns),
        "trained_turns": sum(t.advantage is not None for t in turns),
        **metrics,
    }


def run_credit(records: Path, estimator: str, overrides: list[str], out: Path, console) -> dict[str, Any]:
    """The ``turnrl credit`` command: settings first (a bad option costs nothing), then the records."""
    settings = credit_settings(estimator, overrides)
    summary = credit_records(records, settings, out)
    console.print(
        f"{settings.estimator}: {summary['trained_turns']} of {summary['turns']} turns of {summary['episodes']}"
        f" episodes ({summary['groups']} groups) carry an advantage; wrote {out}"
    )
    shown = {k: v for k, v in summary.items() if k not in ("episodes", "groups", "turns", "trained_turns")}
    if shown:
        console.print("  " + ", ".join(f"{k} {v:.4g}" for k, v in shown.items()))
    return summary
