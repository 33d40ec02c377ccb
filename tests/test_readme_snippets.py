"""Every Python snippet of every README runs, or names only knitkit things that exist, called as they take it.

Each ```python block of every README.md in the repository is one case. A self-contained snippet
(it defines every name it uses) runs in a fresh interpreter, unless ``NOT_RUN`` says why not.
Every snippet is also checked statically: it parses; every name it leaves open is the reader's
own object (``READER_NAMES``), never a knitkit name it forgot to import; every ``from knitkit...
import`` exists; and every attribute and call it makes on a knitkit object resolves: the
attribute exists on the module, class or instance (from annotations, slots and ``self.x =``
assignments), and the call's positional count and keyword names bind to the signature.
"""

from __future__ import annotations

import ast
import builtins
import importlib
import inspect
import re
import subprocess
import symtable
import sys
import typing
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from types import ModuleType

import pytest
from background import in_background, selected

ROOT = Path(__file__).resolve().parents[1]
SKIP_DIRS = {"node_modules", "build", "dist"}


def _readmes() -> list[Path]:
    return sorted(
        p
        for p in ROOT.glob("**/README.md")
        if not any(
            part.startswith(".") or part.endswith(".egg-info") or part in SKIP_DIRS
            for part in p.relative_to(ROOT).parts
        )
    )


@dataclass(frozen=True, slots=True)
class Snippet:
    readme: str
    """Path from the repository root."""
    index: int
    """Its place among the README's python snippets, from 0."""
    line: int
    code: str

    @property
    def where(self) -> str:
        return f"{self.readme}:{self.line}"


def _snippets() -> list[Snippet]:
    out = []
    for path in _readmes():
        text = path.read_text()
        for index, match in enumerate(re.finditer(r"```python\n(.*?)```", text, re.S)):
            line = text.count("\n", 0, match.start()) + 2
            out.append(Snippet(str(path.relative_to(ROOT)), index, line, match.group(1)))
    return out


SNIPPETS = _snippets()

READER_NAMES = frozenset(
    {
        # the reader's own objects, which a snippet uses without defining them
        *("batch", "config", "controller", "ddp_model", "encode_fn", "forward_backward_func"),
        *("forward_step", "H", "image_tiles", "images", "input_ids", "iterator", "labels"),
        *("load", "load_tiles", "max_seq", "mini_batches", "model", "my_loader", "num_steps"),
        *("optimizer", "out", "passes", "path", "plan", "post", "prompt_ids", "rank"),
        "reference",
        *("request", "sample", "sid", "spec", "step", "store", "tid", "tiles_per_image"),
        *("tool_response_ids", "tp_rank", "train_on", "train_one_mini_batch", "trajectory"),
        *("trajectory_meta", "url", "vision", "writer"),
    }
)
FACES = (
    "knitkit.types",
    "knitkit.admission",
    "knitkit.storage",
    "knitkit.microbatch_iter",
    "knitkit.encoder_dedup",
    "knitkit.metrics",
)
"""Faces whose public names a snippet must import, never leave to the reader."""

NOT_RUN: dict[tuple[str, int], str] = {
    ("integration/mooncake/README.md", 0): "needs the Mooncake engine and starts its master",
    ("integration/ray/README.md", 0): "starts a local Ray cluster (tens of seconds)",
    ("integration/transferqueue/README.md", 0): "needs TransferQueue and starts Ray",
    ("integration/transferqueue/README.md", 1): "needs TransferQueue and starts its servers",
    ("knitkit/storage/README.md", 0): "writes shards to /scratch, an absolute path",
}
"""Self-contained snippets that are checked statically only: (README, index) -> why."""

KNOWN_BROKEN: dict[tuple[str, int], str] = {}
"""Snippets that fail today, with the fix (their READMEs belong to others; the lead applies
them). Strict: a fixed snippet fails here until its entry is removed."""


def _free_names(code: str) -> set[str]:
    """Names the snippet reads but neither imports nor assigns, in any scope (builtins aside)."""
    top = symtable.symtable(code, "<snippet>", "exec")
    bound = {s.get_name() for s in top.get_symbols() if s.is_assigned() or s.is_imported()}
    used: set[str] = set()
    tables = [top]
    while tables:
        table = tables.pop()
        tables.extend(table.get_children())
        used.update(
            s.get_name()
            for s in table.get_symbols()
            if s.is_referenced() and (table is top or s.is_global())
        )
    return used - bound - set(dir(builtins))


