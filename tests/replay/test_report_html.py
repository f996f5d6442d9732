"""The HTML report, opened in a real headless Chromium (no console errors, no request beyond the
page itself, a screenshot of each): one rollout's page on real runs that crashed and resumed,
restarted, and forked; and the whole-journal report of a journal of a thousand rollouts of every
kind and one of 200 turns, written event by event through the journal API. What a page draws is
what ``replay show`` and ``replay list`` say."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from rollout_journal.journal.anchoring import HeadSigner
from rollout_journal.participants.model.folders import policy_version_of
from rollout_journal.participants.model.tiny_model import default_tokenizer, tiny_model_dir
from rollout_journal.participants.workload.specs import workload_specs
from rollout_journal.replay.cli.main import main as cli_main
from rollout_journal.replay.exit_codes import EXIT_INPUT
from tests.support.headless_chromium import HeadlessChromium
from tests.support.replay_journals import Scenario, crashed_and_resumed, forked_and_continued, thousand_rollouts

GRID = """(() => Array.from(document.querySelectorAll('#timeline .band')).reduce((lanes, band) => {
    band.querySelectorAll('.lane').forEach(lane => {
        const a = lane.getAttribute('data-attempt');
        lanes[a] = (lanes[a] || '') + Array.from(lane.querySelectorAll('.cell')).map(c => c.textContent || ' ').join('');
    });
    return lanes;
}, {}))()"""


def cli_json(capsys: pytest.CaptureFixture, *argv: str) -> dict:
    capsys.readouterr()  # what came before
    assert cli_main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def shown_map(capsys: pytest.CaptureFixture, location: str, rollout: str) -> dict[str, str]:
    """``replay show``'s turn map: attempt -> its cells."""
    doc = cli_json(capsys, "replay", "show", rollout, "--journal", location)
    return {str(row["attempt"]): row["cells"] for row in doc["turn_map"]["rows"]}


def report_of(location: str, rollout: str, tmp_path: Path, signer: HeadSigner | None = None) -> Path:
    page = tmp_path / f"{rollout}.html"
    argv = ["replay", "report", rollout, "--journal", location, "--html", str(page)]
    if signer is not None:
        public = tmp_path / "verify.pem"
        public.write_bytes(signer.public_pem())
        argv += ["--public-key", str(public)]
    assert cli_main(argv) == 0
    return page


def assert_self_contained(html: str) -> None:
    assert not re.search(r"""\b(src|href)\s*=\s*["'](?!data:|#|\.\./index\.html|rollouts/|[\w.-]+\.html)""", html)
    assert "@import" not in html and not re.search(r"url\((?!#|data:)", html)


def opened(browser: HeadlessChromium, page: Path) -> None:
    loaded = browser.open(page)
    assert loaded.errors == [], loaded.errors
    assert loaded.requests == [page.resolve().as_uri()], "the page asked for something besides itself"


# -- one rollout, real runs ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, HeadSigner, dict[str, str]]:
    """A signed workload of workplace and sandbox rollouts, crashed after turn 2 and resumed."""
    signer = HeadSigner.generate()
    location = str(tmp_path_factory.mktemp("report") / "journal")
    config = crashed_and_resumed(
        location, signer, environment="workplace,sandbox", groups=2, siblings=1, max_turns=5, crash_at=2
    )
    return location, signer, {s.environment: s.rollout_id for s in workload_specs(config)}


def test_a_forks_copied_turns_are_drawn_copied_as_replay_show_says(tmp_path: Path, capsys) -> None:
    """(The report drew a fork's copied turns as "ran" where ``replay show`` says "copied".)"""
    location = str(tmp_path / "journal")
    _, origin, fork = forked_and_continued(location, at_turn=1, seed=7)
    page = report_of(location, fork, tmp_path)
    with HeadlessChromium() as browser:
        opened(browser, page)
        grid = browser.evaluate(GRID)
        assert {a: cells.rstrip() for a, cells in grid.items()} == {
            a: cells.rstrip() for a, cells in shown_map(capsys, location, fork).items()
        }
        assert (
            grid["1"].rstrip() == "ff"
            and browser.evaluate("document.querySelectorAll('#timeline .lane[data-attempt=\"1\"] .turn.ran').length")
            == 0
        )
        assert browser.evaluate("document.querySelectorAll('#timeline .turn.copied').length") == 2
        diffs = browser.evaluate("Array.from(document.querySelectorAll('#diffs summary')).map(s => s.textContent)")
        assert diffs and all(f"against its origin {origin}" in d for d in diffs)  # turns 2-4, with another seed
        browser.screenshot(tmp_path / "fork.png")


