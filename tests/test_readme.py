"""The README is for users and stays short; every relative link in it and in docs/ leads somewhere;
its Python client snippet runs as pasted (against a real broker and simulated workers)."""

from __future__ import annotations

import ast
import importlib
import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").rglob("*.md"))
_FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def _prose(text: str) -> str:
    """The text without fenced code blocks (a link inside one is an example, not a link)."""
    return _FENCE.sub("", text)


def _anchors(path: Path) -> set[str]:
    """GitHub's heading anchors of a markdown file: lower case, punctuation dropped, spaces as '-'."""
    out = set()
    for line in _prose(path.read_text()).splitlines():
        m = re.match(r"#{1,6}\s+(.*)", line)
        if m:
            out.add(re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-"))
    return out


def _python_snippets(text: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", text, re.S | re.M)


def test_the_readme_is_at_most_300_lines():
    n = len(README.read_text().splitlines())
    assert n <= 300, f"README.md has {n} lines: move reference material to docs/"


@pytest.mark.parametrize("doc", [README, *DOCS], ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_points_to_an_existing_file_and_heading(doc: Path):
    broken = []
    for target in _LINK.findall(_prose(doc.read_text())):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (doc.parent / path).resolve() if path else doc
        if not dest.exists():
            broken.append(f"{target} (no file {dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest})")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{target} (no heading #{anchor} in {dest.relative_to(ROOT)})")
    assert not broken, f"{doc.relative_to(ROOT)}: broken links: {broken}"


def _recipe_commands() -> list[list[str]]:
    """The ``mesh ...`` command lines of the fleet recipe (continuations joined, optional [...] unwrapped)."""
    text = README.read_text()
    recipe = text[text.index("## mesh in front of"):text.index("\n## ", text.index("## mesh in front of") + 1)]
    out = []
    for block in re.findall(r"^```bash\n(.*?)^```", recipe, re.S | re.M):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split("#", 1)[0].replace("[", "").replace("]", "")
            if line.startswith("mesh "):
                out.append(shlex.split(line)[1:])
    return out


def test_the_fleet_recipe_names_only_flags_mesh_has():
    from mesh.cli import build_parser

    cmds = _recipe_commands()
    assert {c[0] for c in cmds} >= {"broker", "attach", "gateway", "indexer"}, cmds
    assert any("--tokenizer" in c for c in cmds if c[0] == "broker")
    for argv in cmds:
        try:
            build_parser().parse_args(argv)
        except SystemExit as exc:
            pytest.fail(f"README: mesh {' '.join(argv)} does not parse (exit {exc.code})")


def test_the_readme_python_snippet_compiles_and_imports_only_names_that_exist():
    snippets = _python_snippets(README.read_text())
    assert len(snippets) == 1, "the README has one Python snippet, the client's"
    tree = ast.parse(snippets[0], "README.md")  # no top-level await: it must run when pasted
    compile(tree, "README.md", "exec")
    imported = 0
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                importlib.import_module(alias.name)
                imported += 1
        elif isinstance(node, ast.ImportFrom):
            mod = importlib.import_module(node.module)
            for alias in node.names:
                assert hasattr(mod, alias.name), f"README: {node.module} has no {alias.name}"
                imported += 1
    assert imported


def test_the_readme_python_snippet_runs_against_a_real_broker(procs, capsys):
    b = procs.broker("b", "--park-timeout-s", "10")
    procs.workers("w", [b.backend], count=1)
    code = _python_snippets(README.read_text())[0]
    assert "tcp://127.0.0.1:5555" in code
    exec(compile(code.replace("tcp://127.0.0.1:5555", b.frontend), "README.md", "exec"), {"__name__": "__readme__"})
    out = capsys.readouterr().out.splitlines()
    assert out[-1].startswith("[") and out[-1].endswith("]"), out  # the SyncClient's token ids
    assert any(line.startswith(("length", "stop")) for line in out), out  # the async client's finish_reason
