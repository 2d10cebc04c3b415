"""Slosh tank: a cart carries an open tank of liquid; drive it to a goal and leave it calm.

The liquid's first slosh mode behaves like a damped pendulum of length L hanging
from the cart. You command the cart's acceleration u every DT seconds. The cart's
real acceleration is a = kappa * u, where kappa > 0 is an actuator gain that is
fixed for a task but NOT given to you (it is not in this file; the task supplies it).

Units: metres, seconds, radians, m/s^2. Standard library only.

One step (semi-implicit Euler, DT = 0.02 s):
    u_c   = min(max(u, -A_MAX), A_MAX)          commanded acceleration, clipped
    a     = kappa * u_c                         real cart acceleration
    v     = v + a * DT                          cart velocity
    x     = x + v * DT                          cart position (uses the new v)
    alpha = -(G / L) * sin(theta) - 2 * ZETA * sqrt(G / L) * omega - (a / L) * cos(theta)
    omega = omega + alpha * DT                  slosh angular velocity
    theta = theta + omega * DT                  slosh angle (uses the new omega)
    t     = t + DT

Accelerating forward (a > 0) pushes theta negative. The undamped slosh frequency is
sqrt(G / L) = 6.26 rad/s (period about 1.0 s) and the slosh decays slowly (ZETA = 0.05).

An episode starts at rest: x = v = theta = omega = 0, t = 0. It lasts HORIZON steps
(3.0 s) unless the liquid spills: |theta| > SPILL ends it at once with score 0.

Score (see simulate): 1.0 if, over the last WINDOW_STEPS steps (0.5 s), every state has
|x - goal| < POS_TOL, |v| < VEL_TOL and |theta| < ANGLE_TOL. Otherwise partial credit
0.5 * closeness * calmness (at most 0.5) from the final state. 0 on spill or on an
exception in the policy.
"""

import math
import random

G = 9.81  # gravity, m/s^2
L = 0.25  # equivalent pendulum length of the slosh mode, m
ZETA = 0.05  # slosh damping ratio
DT = 0.02  # time step, s
HORIZON = 150  # steps per episode (3.0 s)
A_MAX = 4.0  # commanded acceleration is clipped to [-A_MAX, A_MAX], m/s^2
SPILL = 0.5  # |theta| above this spills the liquid, rad
GOAL_MIN, GOAL_MAX = 0.6, 1.4  # goal positions are drawn from this range, m
WINDOW_STEPS = 25  # success window: the last 25 steps (0.5 s)
POS_TOL, VEL_TOL, ANGLE_TOL = 0.02, 0.05, 0.02  # success tolerances (m, m/s, rad)
POS_SCALE = 0.1  # partial credit: closeness = exp(-|x - goal| / POS_SCALE)
SLOSH_SCALE = 0.05  # partial credit: calmness = exp(-slosh / SLOSH_SCALE)


def goal_for_seed(seed):
    """The goal position (m) of a task seed: uniform in [GOAL_MIN, GOAL_MAX], 3 decimals."""
    return round(random.Random(seed).uniform(GOAL_MIN, GOAL_MAX), 3)


def slosh_amplitude(theta, omega):
    """Size of the slosh oscillation (rad): sqrt(theta^2 + (omega / sqrt(G / L))^2)."""
    return math.hypot(theta, omega / math.sqrt(G / L))


