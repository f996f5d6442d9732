"""Where the repository's folders are, worked out once, here.

A test that computed them from its own file (``Path(__file__).parents[2]``) broke as soon as it
moved one folder deeper; tests/ mirrors the library's rooms, so test modules sit at different
depths. This module's own place (tests/support/) is the one fixed point.
"""

from __future__ import annotations

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
"""The checkout: README.md, examples/, bench/, and the cwd and PYTHONPATH of the child processes
that run ``python -m tests.support...``."""

TESTS_DIR = REPO_ROOT / "tests"
"""The suite itself (tests/java/, tests/support/user_envs/)."""

DATA_DIR = TESTS_DIR / "data"
"""Files the suite reads and never writes (the golden journals)."""
