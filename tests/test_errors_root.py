"""Every exception harbor-exec defines derives from one root, ``HarborExecError``: a caller
catches harbor-exec's errors with one ``except``, and each that can end a trial has its row
in the one error table (``errors.POLICIES``)."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import harbor_exec
from harbor_exec.errors import POLICIES, HarborExecError, TrialPhase

# Modules that need an optional extra this environment may lack.
OPTIONAL = ("harbor_exec.executors.ray", "harbor_exec.agents.native.environment")


def _defined_exceptions() -> list[type[BaseException]]:
    found: list[type[BaseException]] = []
    for info in pkgutil.walk_packages(harbor_exec.__path__, "harbor_exec."):
        if (
            info.name.startswith(OPTIONAL)
            or "._buildkit" in info.name
            or info.name.endswith("__main__")
        ):
            continue
        module = importlib.import_module(info.name)
        for _, value in inspect.getmembers(module, inspect.isclass):
            if (
                issubclass(value, Exception)
                and value.__module__ == info.name
                and not value.__name__.startswith("_")
            ):
                found.append(value)
    return found


def test_every_public_exception_derives_from_harbor_exec_error() -> None:
    exceptions = _defined_exceptions()
    assert len(exceptions) > 40  # the walk found the package's errors
    outside = sorted(
        f"{cls.__module__}.{cls.__qualname__}"
        for cls in exceptions
        if not issubclass(cls, HarborExecError)
    )
    assert not outside, f"exceptions outside the root: {outside}"


def test_the_tables_rows_for_our_errors_are_under_the_root() -> None:
    """The table keeps Harbor's rows by name (``FileNotFoundError`` and Harbor's own
    errors we never raise among them); a row naming one of ours names a root subclass."""
    ours = {cls.__name__: cls for cls in _defined_exceptions()}
    assert all(
        isinstance(policy.phase, TrialPhase) or policy.phase is None for policy in POLICIES.values()
    )
    rows_for_ours = [name for name in POLICIES if name in ours]
    assert len(rows_for_ours) >= 20
    assert all(issubclass(ours[name], HarborExecError) for name in rows_for_ours)
