"""The HTML report of a crashed and resumed rollout, opened in a real headless Chromium:
no console errors, no request beyond the file itself, the timeline drawn with the crash
point, the reused turns and (for a restart-only sandbox) the turns thrown away."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from journal.anchoring import HeadSigner
from participants.runner import workload_specs
from replay.cli import main as cli_main
from replay.exit_codes import EXIT_INPUT
from tests.headless_chromium import HeadlessChromium
from tests.test_audit import crashed_and_resumed


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, HeadSigner, dict[str, str]]:
    """A signed workload of workplace and sandbox rollouts, crashed after turn 2 and resumed."""
    signer = HeadSigner.generate()
    location = str(tmp_path_factory.mktemp("report") / "journal")
    config = crashed_and_resumed(location, signer, environment="workplace,sandbox", groups=2, siblings=1,
                                 max_turns=5, crash_at=2)
    return location, signer, {s.environment: s.rollout_id for s in workload_specs(config)}


def report_of(location: str, signer: HeadSigner, rollout: str, tmp_path: Path) -> Path:
    public = tmp_path / "verify.pem"
    public.write_bytes(signer.public_pem())
    page = tmp_path / f"{rollout}.html"
    assert cli_main(["replay", "report", rollout, "--journal", location, "--html", str(page),
                     "--public-key", str(public)]) == 0
    return page


def assert_self_contained(html: str) -> None:
    assert not re.search(r"""\b(src|href)\s*=\s*["'](?!data:|#)""", html), "a link to an external asset"
    assert "@import" not in html and not re.search(r"url\((?!#|data:)", html)


def test_a_resumed_rollout_shows_its_crash_and_reused_turns_in_a_real_browser(run, tmp_path: Path) -> None:
    location, signer, rollouts = run
    page = report_of(location, signer, rollouts["workplace"], tmp_path)
    assert_self_contained(page.read_text())

    with HeadlessChromium() as browser:
        loaded = browser.open(page)
        assert loaded.errors == [], loaded.errors
        assert loaded.requests == [page.resolve().as_uri()], "the page asked for something besides itself"
        assert browser.evaluate("document.body.getAttribute('data-ready')") == "7"  # the script ran: 2 + 5 turns
        counts = browser.evaluate("""({
            ran: document.querySelectorAll('#timeline-svg .turn.ran').length,
            reused: document.querySelectorAll('#timeline-svg .turn.reused').length,
            lost: document.querySelectorAll('#timeline-svg .turn.lost').length,
            crashes: document.querySelectorAll('#timeline-svg .crash').length,
            audit: document.querySelector('#audit').innerText})""")
        assert (counts["ran"], counts["reused"], counts["lost"], counts["crashes"]) == (5, 2, 0, 1)
        assert "hash chains OK" in counts["audit"] and "signed heads verify" in counts["audit"]
        browser.evaluate("document.querySelector('#timeline-svg .turn.reused').dispatchEvent(new MouseEvent('click'))")
        assert browser.evaluate("document.querySelector('.turn-card.flash').id") == "turn-l0-t0"
        shot = browser.screenshot(tmp_path / "report.png")
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 20_000


def test_a_restarted_sandbox_rollout_shows_the_turns_thrown_away(run, tmp_path: Path) -> None:
    location, signer, rollouts = run
    page = report_of(location, signer, rollouts["sandbox"], tmp_path)
    with HeadlessChromium() as browser:
        loaded = browser.open(page)
        assert loaded.errors == [], loaded.errors
        counts = browser.evaluate("""({
            ran: document.querySelectorAll('#timeline-svg .turn.ran').length,
            reused: document.querySelectorAll('#timeline-svg .turn.reused').length,
            lost: document.querySelectorAll('#timeline-svg .turn.lost').length,
            crashes: document.querySelectorAll('#timeline-svg .crash').length,
            chains: document.querySelector('#audit').innerText})""")
        assert (counts["ran"], counts["reused"], counts["lost"], counts["crashes"]) == (5, 0, 2, 1)
        assert "life 0" in counts["chains"] and "life 1" in counts["chains"]  # the sandbox's two chains
        browser.screenshot(tmp_path / "sandbox.png")


def test_an_unknown_rollout_is_one_line_and_an_input_exit_code(run, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    location, _, _ = run
    assert cli_main(["replay", "report", "nobody", "--journal", location, "--html", str(tmp_path / "x.html")]) == EXIT_INPUT
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "'nobody'" in err
    assert not (tmp_path / "x.html").exists()
