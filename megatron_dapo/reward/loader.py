"""Load the reward function named by `reward.custom_function.path` / `reward.custom_function.name`.

Accepted forms:

* ``None`` -> the DAPO math reward, `megatron_dapo.reward.math_dapo.compute_score`;
* ``"package.module:function"`` -> imported like any module;
* ``"/path/to/file.py:function"`` (or a relative path) -> the file is executed as a module;
* a module or file path with the function given separately in `name`.

Scoring runs in worker processes that cannot unpickle a function from a file that is not on
``sys.path``. Every function returned here therefore carries a `RewardFunctionRef` (attribute
``__reward_function_ref__``): a small picklable description that a worker loads again itself, once
per process (`RewardFunctionRef.load` caches).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Optional

from megatron_dapo.reward.math_dapo import compute_score

__all__ = ["RewardFunctionRef", "load_reward_function", "parse_reward_spec"]

_PATH_KEY = "reward.custom_function.path"
_NAME_KEY = "reward.custom_function.name"
REF_ATTRIBUTE = "__reward_function_ref__"

_FILE_MODULES: dict[str, ModuleType] = {}
_FILE_MODULES_LOCK = threading.Lock()


@dataclass(frozen=True)
class RewardFunctionRef:
    """Where a reward function lives: a module name or a ``.py`` file, plus the attribute name."""

    target: str
    """Dotted module name, or an absolute path to a ``.py`` file."""
    name: str
    is_file: bool

    def load(self) -> Callable[..., Any]:
        """Import the target (once per process) and return the named callable."""
        module = _load_file_module(self.target) if self.is_file else _import_module(self.target)
        try:
            function = getattr(module, self.name)
        except AttributeError:
            where = f"file {self.target}" if self.is_file else f"module {self.target!r}"
            raise ValueError(
                f"{where} has no attribute {self.name!r} (from '{_NAME_KEY}' or the part after ':' in "
                f"'{_PATH_KEY}'); defined there: {', '.join(_public_names(module)) or 'nothing public'}"
            ) from None
        if not callable(function):
            raise ValueError(
                f"'{self.name}' in {self.target} is a {type(function).__name__}, not a function: "
                f"'{_NAME_KEY}' must name a callable (response, ground_truth, **extra) -> float | dict"
            )
        return function

    def __str__(self) -> str:
        return f"{self.target}:{self.name}"


def _looks_like_file(target: str) -> bool:
    return target.endswith(".py") or os.sep in target or (os.altsep is not None and os.altsep in target)


def parse_reward_spec(spec: str, name: Optional[str] = None) -> RewardFunctionRef:
    """Turn the config strings into a `RewardFunctionRef` without importing anything."""
    spec = spec.strip()
    if not spec:
        raise ValueError(f"'{_PATH_KEY}' is empty: give 'package.module:function' or '/path/to/file.py:function'")
    if name is not None:
        if ":" in spec:
            raise ValueError(
                f"'{_PATH_KEY}'={spec!r} already names a function after ':' and '{_NAME_KEY}'={name!r} "
                "names another: set the function in one place only"
            )
        target, function_name = spec, name
    else:
        target, sep, function_name = spec.rpartition(":")
        if not sep:
            raise ValueError(
                f"'{_PATH_KEY}'={spec!r} does not name the function: write 'package.module:function' or "
                f"'/path/to/file.py:function', or set '{_NAME_KEY}'"
            )
    target, function_name = target.strip(), function_name.strip()
    if not target or not function_name:
        raise ValueError(
            f"'{_PATH_KEY}'={spec!r} with '{_NAME_KEY}'={name!r}: both a module/file and a function are needed"
        )
    if _looks_like_file(target):
        path = os.path.abspath(os.path.expanduser(target))
        if not os.path.isfile(path):
            raise ValueError(f"'{_PATH_KEY}' points to {target!r}, but no such file exists ({path})")
        return RewardFunctionRef(target=path, name=function_name, is_file=True)
    return RewardFunctionRef(target=target, name=function_name, is_file=False)


def load_reward_function(spec: Optional[str], name: Optional[str] = None) -> Callable[..., Any]:
    """Return the reward function described by the config (`spec` = path, `name` = name).

    ``None`` gives `math_dapo.compute_score`. Raises ValueError (bad spec, missing file, missing
    attribute, not callable) or ImportError (module not found, or the module/file failed while
    importing), each naming ``reward.custom_function.path`` / ``reward.custom_function.name``.
    The returned callable carries its `RewardFunctionRef` for worker processes.
    """
    if spec is None:
        if name is not None:
            raise ValueError(f"'{_NAME_KEY}'={name!r} is set but '{_PATH_KEY}' is not")

        return compute_score
    ref = parse_reward_spec(spec, name)
    function = ref.load()
    _attach_ref(function, ref)
    return function


def reward_function_ref(function: Callable[..., Any]) -> Optional[RewardFunctionRef]:
    """The `RewardFunctionRef` attached by `load_reward_function`, or None."""
    ref = getattr(function, REF_ATTRIBUTE, None)
    return ref if isinstance(ref, RewardFunctionRef) else None


def _attach_ref(function: Callable[..., Any], ref: RewardFunctionRef) -> None:
    try:
        setattr(function, REF_ATTRIBUTE, ref)
    except (AttributeError, TypeError):
        # Builtins and some callable objects refuse attributes; they must then pickle on their own.
        pass


def _import_module(module_name: str) -> ModuleType:
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        if error.name is not None and module_name != error.name and not module_name.startswith(error.name + "."):
            # The module exists but one of ITS imports is missing: report that, not a bad config.
            raise ImportError(f"importing {module_name!r} (from '{_PATH_KEY}') failed: {error}") from error
        raise ImportError(
            f"'{_PATH_KEY}' names module {module_name!r}, which cannot be found ({error}); "
            "check the spelling and that it is on PYTHONPATH, or give a file path ending in .py"
        ) from error
    except Exception as error:
        raise ImportError(
            f"importing {module_name!r} (from '{_PATH_KEY}') raised {type(error).__name__}: {error}"
        ) from error


def _load_file_module(path: str) -> ModuleType:
    """Execute a ``.py`` file once per process under a stable private module name."""
    with _FILE_MODULES_LOCK:
        module = _FILE_MODULES.get(path)
        if module is not None:
            return module
        if not os.path.isfile(path):
            raise ValueError(f"'{_PATH_KEY}' points to {path!r}, but no such file exists")
        digest = hashlib.sha1(path.encode()).hexdigest()[:12]
        stem = "".join(c if c.isalnum() else "_" for c in os.path.splitext(os.path.basename(path))[0])
        module_name = f"_megatron_dapo_reward_{stem}_{digest}"
        spec = importlib.util.spec_from_file_location(module_name, path)
        if spec is None or spec.loader is None:
            raise ImportError(f"'{_PATH_KEY}'={path!r} cannot be loaded as a Python module")
        module = importlib.util.module_from_spec(spec)
        # Registered before executing so that dataclasses / pickling inside the file can find it.
        sys.modules[module_name] = module
        try:
            spec.loader.exec_module(module)
        except BaseException as error:
            del sys.modules[module_name]
            if isinstance(error, (KeyboardInterrupt, SystemExit)):
                raise
            raise ImportError(
                f"executing reward file {path} (from '{_PATH_KEY}') raised {type(error).__name__}: {error}"
            ) from error
        _FILE_MODULES[path] = module
        return module


def _public_names(module: ModuleType) -> list[str]:
    return sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))[:20]
