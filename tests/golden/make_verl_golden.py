"""Record verl's and verl-agent's advantage outputs on the inputs of ``verl_inputs.py``: verl_golden.json.

Run in a venv with verl (``pip install torch==2.13.0 verl==0.9.1``) and verl-agent's ``gigpo/core_gigpo.py``
importable (a checkout of verl-agent on PYTHONPATH)::

    PYTHONPATH=tests/golden:/path/to/verl-agent python tests/golden/make_verl_golden.py

The test venv has neither (verl imports Ray at its top level, and verl-agent is not a package), so
tests/test_integration_verl.py compares with these recorded outputs, and with the live functions where
they import.
"""

from __future__ import annotations

import json
from importlib.metadata import version
from pathlib import Path

from gigpo.core_gigpo import compute_gigpo_outcome_advantage
from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage
from verl_inputs import gigpo_inputs, grpo_inputs


def main() -> None:
    rewards, mask, index = grpo_inputs()
    out = {"verl": version("verl"), "grpo_rewards": rewards.tolist(), "grpo": {}, "gigpo": {}}
    for norm in (True, False):
        adv, _ = compute_grpo_outcome_advantage(rewards, mask, index, epsilon=1e-4, norm_adv_by_std_in_grpo=norm)
        out["grpo"][str(norm)] = adv.tolist()
    for mode in ("mean_norm", "mean_std_norm"):
        adv, _ = compute_gigpo_outcome_advantage(*gigpo_inputs(), epsilon=1e-6, step_advantage_w=0.7, mode=mode)
        out["gigpo"][mode] = adv.tolist()
    path = Path(__file__).with_name("verl_golden.json")
    path.write_text(json.dumps(out) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
