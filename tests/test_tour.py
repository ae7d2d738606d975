"""The guided tour (docs/tour.md) cannot drift from the code.

1. Every ```python block of the tour is extracted and executed, each in a FRESH namespace: every
   snippet is self-contained (its own imports), so a reader can paste any one alone. The block is
   compiled with the tour's path and its real line numbers, so a traceback points into docs/tour.md;
   a failure names the block's section heading and line. Snippets assert their claims, so changing a
   function's behaviour breaks this test.
2. Every relative link in docs/tour.md and README.md points to an existing file; a link whose text
   is a `name` (or `Class.member`) and whose target is a .py file must name something defined in that
   file (def / class / assignment); in-page #anchors of the tour must match one of its headings.
3. Every numbered concept section has a snippet and a link to the code.
4. Every metric in the tour's "which metric tells me what" table is really logged: the namespaced
   name (nanorl/metrics.py) of a losses.total_loss key or of a quoted string in train.py or nanorl/*.py.

Run: python -m pytest tests/test_tour.py -q
"""
from __future__ import annotations

import ast
import functools
import re
import time
import traceback
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
TOUR = ROOT / "docs" / "tour.md"
README = ROOT / "README.md"
LINK = re.compile(r"\[([^\]]+)\]\(([^)\s]+)\)")
IDENT = re.compile(r"^`([A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)?)`$")


# ----------------------------------------------------------------------------- markdown parsing
def sections(path: Path) -> list[tuple[str, int, list[str]]]:
    """(heading, line of the heading, lines of the section) for every heading outside code fences."""
    out, heading, start, lines, fence = [], "(top)", 1, [], False
    for no, line in enumerate(path.read_text().splitlines(), 1):
        if line.startswith("```"):
            fence = not fence
        if not fence and re.match(r"#{1,6} ", line):
            out.append((heading, start, lines))
            heading, start, lines = line.lstrip("#").strip(), no, []
        lines.append(line)
    out.append((heading, start, lines))
    return out


def python_blocks(path: Path) -> list[tuple[str, int, str]]:
    """(section heading, line of the first code line, code) of every ```python block."""
    blocks, heading, code, first, fence = [], "(top)", None, 0, False
    for no, line in enumerate(path.read_text().splitlines(), 1):
        if line.startswith("```"):
            if code is not None:  # closing a python block
                blocks.append((heading, first, "\n".join(code)))
                code = None
            elif line.strip() == "```python":
                code, first = [], no + 1
            fence = not fence
            continue
        if code is not None:
            code.append(line)
        elif not fence and re.match(r"#{1,6} ", line):
            heading = line.lstrip("#").strip()
    assert code is None, f"{path}: unclosed ```python block starting at line {first - 1}"
    return blocks


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


BLOCKS = python_blocks(TOUR)


# ----------------------------------------------------------------------------- 1. the snippets run
@pytest.mark.parametrize("heading,line,code", BLOCKS,
                         ids=[f"{i:02d}-line{b[1]}-{github_slug(b[0])[:40]}" for i, b in enumerate(BLOCKS)])
def test_snippet_runs(heading, line, code):
    # Pad with newlines so tracebacks show docs/tour.md's own line numbers.
    compiled = compile("\n" * (line - 1) + code, str(TOUR), "exec")
    start, error = time.perf_counter(), None
    try:
        exec(compiled, {"__name__": "__tour__"})
    except Exception as e:  # report which snippet broke, where, and the snippet-level traceback
        tb = "".join(traceback.format_exception(type(e), e, e.__traceback__))
        error = f"{type(e).__name__}: {e}\n{tb}"
    if error is not None:
        pytest.fail(f"docs/tour.md snippet in section '{heading}' (line {line}) failed: {error}",
                    pytrace=False)
    print(f"{heading}: {time.perf_counter() - start:.2f}s")


# The guides beside the tour (docs/extending.md, docs/from-slime-verl.md) are held to the same rule.
GUIDES = [ROOT / "docs" / "extending.md", ROOT / "docs" / "from-slime-verl.md"]
GUIDE_BLOCKS = [(doc, *b) for doc in GUIDES for b in python_blocks(doc)]


@pytest.mark.parametrize("doc,heading,line,code", GUIDE_BLOCKS,
                         ids=[f"{d.stem}-line{b[1]}-{github_slug(b[0])[:30]}" for d, *b in GUIDE_BLOCKS])
def test_guide_snippet_runs(doc, heading, line, code):
    try:
        exec(compile("\n" * (line - 1) + code, str(doc), "exec"), {"__name__": "__tour__"})
    except Exception as e:  # which snippet broke, where (the doc's own line numbers), and why
        tb = "".join(traceback.format_exception(type(e), e, e.__traceback__))
        pytest.fail(f"docs/{doc.name} snippet in section '{heading}' (line {line}) failed: {e}\n{tb}",
                    pytrace=False)


