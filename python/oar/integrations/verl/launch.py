"""verl integration, launch side: the command-line spellings that turn OAR on in verl, the OAR config given in verl's
own Hydra config (``+oar.<key>=<value>``), and the checks of a launch command (docs/trainers/verl.md, "The lines you
change"). Imports nothing of verl; :func:`check_overrides` imports Hydra's override parser (a verl dependency) when
called.

Two spellings cannot work and fail before any oar code runs in verl's processes, so they are named here with the
working one:

* ``+ray_kwargs.ray_init.runtime_env.env_vars.OAR_VERL_PLUGIN=1``: Hydra reads ``1`` as an int, and Ray refuses a
  runtime env whose ``env_vars`` are not all strings (``TypeError: runtime_env['env_vars'] must be of type
  Dict[str, str]``). Quoted for Hydra (``'...OAR_VERL_PLUGIN="1"'``), it is the string ``"1"``.
* ``+ray_kwargs.ray_init.runtime_env.env_vars.OAR_CONFIG='{"probe": ...}'``: Hydra's override grammar has no
  quoted dictionary keys (``OverrideParseException: no viable alternative at input '{"probe"'``), and a Hydra
  dictionary would not be a string either. The OAR config goes into verl's own config instead:
  ``+oar.probe=answer_mean +oar.tiers=both`` (:func:`trainer_oar_section`), read by the OAR trainers in verl's
  TaskRunner when they are built.

The ``verl.plugins`` entry point (:mod:`oar.integrations.verl.plugin`) runs :func:`warn_about_argv` when verl is
imported by a launch command that names an OAR override, so the working spelling is printed before Hydra's or Ray's
own error.
"""

from __future__ import annotations

import os
import re
import sys
from typing import Any, Sequence

#: The Hydra override that enables the plugin in verl's Ray processes (the TaskRunner and the workers).
PLUGIN_OVERRIDE = "+ray_kwargs.ray_init.runtime_env.env_vars.OAR_VERL_PLUGIN"
#: The working spelling of :data:`PLUGIN_OVERRIDE` as typed in a POSIX shell (single quotes keep Hydra's quotes).
PLUGIN_LINE = f"'{PLUGIN_OVERRIDE}=\"1\"'"
#: The key of verl's config that holds the OAR config (``+oar.probe=answer_mean``; the schema of docs/config.md).
CONFIG_KEY = "oar"
#: An example of the working spelling of the OAR config on verl's command line.
CONFIG_LINE = "+oar.probe=answer_mean +oar.tiers=both"
_ENV_PREFIX = "ray_kwargs.ray_init.runtime_env.env_vars."


def _config_hint() -> str:
    return (f"give the OAR config in verl's own config instead, one key per override: {CONFIG_LINE} (the keys of "
            "docs/config.md), or set OAR_CONFIG in the runtime env to a quoted Hydra string holding JSON or a file path")


#: The values of ``OAR_VERL_PLUGIN`` that turn the plugin on (:mod:`oar.integrations.verl.plugin`).
PLUGIN_ON = ("1", "true", "yes", "on")
#: A Hydra override's key, as the plugin's scan of a command line recognizes one (``+``, ``++`` or ``~`` prefix).
_KEY = re.compile(r"^(\+\+|\+|~)?([A-Za-z_][\w.\-]*)(\s*=|$)")


def _names_oar(key: str) -> bool:
    """Whether a Hydra override key is one of oar's: the ``oar`` section or an ``OAR_*`` Ray env var."""
    return key == CONFIG_KEY or key.startswith(CONFIG_KEY + ".") or (
        key.startswith(_ENV_PREFIX) and key[len(_ENV_PREFIX):].startswith("OAR_"))


