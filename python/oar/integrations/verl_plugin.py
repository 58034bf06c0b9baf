"""Entry point of the ``verl.plugins`` group (pyproject: ``oar = "oar.integrations.verl_plugin"``).

verl imports every ``verl.plugins`` entry point at the end of ``import verl`` (verl/__init__.py, unless
``VERL_USE_EXTERNAL_PLUGINS=none``) and logs a failure only at debug level; this module therefore registers the
OAR estimators (:func:`oar.integrations.verl.register`) and turns a failure into a visible warning.
"""

import warnings

try:
    from oar.integrations.verl import register as _register

    REGISTERED = _register()
except Exception as _e:  # noqa: BLE001 - a plugin must never break `import verl`
    REGISTERED = []
    warnings.warn(f"oar verl plugin not loaded: {type(_e).__name__}: {_e}", RuntimeWarning, stacklevel=2)
