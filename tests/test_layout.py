"""House rules of the tree: parts meet only through faces and knitkit.types; NOTE blocks are named
once and referenced from the code that depends on them."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PARTS = ("admission", "storage", "microbatch_iter", "encoder_dedup")
FACES = {
    "knitkit.admission",
    "knitkit.admission.replay",
    "knitkit.storage",
    "knitkit.storage.backends",
    "knitkit.storage.baselines",
    "knitkit.storage.delivery",
    "knitkit.storage.planning",
    "knitkit.microbatch_iter",
    "knitkit.encoder_dedup",
    "knitkit.job",
}
NOTE_TREES = ("knitkit", "integration")
NOTE_NAME = re.compile(r"NOTE(?:[ \t]|\n[ \t]*#?[ \t]*)\[ ([A-Z0-9][^\]]*?) \]")
"""A named NOTE; it may wrap onto the next comment or docstring line."""
DEFINITION_PREFIX = re.compile(r'^[ \t]*(#[ \t]*|"""[ \t]*)?$')


def _imports(path: Path) -> Iterator[tuple[int, str]]:
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.lineno, node.module
        elif isinstance(node, ast.Import):
            yield from ((node.lineno, alias.name) for alias in node.names)


def _part_of(module: str) -> str | None:
    names = module.split(".")
    return names[1] if len(names) > 1 and names[0] == "knitkit" and names[1] in PARTS else None


def _py_files(*trees: str) -> list[Path]:
    return sorted(p for tree in trees for p in (ROOT / tree).rglob("*.py"))


def test_demo_and_adapters_import_parts_only_through_faces() -> None:
    """knitkit.demo and every adapter in integration/ import a part through its face, never a
    room or module inside it (so parts can reorganise their rooms freely)."""
    bad = [
        f"{path.relative_to(ROOT)}:{line} imports {module}"
        for path in _py_files("knitkit/demo", "integration")
        for line, module in _imports(path)
        if _part_of(module) and module not in FACES
    ]
    assert not bad, "import these names from the part's face instead:\n" + "\n".join(bad)


def test_benchmarks_import_parts_only_through_faces() -> None:
    """Benchmarks measure what users get: they import each part through a public face."""
    bad = [
        f"{path.relative_to(ROOT)}:{line} imports {module}"
        for path in _py_files("benchmarks")
        for line, module in _imports(path)
        if _part_of(module) and module not in FACES
    ]
    assert not bad, "import these names from the part's face instead:\n" + "\n".join(bad)


def test_the_storage_user_face_is_small() -> None:
    """``knitkit.storage`` is the user's face (about 25 names: 27 with the rollout writer's
    ``UnitPlacer`` and its ``PlacedTrajectory``); helpers for backend authors and
    adapters live on their own faces, internals on none."""
    import knitkit.storage

    assert len(knitkit.storage.__all__) <= 27, sorted(knitkit.storage.__all__)
    for internal in ("ReadCounter", "check_ranges", "ReorganizerHost"):
        assert internal not in knitkit.storage.__all__


def test_delivery_internals_are_on_no_face() -> None:
    """Reorganizer hosts run a ``ReorganizerHost``; the ring, publisher, reorganizer loop and
    assignment record it wraps are internals that no face exports."""
    import importlib

    internals = {"Publisher", "SlotRing", "Assignment", "Reorganizer"}
    for face in sorted(FACES):
        exported = set(importlib.import_module(face).__all__)
        assert not exported & internals, f"{face} exports {sorted(exported & internals)}"
    assert "ReorganizerHost" in importlib.import_module("knitkit.storage.delivery").__all__


LIFECYCLE_NOTES = (
    "Prefetch thread shutdown",
    "Exit with a thread inside the source",
    "Micro-batch publication protocol",
    "Reorganizer process shutdown",
    "SIGTERM while child processes are open",
    "Reorganizer actor lifetime",
    "Ray loopback runtime",
    "Planner and the garbage collector",
    "Slab lifetime",
    "Owner-only clean-up",
    "Driver threads",
    "Records over slot rings",
)


def test_every_lifecycle_note_links_the_lifecycle_page() -> None:
    """One page lists every thread and process knitkit starts (docs/lifecycle.md); each NOTE
    about starting, stopping or cleaning up links to it."""
    assert (ROOT / "docs" / "lifecycle.md").is_file()
    texts = {p: p.read_text() for tree in NOTE_TREES for p in (ROOT / tree).rglob("*.py")}
    for name in LIFECYCLE_NOTES:
        block = next(
            (t[at:][:6000] for t in texts.values() for at in _definitions(t, name)),
            None,
        )
        assert block is not None, f"NOTE [ {name} ] is not defined"
        own = re.split(r"\n[ \t]*(?:#[ \t]*)?NOTE \[ ", block)[0]  # up to the next block
        assert "docs/lifecycle.md" in own, f"NOTE [ {name} ] does not link docs/lifecycle.md"