def test_a_resumed_rollout_shows_its_crash_reused_turns_and_tokens(run, tmp_path: Path, capsys) -> None:
    location, signer, rollouts = run
    rollout = rollouts["workplace"]
    page = report_of(location, rollout, tmp_path, signer)
    assert_self_contained(page.read_text())
    shown = cli_json(capsys, "replay", "show", rollout, "--journal", location, "--tokens")
    with HeadlessChromium() as browser:
        opened(browser, page)
        grid = browser.evaluate(GRID)
        assert {a: c.rstrip() for a, c in grid.items()} == {
            str(r["attempt"]): r["cells"].rstrip() for r in shown["turn_map"]["rows"]
        }
        assert grid == {"1": "CC!  ", "2": "==CCF"}
        audit = browser.evaluate("document.querySelector('#audit').innerText")
        assert "hash chains OK" in audit and "signed heads verify" in audit
        browser.evaluate("document.querySelector('#timeline .turn.reused').click()")
        assert browser.evaluate("document.querySelector('.turn-card.flash').id") == "turn-a1-t0"
        # the token view of the last call: its prompt delta and output, each token with its logprob and maker
        last = shown["turns"][-1]["calls"][0]
        browser.evaluate("Array.from(document.querySelectorAll('button.tok[data-call]')).pop().click()")
        assert browser.evaluate("document.body.getAttribute('data-tokens-shown')") == str(
            len(last["prompt_delta"]) + len(last["output_ids"])
        )
        sampled = browser.evaluate("document.querySelectorAll('#token-text span.sampled').length")
        assert sampled == len(last["output_ids"])
        browser.evaluate(
            "document.querySelector('#token-text span.sampled').dispatchEvent(new MouseEvent('mouseover', {bubbles: true}))"
        )
        hover = browser.evaluate("document.getElementById('token-hover').textContent")
        assert (
            f"logprob {last['logprobs'][0]:.4f}" in hover and "attempt 2" in hover and last["policy_version"] in hover
        )
        shot = browser.screenshot(tmp_path / "report.png")
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 20_000


def test_a_restarted_sandbox_rollout_shows_the_discarded_turns_and_diffs_the_redone_ones(
    run, tmp_path: Path, capsys
) -> None:
    location, signer, rollouts = run
    rollout = rollouts["sandbox"]
    page = report_of(location, rollout, tmp_path, signer)
    with HeadlessChromium() as browser:
        opened(browser, page)
        grid = browser.evaluate(GRID)
        assert {a: c.rstrip() for a, c in grid.items()} == {
            a: c.rstrip() for a, c in shown_map(capsys, location, rollout).items()
        }
        assert grid["1"].rstrip() == "xx!" and grid["2"].startswith("RR")
        diffs = browser.evaluate("Array.from(document.querySelectorAll('#diffs summary')).map(s => s.textContent)")
        assert [d.split(":")[0] for d in diffs] == ["turn 0", "turn 1"] and all(
            "redone by attempt 2" in d for d in diffs
        )
        chains = browser.evaluate("document.querySelector('#audit').innerText")
        assert "life 0" in chains and "life 1" in chains  # the sandbox's two chains
        browser.screenshot(tmp_path / "sandbox.png")


