"""The run report opened in headless Chromium: it loads cleanly, shows its plots, and opening an
episode shows its tokens coloured by advantage.

Needs Playwright for Python and a Chromium binary; no browser is downloaded:

    pip install playwright          # the Python package only; never `playwright install`
    apt-get install -y chromium     # Debian/Ubuntu; or point TURNRL_CHROMIUM at a binary

Without them every test here is skipped with that hint. ``TURNRL_SAVE_SCREENSHOT=1`` saves a
screenshot of an opened training episode of a real run to ``docs/report_screenshot.png``;
``TURNRL_REPORT_RUN=runs/NAME`` uses that run directory instead of a fresh tiny-model run.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

try:
    from test_provenance import WordTokenizer, provenance_episode
    from test_tracking import FakeTokenizer, build_run
except ImportError:  # tests collected as a package
    from tests.test_provenance import WordTokenizer, provenance_episode
    from tests.test_tracking import FakeTokenizer, build_run

from turnrl.tracking.report import write_report

INSTALL_HINT = (
    "needs Playwright and Chromium: `pip install playwright` and `apt-get install -y chromium`"
    " (or set TURNRL_CHROMIUM to a Chromium binary); no `playwright install` download is used"
)
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--no-first-run",
]


def _chromium() -> str | None:
    for candidate in (
        os.environ.get("TURNRL_CHROMIUM"),
        "/usr/bin/chromium",
        shutil.which("chromium"),
        shutil.which("chromium-browser"),
    ):
        if candidate and Path(candidate).is_file() and os.access(candidate, os.X_OK):
            return candidate
    return None


try:
    from playwright.sync_api import sync_playwright
except ImportError:
    sync_playwright = None

CHROMIUM = _chromium()
_missing = [name for name, ok in (("playwright", sync_playwright is not None), ("chromium", CHROMIUM)) if not ok]

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(bool(_missing), reason=f"{' and '.join(_missing)} missing: {INSTALL_HINT}"),
]


@pytest.fixture(scope="module")
def browser():
    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield b
        b.close()


class Page:
    """A page that records JS errors and every request that is not the report itself or data:."""

    def __init__(self, browser, path: Path) -> None:
        self.page = browser.new_page(viewport={"width": 1400, "height": 900})
        self.errors: list[str] = []
        self.external: list[str] = []
        self.dialogs: list[str] = []
        self.page.on("console", lambda m: self.errors.append(m.text) if m.type == "error" else None)
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))
        self.page.on("dialog", lambda d: (self.dialogs.append(d.message), d.dismiss()))
        url = path.resolve().as_uri()
        self.page.on(
            "request",
            lambda r: None if r.url in (url, url + "#") or r.url.startswith("data:") else self.external.append(r.url),
        )
        self.page.goto(url)

    def check_clean(self) -> None:
        assert self.errors == [], self.errors
        assert self.external == [], self.external  # self-contained: nothing else is fetched
        assert self.dialogs == []  # the hostile action text did not run


def test_report_loads_with_plots_and_coloured_tokens(browser, tmp_path):
    run = build_run(tmp_path / "run")
    view = Page(browser, write_report(run, tokenizer=FakeTokenizer()))
    page = view.page

    widths = page.eval_on_selector_all("#plots img", "els => els.map(e => e.complete ? e.naturalWidth : 0)")
    assert len(widths) == 7 and all(w > 0 for w in widths)
    assert "+50.0 pp" in page.inner_text("#results")

    assert page.locator("#detail .tok").count() == 0  # nothing rendered before a click
    page.click('.ep[data-episode-id="tree-s1-01"]')
    detail = page.locator("#detail")
    assert detail.locator(".tok[data-adv]").count() == 5  # 3 action tokens in turn 0, 2 in turn 1
    assert detail.locator(".tok.adv.pos").count() == 3 and detail.locator(".tok.adv.neg").count() == 2
    assert detail.locator(".tok.ctx").count() > 0  # context / environment tokens, untrained
    first = detail.locator(".tok.adv.pos").first
    assert first.get_attribute("title").startswith("A = +0.5000") and "logp -0.100" in first.get_attribute("title")
    assert "w41" in detail.inner_text() and "done" in detail.inner_text()
    assert page.locator(".ep.sel").get_attribute("data-episode-id") == "tree-s1-01"

    page.click('.ep[data-episode-id="eval-s6-0"]')  # evaluation: nothing trained
    assert detail.locator(".tok[data-adv]").count() == 0 and detail.locator(".tok.act-untrained").count() > 0

    view.check_clean()


def test_report_colours_tokens_by_source_on_toggle(browser, tmp_path):
    from turnrl.rundir import write_jsonl

    write_jsonl(tmp_path / "rollouts" / "iter_000.jsonl", [provenance_episode()])
    view = Page(browser, write_report(tmp_path, tokenizer=WordTokenizer()))
    page = view.page
    assert "0.667" in page.inner_text("#mask-report + table + p")  # the run's mask report
    page.click('.ep[data-episode-id="p0"]')
    detail = page.locator("#detail")
    counts = {s: detail.locator(f'.seq .tok[data-src="{s}"]').count() for s in ("system", "user", "assistant", "tool")}
    assert counts == {"system": 3, "user": 2, "assistant": 1 + 3 + 1 + 2, "tool": 3}  # the hand count
    rows = detail.locator("table.rows tr.mask-row")
    assert rows.count() == 1 and rows.first.inner_text().split() == "whole episode 3 2 7 3 5 5 0.667".split()

    def background(selector: str) -> str:
        return detail.locator(selector).first.evaluate("el => getComputedStyle(el).backgroundColor")

    advantage = background(".tok.adv.pos")  # turn 0's action: coloured by its advantage
    assert background('.tok.ctx[data-src="tool"]') == background('.tok.ctx[data-src="user"]')  # both grey
    page.check("#by-source")
    assert "by-source" in detail.get_attribute("class")
    assert background('.tok[data-src="tool"]') == "rgb(166, 227, 161)"
    assert background('.tok[data-src="user"]') == "rgb(159, 216, 247)"
    assert background(".tok.adv.pos") == "rgb(255, 210, 138)" != advantage  # now the assistant colour
    page.uncheck("#by-source")
    assert background(".tok.adv.pos") == advantage
    view.check_clean()


def test_report_of_a_real_training_run(browser, tmp_path, tokenizer):
    """A real (tiny-model, CPU) training run: report loads, plots show, an episode's tokens are coloured."""
    from turnrl.config import load_config

    existing = os.environ.get("TURNRL_REPORT_RUN")
    if existing:
        run = Path(existing)
        from turnrl.models import load_tokenizer

        tokenizer = load_tokenizer(load_config(run / "config.yaml").model.name)
    else:
        from test_train_e2e import tiny_config
        from toy_envs import CountEnv
        from turnrl.envs import register_env
        from turnrl.train.loop import train

        register_env("count", CountEnv)
        cfg = tiny_config(tmp_path, tracking={"backends": ["csv"], "report": False})
        train(cfg)
        run = tmp_path / "runs" / "e2e"
    view = Page(browser, write_report(run, tokenizer=tokenizer))
    page = view.page
    widths = page.eval_on_selector_all("#plots img", "els => els.map(e => e.complete ? e.naturalWidth : 0)")
    assert len(widths) >= 4 and all(w > 0 for w in widths)
    assert "success" in page.inner_text("#results").lower()
    first = page.locator(".ep[data-episode-id]").first
    episode_id = first.get_attribute("data-episode-id")
    assert not episode_id.startswith("eval-")  # training episodes are listed first
    first.click()
    detail = page.locator("#detail")
    assert detail.locator(".tok[data-adv]").count() > 0  # trained tokens, coloured by advantage
    assert detail.locator(".tok.ctx").count() > 0  # prompt / environment tokens, untrained
    if os.environ.get("TURNRL_SAVE_SCREENSHOT") == "1":
        page.evaluate("document.getElementById('transcripts').scrollIntoView()")
        out = Path(__file__).resolve().parents[1] / "docs" / "report_screenshot.png"
        out.parent.mkdir(exist_ok=True)
        page.screenshot(path=str(out), full_page=False)
    view.check_clean()


