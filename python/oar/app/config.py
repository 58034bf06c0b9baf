"""Run configuration files (configs/*.yaml): one YAML file per run, read with PyYAML.

Sections:
    run:   output_dir, seed, plot (bool), save_model (bool)
    model: name (``smollm2-135m-instruct`` or a local HF folder), dtype
    task:  name (arithmetic | gsm8k | math500), kwargs (passed to oar.app.tasks.get_task), train_size
    grpo:  keyword arguments of ``trl.GRPOConfig`` (max_steps, learning_rate, num_generations, ...)
    eval:  held-out evaluation of ``oar train`` (problems, every_steps, max_new_tokens, batch_size, seed,
           before_cache; ``oar.app.train.EVAL_DEFAULTS``)
    oar:   the OAR schema, validated by the C++ parser (``oar.OARConfig.from_json``; docs/config.md)

Unknown top-level sections raise ValueError naming them; unknown ``oar`` keys raise from the C++ schema.
"""

from __future__ import annotations

import copy
import json
import os
from dataclasses import dataclass, field
from typing import Any

from oar.schema import config_from_mapping, yaml_load

SECTIONS = ("run", "model", "task", "grpo", "eval", "oar")




def _check_run_fields(raw: dict) -> None:
    """Fields that oar itself reads (run.seed, grpo.max_steps, model.dtype), checked up front so that a bad
    value names its key instead of failing later inside int() or getattr(torch, ...)."""
    import torch

    for section, key in (("run", "seed"), ("grpo", "max_steps")):
        v = (raw.get(section) or {}).get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int)):
            raise ValueError(f"{section}.{key} must be an integer, got {type(v).__name__} {v!r}")
    dtype = (raw.get("model") or {}).get("dtype")
    if dtype is not None:
        dt = getattr(torch, str(dtype), None)
        if not isinstance(dt, torch.dtype) or not dt.is_floating_point:
            raise ValueError(f"model.dtype must name a floating torch dtype (float32, bfloat16, float16), got {dtype!r}")

_PKG = os.path.dirname(os.path.abspath(__file__))


def config_dir() -> str:
    """Folder of the shipped configs: ``oar/app/configs`` in an installed wheel (copied from the repository's
    configs/ at install), else the repository's ``configs/`` (development layout: python/oar/app -> the root)."""
    installed = os.path.join(_PKG, "configs")
    if os.path.isdir(installed):
        return installed
    return os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(_PKG))), "configs")


def resolve_config(name_or_path: str | None) -> str:
    """A path as given, or a shipped config by name (``default``, ``gsm8k``, ``gpu_qwen_math``)."""
    if name_or_path is None:
        name_or_path = "default"
    if os.path.exists(name_or_path):
        return name_or_path
    cand = os.path.join(config_dir(), name_or_path if name_or_path.endswith(".yaml") else name_or_path + ".yaml")
    return cand if os.path.exists(cand) else name_or_path


@dataclass
class RunConfig:
    """A parsed run configuration (see module docstring)."""

    run: dict = field(default_factory=dict)
    model: dict = field(default_factory=dict)
    task: dict = field(default_factory=dict)
    grpo: dict = field(default_factory=dict)
    eval: dict = field(default_factory=dict)
    oar: Any = None  # oar.OARConfig
    source: str = ""

    def oar_dict(self) -> dict:
        return json.loads(self.oar.to_json())


def _merge(base: dict, over: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _merge(out[k], v)
        else:
            out[k] = v
    return out


def parse_overrides(items: list[str]) -> dict:
    """``["oar.method=oar_p", "grpo.max_steps=5"]`` -> nested dict; values parsed as YAML scalars.
    Raises ValueError for an item without ``=`` or without a section."""
    out: dict = {}
    for item in items:
        if "=" not in item:
            raise ValueError(f"override {item!r} must look like section.key=value")
        key, value = item.split("=", 1)
        parts = key.split(".")
        if len(parts) < 2:
            raise ValueError(f"override {item!r} must name a section, e.g. oar.{key}=...")
        if not all(parts):
            raise ValueError(f"override {item!r} has an empty key part; expected section.key=value")
        d = out
        for p in parts[:-1]:
            d = d.setdefault(p, {})
            if not isinstance(d, dict):
                raise ValueError(f"override {item!r} sets a key inside {p!r}, which another override set to a value")
        d[parts[-1]] = yaml_load(value, f"the value of override {item!r}")
    return out


def load_config(path: str | None = None, overrides: list[str] | None = None) -> RunConfig:
    """Reads a YAML run config (a path, or a shipped config name; default: ``default``), applies ``section.key=value`` overrides,
    validates the sections and the ``oar`` schema.

    Raises:
        FileNotFoundError: the file does not exist.
        ValueError: invalid YAML (file or override), not a mapping, unknown section, a bad ``run.seed`` /
            ``grpo.max_steps`` / ``model.dtype``, or an invalid ``oar`` value (message names the key).
    """
    path = resolve_config(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"config file {path!r} does not exist (or is not a file)")
    with open(path) as f:
        raw = yaml_load(f.read(), f"config {path!r}") or {}
    if not isinstance(raw, dict):
        raise ValueError(f"config {path!r} must be a mapping of sections {SECTIONS}, got {type(raw).__name__}")
    if overrides:
        raw = _merge(raw, parse_overrides(overrides))
    unknown = sorted(set(raw) - set(SECTIONS))
    if unknown:
        raise ValueError(f"config {path!r} has unknown sections {unknown}; known: {list(SECTIONS)}")
    for s in SECTIONS:
        if raw.get(s) is not None and not isinstance(raw[s], dict):
            raise ValueError(f"config section {s!r} must be a mapping, got {type(raw[s]).__name__}")
    _check_run_fields(raw)
    oar_cfg = config_from_mapping(raw.get("oar") or {})
    return RunConfig(run=raw.get("run") or {}, model=raw.get("model") or {}, task=raw.get("task") or {},
                     grpo=raw.get("grpo") or {}, eval=raw.get("eval") or {}, oar=oar_cfg, source=path)
