"""Entry point of the ``verl.plugins`` group (pyproject: ``oar = "oar.integrations.verl.plugin"``), opt-in.

verl imports every ``verl.plugins`` entry point at the end of ``import verl`` (verl/__init__.py, unless
``VERL_USE_EXTERNAL_PLUGINS=none``). Installing oar must not change every verl run of that environment, so this
module registers nothing unless ``$OAR_VERL_PLUGIN`` is ``1`` (set it in Ray's runtime env, quoted for Hydra so
that it stays a string: ``'+ray_kwargs.ray_init.runtime_env.env_vars.OAR_VERL_PLUGIN="1"'``, so that verl's
TaskRunner and workers load it). Then it registers the OAR estimators and trainers
(:func:`oar.integrations.verl.register`) and turns a failure into a visible warning (verl logs a plugin's failure
only at debug level). In any process whose command line names an OAR override (verl's launch command), it warns
about a spelling that cannot work, with the working one (:func:`oar.integrations.verl.launch.warn_about_argv`),
before Hydra or Ray refuse it with their own messages.
"""

import os
import sys
import warnings

#: Environment variable that enables the plugin ("1").
ENV = "OAR_VERL_PLUGIN"
REGISTERED: list = []

if os.environ.get(ENV, "").strip().lower() in ("1", "true", "yes", "on"):  # launch.PLUGIN_ON
    try:
        from oar.integrations.verl import register as _register

        REGISTERED = _register()
    except Exception as _e:  # noqa: BLE001 - a plugin must never break `import verl`
        warnings.warn(f"oar verl plugin not loaded: {type(_e).__name__}: {_e}", RuntimeWarning, stacklevel=2)

if any(isinstance(_a, str) and ("env_vars.OAR_" in _a or _a.lstrip("+~").startswith(("oar.", "oar="))
                                or _a.startswith(("trainer.v1.trainer_mode=oar", "algorithm.adv_estimator=oar")))
       for _a in sys.argv[1:]):
    try:
        from oar.integrations.verl.launch import warn_about_argv

        warn_about_argv()
    except Exception:  # noqa: BLE001 - a plugin must never break `import verl`
        pass