def _face_names() -> dict[str, str]:
    names: dict[str, str] = {}
    for face in FACES:
        module = importlib.import_module(face)
        for name in getattr(module, "__all__", ()):
            names.setdefault(name, face)
    return names


# ----- static resolution of what a snippet does with knitkit objects ---------------------------
@dataclass(frozen=True, slots=True)
class Obj:
    """A knitkit module, class or function itself."""

    value: object


@dataclass(frozen=True, slots=True)
class Inst:
    """An instance of a knitkit class."""

    cls: type


@dataclass(frozen=True, slots=True)
class Bound:
    """A method looked up on an instance (its first parameter is bound)."""

    cls: type
    function: object


Kind = Obj | Inst | Bound | None
"""What an expression evaluates to, as far as the checker knows (None: unknown, not checked)."""


def _is_knitkit(value: object) -> bool:
    module = value.__name__ if isinstance(value, ModuleType) else getattr(value, "__module__", "")
    return isinstance(module, str) and module.startswith("knitkit")


class Checker:
    """Walks a snippet in order, tracking names bound to knitkit objects; collects problems."""

    def __init__(self) -> None:
        self.env: dict[str, Kind] = {}
        self.problems: list[str] = []

    def run(self, tree: ast.Module) -> list[str]:
        self._body(tree.body)
        return self.problems

    def _body(self, body: list[ast.stmt]) -> None:
        for statement in body:
            self._statement(statement)

    def _statement(self, node: ast.stmt) -> None:
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("knitkit"):
            self._import_from(node)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("knitkit"):
                    module = importlib.import_module(alias.name)
                    top = alias.asname or alias.name.split(".")[0]
                    self.env[top] = Obj(module if alias.asname else importlib.import_module(top))
        elif isinstance(node, ast.Assign):
            kind = self._eval(node.value)
            for target in node.targets:
                self._bind(target, kind)
        elif isinstance(node, ast.With):
            for item in node.items:
                kind = self._enter(self._eval(item.context_expr))
                if item.optional_vars is not None:
                    self._bind(item.optional_vars, kind)
            self._body(node.body)
        elif isinstance(node, ast.For | ast.While | ast.If | ast.Try):
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.expr):
                    self._visit_expr(child)
            if isinstance(node, ast.For):
                self._bind(node.target, None)
            for field in ("body", "orelse", "finalbody"):
                self._body(getattr(node, field, []))
            for handler in getattr(node, "handlers", []):
                self._body(handler.body)
        else:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.expr):
                    self._visit_expr(child)

    def _import_from(self, node: ast.ImportFrom) -> None:
        module = importlib.import_module(node.module or "")
        for alias in node.names:
            if not hasattr(module, alias.name):
                self.problems.append(f"{node.module} has no {alias.name!r}")
                self.env[alias.asname or alias.name] = None
            else:
                self.env[alias.asname or alias.name] = Obj(getattr(module, alias.name))

    def _bind(self, target: ast.expr, kind: Kind) -> None:
        if isinstance(target, ast.Name):
            self.env[target.id] = kind
        else:
            for name in ast.walk(target):
                if isinstance(name, ast.Name):
                    self.env[name.id] = None

    def _visit_expr(self, node: ast.expr) -> None:
        """Evaluate the outermost calls and attributes of ``node`` (each is checked once)."""
        if isinstance(node, ast.Call | ast.Attribute):
            self._eval(node)
            return
        if isinstance(node, ast.NamedExpr):
            self._bind(node.target, self._eval(node.value))
            return
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.expr):
                self._visit_expr(child)

    def _eval(self, node: ast.expr) -> Kind:
        if isinstance(node, ast.Name):
            return self.env.get(node.id)
        if isinstance(node, ast.Attribute):
            return self._attribute(self._eval(node.value), node.attr)
        if isinstance(node, ast.Call):
            function = self._eval(node.func)
            for arg in (*node.args, *(k.value for k in node.keywords)):
                self._visit_expr(arg)
            return self._call(function, node)
        if isinstance(node, ast.NamedExpr):
            kind = self._eval(node.value)
            self._bind(node.target, kind)
            return kind
        self._visit_expr(node)
        return None

    def _attribute(self, base: Kind, name: str) -> Kind:
        if isinstance(base, Obj) and _is_knitkit(base.value):
            if not hasattr(base.value, name):
                self.problems.append(f"{_name(base.value)} has no attribute {name!r}")
                return None
            return Obj(getattr(base.value, name))
        if isinstance(base, Inst):
            return self._instance_attribute(base.cls, name)
        return None

    def _instance_attribute(self, cls: type, name: str) -> Kind:
        static = inspect.getattr_static(cls, name, None)
        if isinstance(static, property):
            return _returned(static.fget, cls)
        if inspect.isfunction(static) or isinstance(static, staticmethod | classmethod):
            return Bound(cls, getattr(cls, name))
        if static is not None or name in _instance_fields(cls):
            hint = _hints(cls).get(name)
            return Inst(hint) if isinstance(hint, type) and _is_knitkit(hint) else None
        if hasattr(cls, "__getattr__"):
            return None
        self.problems.append(f"{_name(cls)} instances have no attribute {name!r}")
        return None

    def _call(self, function: Kind, node: ast.Call) -> Kind:
        if isinstance(function, Obj) and _is_knitkit(function.value) and callable(function.value):
            self._check_binding(function.value, node, bound=False)
            if isinstance(function.value, type):
                return Inst(function.value)
            return _returned(function.value, None)
        if isinstance(function, Bound):
            self._check_binding(function.function, node, bound=True)
            return _returned(function.function, function.cls)
        return None

    def _check_binding(self, function: object, node: ast.Call, *, bound: bool) -> None:
        elided = any(isinstance(a, ast.Constant) and a.value is Ellipsis for a in node.args)
        starred = any(isinstance(a, ast.Starred) for a in node.args)
        if elided or starred or any(k.arg is None for k in node.keywords):
            return  # the snippet leaves arguments out on purpose ("...") or unpacks them
        try:
            signature = inspect.signature(function)  # type: ignore[arg-type]
        except (TypeError, ValueError):
            return
        params = list(signature.parameters.values())
        if bound and isinstance(inspect.getattr_static(function, "__self__", None), type | None):
            params = params[1:] if params and params[0].name in ("self", "cls") else params
        signature = signature.replace(parameters=params)
        try:
            signature.bind_partial(*node.args, **{k.arg: k.value for k in node.keywords if k.arg})
        except TypeError as error:
            self.problems.append(f"{_name(function)}{signature}: {error}")

    def _enter(self, kind: Kind) -> Kind:
        if not isinstance(kind, Inst):
            return None
        enter = getattr(kind.cls, "__enter__", None)
        return _returned(enter, kind.cls) if enter is not None else None