def test_an_unknown_rollout_is_one_line_and_an_input_exit_code(
    run, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    location, _, _ = run
    assert (
        cli_main(["replay", "report", "nobody", "--journal", location, "--html", str(tmp_path / "x.html")])
        == EXIT_INPUT
    )
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "'nobody'" in err
    assert not (tmp_path / "x.html").exists()


# -- the whole journal: a thousand rollouts, and one of 200 turns -------------------------------------


@pytest.fixture(scope="module")
def big(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Scenario, Path]:
    root = tmp_path_factory.mktemp("big")
    location = str(root / "journal")
    scenario = thousand_rollouts(Path(location), default_tokenizer(), policy_version_of(tiny_model_dir()))
    out = root / "report"
    assert cli_main(["replay", "report", "--journal", location, "--html", str(out)]) == 0
    return location, scenario, out


def test_the_index_lists_every_rollout_as_replay_list_does(big, capsys) -> None:
    location, scenario, out = big
    listed = {r["rollout_id"]: r for r in cli_json(capsys, "replay", "list", "--journal", location)["rollouts"]}
    crashed = {
        r["rollout_id"] for r in cli_json(capsys, "replay", "list", "--journal", location, "--crashed")["rollouts"]
    }
    assert len(listed) == len(list(scenario.all())) >= 1001
    html = (out / "index.html").read_text()
    assert_self_contained(html)
    rows = re.findall(r'<tr data-status="\w+" data-crashed="(\d)"(.*?)</tr>', html, re.S)
    assert len(rows) == len(listed)
    for hit, cells in rows:
        rid, _, status, attempts, crashes, turns = re.findall(r'data-v="([^"]*)"', cells)[:6]
        row = listed[rid]
        assert (status, int(attempts), int(crashes), int(turns)) == (
            row["status"],
            row["attempts"],
            row["crashes"],
            row["turns"],
        ), rid
        assert (hit == "1") == (rid in crashed), rid
        assert (out / re.search(r'href="([^"]+)"', cells).group(1)).is_file()
    # queued behind the concurrency limit when the worker died: superseded before running, no crash
    assert all(listed[rid]["crashes"] == 0 and listed[rid]["attempts"] == 2 for rid in scenario.queued)
    assert all(listed[rid]["crashes"] == 1 for rid in scenario.crashed)
    assert {listed[rid]["status"] for rid in scenario.failed} == {"failed"}
    assert {listed[rid]["status"] for rid in scenario.running} == {"running"}


def test_a_bad_rollout_among_a_thousand_is_a_few_clicks_away(big, tmp_path: Path) -> None:
    location, scenario, out = big
    total = len(list(scenario.all()))

    def typed(field: str, value: str) -> str:
        return f"(() => {{ const e = document.getElementById('{field}'); {value}; e.dispatchEvent(new Event('input')); }})()"

    def shown() -> int:
        return int(browser.evaluate("document.body.getAttribute('data-shown')"))

    with HeadlessChromium() as browser:
        opened(browser, out / "index.html")
        assert browser.evaluate("document.body.getAttribute('data-ready')") == str(total)
        failed = "document.querySelector('.chips button[data-status=\"failed\"]').click()"
        browser.evaluate(failed)  # one click: the failed ones
        assert shown() == len(scenario.failed)
        browser.screenshot(tmp_path / "index-failed.png", full_page=False)
        browser.evaluate(failed)  # and off again
        browser.evaluate(typed("only-crashed", "e.checked = true"))
        assert len(scenario.crashed) + len(scenario.restarted) <= shown() < total
        browser.evaluate(typed("search", "e.value = 'big-g1-'"))
        names = browser.evaluate(
            "Array.from(document.querySelectorAll('#rollouts tbody tr:not(.hidden) td:first-child'))"
            ".map(td => td.textContent)"
        )
        assert names and all(r.startswith("big-g1-") for r in names) and shown() == len(names)
        browser.evaluate(typed("search", "e.value = ''"))
        browser.evaluate(typed("only-crashed", "e.checked = false"))
        assert shown() == total
        # sort by crashes, most first (two clicks on the header)
        browser.evaluate("const th = document.querySelectorAll('#rollouts th')[4]; th.click(); th.click()")
        first = browser.evaluate("document.querySelector('#rollouts tbody tr td:nth-child(5)').getAttribute('data-v')")
        assert first == "1"
        browser.screenshot(tmp_path / "index.png", full_page=False)


def test_a_200_turn_rollout_stays_readable(big, tmp_path: Path) -> None:
    location, scenario, out = big
    page = out / "rollouts" / f"{scenario.long}.html"
    with HeadlessChromium(width=1280, height=900) as browser:
        opened(browser, page)
        grid = browser.evaluate(GRID)
        assert len(grid["2"]) == 200 and grid["2"].endswith("CF") and grid["1"].rstrip().endswith("C!")
        assert browser.evaluate("document.querySelectorAll('#timeline .band').length") == 4
        # nothing cut off or scrolled sideways: every cell inside the window, none too narrow to see
        fit = browser.evaluate("""(() => { const cells = Array.from(document.querySelectorAll('#timeline .cell'));
            return {overflow: document.documentElement.scrollWidth - innerWidth,
                    right: Math.max(...cells.map(c => c.getBoundingClientRect().right)),
                    narrowest: Math.min(...cells.map(c => c.getBoundingClientRect().width))}; })()""")
        assert fit["overflow"] <= 0 and fit["right"] <= 1280 and fit["narrowest"] >= 12
        browser.evaluate("document.querySelector('#timeline .lane[data-attempt=\"2\"] .turn.finished').click()")
        assert browser.evaluate("document.querySelector('.turn-card.flash').id") == "turn-a2-t199"
        browser.evaluate("Array.from(document.querySelectorAll('button.tok[data-call]')).pop().click()")
        assert int(browser.evaluate("document.body.getAttribute('data-tokens-shown')")) > 0
        browser.screenshot(tmp_path / "long.png", full_page=False)


def test_a_forks_page_diffs_it_against_its_origin(big, tmp_path: Path) -> None:
    location, scenario, out = big
    fork, origin = next(iter(scenario.forks.items()))
    with HeadlessChromium() as browser:
        opened(browser, out / "rollouts" / f"{fork}.html")
        assert browser.evaluate(GRID)["1"].rstrip() == "ff"
        first = browser.evaluate("document.querySelector('#diffs details')")  # the first diff is open
        assert first is not None
        changed = browser.evaluate(
            "Array.from(document.querySelectorAll('#diffs details[open] td.ins mark')).map(m => m.textContent).join('')"
        )
        assert "send" in changed  # the fork's own turn 2 against the origin's
        assert (
            browser.evaluate(
                "document.querySelector('header a[href$=\".html\"]:not([href^=\"..\"])').getAttribute('href')"
            )
            == f"{origin}.html"
        )
        browser.screenshot(tmp_path / "fork.png")