def test_tour_has_a_snippet_per_concept():
    concepts = [s for s in sections(TOUR) if re.match(r"\d+\. ", s[0])]
    assert len(concepts) >= 15, [c[0] for c in concepts]
    for heading, line, lines in concepts:
        body = "\n".join(lines)
        assert "```python" in body, f"section '{heading}' (line {line}) has no python snippet"
        assert re.search(r"\]\(\.\./(nanorl/\w+|train)\.py\)", body), \
            f"section '{heading}' (line {line}) links to no source file"


# ----------------------------------------------------------------------------- 2. links resolve
@functools.lru_cache(maxsize=None)
def defined_names(py: Path) -> set[str]:
    """Top-level defs, classes and assigned names of a module, plus `Class.member` for class bodies."""
    names = set()
    for node in ast.parse(py.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
            if isinstance(node, ast.ClassDef):
                for sub in node.body:
                    if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        names.add(f"{node.name}.{sub.name}")
                    elif isinstance(sub, ast.AnnAssign) and isinstance(sub.target, ast.Name):
                        names.add(f"{node.name}.{sub.target.id}")
        elif isinstance(node, ast.Assign):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return names


def links(path: Path) -> list[tuple[int, str, str]]:
    """(line, text, target) of every markdown link outside code fences."""
    out, fence = [], False
    for no, line in enumerate(path.read_text().splitlines(), 1):
        if line.startswith("```"):
            fence = not fence
            continue
        if not fence:
            out += [(no, m.group(1), m.group(2)) for m in LINK.finditer(line)]
    return out


@pytest.mark.parametrize("doc", [TOUR, README, *GUIDES], ids=["tour", "readme", *(g.stem for g in GUIDES)])
def test_links_resolve(doc):
    anchors = {github_slug(h) for h, _, _ in sections(doc)}
    checked, problems = 0, []
    for line, text, target in links(doc):
        if re.match(r"^[a-z]+://|^mailto:", target):
            continue
        path, _, anchor = target.partition("#")
        if not path:  # an in-page anchor
            if anchor not in anchors:
                problems.append(f"line {line}: anchor #{anchor} matches no heading")
            continue
        file = (doc.parent / path).resolve()
        if not file.exists():
            problems.append(f"line {line}: [{text}]({target}) -> {file} does not exist")
            continue
        m = IDENT.match(text)
        if m and file.suffix == ".py" and not m.group(1).endswith("py"):
            checked += 1
            if m.group(1) not in defined_names(file):
                problems.append(f"line {line}: `{m.group(1)}` is not defined in {path}")
    assert not problems, f"{doc.name}:\n" + "\n".join(problems)
    if doc == TOUR:
        assert checked >= 30, f"only {checked} function links checked: is the link syntax still parsed?"


def test_readme_reaches_the_tour():
    assert any(t == "docs/tour.md" for _, _, t in links(README)), "README must link docs/tour.md"


# ----------------------------------------------------------------------------- 4. metric names
def test_metric_table_names_are_logged():
    from nanorl.losses import LossConfig, total_loss
    from nanorl.metrics import NAMESPACES, name

    text = TOUR.read_text()
    table = text[text.index("## Which metric tells me what"):]
    names = re.findall(r"^\| `([^`]+)` \|", table, flags=re.M)
    assert len(names) >= 15, names
    x = torch.zeros(1, 2)
    _, loss_metrics = total_loss(LossConfig(), x, x, x, torch.ones(1, 2), entropy=x, kl=x, rollout_logp=x)
    src = "\n".join(p.read_text() for p in [ROOT / "train.py", *sorted((ROOT / "nanorl").glob("*.py"))])
    # Logged = what nanorl/metrics.py's namespacing makes of a total_loss key or a quoted string of the
    # code; `<k>` in the table and `{k}` in an f-string are the same placeholder (a string that starts
    # with one, e.g. f"{k}", names nothing).
    quoted = [q for q in re.findall(r'"([^"\s<>]+)"', src) if not q.startswith("{")]
    logged = {re.sub(r"\{[^}]*\}", "<>", name(q)) for q in {*loss_metrics, *quoted}}
    templates = [re.compile(re.escape(t).replace("<>", r"[\w@./-]+") + "$") for t in logged if "<>" in t]
    missing = [n for n in names if re.sub(r"<[^>]*>", "<>", n) not in logged
               and not any(t.match(n) for t in templates)]
    assert not missing, f"metrics in the tour's table that nothing logs: {missing}"
    assert all(n.startswith(NAMESPACES) for n in names), [n for n in names if not n.startswith(NAMESPACES)]