def _name(value: object) -> str:
    return str(getattr(value, "__qualname__", None) or getattr(value, "__name__", repr(value)))


def _hints(value: object) -> dict[str, object]:
    try:
        return typing.get_type_hints(value)
    except Exception:  # names only imported under TYPE_CHECKING: unknown, not checked
        return {}


def _returned(function: object, owner: type | None) -> Kind:
    """What calling ``function`` gives, from its return annotation (a knitkit class or ``Self``)."""
    hint = _hints(function).get("return")
    if hint is typing.Self and owner is not None:
        return Inst(owner)
    if isinstance(hint, type) and _is_knitkit(hint):
        return Inst(hint)
    return None


def _instance_fields(cls: type) -> set[str]:
    """Attributes an instance has that its class may not: annotations, slots, ``self.x =`` in code."""
    names: set[str] = set()
    for klass in cls.__mro__:
        names.update(getattr(klass, "__annotations__", {}))
        slots = getattr(klass, "__slots__", ())
        names.update((slots,) if isinstance(slots, str) else slots)
        try:
            source = inspect.getsource(klass)
        except (OSError, TypeError):
            continue
        names.update(re.findall(r"self\.(\w+)\s*(?::[^=\n]*)?=(?!=)", source))
    return names


# ----- the tests ------------------------------------------------------------------------------
def _problems(snippet: Snippet) -> list[str]:
    try:
        tree = ast.parse(snippet.code)
    except SyntaxError as error:
        return [f"does not parse: {error}"]
    problems = []
    free = _free_names(snippet.code)
    faces = _face_names()
    for name in sorted(free):
        if name in faces:
            problems.append(f"uses {name} without importing it (from {faces[name]} import {name})")
        elif name not in READER_NAMES:
            problems.append(
                f"leaves {name!r} undefined; import it, define it, or (if it is the reader's own "
                "object) add it to READER_NAMES"
            )
    return problems + Checker().run(tree)


