"""The rollout-record contract (turnrl.records): round trips, and one error line naming line and field."""

from __future__ import annotations

import json
import os

import pytest

from turnrl import records
from turnrl.records import SCHEMA, RecordError, read_records, record_of, sequence, write_records
from turnrl.types import Episode, StopReason, Turn


def _episode(eid: str, group: str = "g0", task: str = "t0", branch=(), reward: float = 1.0) -> Episode:
    turns = [
        Turn(0, [1, 2, 3], [10, 11], [-0.5, -1.0], "guess 5", observation="higher", reward=0.0, policy_version=3),
        Turn(
            1,
            [1, 2, 3, 10, 11, 4, 5],
            [12],
            [-0.25],
            "guess 7",
            reward=reward,
            policy_version=3,
            finish_reason="length",
            advantage=0.5,
            state_key='{"lo": 6}',
            prompt_sources=[["system", 2], ["user", 1], ["assistant", 2], ["user", 2]],
            topk_ids=[[12, 13]],
            topk_logprobs=[[-0.25, -2.0]],
        ),
    ]
    return Episode(
        eid,
        task,
        turns,
        reward=reward,
        terminated=True,
        truncated=False,
        stop_reason=StopReason.SUCCESS,
        metrics={"turns": 2.0},
        group_id=group,
        branch=list(branch),
        prompt="Guess a number",
    )


def _rewritten(ep: Episode) -> Episode:
    """A third turn whose context does not extend the second (a template that rewrote the history)."""
    ep.turns.append(Turn(2, [1, 2, 3, 99], [20, 21], [-0.1, -0.2], "guess 6", reward=None, policy_version=4))
    return ep


def test_records_round_trip_write_validate_read(tmp_path):
    episodes = [_episode("e0"), _rewritten(_episode("e1", reward=0.0)), _episode("e2", "g1", "t1", branch=[0, 1])]
    path = write_records(tmp_path / "r.jsonl", episodes, source="trl")
    lines = path.read_text().splitlines()
    assert len(lines) == 3
    first = json.loads(lines[1])
    assert first["schema"] == SCHEMA and first["source"] == "trl"
    # linear records: turn 1 carries only the tokens after turn 0's action; turn 2 its whole context
    assert [t["context"] for t in first["turns"]] == ["extend", "extend", "full"]
    assert first["turns"][1]["prompt_ids"] == [4, 5] and first["turns"][2]["prompt_ids"] == [1, 2, 3, 99]
    back = read_records(path)
    assert back == episodes  # every field of every turn, contexts rebuilt whole
    assert back[2].branch == [0, 1] and back[0].turns[1].topk_ids == [[12, 13]]
    assert [e.validate() for e in back] == [[], [], []]


def test_sequence_is_the_token_stream_and_its_loss_mask():
    ep = _episode("e0")
    ids, mask = sequence(ep)
    assert ids == [1, 2, 3, 10, 11, 4, 5, 12]
    assert mask == [0, 0, 0, 0, 0, 0, 0, 1]  # turn 0 has no advantage (not trained), turn 1 has one
    ep.turns[0].advantage = 1.0
    assert sequence(ep)[1] == [0, 0, 0, 1, 1, 0, 0, 1]
    with pytest.raises(ValueError, match="turn 2's context does not extend"):
        sequence(_rewritten(_episode("e1")))


def _file(tmp_path, rows: list[dict | str]) -> str:
    path = tmp_path / "bad.jsonl"
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def _good(eid: str = "e0", **kw) -> dict:
    return record_of(_episode(eid, **kw))


def _set(obj: dict, dotted: str, value) -> dict:
    *head, last = dotted.split(".")
    node = obj
    for part in head:
        node = node[int(part)] if part.isdigit() else node[part]
    if value is _DELETE:
        del node[int(last) if last.isdigit() else last]
    else:
        node[int(last) if last.isdigit() else last] = value
    return obj


_DELETE = object()

CORRUPTIONS = [
    ("schema", _DELETE, "schema: missing: every record names its version"),
    ("schema", "turnrl.records/2", "schema: 'turnrl.records/2' is not a version this turnrl reads"),
    ("turns.0.colour", "red", "turns[0].colour: not a field of a turnrl record"),
    ("turns.1.action_ids.0", "12", "turns[1].action_ids[0]: Input should be a valid integer (got '12')"),
    ("turns.0.action_ids.1", -3, "turns[0].action_ids[1]: Input should be greater than or equal to 0"),
    ("turns.0.action_ids", [], "turns[0].action_ids: List should have at least 1 item"),
    ("turns.0.action_logprobs.1", 0.5, "turns[0].action_logprobs[1]: Input should be less than or equal to 0"),
    ("turns.1.action_logprobs", [-0.1, -0.2], "turns[1].action_logprobs: 2 log-probs for 1 action ids"),
    ("turns.1.index", 5, "turns[1].index: is 5; turns are numbered 0, 1, ... in order (expected 1)"),
    ("turns.0.policy_version", _DELETE, "turns[0].policy_version: Field required"),
    ("turns.1.finish_reason", "eos", "turns[1].finish_reason: Input should be 'stop' or 'length'"),
    ("turns.1.prompt_sources.0.1", 5, "turns[1].prompt_sources: cover 10 tokens of a 7-token context"),
    ("turns.1.topk_logprobs", None, "turns[1].topk_ids: topk_ids and topk_logprobs come together"),
    ("truncated", True, "truncated: an episode is not both terminated and truncated"),
    ("stop_reason", "won", "stop_reason: Input should be 'success', 'failure'"),
    ("reward", "1.0", "reward: Input should be a valid number (got '1.0')"),
    ("turns", [], "turns: List should have at least 1 item"),
    ("episode_id", "", "episode_id: String should have at least 1 character"),
]


