"""Tracking: progress files, resume, optional backends, plots and the self-contained report."""

from __future__ import annotations

import csv
import json
import math
import re
import sys
import types
import warnings
from io import StringIO
from pathlib import Path

import pytest

from turnrl.config import ConfigError, RunConfig, TrackingConfig, dump_config
from turnrl.rundir import write_jsonl
from turnrl.tracking.plots import make_plots
from turnrl.tracking.registry import MissingBackendError
from turnrl.tracking.remote import WandbSink
from turnrl.tracking.report import collect_episodes, write_report
from turnrl.tracking.sinks import ConsoleSink, CsvSink, MultiSink, make_sinks, read_csv
from turnrl.types import Episode, Turn

HOSTILE = "</script><script>alert(1)</script>"


class FakeTokenizer:
    """Decodes id i to a word; a few ids are special tokens, newlines or spaces."""

    SPECIAL = {0: "<|im_start|>", 1: "<|im_end|>", 2: "\n", 3: " "}

    def decode(self, ids, skip_special_tokens=False, clean_up_tokenization_spaces=False):
        return "".join(self.SPECIAL.get(i, f" w{i}") for i in ids)


def _turn(
    k: int,
    prev: Turn | None,
    env_ids: list[int],
    action_ids: list[int],
    adv: float | None,
    text: str,
    obs: str | None,
) -> Turn:
    prompt = (prev.prompt_ids + prev.action_ids if prev else []) + env_ids
    return Turn(
        index=k,
        prompt_ids=prompt,
        action_ids=action_ids,
        action_logprobs=[-0.1 * (j + 1) for j in range(len(action_ids))],
        action_text=text,
        observation=obs,
        policy_version=0,
        advantage=adv,
    )


def _flat_episode(
    eid: str,
    task: str,
    group: str,
    step: int,
    reward: float,
    advs: list[float | None],
    first_text: str = "guess 5",
) -> Episode:
    turns: list[Turn] = []
    for k, adv in enumerate(advs):
        prev = turns[-1] if turns else None
        env = [0, 10, 11, 12, 2] if k == 0 else [0, 13, 14 + k, 1, 2]
        turns.append(
            _turn(
                k,
                prev,
                env,
                [20 + k, 3, 30 + k, 1],
                adv,
                first_text if k == 0 else f"guess {k}",
                "higher" if k < len(advs) - 1 else "correct",
            )
        )
    return Episode(
        episode_id=eid,
        task_id=task,
        turns=turns,
        reward=reward,
        terminated=True,
        truncated=False,
        stop_reason="success" if reward > 0 else "failure",
        metrics={"step": step},
        group_id=group,
        prompt=f"Guess the number ({task}).",
    )


def _tree(group: str, task: str, step: int) -> list[Episode]:
    """A 2×2 tree: leaves [i, j] share turn 0 with their siblings (same tokens, same advantage)."""
    leaves = []
    for i in range(2):
        first = _turn(0, None, [0, 10, 11, 2], [40 + i, 3, 41], 0.5 if i == 0 else -0.5, f"probe {i}", "warm")
        for j in range(2):
            second = _turn(
                1,
                first,
                [0, 13, 2],
                [50 + 2 * i + j, 1],
                0.8 if j == 0 else -0.8,
                f"commit {i}{j}",
                "done",
            )
            reward = 1.0 if (i, j) == (0, 0) else 0.0
            leaves.append(
                Episode(
                    episode_id=f"{group}-{i}{j}",
                    task_id=task,
                    turns=[first, second],
                    reward=reward,
                    terminated=True,
                    truncated=False,
                    stop_reason="success" if reward else "failure",
                    metrics={"step": step},
                    group_id=group,
                    branch=[i, j],
                    prompt="Find it.",
                )
            )
    return leaves


