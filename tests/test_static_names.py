"""Every name a module reads is bound somewhere: the GPU-only scripts (benchmarks/, the kernels'
checks) never run in CI, so a NameError there surfaces only on the lent GPU. One did
(benchmarks/mla_ab.py read an undefined `cell` after a refactor and failed its first device call).
symtable resolves scopes as the compiler does, so this is exact for plain globals; names created
dynamically (globals()[...], star imports) would be reported and should not be used."""

import builtins
import glob
import os
import symtable

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODULE_ATTRS = {"__file__", "__name__", "__doc__", "__spec__", "__path__", "__package__"}
FILES = sorted(
    os.path.relpath(f, ROOT)
    for pattern in ("k3trt/**/*.py", "benchmarks/*.py", "scripts/*.py", "tests/*.py")
    for f in glob.glob(os.path.join(ROOT, pattern), recursive=True))


def undefined_names(src: str, path: str) -> list[tuple[str, str]]:
    """(scope, name) for each global a scope reads that the module never binds."""
    top = symtable.symtable(src, path, "exec")
    known = {s.get_name() for s in top.get_symbols() if s.is_assigned() or s.is_imported()}
    known |= set(dir(builtins)) | MODULE_ATTRS
    found = []

    def walk(table):
        at_module = table.get_type() == "module"
        for s in table.get_symbols():
            if s.is_referenced() and (s.is_global() or at_module) and s.get_name() not in known:
                found.append((table.get_name(), s.get_name()))
        for child in table.get_children():
            walk(child)

    walk(top)
    return found


def test_the_check_catches_an_unbound_name():
    src = "import os\ndef f(x):\n    return os.sep + x + cell\nclass C:\n    y = f\n"
    assert undefined_names(src, "t.py") == [("f", "cell")]
    assert undefined_names("def g():\n    cell = 1\n    return lambda: cell\n", "t.py") == []


def test_files_are_found():
    assert "benchmarks/mla_verify.py" in FILES and len(FILES) > 100


@pytest.mark.parametrize("path", FILES)
def test_no_unbound_names(path):
    with open(os.path.join(ROOT, path)) as f:
        assert undefined_names(f.read(), path) == []
