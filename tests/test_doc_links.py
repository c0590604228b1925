"""Every relative link in README.md and docs/*.md leads somewhere: the file exists and, for a
``#fragment`` into a markdown file, that file has a heading with that anchor (GitHub's rule)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# [text](target) and ![alt](target), the target up to a space or ")"; reference definitions
# "[name]: target" too.
INLINE = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
DEFINITION = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+\"[^\"]*\")?\s*$", re.M)


def prose(text: str) -> str:
    """``text`` without fenced code blocks and inline code, where brackets are not links."""
    text = re.sub(r"^(```|~~~).*?^\1[^\n]*$", "", text, flags=re.M | re.S)
    return re.sub(r"(`+)(?:(?!\1).)+?\1", "", text, flags=re.S)


def anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, inline markup and punctuation dropped (but
    ``-`` and ``_``), spaces made ``-``.

    >>> anchor("Is the job fast?")
    'is-the-job-fast'
    """
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip())
    text = re.sub(r"[`*]", "", text).lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading anchor in ``path``; a repeated heading's get ``-1``, ``-2``, ... as on GitHub,
    and explicit ``<a name=...>``/``id=...`` anchors count too."""
    seen: dict[str, int] = {}
    found: set[str] = set()
    text = prose(path.read_text())
    for m in re.finditer(r"^#{1,6}\s+(.+?)\s*#*\s*$", text, re.M):
        base = anchor(m.group(1))
        n = seen.get(base, 0)
        found.add(base if n == 0 else f"{base}-{n}")
        seen[base] = n + 1
    found.update(re.findall(r"""<a\s+(?:name|id)=["']([^"']+)["']""", text))
    return found


def links(path: Path) -> list[str]:
    text = prose(path.read_text())
    return INLINE.findall(text) + DEFINITION.findall(text)


def broken_links(path: Path) -> list[str]:
    """The relative links of ``path`` that lead nowhere, each with the reason."""
    bad = []
    for target in links(path):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # http:, https:, mailto:
            continue
        file_part, _, fragment = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        if not dest.exists():
            bad.append(f"{target}: no file {dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest}")
        elif fragment and dest.suffix == ".md" and fragment not in anchors(dest):
            bad.append(f"{target}: {dest.name} has no heading with anchor #{fragment}")
    return bad


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(path):
    assert broken_links(path) == []


def test_the_checker_finds_a_missing_file_and_a_missing_anchor(tmp_path, monkeypatch):
    monkeypatch.setattr(f"{__name__}.ROOT", tmp_path)
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text("# Title\n\n## Is the job fast?\n\n## Is the job fast?\n")
    page = tmp_path / "docs" / "a.md"
    page.write_text("See [fast](../README.md#is-the-job-fast), [again](../README.md#is-the-job-fast-1),\n"
                    "[gone](../README.md#clipping), [nothing](missing.md), [site](https://example.org/x#y),\n"
                    "![shot](../README.md) and `[not a link](nowhere.md)`.\n\n"
                    "```\n[in code](nowhere.md)\n```\n")
    assert broken_links(page) == ["../README.md#clipping: README.md has no heading with anchor #clipping",
                                  "missing.md: no file docs/missing.md"]
    assert len(links(page)) == 6  # the two in code are not links
