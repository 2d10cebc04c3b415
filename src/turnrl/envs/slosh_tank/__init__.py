"""Slosh tank: probe a hidden actuator gain, then commit a controller (two turns).

See ``docs/slosh_tank.md``. ``physics.py`` is the environment source shown to
the model; ``protocol.py`` the :class:`SloshTankEnv`; ``controllers.py`` the
reference controllers, calibration and scripted policies; ``tasks.py`` the
task builder and validator; ``prompts.py`` every text the model sees.
"""

from turnrl.envs.slosh_tank import physics
from turnrl.envs.slosh_tank.controllers import (
    BEST_BLIND,
    REFERENCE_GRID,
    SCRIPTED_POLICIES,
    SMALL_GRID,
    Calibration,
    PDGains,
    calibrate,
    gain_grid,
    parse_kappa_estimate,
    run_controller,
    success_table,
)
from turnrl.envs.slosh_tank.protocol import (
    PolicyOutcome,
    ProbeOutcome,
    SloshTankEnv,
    evaluate_policy,
    extract_code,
    run_probe,
)
from turnrl.envs.slosh_tank.tasks import (
    build_tasks,
    env_source,
    load_tasks,
    scenario_dicts,
    shipped_tasks,
    validate_params,
)

__all__ = [
    "BEST_BLIND",
    "REFERENCE_GRID",
    "SCRIPTED_POLICIES",
    "SMALL_GRID",
    "Calibration",
    "PDGains",
    "PolicyOutcome",
    "ProbeOutcome",
    "SloshTankEnv",
    "build_tasks",
    "calibrate",
    "env_source",
    "evaluate_policy",
    "extract_code",
    "gain_grid",
    "load_tasks",
    "parse_kappa_estimate",
    "physics",
    "run_controller",
    "run_probe",
    "scenario_dicts",
    "shipped_tasks",
    "success_table",
    "validate_params",
]
