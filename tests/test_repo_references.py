"""Every `megatron_dapo...` name written outside the package's Python code still exists.

Shell scripts, sbatch files, docs, configs and benchmarks name modules in strings that no import
checks: a module moved by a refactor breaks them silently (the bootstrap's SGLang check once
imported a module that had moved, and only CI's install step found out).
"""

import importlib
import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCANNED = ["README.md", "Makefile", "setup.py", ".ci", "scripts", "slurm", "docs", "configs", "benchmarks", "tools"]
SUFFIXES = {".md", ".sh", ".sbatch", ".yaml", ".yml", ".py", ".txt", ".toml", ".cfg", ""}

FROM_IMPORT = re.compile(r"from (megatron_dapo(?:\.\w+)*) import \(?([\w, ]+)")
DOTTED = re.compile(r"\bmegatron_dapo(?:\.\w+)+")


def _scanned_files():
    for name in SCANNED:
        path = ROOT / name
        if path.is_file():
            yield path
        elif path.is_dir():
            yield from (p for p in sorted(path.rglob("*")) if p.is_file() and p.suffix in SUFFIXES)


def _references():
    """(file:line, module, attributes) for every reference found."""
    found = []
    for path in _scanned_files():
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            where = f"{path.relative_to(ROOT)}:{number}"
            for match in FROM_IMPORT.finditer(line):
                names = [n.strip().split()[0] for n in match.group(2).split(",") if n.strip()]
                found.append((where, match.group(1), names))
            for match in DOTTED.finditer(line):
                found.append((where, match.group(0), None))
    return found


def _resolves(dotted: str) -> bool:
    """A module, or attributes reached from the longest importable module prefix."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        module_name = ".".join(parts[:cut])
        try:
            spec = importlib.util.find_spec(module_name)
        except ModuleNotFoundError:
            spec = None
        if spec is None:
            continue
        obj = importlib.import_module(module_name)
        for attribute in parts[cut:]:
            if not hasattr(obj, attribute):
                return False
            obj = getattr(obj, attribute)
        return True
    return False


def test_scan_finds_references():
    # Guards the scan itself: the scripts and docs do name modules.
    assert any(where.startswith("scripts/") for where, _, _ in _references())


@pytest.mark.parametrize("where,module,names", _references(), ids=lambda v: v if isinstance(v, str) else "")
def test_reference_resolves(where, module, names):
    if names is None:
        assert _resolves(module), f"{where}: {module} does not exist"
    else:
        for name in names:
            assert _resolves(f"{module}.{name}"), f"{where}: 'from {module} import {name}' fails"