@pytest.mark.parametrize(("field", "value", "expected"), CORRUPTIONS, ids=[c[0] for c in CORRUPTIONS])
def test_a_corrupted_record_is_one_error_naming_line_and_field(tmp_path, field, value, expected):
    path = _file(tmp_path, [_good("e0"), _set(_good("e1"), field, value), _good("e2")])
    with pytest.raises(RecordError) as info:
        read_records(path)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"{path}:2: {expected}"), message


def test_file_level_corruptions_name_the_line_and_the_first_one(tmp_path):
    cases = [
        ([_good("e0"), _good("e0")], "2: episode_id: 'e0' is also on line 1; episode ids are unique"),
        ([_good("e0"), _good("e1", task="t9")], "2: task_id: 't9', but group 'g0' holds task 't0' (line 1)"),
        ([_good("e0", branch=[1, 0]), "", _good("e1", branch=[1, 0])], "3: branch: [1, 0] is also the path of line 1"),
        ([_good("e0"), '{"schema": "turnrl.records/1", "episode_id": "e1", "tur'], "2: the record: not a JSON object"),
        ([_good("e0"), _good("e1").__repr__()], "2: the record: not a JSON object"),
        ([json.dumps(_good("e0")).replace('"reward": 1.0', '"reward": NaN', 1)], "1: reward: Input should be a finite"),
    ]
    for rows, expected in cases:
        path = _file(tmp_path, rows)
        with pytest.raises(RecordError) as info:
            read_records(path)
        assert str(info.value).startswith(f"{path}:{expected}"), str(info.value)


def test_several_corruptions_in_one_record_report_the_first_and_count_the_rest(tmp_path):
    bad = _good("e1")
    bad["turns"][0]["action_ids"][0] = "x"
    bad["turns"][1]["finish_reason"] = "eos"
    bad["metrics"]["turns"] = "two"
    with pytest.raises(RecordError, match=r":1: metrics\.turns: Input should be a valid number .* \(and 2 more\)$"):
        read_records(_file(tmp_path, [bad]))
    bad = _good("e1")
    bad["turns"][1]["index"] = 7
    bad["turns"][0]["action_logprobs"] = [-1.0]
    with pytest.raises(RecordError, match=r":1: turns\[0\]\.action_logprobs: 1 log-probs .* \(and 1 more\)$"):
        read_records(_file(tmp_path, [bad]))


def test_reading_is_bounded_and_regular_files_only(tmp_path, monkeypatch):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(RecordError, match="not a regular file"):  # refused at once, not waited on
        read_records(fifo)
    with pytest.raises(RecordError, match="is a directory"):
        read_records(tmp_path)
    with pytest.raises(RecordError, match="no such file"):
        read_records(tmp_path / "missing.jsonl")
    path = _file(tmp_path, [_good("e0"), _good("e1")])
    monkeypatch.setattr(records, "MAX_RECORD_BYTES", 100)
    with pytest.raises(RecordError, match=r":1: a line over 100 bytes"):
        read_records(path)
    monkeypatch.setattr(records, "MAX_RECORD_BYTES", 1 << 20)
    monkeypatch.setattr(records, "MAX_RECORDS", 1)
    with pytest.raises(RecordError, match=r":2: more than 1 records"):
        read_records(path)
    monkeypatch.setattr(records, "MAX_RECORDS", 10)
    monkeypatch.setattr(records, "MAX_CONTEXT_TOKENS", 9)  # 3 + 7 context tokens expand past 9
    with pytest.raises(RecordError, match=r":1: turns: the turns' contexts add up to 10 tokens; at most 9"):
        read_records(path)


def test_turnrl_never_writes_a_record_it_would_refuse(tmp_path):
    ep = _episode("e0")
    ep.turns[1].action_logprobs = [0.3]
    with pytest.raises(ValueError, match=r"episode e0: turns\[1\]\.action_logprobs\[0\]: Input should be less"):
        write_records(tmp_path / "r.jsonl", [ep])
    ep = _episode("e1")
    ep.metrics["bad"] = float("nan")
    with pytest.raises(ValueError, match="episode e1: bad is not finite"):
        write_records(tmp_path / "r.jsonl", [ep])
    assert not (tmp_path / "r.jsonl").exists()
