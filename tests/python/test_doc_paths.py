"""Every documentation path the project names exists: ``docs/...`` paths cited in code, build files, configs,
README and docs (an output stem such as ``--out docs/benchmarks/step`` counts when files ``step.*`` exist), and
every relative Markdown link of README.md and docs/ (issue 22)."""

import os
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOURCES = ["python", "src", "include", "tests", "benchmarks", "cmake", "configs", "docs", ".ci"]
FILES = ["README.md", "CMakeLists.txt", "setup.sh", "pyproject.toml"]
SUFFIXES = {".py", ".cpp", ".h", ".cu", ".cuh", ".inc", ".md", ".txt", ".sh", ".cmake", ".toml", ".yaml", ".yml", ""}
DOC_PATH = re.compile(r"(?<![\w/.-])docs/[A-Za-z0-9_./-]*[A-Za-z0-9_]")
MD_LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


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
