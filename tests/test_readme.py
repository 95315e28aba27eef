"""README.md is a manual: short, its first screen says what growtrain does, the two commands, where
a run's outputs are and what growth measured against scratch, and every figure in its results table
is one docs/results.md states. Relative links and anchors are checked for every document, README
included, in tests/test_docs_links.py; the quickstart's phrases and the callback defaults in
tests/test_docs_agree.py."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from growtrain.insertion import INSERTIONS

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
MAX_LINES = 250
FIRST_SCREEN = 60  # lines: what a reader sees before scrolling far
START, END = "<!-- results-table:start -->", "<!-- results-table:end -->"
# a signed or unsigned decimal: the measured figures (-0.0408, +0.0043, 0.2279); integers such as
# seeds, block counts and "95 %" are labels, not measurements
DECIMAL = re.compile(r"(?<![\w.])[+\-−]?\d+\.\d+")


def minus(text: str) -> str:
    """The typographic minus as ASCII: docs/results.md writes a negative figure both ways."""
    return text.replace("−", "-")


def results_table(page: str) -> str:
    """The text between the results-table markers (an error names a missing or misordered marker)."""
    assert page.count(START) == 1 and page.count(END) == 1, f"expected one {START} and one {END}"
    start, end = page.index(START) + len(START), page.index(END)
    assert start < end, f"{END} comes before {START}"
    return page[start:end]


def table_figures(page: str) -> list[str]:
    return [minus(f) for f in DECIMAL.findall(results_table(page))]


def missing_from_results(page: str, results: str) -> list[str]:
    """The results table's figures that docs/results.md does not state, sign included."""
    results = minus(results)
    return [f for f in table_figures(page) if f not in results]


def test_the_readme_is_under_its_line_budget():
    assert len(README.splitlines()) < MAX_LINES


def test_the_first_screen_has_the_commands_the_outputs_and_the_results_table():
    screen = "\n".join(README.splitlines()[:FIRST_SCREEN])
    block = re.search(r"```bash\n(.*?)```", screen, re.S)
    assert block, "no ```bash block on the first screen"
    commands = [line for line in block.group(1).splitlines() if line.strip()]
    assert "growtrain fit --config configs/quickstart.yaml" in commands[0]
    assert commands[1].endswith("python -m pytest -q")  # tests/test_ci.py: the line .ci/run runs
    assert START in screen and END in screen
    # the outputs paragraph, its folder taken from the quickstart config
    config = yaml.safe_load((ROOT / "configs" / "quickstart.yaml").read_text())
    folder = f"`{config['trainer']['default_root_dir']}/lightning_logs/version_N/`"
    flat = " ".join(screen.split())
    assert folder in flat, folder
    outputs = flat[flat.index(folder):]
    for name in ("metrics.csv", "growth_history.json", "gamma_trace.png", "checkpoints/last.ckpt"):
        assert f"`{name}`" in outputs, name
    # last.ckpt exists only because the config asks Lightning for it
    saves = [c["init_args"] for c in config["trainer"]["callbacks"] if c["class_path"].endswith("ModelCheckpoint")]
    assert any(s.get("save_last") for s in saves)
    # what growtrain does and the paper it is built on
    assert "Quantifying Depth Sufficiency in Residual Neural Networks: A First-Order Criterion" in flat
    assert "What it will not do for you" in flat


def test_the_results_table_is_a_plain_markdown_table_of_measured_figures():
    lines = [line for line in results_table(README).splitlines() if line.strip()]
    assert lines and all(line.startswith("|") and line.endswith("|") for line in lines), lines
    assert len(lines) >= 2 + 3  # header, rule, and a row per measured goal
    assert len(table_figures(README)) >= 8, table_figures(README)
    assert README.index(END) < README.index("## Installing")


def test_every_figure_in_the_results_table_is_in_docs_results():
    """A changed result that is not carried into the README (or a figure typed into the table
    without a measurement behind it) fails here."""
    missing = missing_from_results(README, (ROOT / "docs" / "results.md").read_text())
    assert not missing, f"README results-table figures not in docs/results.md: {missing}"


def test_the_figure_check_catches_a_figure_results_does_not_state():
    """Negative control: the sign counts, a typographic minus matches an ASCII one, and a figure
    that is not in the results is named."""
    page = f"{START}\n| a | −0.0408 and +0.1234 |\n{END}"
    assert missing_from_results(page, "mean -0.0408, 0.1234") == ["+0.1234"]
    assert missing_from_results(page.replace("+0.1234", "0.1234"), "−0.0408 and 0.1234") == []


def test_the_readme_has_no_session_narrative_and_no_removed_feature():
    words = re.findall(r"\bsessions?\b|\btoday\b|\bthis week\b", README, re.I)
    assert not words, words
    removed = [w for w in ("probation", "window rule", 'decision="fork"', 'decision="gain"', "decision='fork'")
               if w in README]  # fmt: skip
    assert not removed, removed


def test_the_readme_lists_every_insertion():
    """The sentence that lists the plan schedule's insertions names exactly the code's kinds."""
    flat = " ".join(README.split())
    sentence = re.search(r"`insertion` takes (\w+) values: (.*?)\.", flat)
    assert sentence, "no sentence listing the plan's insertions"
    listed = re.findall(r'`"([a-z_]+)"`', sentence.group(2))
    assert listed == list(INSERTIONS)
    assert sentence.group(1) == {2: "two", 3: "three", 4: "four", 5: "five"}[len(INSERTIONS)]


def test_the_first_screen_names_every_growth_callback():
    import growtrain.callbacks as callbacks

    screen = "\n".join(README.splitlines()[:FIRST_SCREEN])
    growing = [name for name in callbacks.__all__ if name.startswith("Grow")]
    assert growing == ["GrowUntilSaturated"] and f"`{growing[0]}" in screen  # one growth callback, its parts below