class SloshTank:
    """The cart and its liquid for one task (seed -> goal; kappa -> actuator gain).

    reset() -> state         start a new episode at rest and return the state
    step(u) -> state         apply commanded acceleration u (a float) for one DT
    state() -> state         the current state, without stepping

    A state is a dict with keys t, x, v, theta, omega, goal, steps_left.
    Attributes: goal (m), done (spilled or horizon reached), spilled,
    steps_used (step calls so far, over all resets), max_steps (None = unlimited).

    Calling step after the episode is over, or more than max_steps times in total,
    raises RuntimeError. A u that is not a finite number raises ValueError.
    """

    def __init__(self, seed, kappa, max_steps=None):
        kappa = float(kappa)
        if not (math.isfinite(kappa) and kappa > 0):
            raise ValueError("kappa must be a finite number > 0")
        self.goal = goal_for_seed(seed)
        self.max_steps = max_steps
        self.steps_used = 0

        # kappa is kept in this closure rather than in an attribute.
        def actuator(u):
            return kappa * min(max(u, -A_MAX), A_MAX)

        self._actuator = actuator
        self.reset()

    def reset(self):
        self._t, self._x, self._v, self._theta, self._omega = 0.0, 0.0, 0.0, 0.0, 0.0
        self._k = 0
        self.spilled = False
        return self.state()

    @property
    def done(self):
        return self.spilled or self._k >= HORIZON

    def state(self):
        return {
            "t": self._t,
            "x": self._x,
            "v": self._v,
            "theta": self._theta,
            "omega": self._omega,
            "goal": self.goal,
            "steps_left": HORIZON - self._k,
        }

    def step(self, u):
        if self.done:
            raise RuntimeError("the episode is over (spilled or horizon reached); call reset()")
        if self.max_steps is not None and self.steps_used >= self.max_steps:
            raise RuntimeError(f"step budget exhausted: at most {self.max_steps} step calls")
        finite = isinstance(u, (int, float)) and not isinstance(u, bool) and abs(u) < math.inf
        if not finite:  # (abs(nan) < inf is False too)
            raise ValueError(f"u must be a finite number, got {u!r}")
        self.steps_used += 1
        a = self._actuator(u)
        self._v += a * DT
        self._x += self._v * DT
        w2 = G / L
        alpha = (
            -w2 * math.sin(self._theta)
            - 2.0 * ZETA * math.sqrt(w2) * self._omega
            - (a / L) * math.cos(self._theta)
        )
        self._omega += alpha * DT
        self._theta += self._omega * DT
        self._k += 1
        self._t = self._k * DT
        if abs(self._theta) > SPILL:
            self.spilled = True
        return self.state()


def as_number(u):
    """A policy's return value as a float (ints, floats and numpy-style scalars)."""
    if isinstance(u, (int, float)) and not isinstance(u, bool):
        return float(u)
    if hasattr(u, "__float__") and not isinstance(u, (bool, str)):
        return float(u)
    raise TypeError(f"policy must return a number, got {type(u).__name__}")


def is_calm(state):
    """True when a state is inside the success tolerances."""
    return (
        abs(state["x"] - state["goal"]) < POS_TOL
        and abs(state["v"]) < VEL_TOL
        and abs(state["theta"]) < ANGLE_TOL
    )


def score_final(state, spilled, calm_steps):
    """The score of an episode from its final state.

    calm_steps is how many consecutive final states were calm (see is_calm).
    1.0 on success (calm_steps >= WINDOW_STEPS at the horizon); 0.0 on spill;
    else 0.5 * exp(-|x - goal| / POS_SCALE) * exp(-slosh_amplitude / SLOSH_SCALE).
    """
    if spilled:
        return 0.0
    if calm_steps >= WINDOW_STEPS and state["steps_left"] == 0:
        return 1.0
    closeness = math.exp(-abs(state["x"] - state["goal"]) / POS_SCALE)
    calmness = math.exp(-slosh_amplitude(state["theta"], state["omega"]) / SLOSH_SCALE)
    return 0.5 * closeness * calmness


def simulate(policy, seed, kappa):
    """Run policy(state) -> u for a full episode and score it.

    Returns a dict: score (0..1), success (bool), spilled (bool), steps (int),
    final (the last state) and error (None, or the policy's exception as text;
    an exception or a non-finite u ends the episode with score 0).
    """
    tank = SloshTank(seed, kappa)
    state = tank.reset()
    calm_steps = 0
    while not tank.done:
        try:
            state = tank.step(as_number(policy(dict(state))))
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
            return {"score": 0.0, "success": False, "spilled": False,
                    "steps": tank.steps_used, "final": state, "error": error}
        calm_steps = calm_steps + 1 if is_calm(state) else 0
    score = score_final(state, tank.spilled, calm_steps)
    return {"score": score, "success": score == 1.0, "spilled": tank.spilled,
            "steps": tank.steps_used, "final": state, "error": None}