def build_run(run_dir: Path, steps: int = 6, iterations: int = 2) -> Path:
    """A small but complete run directory: config, progress files (via the sink), rollouts."""
    cfg = RunConfig(run_name="demo", credit={"estimator": "branched"}, rollout={"branching": [2, 2]})
    (run_dir / "config.yaml").parent.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(dump_config(cfg))
    sink = CsvSink(run_dir)
    per_iter = steps // iterations
    sink.log_eval(
        0,
        {
            "iteration": 0,
            "label": "base",
            "success_rate": 0.25,
            "mean_reward": 0.25,
            "mean_turns": 3.0,
            "malformed_rate": 0.1,
            "num_tasks": 8,
        },
    )
    for step in range(1, steps + 1):
        it = (step - 1) // per_iter
        m = {
            "iteration": it,
            "reward": 0.1 * step,
            "reward_std": 0.2,
            "frac_reward_zero_std": 0.25,
            "loss": 0.5 / step,
            "grad_norm": 1.0 + step,
            "lr": 1e-4,
            "completions/mean_length": 4.0 + step,
            "num_turns/mean": 2.5,
            "clip_ratio/low_mean": 0.01,
            "clip_ratio/high_mean": 0.02,
            "clip_ratio/region_mean": 0.03,
            "logprob_gap": 0.001,
            "time/step_s": 1.5,
        }
        if step >= 3:  # credit diagnostics appear later: the header grows
            m |= {
                "branched/V0": 0.3,
                "branched/v1_signal_ratio": 0.6,
                "branched/frac_zero_var_prefixes": 0.5,
            }
        sink.log_step(step, m)
        if step % per_iter == 0:
            label = "final" if step == steps else "step"
            sink.log_eval(
                step,
                {
                    "iteration": it,
                    "label": label,
                    "success_rate": 0.25 + 0.5 * step / steps,
                    "mean_reward": 0.3 + 0.4 * step / steps,
                    "mean_turns": 2.0,
                    "malformed_rate": 0.0,
                    "num_tasks": 8,
                },
            )
    sink.close()
    for it in range(iterations):
        eps: list[Episode] = []
        for step in range(it * per_iter + 1, (it + 1) * per_iter + 1):
            eps += _tree(f"tree-s{step}", "t-tree", step)
            advs = [0.3, -0.7, 1.2]
            eps += [
                _flat_episode(
                    f"flat-s{step}-{e}",
                    "t-flat",
                    f"flat-s{step}",
                    step,
                    float(e % 2),
                    advs if e % 2 else [-a for a in advs],
                    first_text=HOSTILE if (step, e) == (1, 0) else "guess 5",
                )
                for e in range(3)
            ]
        write_jsonl(run_dir / "rollouts" / f"iter_{it:03d}.jsonl", eps)
    for step in (0, steps):
        evals = [
            _flat_episode(
                f"eval-s{step}-{e}",
                f"t-eval-{e}",
                f"eval-{e}",
                step,
                float(e < 2 + step // 3),
                [None, None],
            )
            for e in range(8)
        ]
        write_jsonl(run_dir / "rollouts" / f"eval_step_{step:05d}.jsonl", evals)
    return run_dir


def _csv_rows(path: Path) -> tuple[list[str], list[dict[str, str]]]:
    with path.open(newline="") as fh:
        reader = csv.DictReader(fh)
        return list(reader.fieldnames or []), list(reader)


# ----------------------------------------------------------------------------- CSV / JSONL sink


def test_csv_sink_writes_progress_files(tmp_path):
    sink = CsvSink(tmp_path)
    sink.log_step(1, {"iteration": 0, "reward": 0.5, "loss": 1.25, "num_turns/mean": 2})
    sink.log_step(2, {"iteration": 0.0, "reward": 0.75, "loss": float("nan"), "num_turns/mean": 3})
    sink.log_eval(2, {"iteration": 0, "label": "step", "success_rate": 0.5, "num_tasks": 4})
    header, rows = _csv_rows(tmp_path / "progress/train.csv")
    assert header == ["step", "iteration", "reward", "loss", "num_turns/mean"]
    assert [r["step"] for r in rows] == ["1", "2"]
    assert rows[0]["reward"] == "0.5" and rows[1]["loss"] == "nan" and rows[1]["iteration"] == "0"
    lines = (tmp_path / "progress/steps.jsonl").read_text().splitlines()
    assert [json.loads(x) for x in lines] == [
        {"step": 1, "iteration": 0, "reward": 0.5, "loss": 1.25, "num_turns/mean": 2},
        {
            "step": 2,
            "iteration": 0,
            "reward": 0.75,
            "loss": None,
            "num_turns/mean": 3,
        },  # strict JSON: NaN → null
    ]
    header, rows = _csv_rows(tmp_path / "progress/eval.csv")
    assert header == ["step", "iteration", "label", "success_rate", "num_tasks"]
    assert rows == [{"step": "2", "iteration": "0", "label": "step", "success_rate": "0.5", "num_tasks": "4"}]
    parsed = read_csv(tmp_path / "progress/train.csv")
    assert parsed[0] == {
        "step": 1.0,
        "iteration": 0.0,
        "reward": 0.5,
        "loss": 1.25,
        "num_turns/mean": 2.0,
    }
    assert math.isnan(parsed[1]["loss"])


def test_header_grows_and_earlier_rows_stay(tmp_path):
    sink = CsvSink(tmp_path)
    sink.log_step(1, {"reward": 0.1})
    sink.log_step(2, {"reward": 0.2})
    sink.log_step(3, {"reward": 0.3, "branched/V0": 0.4})
    sink.log_step(4, {"reward": 0.4})
    header, rows = _csv_rows(tmp_path / "progress/train.csv")
    assert header == ["step", "iteration", "reward", "branched/V0"]
    assert [(r["step"], r["reward"], r["branched/V0"]) for r in rows] == [
        ("1", "0.1", ""),
        ("2", "0.2", ""),
        ("3", "0.3", "0.4"),
        ("4", "0.4", ""),
    ]
    text = (tmp_path / "progress/train.csv").read_text()
    assert text.count("step,") == 1 and len(text.splitlines()) == 5
    assert not list((tmp_path / "progress").glob(".*.tmp"))  # no temp files left behind


def test_resume_appends_and_never_drops_a_row(tmp_path):
    """Cutting back to the checkpoint is the loop's job (by row count, tests/test_resume.py); a
    resumed sink keeps every complete row it finds, whatever its step, and appends after it."""
    sink = CsvSink(tmp_path)
    sink.log_eval(0, {"label": "base", "success_rate": 0.1})
    for step in range(1, 6):
        sink.log_step(step, {"reward": step / 10})
        if step in (3, 5):
            sink.log_eval(step, {"label": "step", "success_rate": step / 10})
    with (tmp_path / "progress/train.csv").open("a") as fh:  # a kill mid-append tore the last line
        fh.write("6,,0.")
    with (tmp_path / "progress/steps.jsonl").open("a") as fh:
        fh.write('{"step": 6, "rew')

    # the loop passes the checkpoint's step; rows 4 and 5 are after it and stay all the same
    resumed = make_sinks(TrackingConfig(backends=["csv"]), tmp_path, "demo", {}, resume_step=3)[0]
    assert [r["step"] for r in read_csv(tmp_path / "progress/train.csv")] == [1, 2, 3, 4, 5]
    assert (tmp_path / "progress/steps.jsonl").read_text().endswith("\n")  # torn tail cut
    resumed.log_step(6, {"reward": 0.6})  # appended
    resumed.log_step(7, {"reward": 0.7, "new_key": 1.0})  # a new column: header grows
    resumed.log_step(8, {"reward": 0.8})
    resumed.log_eval(8, {"label": "final", "success_rate": 0.9})

    header, rows = _csv_rows(tmp_path / "progress/train.csv")
    assert header == ["step", "iteration", "reward", "new_key"]
    assert [(r["step"], r["reward"], r["new_key"]) for r in rows] == [
        ("1", "0.1", ""),
        ("2", "0.2", ""),
        ("3", "0.3", ""),
        ("4", "0.4", ""),
        ("5", "0.5", ""),
        ("6", "0.6", ""),
        ("7", "0.7", "1.0"),
        ("8", "0.8", ""),
    ]
    assert (tmp_path / "progress/train.csv").read_text().count("step,") == 1
    jsonl = [json.loads(x)["step"] for x in (tmp_path / "progress/steps.jsonl").read_text().splitlines()]
    assert jsonl == [1, 2, 3, 4, 5, 6, 7, 8]
    evals = read_csv(tmp_path / "progress/eval.csv")
    assert [(r["step"], r["label"]) for r in evals] == [
        (0, "base"),
        (3, "step"),
        (5, "step"),
        (8, "final"),
    ]


def test_resume_rewrites_a_header_without_the_lead_columns(tmp_path):
    """Appending under a header that lacks ``iteration`` would shift every cell: rewritten once."""
    (tmp_path / "progress").mkdir()
    (tmp_path / "progress/train.csv").write_text("step,reward\n1,0.1\n")
    sink = CsvSink(tmp_path, resume=True)
    assert _csv_rows(tmp_path / "progress/train.csv")[0] == ["step", "iteration", "reward"]
    sink.log_step(2, {"iteration": 0, "reward": 0.2})
    assert read_csv(tmp_path / "progress/train.csv") == [
        {"step": 1.0, "reward": 0.1},
        {"step": 2.0, "iteration": 0.0, "reward": 0.2},
    ]


def test_fresh_run_replaces_old_progress(tmp_path):
    old = CsvSink(tmp_path)
    for step in range(1, 4):
        old.log_step(step, {"reward": 1.0})
    new = CsvSink(tmp_path)  # not a resume: a new run in the same directory
    new.log_step(1, {"reward": 0.0})
    assert [r["step"] for r in read_csv(tmp_path / "progress/train.csv")] == [1]
    assert len((tmp_path / "progress/steps.jsonl").read_text().splitlines()) == 1


# ----------------------------------------------------------------------------- backends


@pytest.mark.parametrize("backend, module", [("wandb", "wandb"), ("tensorboard", "tensorboard")])
def test_missing_backend_gives_install_hint(tmp_path, monkeypatch, backend, module):
    monkeypatch.setitem(sys.modules, module, None)  # `import module` now raises ImportError
    cfg = TrackingConfig(backends=["csv", backend])
    with pytest.raises(MissingBackendError) as info:
        make_sinks(cfg, tmp_path / "run", "demo", {})
    msg = str(info.value)
    assert f"pip install 'turnrl[{backend}]'" in msg and "tracking.backends" in msg
    assert isinstance(info.value, ConfigError)  # the CLI prints ConfigError without a traceback
    assert info.value.__cause__ is None and info.value.__suppress_context__
    assert not (tmp_path / "run").exists()  # checked before any file is written


class _FakeRun:
    def __init__(self, **kwargs):
        self.init = kwargs
        self.logged: list[dict] = []
        self.defined: list[tuple] = []
        self.finished = False

    def define_metric(self, name, step_metric=None):
        self.defined.append((name, step_metric))

    def log(self, data):
        self.logged.append(data)

    def finish(self):
        self.finished = True


def _fake_wandb(runs: list[_FakeRun]) -> types.ModuleType:
    mod = types.ModuleType("wandb")

    def init(**kwargs):
        runs.append(_FakeRun(**kwargs))
        return runs[-1]

    mod.init = init
    return mod


def test_wandb_sink_offline_and_resume(tmp_path, monkeypatch):
    runs: list[_FakeRun] = []
    monkeypatch.setitem(sys.modules, "wandb", _fake_wandb(runs))
    monkeypatch.setenv("WANDB_MODE", "offline")
    cfg = TrackingConfig(backends=["csv", "wandb"], project="proj")
    sink = MultiSink(make_sinks(cfg, tmp_path, "demo", {"seed": 0}))
    sink.log_step(1, {"reward": 0.5, "iteration": 0})
    sink.log_eval(1, {"label": "step", "success_rate": 0.25})
    sink.log_iteration(0, {"reward": 0.5})
    sink.close()
    run = runs[0]
    assert run.init["mode"] == "offline" and run.init["project"] == "proj" and run.init["name"] == "demo"
    assert run.init["config"] == {"seed": 0} and re.fullmatch(r"[0-9a-f]{12}", run.init["id"])
    assert run.logged == [
        {"step": 1, "train/reward": 0.5, "train/iteration": 0.0},
        {"step": 1, "eval/success_rate": 0.25},  # the string label is not a metric
        {"iteration": 0, "iteration/reward": 0.5},
    ]
    assert ("iteration/*", "iteration") in run.defined and run.finished
    WandbSink("proj", "demo", tmp_path, {}, resume_step=1).close()
    assert runs[1].init["id"] == run.init["id"]  # a resumed run continues the same W&B run
    WandbSink("proj", "demo", tmp_path, {}).close()
    assert runs[2].init["id"] != run.init["id"]  # a fresh run in the same directory is a new W&B run


def test_tensorboard_sink_purges_on_resume(tmp_path, monkeypatch):
    writers = []

    class FakeWriter:
        def __init__(self, log_dir, purge_step=None):
            self.log_dir, self.purge_step, self.scalars, self.closed = (
                log_dir,
                purge_step,
                [],
                False,
            )
            writers.append(self)

        def add_scalar(self, tag, value, step):
            self.scalars.append((tag, value, step))

        def add_text(self, tag, text, step):
            pass

        def flush(self):
            pass

        def close(self):
            self.closed = True

    monkeypatch.setitem(sys.modules, "tensorboard", types.ModuleType("tensorboard"))
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", types.SimpleNamespace(SummaryWriter=FakeWriter))
    sinks = make_sinks(TrackingConfig(backends=["tensorboard"]), tmp_path, "demo", {}, resume_step=4)
    tb = sinks[1]
    tb.log_step(5, {"reward": 1.0})
    tb.log_eval(5, {"label": "final", "success_rate": 0.5})
    tb.log_iteration(1, {"reward": 0.7})
    MultiSink(sinks).close()
    steps, iters = writers
    assert steps.purge_step == 5 and steps.log_dir.endswith("tensorboard/steps")
    assert steps.scalars == [("train/reward", 1.0, 5), ("eval/success_rate", 0.5, 5)]
    assert iters.scalars == [("iteration/reward", 0.7, 1)] and steps.closed and iters.closed


def test_console_sink_prints_eval_table_with_delta():
    from rich.console import Console

    out = StringIO()
    sink = ConsoleSink(Console(file=out, width=100, color_system=None), step_lines=True)
    sink.log_eval(0, {"label": "base", "success_rate": 0.25, "mean_reward": 0.3, "num_tasks": 8})
    sink.log_step(1, {"iteration": 0, "reward": 0.5, "loss": 0.1})
    sink.log_eval(5, {"label": "final", "success_rate": 0.75, "mean_reward": 0.8, "num_tasks": 8})
    text = out.getvalue()
    assert "evaluation · final · step 5" in text
    assert re.search(r"success rate\s+│\s+75\.0%\s+│\s+25\.0%\s+│\s+\+50\.0%", text)
    assert "step 1" in text and "reward 0.500" in text


def test_multisink_closes_every_sink_even_if_one_fails():
    closed = []

    class Bad:
        def close(self):
            raise RuntimeError("boom")

    class Good:
        def close(self):
            closed.append(True)

    with pytest.raises(RuntimeError, match="boom"):
        MultiSink([Bad(), Good()]).close()
    assert closed == [True]


# ----------------------------------------------------------------------------- plots


EXPECTED_PLOTS = {
    "reward",
    "iterations",
    "eval_rewards",
    "advantage_by_turn",
    "lengths",
    "credit",
    "optimization",
}


def test_make_plots_writes_every_plot(tmp_path):
    run = build_run(tmp_path / "run")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no plot may fail on good data
        paths = make_plots(run)
    assert {p.stem for p in paths} == EXPECTED_PLOTS
    for p in paths:
        assert p.parent == run / "plots" and p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_make_plots_skips_what_is_missing(tmp_path):
    assert make_plots(tmp_path) == []  # empty directory: nothing, no crash
    sink = CsvSink(tmp_path)
    sink.log_step(1, {"reward": 0.5})
    (tmp_path / "rollouts").mkdir()
    (tmp_path / "rollouts/iter_000.jsonl").write_text('{"truncated line')  # unreadable: skipped
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert {p.stem for p in make_plots(tmp_path)} == {"reward"}


# ----------------------------------------------------------------------------- report


def _embedded(html: str) -> dict:
    m = re.search(r'<script type="application/json" id="episodes-data">(.*?)</script>', html, re.S)
    assert m
    return json.loads(m.group(1))


def test_report_is_self_contained(tmp_path):
    run = build_run(tmp_path / "run")
    path = write_report(run, tokenizer=FakeTokenizer())
    assert path == run / "report.html"
    html = path.read_text()
    # nothing is fetched: no external src/href/url(), no module imports, a CSP that forbids it anyway
    assert not re.search(r"""(src|href)\s*=\s*["']?\s*(https?:)?//""", html, re.I)
    assert not re.search(r"url\(\s*['\"]?(https?:)?//", html, re.I)
    assert "default-src 'none'" in html
    assert html.count('src="data:image/png;base64,') == len(EXPECTED_PLOTS)
    assert HOSTILE not in html  # model text cannot close the script tag
    data = _embedded(html)
    assert data["tokenized"] and data["total"] == len(data["E"]) == 2 * 3 * 7 + 16
    hostile = next(ep for ep in data["E"] if ep["id"] == "flat-s1-0")
    assert hostile["T"][0]["t"] == HOSTILE
    assert "25.0%" in html and "75.0%" in html and "+50.0 pp" in html  # base vs final
    assert "config.yaml" in html and "estimator: branched" in html


def test_report_tokens_split_context_and_actions(tmp_path):
    run = build_run(tmp_path / "run")
    data = collect_episodes(run, FakeTokenizer())
    piece = lambda run_idx: [data["S"][p] for p in data["G"][run_idx]]  # noqa: E731
    ep = next(e for e in data["E"] if e["id"] == "tree-s1-01")
    t0, t1 = ep["T"]
    assert piece(t0["c"]) == ["<|im_start|>", " w10", " w11", "\n"] and piece(t0["a"]) == [
        " w40",
        " ",
        " w41",
    ]
    assert piece(t1["c"]) == ["<|im_start|>", " w13", "\n"]  # only the new environment tokens
    assert (t0["A"], t1["A"]) == (0.5, -0.8) and t1["lp"] == [-0.1, -0.2]
    sibling = next(e for e in data["E"] if e["id"] == "tree-s1-00")
    assert sibling["T"][0]["a"] == t0["a"]  # shared turn stored once
    assert ep["b"] == [0, 1] and ep["g"] == "tree-s1"


def test_report_without_tokenizer_and_sampling(tmp_path):
    run = build_run(tmp_path / "run")
    data = collect_episodes(run, None, max_episodes=20)
    assert not data["tokenized"] and data["S"] == []
    assert len(data["E"]) <= 24
    by_group: dict[str, int] = {}
    for ep in data["E"]:
        by_group[ep["src"] + ep["g"]] = by_group.get(ep["src"] + ep["g"], 0) + 1
    assert all(n == (4 if "tree" in g else 3 if "flat" in g else 1) for g, n in by_group.items())  # whole groups
    assert {ep["src"] for ep in data["E"]} == {
        "iter_000",
        "iter_001",
        "eval_step_00000",
        "eval_step_00006",
    }
    ep = data["E"][0]
    assert ep["p"] and ep["T"][0]["t"] and "c" not in ep["T"][0]
    html = write_report(run).read_text()
    assert '"tokenized":false' in html


def test_report_on_an_empty_run_directory(tmp_path):
    html = write_report(tmp_path).read_text()
    assert "No evaluations recorded" in html and '"E":[]' in html


def test_report_decodes_real_tokenizer_one_token_at_a_time(tmp_path, tokenizer):
    messages = [{"role": "user", "content": "Guess a number.\nReply <guess>N</guess>."}]
    turns: list[Turn] = []
    for k, (text, obs) in enumerate([("<guess>50</guess>", "Higher."), ("It is  <guess>75</guess>", "Correct!")]):
        prompt = list(
            tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)[
                "input_ids"
            ]
        )
        action = tokenizer.encode(text, add_special_tokens=False) + [tokenizer.convert_tokens_to_ids("<|im_end|>")]
        turns.append(
            Turn(
                k,
                prompt,
                action,
                [-0.5] * len(action),
                text,
                obs,
                policy_version=0,
                advantage=0.5 - k,
            )
        )
        messages += [{"role": "assistant", "content": text}, {"role": "user", "content": obs}]
    episode = Episode("e", "t", turns, 1.0, True, False, "success", {"step": 1}, "g")
    write_jsonl(tmp_path / "rollouts/iter_000.jsonl", [episode])
    data = collect_episodes(tmp_path, tokenizer)
    t0, t1 = data["E"][0]["T"]
    joined = lambda run_idx: "".join(data["S"][p] for p in data["G"][run_idx])  # noqa: E731
    assert joined(t0["c"]).startswith("<|im_start|>") and "Guess a number.\n" in joined(t0["c"])
    assert joined(t0["a"]) == "<guess>50</guess><|im_end|>"
    assert joined(t1["a"]) == "It is  <guess>75</guess><|im_end|>"  # spaces survive per-token decoding
    assert "Higher." in joined(t1["c"]) and "Guess" not in joined(t1["c"])  # only the new tokens
    assert len(data["G"][t1["a"]]) == len(turns[1].action_ids)


