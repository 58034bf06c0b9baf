"""Every documentation path the project names exists: ``docs/...`` paths cited in code, build files, configs,
README and docs (an output stem such as ``--out docs/benchmarks/step`` counts when files ``step.*`` exist), and
every relative Markdown link of README.md and docs/ (issue 22); and every ``tests/...`` and ``benchmarks/...`` path
cited in the same files (issue 43: the layout of tests/ and benchmarks/ moves files, and a command or a docstring
that names the old place must fail here; brace forms ``a_{b,c}.py`` are expanded, globs must match a file)."""

import itertools
import os
import re
from pathlib import Path

from _paths import ROOT

SOURCES = ["python", "src", "include", "tests", "benchmarks", "cmake", "configs", "docs", ".ci"]
FILES = ["README.md", "CMakeLists.txt", "setup.sh", "pyproject.toml"]
SUFFIXES = {".py", ".cpp", ".h", ".cu", ".cuh", ".inc", ".md", ".txt", ".sh", ".cmake", ".toml", ".yaml", ".yml", ""}
DOC_PATH = re.compile(r"(?<![\w/.-])docs/[A-Za-z0-9_./-]*[A-Za-z0-9_]")
MD_LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
#: a path under tests/ or benchmarks/ (not inside another path: docs/benchmarks/... is a docs path), with optional
#: ``{a,b}`` alternatives and ``*`` globs
TREE_PATH = re.compile(r"(?<![\w/.$-])(?:tests|benchmarks)/(?:[A-Za-z0-9_./*-]|\{[A-Za-z0-9_.,/-]*\})*"
                       r"(?:[A-Za-z0-9_*]|\})")


def _files():
    for f in FILES:
        if (ROOT / f).is_file():
            yield ROOT / f
    for d in SOURCES:
        for dirpath, dirnames, names in os.walk(ROOT / d):
            dirnames[:] = [n for n in dirnames if not n.startswith(".") and n not in ("runs", "__pycache__")]
            for n in names:
                p = Path(dirpath) / n
                if p.suffix in SUFFIXES and p.stat().st_size < 2_000_000:
                    yield p


def _exists(rel: str) -> bool:
    p = ROOT / rel
    return p.exists() or any(p.parent.glob(p.name + ".*")) if p.parent.is_dir() else p.exists()


def test_every_cited_docs_path_exists():
    missing, seen = {}, set()
    for f in _files():
        try:
            text = f.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        for m in DOC_PATH.finditer(text):
            rel = m.group(0).rstrip(".")
            seen.add(rel)
            if not _exists(rel):
                missing.setdefault(rel, []).append(str(f.relative_to(ROOT)))
    assert len(seen) > 20, f"only {len(seen)} docs paths found: the scan is broken"
    assert not _exists("docs" + "/no-such-page.md")  # (split: this file is scanned too)
    assert not missing, "docs paths cited but absent: " + "; ".join(f"{k} (in {', '.join(sorted(set(v))[:3])})"
                                                                     for k, v in sorted(missing.items()))


def _expand(rel: str) -> list[str]:
    """The paths a cited ``a_{b,c}.py`` stands for (every combination of its brace groups)."""
    parts = re.split(r"\{([^}]*)\}", rel)
    choices = [[p] if i % 2 == 0 else p.split(",") for i, p in enumerate(parts)]
    return ["".join(c) for c in itertools.product(*choices)]


def _tree_path_exists(rel: str, where: Path) -> bool:
    if "*" in rel:
        return any(ROOT.glob(rel))
    # a Markdown page of docs/ names docs/benchmarks/... relative to itself, as its links do
    return _exists(rel) or (where.suffix == ".md" and (where.parent / rel).exists())


def missing_tree_paths(text: str, where: Path) -> list[str]:
    """The ``tests/...`` / ``benchmarks/...`` paths cited in ``text`` (the text of the file ``where``) that name no
    file or folder."""
    out = []
    for m in TREE_PATH.finditer(text):
        if text[m.end():m.end() + 1] == "<":  # a placeholder: tests/python/core/test_<op>.py
            continue
        rel = m.group(0).rstrip(".")
        out += [p for p in _expand(rel) if not _tree_path_exists(p, where)]
    return out


def test_the_tree_path_check_finds_an_absent_path():
    t, b = "tests", "benchmarks"  # (the paths are assembled: this file is scanned too)
    absent = t + "/python/test_no_such_module.py"
    text = (f"run {absent}, {b}/gpu/run_scale.sh and {t}/python/project/test_" + "{doc_paths,layers}.py; glob "
            f"{t}/python/*/test_*.py, {t}/python/core/test_<op>.py; docs/{b}/step is a docs path; "
            f"{b}/long/long.md is docs/'s own link")
    assert missing_tree_paths(text, ROOT / "docs" / "benchmarks.md") == [absent]
    assert missing_tree_paths(text, ROOT / "README.md") == [absent, b + "/long/long.md"]
    assert missing_tree_paths(t + "/python/project/test_" + "{doc_paths,no_such}.py", ROOT / "README.md") == [
        t + "/python/project/test_no_such.py"]
    assert missing_tree_paths(b + "/python/no_such_*.py", ROOT / "README.md") == [b + "/python/no_such_*.py"]


def test_every_cited_tests_and_benchmarks_path_exists():
    missing, seen = {}, set()
    for f in _files():
        try:
            text = f.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        seen |= {m.group(0) for m in TREE_PATH.finditer(text)}
        for rel in missing_tree_paths(text, f):
            missing.setdefault(rel, []).append(str(f.relative_to(ROOT)))
    assert len(seen) > 20, f"only {len(seen)} paths under tests and benchmarks found: the scan is broken"
    assert not missing, "paths under tests and benchmarks cited but absent: " + "; ".join(
        f"{k} (in {', '.join(sorted(set(v))[:3])})" for k, v in sorted(missing.items()))


def test_every_relative_markdown_link_resolves():
    broken, n = [], 0
    for f in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        for m in MD_LINK.finditer(f.read_text(encoding="utf-8")):
            target = m.group(1)
            if re.match(r"^[a-z]+:", target):  # http:, https:, mailto:
                continue
            n += 1
            if not (f.parent / target).exists():
                broken.append(f"{f.relative_to(ROOT)} -> {target}")
    assert n > 20, f"only {n} relative links found: the scan is broken"
    assert not broken, "broken links: " + "; ".join(broken)
