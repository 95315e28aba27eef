"""The documents a reader follows: every relative link and anchor in README.md, BENCHMARKS.md and
docs/*.md resolves, and none cites an internal issue number a reader cannot look up
("issue 21", "(#20)", "issue-21")."""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs").rglob("*.md"))]
# what a reader also reads: the configs' comments, the code's docstrings, the scripts that made the results
SOURCES = sorted(p for pattern in ("configs/**/*.yaml", "growtrain/**/*.py", "bench/*.py", "experiments/*",
                                   "notebooks/*.ipynb", "tests/*.py") for p in ROOT.glob(pattern)
                 if p.is_file() and p.name != Path(__file__).name)  # this file holds the forms it looks for
LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(([^()\s]+)(?:\s+\"[^\"]*\")?\)")
# an issue by number ("issue 21", "issue #7", "issue-21", "(#20)", "#12") or by its title or
# as "the issue's ..." (an internal tracker the reader has no access to)
ISSUE = re.compile(r"\bissues?[ -]#?\d+|\(#\d+\)|(?<![\w&])#\d+\b|\bissues?\s*[:(]?\s*\"|\bissue's\b",
                   re.IGNORECASE)


def prose(text: str) -> str:
    """The text without fenced code blocks and inline code (a link or a '#3' there is code)."""
    text = re.sub(r"^(```|~~~).*?^\1[^\n]*$", "", text, flags=re.S | re.M)
    return re.sub(r"`[^`\n]*`", "", text)


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: markup dropped, lower case, every character but letters,
    marks, digits, '_', '-' and spaces removed, spaces to '-'."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading: its text
    text = text.replace("`", "").replace("*", "").lower().strip()
    kept = "".join(c for c in text if c in " -_" or unicodedata.category(c)[0] in "LMN")
    return kept.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for line in prose(path.read_text()).splitlines():
        match = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not match:
            continue
        base = slug(match.group(1))
        count = seen.get(base, 0)
        seen[base] = count + 1
        out.add(base if count == 0 else f"{base}-{count}")  # GitHub numbers repeated headings
    out.update(re.findall(r"<a\s+(?:name|id)=\"([^\"]+)\"", path.read_text()))
    return out


def test_slug_follows_github():
    assert slug("3. Why the paper's threshold is not enough") == "3-why-the-papers-threshold-is-not-enough"
    assert slug("Table 1 (protocol): growth vs scratch") == "table-1-protocol-growth-vs-scratch"
    assert slug("`measure`: Γ̂ and δ+t") == "measure-γ̂-and-δt"


def rel(path: Path) -> Path:
    return path.relative_to(ROOT) if path.is_relative_to(ROOT) else path


def broken_links(doc: Path) -> list[str]:
    bad = []
    for target in LINK.findall(prose(doc.read_text())):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        file = (doc.parent / path).resolve() if path else doc
        if not file.exists():
            bad.append(f"{target}: no file {rel(file)}")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            bad.append(f"{target}: no heading with anchor #{anchor} in {rel(file)}")
    return bad


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_and_anchor_resolves(doc):
    assert broken_links(doc) == []


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_doc_cites_an_internal_issue_number(doc):
    cited = [f"{doc.relative_to(ROOT)}:{n}: {line.strip()}" for n, line in enumerate(doc.read_text().splitlines(), 1)
             if ISSUE.search(prose(line))]  # fmt: skip
    assert cited == []


def test_no_config_script_or_docstring_cites_an_internal_issue_number():
    cited = [f"{p.relative_to(ROOT)}:{n}: {line.strip()}" for p in SOURCES
             for n, line in enumerate(p.read_text(errors="replace").splitlines(), 1) if ISSUE.search(line)]
    assert len(SOURCES) > 50 and cited == []


def test_the_checks_catch_what_they_look_for(tmp_path):
    """Negative controls: a missing file, a missing anchor and each citation form are caught;
    code and external links are not."""
    (tmp_path / "a.md").write_text("# Top\n\n## A section\n\nSee [b](b.md), [gone](a.md#nowhere), [ok](#a-section), "
                                   "[web](https://example.com/x.md#y) and `[code](nowhere.md)`.\n")  # fmt: skip
    assert broken_links(tmp_path / "a.md") == [f"b.md: no file {tmp_path / 'b.md'}",
                                               "a.md#nowhere: no heading with anchor #nowhere in " + str(tmp_path / "a.md")]
    for text in ("as in issue 21", "Issue #7 said", "fixed (#20)", "see issue-21", "closes #12",
                 'Issue: "A title"', 'targets (issue "A title")', "the issue's own figure"):
        assert ISSUE.search(prose(text)), text
    for text in ("an issue with 3 blocks", "`#3`", "step 200", "&#39;", "issues of depth", "a known issue: none"):
        assert not ISSUE.search(prose(text)), text


def test_the_design_module_table_names_every_module():
    """docs/design.md §6 is where a reader looks a module up: every module of the package is in it."""
    design = (ROOT / "docs" / "design.md").read_text()
    table = design[design.index("## 6. Module layout"):design.index("## 7.")]
    package = ROOT / "growtrain"
    missing = [str(p.relative_to(package)) for folder in (package, package / "callbacks", package / "experiments")
               for p in sorted(folder.glob("*.py")) if p.name != "__init__.py" and p.name not in table]  # fmt: skip
    subpackages = [d for d in sorted(package.iterdir()) if (d / "__init__.py").exists()]
    missing += [f"{d.name}/" for d in subpackages
                if d.name not in ("callbacks", "experiments") and f"`{d.name}/`" not in table]
    assert missing == []
