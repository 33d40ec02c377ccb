"""The engine backends' contract-suite factories skip only for a missing engine, never for a broken adapter."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

FACTORIES = Path(__file__).parents[1] / "storage"


def _factory_module(name: str) -> ModuleType:
    path = FACTORIES / f"backend_factories_{name}.py"
    spec = importlib.util.spec_from_file_location(f"_knitkit_factory_check_{name}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(("name", "engine"), [("ray", "ray"), ("mooncake", "mooncake.store")])
def test_a_broken_adapter_is_an_error_not_a_skip(
    name: str, engine: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """With the engine importable, an ImportError from knitkit's own adapter (here: the adapter
    module blocked in ``sys.modules``) reaches the test as an error; only a missing engine may
    read "skipped: needs <engine>"."""
    try:
        importlib.import_module(engine)
    except ImportError as error:
        pytest.skip(f"needs the {engine} engine installed to tell the two apart: {error}")
    monkeypatch.setitem(sys.modules, f"knitkit.integration.{name}", None)
    factory = _factory_module(name).FACTORIES[name]
    try:
        factory(tmp_path)
    except ImportError as error:
        assert f"knitkit.integration.{name}" in str(error)
    except pytest.skip.Exception as skipped:
        pytest.fail(f"the {name} factory turned knitkit's broken adapter into a skip: {skipped}")
    else:
        pytest.fail(f"the {name} factory built a backend without its adapter module")
