"""Token provenance, wired: the mask report (tokens per source, dilution) and the report's source colouring,
checked on hand-built episodes whose counts are known by hand."""

from __future__ import annotations

import json
import re

import pytest
from typer.testing import CliRunner

from turnrl.rundir import write_jsonl
from turnrl.tracking.provenance import SOURCE_NAMES, episode_rows, mask_report, run_mask_report, summarize
from turnrl.tracking.report import collect_episodes, write_report
from turnrl.types import Episode, Turn


class WordTokenizer:
    def decode(self, ids, skip_special_tokens=False, clean_up_tokenization_spaces=False):
        return "".join(f" w{i}" for i in ids)


def provenance_episode(eid: str = "p0", first_advantage: float | None = 0.5, sources: bool = True) -> Episode:
    """Two turns. Turn 0: system 3, user 2, the generation prompt 1 (assistant), action 3.
    Turn 1 extends it: tool 3, generation prompt 1, action 2 — 15 tokens, 5 sampled."""
    p0 = [100, 101, 102, 103, 104, 105]
    t0 = Turn(0, p0, [10, 11, 12], [-0.1, -0.2, -0.3], "call", "result", policy_version=0)
    t0.advantage = first_advantage
    t0.prompt_sources = [["system", 3], ["user", 2], ["assistant", 1]] if sources else None
    p1 = p0 + [10, 11, 12] + [106, 107, 108, 109]
    t1 = Turn(1, p1, [13, 14], [-0.4, -0.5], "answer", None, policy_version=0)
    t1.advantage = -0.5
    runs1 = [["system", 3], ["user", 2], ["assistant", 4], ["tool", 3], ["assistant", 1]]
    t1.prompt_sources = runs1 if sources else None
    ep = Episode(eid, "t", [t0, t1], 1.0, True, False, "success", {"step": 1}, "g")
    assert ep.validate() == []
    return ep


def _counts(**kw) -> dict[str, int]:
    return {name: kw.get(name, 0) for name in SOURCE_NAMES}


def test_episode_row_counts_each_source_by_hand():
    (row,) = episode_rows(provenance_episode(), per_turn=False)
    assert row.turn == -1 and row.tokens == _counts(system=3, user=2, assistant=1 + 3 + 1 + 2, tool=3)
    assert (row.total, row.sampled, row.trained) == (15, 5, 5)
    assert row.dilution == pytest.approx(1 - 5 / 15)


def test_per_turn_rows_count_each_turn_with_its_context():
    r0, r1 = episode_rows(provenance_episode(), per_turn=True)
    assert r0.turn == 0 and r0.tokens == _counts(system=3, user=2, assistant=1 + 3)
    assert (r0.sampled, r0.trained, r0.dilution) == (3, 3, pytest.approx(6 / 9))
    # turn 1's row: turn 0's action is context here (assistant, not sampled by this row)
    assert r1.turn == 1 and r1.tokens == _counts(system=3, user=2, assistant=7, tool=3)
    assert (r1.sampled, r1.trained, r1.dilution) == (2, 2, pytest.approx(13 / 15))


def test_untrained_turns_and_missing_provenance():
    shared = provenance_episode(first_advantage=None)  # a tree's shared first turn, trained in a sibling
    (row,) = episode_rows(shared, per_turn=False)
    assert (row.sampled, row.trained) == (5, 2)
    assert [r.turn for r in episode_rows(shared, per_turn=True)] == [1]
    evaluation = provenance_episode()
    for t in evaluation.turns:
        t.advantage = None
    assert episode_rows(evaluation, per_turn=False) == [] == episode_rows(evaluation, per_turn=True)
    (bare,) = episode_rows(provenance_episode(sources=False), per_turn=False)
    assert bare.tokens == _counts(assistant=5, unknown=10) and bare.dilution == pytest.approx(10 / 15)


def test_rebuilt_context_is_counted_as_per_turn_rows():
    ep = provenance_episode()
    t1 = ep.turns[1]
    t1.prompt_ids = t1.prompt_ids[:6] + t1.prompt_ids[9:]  # turn 0's action stripped from the context
    t1.prompt_sources = [["system", 3], ["user", 2], ["assistant", 1], ["tool", 3], ["assistant", 1]]
    assert [r.turn for r in episode_rows(ep, per_turn=False)] == [0, 1]


def test_summary_totals_and_dilution():
    rows = mask_report([provenance_episode("a"), provenance_episode("b", sources=False)], per_turn=False)
    s = summarize(rows)
    assert s["rows"] == 2 and s["total"] == 30 and (s["sampled"], s["trained"]) == (10, 10)
    assert s["tokens"] == _counts(system=3, user=2, assistant=7 + 5, tool=3, unknown=10)
    assert s["dilution"] == pytest.approx(20 / 30) and s["mean_row_dilution"] == pytest.approx(20 / 30)


def _run(tmp_path):
    write_jsonl(tmp_path / "rollouts" / "iter_000.jsonl", [provenance_episode()])
    return tmp_path


def test_report_embeds_sources_and_the_mask_table(tmp_path):
    run = _run(tmp_path)
    data = collect_episodes(run, WordTokenizer())
    t0, t1 = data["E"][0]["T"]
    assert data["P"] == list(SOURCE_NAMES)
    assert t0["cs"] == [[0, 3], [1, 2], [2, 1]]  # system, user, assistant over turn 0's context
    assert t1["cs"] == [[3, 3], [2, 1]]  # only turn 1's new context: tool 3, assistant 1
    assert data["E"][0]["rows"] == [[-1, [3, 2, 7, 3, 0], 5, 5]]
    html = write_report(run, tokenizer=WordTokenizer()).read_text()
    assert 'id="by-source"' in html and 'data-src="tool"' in html  # the toggle and the source swatches
    mask = re.search(r'<table class="cmp mask">.*?</table>(.*?)</p>', html, re.S)
    assert mask and "<td>15</td>" in mask.group(0) and "<b>0.667</b>" in mask.group(1)
    blob = re.search(r'id="episodes-data">(.*?)</script>', html, re.S).group(1)
    assert json.loads(blob)["E"][0]["T"][1]["cs"] == [[3, 3], [2, 1]]


def test_rows_command_prints_the_mask_report(tmp_path):
    from turnrl.cli import app

    run = _run(tmp_path)
    rows, per_turn = run_mask_report(run)
    assert len(rows) == 1 and not per_turn  # no config.yaml: the default (whole-episode rows)
    result = CliRunner().invoke(app, ["rows", str(run)], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "1 whole-episode rows" in result.output and "0.667" in result.output
    line = next(line for line in result.output.splitlines() if "p0" in line)
    assert re.findall(r"\d+(?:\.\d+)?", line.split("p0", 1)[1]) == ["3", "2", "7", "3", "5", "5", "0.667"]
    missing = CliRunner().invoke(app, ["rows", str(tmp_path / "nope")])
    assert missing.exit_code == 2 and "not a run directory" in missing.output


@pytest.mark.parametrize("per_turn", [False, True])
def test_rows_are_the_trainers_rows(per_turn):
    """The report's rows are build_rows' rows: same count, same lengths, same trained tokens."""
    from turnrl.train.batch import build_rows

    episodes = [provenance_episode("a"), provenance_episode("b", first_advantage=None), provenance_episode("c")]
    episodes[2].turns[1].advantage = None
    trainer = build_rows(episodes, per_turn=per_turn)
    report = mask_report(episodes, per_turn=per_turn)
    assert [(r.episode_id, len(r.ids), sum(r.mask)) for r in trainer] == [
        (r.episode_id, r.total, r.trained) for r in report
    ]
