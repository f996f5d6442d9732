"""``examples/demo.yaml`` documents every setting: each field of the workload settings and of the
model settings is there (set, or commented out with its default), with a comment saying what it
does, and the defaults it gives are the models' own. A field added to either model without a line
here fails this test."""

from __future__ import annotations

import re

import yaml

from rollout_journal.participants.workload.config import ModelConfig, WorkloadConfig
from tests.support.paths import REPO_ROOT

DEMO = REPO_ROOT / "examples" / "demo.yaml"
LINE = re.compile(r"^(?P<indent> *)(?P<off>#\s*)?(?P<key>[a-z_]+):(?P<value>[^#]*?)\s*(?:#\s*(?P<doc>.+))?$")


def documented() -> dict[tuple[str, str], tuple[bool, str, str | None]]:
    """(section, key) -> (commented out, value text, comment); section "" or "model"."""
    found = {}
    section = ""
    for line in DEMO.read_text().splitlines():
        m = LINE.match(line)
        if m is None:
            continue
        nested = len(m["indent"]) >= 2 or (m["off"] is not None and line.startswith("  "))
        if not nested:
            section = m["key"] if m["key"] == "model" and m["off"] is None else ""
        key = (section if nested else "", m["key"])
        found[key] = (m["off"] is not None, m["value"].strip(), m["doc"])
    return found


def test_every_workload_and_model_setting_is_documented_with_its_default() -> None:
    lines = documented()
    expected = {("", name): field for name, field in WorkloadConfig.model_fields.items()}
    expected |= {("model", name): field for name, field in ModelConfig.model_fields.items()}
    missing = sorted(f"{s + '.' if s else ''}{k}" for s, k in expected if (s, k) not in lines)
    assert not missing, f"not documented in {DEMO.name}: {', '.join(missing)}"
    for (section, key), field in expected.items():
        off, value, doc = lines[(section, key)]
        assert doc, f"{key}: no comment says what it does"
        if off:  # commented out: it shows the default
            default = field.get_default(call_default_factory=True)
            assert yaml.safe_load(value) == (default if not hasattr(default, "model_dump") else default.model_dump()), (
                key
            )


def test_the_demo_workload_loads_as_documented() -> None:
    config = WorkloadConfig.load(DEMO)
    assert (config.name, config.groups, config.siblings, config.max_turns) == ("demo", 4, 3, 6)


def test_the_demo_without_examples_beside_it_runs_the_same_workload() -> None:
    from rollout_journal.replay.cli.demo import BUILT_IN_DEMO, EXAMPLE, default_demo_config

    assert EXAMPLE == DEMO
    assert WorkloadConfig.model_validate(BUILT_IN_DEMO) == WorkloadConfig.load(DEMO)
    assert default_demo_config("j") == WorkloadConfig.load(DEMO).model_copy(update={"journal": "j"})
