"""Held-out evaluation statistics: stratified standard errors and the base-vs-trained difference."""

from __future__ import annotations

import math

import pytest

from turnrl.eval import comparison_table, summarize
from turnrl.types import Episode, StopReason


def _game(task: str, k: int, success: bool, reward: float, sampled: bool) -> Episode:
    eid = f"eval-{'sampled-' if sampled else ''}g0-e{k}-"
    reason = StopReason.SUCCESS if success else StopReason.FAILURE
    return Episode(f"{eid}{task}", task, [], reward, True, False, stop_reason=reason)


def test_stratified_standard_error_by_hand():
    # task A: greedy success (stratum of one: no variance) + sampled [1, 0, 1, 1]
    # task B: greedy failure + sampled [0, 0, 1, 0]
    games = [_game("A", 0, True, 2.0, False), _game("B", 0, False, -1.0, False)]
    games += [_game("A", k, s, 2.0 if s else -1.0, True) for k, s in enumerate([1, 0, 1, 1])]
    games += [_game("B", k, s, 2.0 if s else -1.0, True) for k, s in enumerate([0, 0, 1, 0])]
    m = summarize(games)
    n = 10
    assert m["success_rate"] == pytest.approx(5 / 10)  # 1 + 0 + 3 + 1 successes
    # each sampled stratum: 4 games, p = 3/4 or 1/4, var (ddof 1) = 4·p(1−p)/3 = 0.25
    var = 0.25
    se = math.sqrt(2 * (4 / n) ** 2 * var / 4)
    assert m["success_rate_se"] == pytest.approx(se)
    # rewards are 3·success − 1, so their SE is 3× the success SE
    assert m["mean_reward_se"] == pytest.approx(3 * se)
    assert m["num_tasks"] == 10


def test_greedy_only_evaluation_has_zero_sampling_error():
    games = [_game(t, 0, t == "A", 1.0, False) for t in "ABC"]
    assert summarize(games)["success_rate_se"] == 0.0


def test_comparison_prints_the_difference_with_its_standard_error():
    base = {
        "success_rate": 0.40,
        "success_rate_se": 0.03,
        "mean_reward": 0.1,
        "mean_reward_se": 0.05,
        "mean_turns": 5.0,
        "malformed_rate": 0.0,
        "num_tasks": 110.0,
    }
    trained = {**base, "success_rate": 0.55, "success_rate_se": 0.04}
    table = comparison_table({"base": base, "trained": trained})
    cells = {row: [c._cells[i] for c in table.columns] for i, row in enumerate(["success", "reward", "turns", "mal"])}
    assert cells["success"][3] == "+15.0% ± 5.0% (+3.0 SE)"  # sqrt(0.03² + 0.04²) = 0.05
    assert cells["success"][1] == "40.0% ± 3.0%"


def test_wellformed_success_rate_leaves_malformed_games_out():
    # task A sampled: win, loss, malformed, win; task B sampled: malformed, loss; greedy A: win
    def game(task: str, k: int, reason: StopReason, sampled: bool = True) -> Episode:
        eid = f"eval-{'sampled-' if sampled else ''}g0-e{k}-{task}"
        return Episode(eid, task, [], 0.0, True, False, stop_reason=reason)

    S, F, M = StopReason.SUCCESS, StopReason.FAILURE, StopReason.MALFORMED
    games = [game("A", 0, S, sampled=False)]
    games += [game("A", k, r) for k, r in enumerate([S, F, M, S])]
    games += [game("B", k, r) for k, r in enumerate([M, F])]
    m = summarize(games)
    assert m["success_rate"] == pytest.approx(3 / 7)
    assert m["malformed_rate"] == pytest.approx(2 / 7)
    assert m["num_wellformed"] == 5
    assert m["wellformed_success_rate"] == pytest.approx(3 / 5)  # A greedy S; A sampled S, F, S; B sampled F
    # strata over the 5 well-formed games: A-sampled [1, 0, 1] (var 1/3), the others single games
    assert m["wellformed_success_rate_se"] == pytest.approx(math.sqrt((3 / 5) ** 2 * (1 / 3) / 3))


def test_wellformed_success_rate_is_nan_when_every_game_is_malformed():
    games = [Episode(f"eval-g0-e0-{t}", t, [], -2.0, True, False, stop_reason=StopReason.MALFORMED) for t in "AB"]
    assert math.isnan(summarize(games)["wellformed_success_rate"])