def test_report_filters_and_pages_many_episodes(browser, tmp_path):
    run = build_run(tmp_path / "run", steps=40, iterations=2)  # 40 steps × 7 episodes + 16 eval
    view = Page(browser, write_report(run))  # no tokenizer: one span per action
    page = view.page
    assert page.inner_text("#page-info") == "page 1/4 · 96 groups · 296 episodes"
    assert page.locator("#list .ep").count() < 100  # only the current page is in the DOM
    page.click("#next")
    assert page.inner_text("#page-info").startswith("page 2/4")

    page.select_option("#f-source", "@eval")
    assert page.inner_text("#page-info") == "page 1/1 · 16 groups · 16 episodes"
    page.select_option("#f-source", "")
    page.fill("#f-search", "flat-s7-")
    assert page.inner_text("#page-info") == "page 1/1 · 1 groups · 3 episodes"
    page.select_option("#f-outcome", "success")
    assert page.locator("#list .ep").count() == 1

    page.click('.ep[data-episode-id="flat-s7-1"]')
    detail = page.locator("#detail")
    assert detail.locator(".tok[data-adv]").count() == 3  # one span per trained turn
    assert detail.locator(".tok.ctx").count() == 4  # the prompt and three environment replies
    assert "guess 2" in detail.inner_text() and "correct" in detail.inner_text()

    page.fill("#f-search", "")
    page.select_option("#f-outcome", "")
    page.click('.ep[data-episode-id="flat-s1-0"]')  # model text that tries to close the script tag
    assert "</script><script>alert(1)</script>" in detail.inner_text()
    view.check_clean()


