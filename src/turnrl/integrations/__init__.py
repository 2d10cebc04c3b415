"""Adapters from turnrl's environments to other libraries' conventions.

- :mod:`turnrl.integrations.trl`: turnrl's multi-turn rollouts and credit in TRL's ``GRPOTrainer``
  (:class:`TurnrlGRPOTrainer`, :class:`TurnrlRollout`).
- :mod:`turnrl.integrations.verl`: turnrl's estimators with verl's advantage-estimator signature.
- :mod:`turnrl.integrations.verifiers`: verifiers traces as records; per-step advantages in
  ``MessageNode.advantages``.
- :mod:`turnrl.integrations.credit`: ``turnrl credit`` (advantages for a record file).
- :mod:`turnrl.integrations.trl_key_door`: key and door as a TRL
  ``environment_factory`` tool environment (:class:`KeyDoorToolEnv`).

docs/integrations.md says what each one makes exact and what it leaves out.

Integrations sit above the environments: they import ``turnrl.envs``, never the
other way round.
"""
