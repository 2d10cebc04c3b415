"""The credit audit: how right each credit estimator is, per turn, against Monte-Carlo ground truth.

Composes the collector (rollouts of the policy, with replayed prefixes) and the credit
registry (every estimator at an equal budget of leaves); nothing below it imports it. Where an
environment offers a finite menu of replies, A* can be had exactly instead (:mod:`turnrl.audit.exact`).
ALGORITHMS.md §5; docs/algorithms.md "Credit audit".
"""

from turnrl.audit.core import (
    EstimatorArm,
    GroundTruth,
    Rollouts,
    default_arms,
    default_shapes,
    estimate,
    estimator_runs,
    ground_truth,
    sample_episodes,
)
from turnrl.audit.exact import ExactAuditError, exact_ground_truth, model_scorer
from turnrl.audit.metrics import audit_metrics, snr, turn_metrics
from turnrl.audit.replay import ReplayEnv, replay_task

__all__ = [
    "EstimatorArm",
    "ExactAuditError",
    "GroundTruth",
    "ReplayEnv",
    "Rollouts",
    "audit_metrics",
    "default_arms",
    "default_shapes",
    "estimate",
    "estimator_runs",
    "exact_ground_truth",
    "ground_truth",
    "model_scorer",
    "replay_task",
    "sample_episodes",
    "snr",
    "turn_metrics",
]