def test_deep_link_opens_episode(browser, tmp_path):
    run = build_run(tmp_path / "run")
    path = write_report(run, tokenizer=FakeTokenizer())
    page = browser.new_page()
    page.goto(path.resolve().as_uri() + "#ep=flat-s2-1")
    assert page.locator("#detail .tok[data-adv]").count() == 3 * 4
    assert page.locator(".ep.sel").get_attribute("data-episode-id") == "flat-s2-1"


# ----------------------------------------------------------------------------- a hostile run directory

PAYLOADS = [
    '<img src=x onerror="window.__ran=(window.__ran||0)+1;alert(1)">',
    '"><svg onload="window.__ran=(window.__ran||0)+1">',
    '\'><body onpageshow="window.__ran=1">',
    "</script><script>window.__ran=1</script>",
    '<details open ontoggle="window.__ran=1">',
    '<iframe srcdoc="<script>parent.__ran=1</script>"></iframe>',
]


def _hostile_run(tmp_path: Path) -> Path:
    """A run directory someone sent you: every string field of its records holds markup, and one line
    types a turn index as markup (the reader refuses that record; the rest are shown)."""
    import json

    from turnrl.rundir import write_jsonl

    run = build_run(tmp_path / "run")
    episodes = []
    for n, payload in enumerate(PAYLOADS):
        ep = provenance_episode(f"h{n}-{payload}")
        ep.task_id, ep.group_id, ep.prompt = payload, f"g{n}{payload}", payload
        ep.metrics = {"step": 1, payload: 1.0}
        for turn in ep.turns:
            turn.action_text, turn.observation, turn.finish_reason = payload, payload, payload
            turn.state_key = payload
        episodes.append(ep)
    write_jsonl(run / "rollouts" / "iter_005.jsonl", episodes)
    typed_away = provenance_episode("index-as-markup").to_dict()
    typed_away["turns"][0]["index"] = PAYLOADS[0]
    with (run / "rollouts" / "iter_005.jsonl").open("a") as fh:
        fh.write(json.dumps(typed_away) + "\n")
    config = (run / "config.yaml").read_text().replace("run_name: demo", f"run_name: {json.dumps(PAYLOADS[0])}")
    (run / "config.yaml").write_text(config)
    return run


@pytest.mark.parametrize("tokenized", [True, False], ids=["tokens", "text"])
def test_a_hostile_run_directorys_report_is_inert(browser, tmp_path, tokenized):
    path = write_report(_hostile_run(tmp_path), tokenizer=WordTokenizer() if tokenized else None)
    view = Page(browser, path)
    page = view.page
    page.select_option("#f-source", "iter_005")
    ids = page.eval_on_selector_all(".ep[data-episode-id]", "els => els.map(e => e.dataset.episodeId)")
    assert sorted(ids) == sorted(f"h{n}-{p}" for n, p in enumerate(PAYLOADS))  # the typed-away record is not shown
    for n in range(len(PAYLOADS)):
        page.locator(".ep[data-episode-id]").nth(n).click()
        detail = page.inner_text("#detail")
        assert PAYLOADS[n] in detail  # shown as text, whole
    page.evaluate("document.querySelectorAll('details').forEach(d => d.open = true)")
    assert page.evaluate("window.__ran === undefined")
    assert page.locator("#detail img, #detail svg, #detail iframe, #list img, #list svg").count() == 0
    assert PAYLOADS[0] in page.title()
    view.check_clean()  # no alert, no request (the img's src=x was never fetched), no error


def test_the_policy_stops_an_event_handler_that_reached_the_markup(browser, tmp_path):
    """Defence in depth: were a field ever interpolated unescaped, the page's CSP (the one script's
    hash, no 'unsafe-inline') still refuses its inline handler, while the report's own script runs."""
    path = write_report(build_run(tmp_path / "run"))
    planted = path.read_text().replace(
        "<body>",
        '<body><img id="planted" src="data:," onerror="window.__ran=1"><div onclick="window.__ran=1"></div>',
        1,
    )
    assert planted != path.read_text()
    path.write_text(planted)
    view = Page(browser, path)
    page = view.page
    page.click("#planted", force=True)
    page.locator("[onclick]").first.dispatch_event("click")
    assert page.evaluate("window.__ran === undefined")
    assert page.locator("#list .ep").count() > 0  # the report's own (hashed) script ran
    assert view.dialogs == [] and view.external == []
    assert any("inline event handler" in e or "Content Security Policy" in e for e in view.errors), view.errors