def _definitions(text: str, name: str) -> Iterator[int]:
    """Where ``text`` defines NOTE [ name ] (the rule of ``_note_sites``)."""
    for m in re.finditer(re.escape(f"NOTE [ {name} ]"), text):
        prefix = text[text.rfind("\n", 0, m.start()) + 1 : m.start()]
        if DEFINITION_PREFIX.match(prefix) and text[m.end() : m.end() + 1] in (":", "\n", ""):
            yield m.start()


OUTSIDE = re.compile(r"\.\./shared|/work/|shared/(?:notes|design)|notes/\w+\.md|\bdesign\.md")


def test_no_doc_or_comment_points_outside_the_repository() -> None:
    """Every reference resolves inside the repository: no path to the planning notes or a
    machine's folders, and every relative markdown link names a file that exists."""
    files = [
        p
        for p in ROOT.rglob("*")
        if p.is_file()
        and p.suffix in (".py", ".md", ".sh")
        and not any(part.startswith(".") or part == "build" for part in p.relative_to(ROOT).parts)
    ]
    bad = [
        f"{p.relative_to(ROOT)}: {m.group(0)}"
        for p in files
        if p.name != "test_layout.py"
        for m in OUTSIDE.finditer(p.read_text())
    ]
    for p in (p for p in files if p.suffix == ".md"):
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", p.read_text()):
            if "://" in target or target.startswith("mailto:"):
                continue
            if not (p.parent / target).exists():
                bad.append(f"{p.relative_to(ROOT)}: broken link {target}")
    assert not bad, "\n".join(bad)


def test_library_parts_do_not_load_baselines_or_the_demo() -> None:
    """Benchmark-only code (``knitkit.storage.baselines``), the demo and the simulated cluster
    (``knitkit.testing``) stay off the import path of the four library parts."""
    code = (
        "import sys, knitkit.admission, knitkit.storage, knitkit.storage.backends, "
        "knitkit.storage.planning, knitkit.storage.delivery, knitkit.microbatch_iter, "
        "knitkit.encoder_dedup\n"
        "print(sorted(m for m in sys.modules if m.startswith(('knitkit.storage.baselines', "
        "'knitkit.demo', 'knitkit.admission.replay', 'knitkit.testing'))))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True, timeout=120
    )
    assert out.stdout.strip() == "[]", out.stdout


def test_parts_import_no_other_part() -> None:
    """The four parts exchange types only through knitkit/types.py: no part imports another."""
    bad = [
        f"{path.relative_to(ROOT)}:{line} imports {module}"
        for part in PARTS
        for path in _py_files(f"knitkit/{part}")
        for line, module in _imports(path)
        if _part_of(module) not in (None, part)
    ]
    assert not bad, "move the shared type to knitkit/types.py:\n" + "\n".join(bad)


def _note_sites() -> Iterator[tuple[str, str | None, bool]]:
    """Every ``NOTE`` in the code: (where, its name or None if malformed, whether it defines)."""
    for path in (p for tree in NOTE_TREES for p in (ROOT / tree).rglob("*") if p.is_file()):
        if path.suffix not in (".py", ".md"):
            continue
        text = path.read_text()
        for match in re.finditer(r"\bNOTE\b", text):
            line_start = text.rfind("\n", 0, match.start()) + 1
            where = f"{path.relative_to(ROOT)}:{text.count(chr(10), 0, match.start()) + 1}"
            named = NOTE_NAME.match(text, match.start())
            name = None
            if named:
                name = " ".join(re.sub(r'\n[ \t]*(#|""")?', " ", named.group(1)).split())
            defines = (
                path.suffix == ".py"
                and named is not None
                and bool(DEFINITION_PREFIX.match(text[line_start : match.start()]))
                and text[named.end() : named.end() + 1] in (":", "\n", "")
            )
            yield where, name, defines


def test_note_blocks_are_named_defined_once_and_referenced() -> None:
    """Every NOTE is written ``NOTE [ Name ]``; a block is defined once (a comment or docstring
    line starting with it, followed by ':' or nothing); every reference names a defined block; every block is referenced
    from code elsewhere (the code that depends on it; a README mention does not count)."""
    sites = list(_note_sites())
    unnamed = [where for where, name, _ in sites if name is None]
    assert not unnamed, (
        "write NOTEs as `NOTE [ Name ]`, name capitalised (a plain comment for a one-off remark):\n"
        + "\n".join(unnamed)
    )
    defined = Counter(name for _, name, defines in sites if defines)
    twice = sorted(name for name, count in defined.items() if count > 1)
    assert not twice, f"NOTE blocks defined more than once: {twice}; give each its own name"
    referenced = Counter(name for where, name, defines in sites if not defines and ".py:" in where)
    dangling = sorted(
        f"{where}: {name}" for where, name, defines in sites if not defines and name not in defined
    )
    assert not dangling, "references to undefined NOTE blocks:\n" + "\n".join(dangling)
    unreferenced = sorted(name for name in defined if not referenced[name])
    assert not unreferenced, (
        f"NOTE blocks nothing refers to: {unreferenced}; reference each as `see NOTE [ Name ]` "
        "from the code that relies on it"
    )