def test_report_assets_are_package_data_and_inlined(tmp_path):
    """The template, CSS and JS are files of the package, listed as package data, inlined verbatim."""
    import tomllib
    from fnmatch import fnmatch
    from importlib import resources

    from turnrl.tracking.report import ASSETS

    folder = resources.files("turnrl.tracking") / "assets"
    shipped = {p.name for p in folder.iterdir() if p.is_file()}
    assert set(ASSETS) <= shipped
    pyproject = Path(__file__).resolve().parents[1] / "pyproject.toml"
    globs = tomllib.loads(pyproject.read_text())["tool"]["setuptools"]["package-data"]["turnrl"]
    for name in shipped:  # a wheel built from pyproject.toml carries every asset
        assert any(fnmatch(f"tracking/assets/{name}", g) for g in globs), name
    html = write_report(tmp_path).read_text()
    css = (folder / "report.css").read_text(encoding="utf-8")
    js = (folder / "report.js").read_text(encoding="utf-8")
    assert f"<style>{css}</style>" in html and f"<script>{js}</script>" in html
    assert "@@" not in html  # every template marker was filled
    assert html.count("<script") == 2  # the data blob and the inlined script: one file, no src=


def test_report_shows_a_rebuilt_context_whole(tmp_path):
    """An episode whose turn-1 context does not extend turn 0 (e.g. thinking stripped) is trained as
    per-turn rows, so the report shows turn 1's whole context, flagged."""
    t0 = _turn(0, None, [0, 10, 2], [20, 21, 1], 0.5, "a", "b")
    t1 = Turn(1, [0, 10, 2, 21, 1, 0, 13, 2], [30, 1], [-0.1, -0.2], "c", None, policy_version=0)
    ep = Episode("rb", "t", [t0, t1], 1.0, True, False, "success", {"step": 1}, "g")
    write_jsonl(tmp_path / "rollouts/iter_000.jsonl", [ep])
    data = collect_episodes(tmp_path, FakeTokenizer())
    e0, e1 = data["E"][0]["T"]
    assert "rebuilt" not in e0 and e1["rebuilt"] is True
    assert [data["I"][p] for p in data["G"][e1["c"]]] == t1.prompt_ids  # the whole context
    assert [data["I"][p] for p in data["G"][e0["c"]]] == t0.prompt_ids
