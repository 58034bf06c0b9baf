"""The trainer versions oar's integrations are tested with, and the message when another one is installed.

:data:`TESTED` is the one table: pyproject.toml's extras ``oar[trl]``, ``oar[verl]``, ``oar[openrlhf]`` carry the
same ranges (tests/python/project/test_packaging.py checks they agree), and each integration calls :func:`check_tested`
when it is imported or registered. Outside the range the integration still runs where the hook points it needs exist
(each checks those itself and refuses clearly when they do not); the warning says that this version was not tested.
Nothing here imports a trainer.
"""

from __future__ import annotations

import re
import warnings

#: Trainer package -> (lowest tested version, first version above the tested series). pyproject's extras:
#: ``"<package>>=<low>,<<high>"``.
TESTED: dict[str, tuple[str, str]] = {
    "trl": ("1.13.0", "1.14"),
    "verl": ("0.9.1", "0.10"),
    "openrlhf": ("0.11.2", "0.12"),
}
_SAID: set = set()


def release(version: str) -> tuple[int, ...]:
    """The numeric release of a version string: ``"1.13.0.dev1+cu130"`` -> ``(1, 13, 0)``.

    Raises:
        ValueError: ``version`` does not start with a number.
    """
    m = re.match(r"\s*[vV]?(\d+(?:\.\d+)*)", str(version))
    if m is None:
        raise ValueError(f"version must start with a release number like 1.13.0, got {version!r}")
    return tuple(int(x) for x in m.group(1).split("."))


def _tested(package: str) -> tuple[str, str]:
    try:
        return TESTED[str(package).lower()]
    except KeyError:
        raise ValueError(f"package must be one of {sorted(TESTED)}, got {package!r}") from None


def _prerelease(version: str) -> bool:
    """Whether ``version`` is a pre-release (``a``, ``b``, ``rc``, ``dev`` after the release number), as pip reads it."""
    return re.match(r"\s*[vV]?\d+(?:\.\d+)*[-_.]?(a|b|c|rc|alpha|beta|pre|preview|dev)", str(version).lower()) is not None


def requirement(package: str) -> str:
    """The pip requirement of the tested range, e.g. ``"trl>=1.13.0,<1.14"`` (pyproject's extra).

    Raises:
        ValueError: ``package`` is not one of :data:`TESTED`.
    """
    low, high = _tested(package)
    package = str(package).lower()
    return f"{package}>={low},<{high}"


def in_tested_range(package: str, version: str) -> bool:
    """Whether ``version`` of ``package`` is within :data:`TESTED` (``low <= version < high`` by release number; a
    pre-release of ``low`` is below it, as for pip's ``>=``).

    Raises:
        ValueError: ``package`` is not one of :data:`TESTED`; an unreadable version.
    """
    low, high = _tested(package)
    v = release(version)

    def pad(t):
        return t + (0,) * (max(len(v), len(release(low)), len(release(high)), 3) - len(t))

    if pad(v) == pad(release(low)) and _prerelease(version):
        return False
    return pad(release(low)) <= pad(v) < pad(release(high))


def check_tested(package: str, version: str | None = None) -> bool:
    """Warns once per process and package (``UserWarning``) when the installed ``package`` is outside the tested
    range, naming both and the extra that installs a tested one.

    Args:
        package: one of :data:`TESTED` (ValueError otherwise).
        version: the installed version (default: ``importlib.metadata.version(package)``; unknown: no warning).

    Returns:
        True when the version is within the range (or unknown).
    """
    low, high = _tested(package)
    package = str(package).lower()
    if version is None:
        from importlib import metadata

        try:
            version = metadata.version(package)
        except metadata.PackageNotFoundError:
            return True
    try:
        ok = in_tested_range(package, version)
    except ValueError:
        ok = False
    if not ok and (package, version) not in _SAID:
        _SAID.add((package, version))
        warnings.warn(f"oar.integrations.{package} is tested with {package} >= {low}, < {high}; {package} {version} "
                      f"is installed. It runs where the hook points it needs exist (checked when it is set up), but "
                      f"this version was not tested: pip install \"{requirement(package)}\" (what oar[{package}] "
                      "installs) for a tested one.", UserWarning, stacklevel=3)
    return ok
