"""Reading the OAR config from the environment, for the trainer adapters that run in processes the user's code
does not reach (verl's TaskRunner, OpenRLHF's Ray workers). The schema and its readers live in :mod:`oar.schema`.

Nothing here imports a trainer framework.
"""

from __future__ import annotations

import json
import os

from oar.schema import config_from_mapping, with_method, yaml_load

#: Environment variable read by the verl plugin and the OpenRLHF launcher when no config was passed in code:
#: a JSON object (the ``oar`` schema of docs/config.md) or a path to a JSON/YAML file holding one.
CONFIG_ENV = "OAR_CONFIG"
#: The working spellings, named by every refusal of $OAR_CONFIG (docs/trainers/verl.md, docs/trainers/openrlhf.md).
SPELLINGS = ("a JSON object, e.g. OAR_CONFIG='{\"probe\": \"answer_mean\"}' in a POSIX shell, or the path of a "
             "JSON/YAML file; with verl, give the keys in verl's own config instead: +oar.probe=answer_mean")


def config_from_env(method: str | None = None):
    """``oar.OARConfig`` from ``$OAR_CONFIG`` (JSON text or a .json/.yaml file; default: empty = defaults), with
    ``method`` overriding the file's method when given. A file may hold the schema itself or a whole run config
    with the schema under ``oar`` (configs/*.yaml, runs/*/config.json).

    Raises:
        ValueError: unreadable file, invalid JSON/YAML (naming $OAR_CONFIG and the file), or a value the schema
            refuses (message names the key).
    """
    raw = os.environ.get(CONFIG_ENV, "").strip()
    obj: dict = {}
    if raw:
        if raw.lstrip().startswith("{"):
            try:
                obj = json.loads(raw)
            except json.JSONDecodeError as e:
                raise ValueError(f"${CONFIG_ENV} must be {SPELLINGS}; got invalid JSON {raw[:80]!r}: {e}") from None
        else:
            if not os.path.isfile(raw):
                try:
                    kind = type(json.loads(raw)).__name__  # valid JSON, but not an object
                except json.JSONDecodeError:
                    kind = None
                what = f"JSON {kind}, not an object" if kind else "neither JSON nor an existing file"
                raise ValueError(f"${CONFIG_ENV} must be {SPELLINGS}; got {raw[:80]!r}, which is {what}")
            is_yaml = raw.endswith((".yaml", ".yml"))
            what = f"${CONFIG_ENV} file {raw!r}"
            try:
                with open(raw, encoding="utf-8") as f:
                    text = f.read()
            except (OSError, UnicodeDecodeError) as e:
                raise ValueError(f"{what} is not readable {'YAML' if is_yaml else 'JSON'}: {e}") from None
            if is_yaml:
                obj = yaml_load(text, what) or {}
            else:
                try:
                    obj = json.loads(text) or {}
                except json.JSONDecodeError as e:
                    raise ValueError(f"{what} is not valid JSON: {e}") from None
        # a whole run config (configs/*.yaml, runs/*/config.json) holds the schema under "oar", in a file or inline
        obj = obj.get("oar", obj) if isinstance(obj, dict) else obj
        if not isinstance(obj, dict):
            raise ValueError(f"${CONFIG_ENV} must hold a JSON object ({SPELLINGS}), got {type(obj).__name__}")
    try:
        cfg = config_from_mapping(obj)
    except ValueError as e:  # the schema's own error type (it names the key), said to come from $OAR_CONFIG
        e.args = (f"${CONFIG_ENV}: {e}",) + e.args[1:]
        raise
    return with_method(cfg, method) if method is not None else cfg