def check_overrides(overrides: Sequence[str]) -> list[str]:
    """The problems of a verl launch command's OAR overrides, each message naming the override and the working
    spelling; empty when there are none. Only Hydra overrides whose key is oar's (``oar.*``, ``oar``,
    ``ray_kwargs.ray_init.runtime_env.env_vars.OAR_*``) are looked at; anything else on the command line is not.

    Args:
        overrides: the command's Hydra overrides as the shell passes them (``sys.argv[1:]`` of
            ``python -m verl.trainer.main_ppo``), a sequence of str.

    Returns:
        One message per problem: an OAR trainer mode or estimator without the line that turns the plugin on (and no
        ``$OAR_VERL_PLUGIN`` in this process, which a local Ray cluster would inherit), an ``env_vars.OAR_*`` value
        Hydra does not read as a string (Ray refuses it), an
        ``OAR_VERL_PLUGIN`` value that leaves the plugin off, an OAR override Hydra cannot parse, an OAR config
        given both as ``+oar.*`` keys and as ``OAR_CONFIG``.

    Raises:
        TypeError: ``overrides`` is not a sequence of str.
    """
    if isinstance(overrides, (str, bytes)) or not all(isinstance(o, str) for o in overrides):
        raise TypeError(f"overrides must be a sequence of str (the command's Hydra overrides), got {overrides!r}")
    mentions, selects, plugin_line = [], [], False
    for text in overrides:
        m = _KEY.match(text)
        if m is None:
            continue
        key, value = m.group(2), text[m.end():].strip()
        if _names_oar(key):
            mentions.append((text, key))
            plugin_line |= key == _ENV_PREFIX + "OAR_VERL_PLUGIN"
        elif key in ("trainer.v1.trainer_mode", "algorithm.adv_estimator") and value.lower().startswith("oar"):
            selects.append(text)
    problems = []
    if selects and not plugin_line and os.environ.get("OAR_VERL_PLUGIN", "").strip().lower() not in PLUGIN_ON:
        problems.append(f"{' '.join(selects)} selects oar, but nothing turns the oar plugin on in verl's Ray "
                        f"processes (verl would then say \"Unknown trainer\" / \"Unknown advantage estimator\"): add "
                        f"{PLUGIN_LINE}")
    if not mentions:
        return problems
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    has_env_config, has_keys = False, False
    for text, key in mentions:
        var = key[len(_ENV_PREFIX):] if key.startswith(_ENV_PREFIX) else None
        quoted = f"'{text.split('=', 1)[0]}=\"<value>\"'"
        fix = f"write {PLUGIN_LINE}" if var == "OAR_VERL_PLUGIN" else _config_hint() if var == "OAR_CONFIG" else (
            f"quote the value for Hydra: {quoted}" if var is not None else
            f"one key and one value per override, without spaces around '=': {CONFIG_LINE}")
        try:
            override = parser.parse_override(text)
        except Exception as e:  # noqa: BLE001 - Hydra's own parse errors, reported with the working spelling
            problems.append(f"Hydra cannot parse the override {text!r} ({type(e).__name__}: {e}); {fix}")
            continue
        if override.is_delete():
            continue
        value = override.value()
        if var is not None:
            if not isinstance(value, str):
                problems.append(f"{text!r} gives the Ray env var {var} the {type(value).__name__} {value!r}: Hydra "
                                "reads an unquoted value by its type and Ray refuses env vars that are not strings "
                                f"(TypeError: runtime_env['env_vars'] must be of type Dict[str, str]); {fix}")
            elif var == "OAR_VERL_PLUGIN" and value.strip().lower() not in PLUGIN_ON:
                problems.append(f"{text!r} leaves the plugin off: OAR_VERL_PLUGIN turns it on with one of "
                                f"{list(PLUGIN_ON)}, got {value!r}; write {PLUGIN_LINE}")
            has_env_config |= var == "OAR_CONFIG" and isinstance(value, str) and bool(value.strip())
        elif value is not None and value != {}:
            has_keys = True
    if has_env_config and has_keys:
        problems.append(f"the OAR config is given twice, as +{CONFIG_KEY}.* overrides and as OAR_CONFIG in the "
                        f"runtime env: keep one ({CONFIG_LINE})")
    return problems


def warn_about_argv(argv: Sequence[str] | None = None) -> list[str]:
    """Prints (``warnings.warn``, RuntimeWarning) the problems :func:`check_overrides` finds in this process's
    command line, when it names an OAR override; called by the ``verl.plugins`` entry point on ``import verl``.
    Never raises (a plugin must not break ``import verl``).

    Returns:
        The messages printed.
    """
    import warnings

    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        problems = check_overrides([a for a in argv if isinstance(a, str)])
    except Exception:  # noqa: BLE001 - e.g. verl without Hydra: nothing to check
        return []
    for p in problems:
        warnings.warn(f"oar: {p}", RuntimeWarning, stacklevel=2)
    return problems


def trainer_oar_section(config) -> dict[str, Any] | None:
    """The ``oar`` section of verl's trainer config (``+oar.probe=answer_mean`` on the command line) as a plain dict,
    or None when the config has none.

    Args:
        config: verl's trainer config (an omegaconf ``DictConfig``, or a dict).

    Raises:
        ValueError: ``oar`` is not a mapping of keys (e.g. ``+oar=oar_g``), naming the working spelling.
    """
    get = getattr(config, "get", None)
    section = get(CONFIG_KEY, None) if get is not None else None
    if section is None:
        return None
    try:
        from omegaconf import OmegaConf

        if OmegaConf.is_config(section):
            section = OmegaConf.to_container(section, resolve=True)
    except ImportError:  # pragma: no cover - verl always has omegaconf
        pass
    if not isinstance(section, dict):
        raise ValueError(f"verl's config key {CONFIG_KEY!r} must hold the OAR config's keys (one override per key: "
                         f"{CONFIG_LINE}), got {type(section).__name__} {section!r}")
    return section