def _self_contained(snippet: Snippet) -> bool:
    try:
        return not _free_names(snippet.code)
    except SyntaxError:
        return False


def _case(snippet: Snippet) -> object:
    key = (snippet.readme, snippet.index)
    marks = []
    if key in KNOWN_BROKEN:
        marks.append(pytest.mark.xfail(reason=KNOWN_BROKEN[key], strict=True))
    return pytest.param(snippet, id=f"{snippet.readme}[{snippet.index}]", marks=marks)


@pytest.mark.parametrize("snippet", [_case(s) for s in SNIPPETS])
def test_snippet_names_exist(snippet: Snippet) -> None:
    """The snippet parses, imports what it uses, and everything it names on knitkit exists
    and is called the way its signature takes it. A snippet whose imports reach a third-party
    extension that cannot load here (Mooncake without libibverbs1) is skipped, saying so."""
    try:
        problems = _problems(snippet)
    except ImportError as error:
        if error.path is None or Path(error.path).is_relative_to(ROOT):
            raise
        pytest.skip(f"{snippet.where}: {error.path} cannot load here: {error}")
    assert not problems, f"{snippet.where}:\n  " + "\n  ".join(problems)


SNIPPET_TIMEOUT_S = 90
"""Bound on one snippet's run; each takes a few seconds, so a snippet past it hangs."""
RUNNABLE = [s for s in SNIPPETS if _self_contained(s) and (s.readme, s.index) not in NOT_RUN]


def _run(snippet: Snippet, folder: Path) -> subprocess.CompletedProcess[str]:
    """``snippet`` saved to ``folder`` and run there as a script in a fresh interpreter."""
    script = folder / "snippet.py"
    script.write_text(snippet.code)
    return subprocess.run(
        [sys.executable, str(script)],
        cwd=folder,
        capture_output=True,
        text=True,
        timeout=SNIPPET_TIMEOUT_S,
    )


@pytest.fixture(scope="module")
def snippet_runs(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[Snippet, Future[subprocess.CompletedProcess[str]]]]:
    """The selected runnable snippets' runs, in the background from the first one's test on
    (``in_background``), each in its own folder; each test waits for its own."""
    chosen = selected(request, test_self_contained_snippet_runs, "snippet")
    calls = {s: partial(_run, s, tmp_path_factory.mktemp("snippet")) for s in chosen}
    with in_background(calls) as futures:
        yield futures


@pytest.mark.parametrize("snippet", [_case(s) for s in RUNNABLE])
def test_self_contained_snippet_runs(
    snippet: Snippet, snippet_runs: dict[Snippet, Future[subprocess.CompletedProcess[str]]]
) -> None:
    """A snippet that defines everything it uses, saved to a file and run as a script in a fresh
    interpreter (as a reader runs it: processes it spawns re-import that file, so one without a
    ``__main__`` guard around them fails there), finishes within a bound, exits 0 and prints
    no traceback."""
    try:
        done = snippet_runs[snippet].result()
    except subprocess.TimeoutExpired as expired:
        pytest.fail(f"{snippet.where} did not finish in {SNIPPET_TIMEOUT_S} s:\n{expired.stderr}")
    assert done.returncode == 0, f"{snippet.where} failed:\n{done.stderr[-3000:]}"
    assert "Traceback" not in done.stderr, f"{snippet.where} printed:\n{done.stderr[-3000:]}"


def test_not_run_entries_are_current() -> None:
    """Every snippet left unrun is self-contained (else it is never run anyway) and still exists;
    every known-broken entry names a snippet that exists."""
    present = {(s.readme, s.index): s for s in SNIPPETS}
    stale = [key for key in NOT_RUN if key not in present or not _self_contained(present[key])]
    assert not stale, f"NOT_RUN entries that name no self-contained snippet: {stale}"
    missing = [key for key in KNOWN_BROKEN if key not in present]
    assert not missing, f"KNOWN_BROKEN entries that name no snippet: {missing}"


def test_every_readme_is_scanned() -> None:
    """The scan finds the READMEs with snippets, the top-level one first among them."""
    readmes = {s.readme for s in SNIPPETS}
    assert "README.md" in readmes and "integration/megatron/README.md" in readmes, readmes


def iter_snippets() -> Iterator[Snippet]:
    """For other tests and tools: every snippet of every README."""
    yield from SNIPPETS
