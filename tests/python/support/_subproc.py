"""Test helper: the environment of a child Python process (and of the Ray workers it starts) that must import the
same oar as the test process: the installed package in CI, python/ + OAR_BUILD_DIR in a development tree."""

import os


def child_env(**extra) -> dict:
    """``os.environ`` with ``OMP_NUM_THREADS=1``, ``PYTHONPATH`` led by the folder that holds the imported ``oar``
    (every entry made absolute: the child may run in another directory), ``OAR_BUILD_DIR`` made absolute, and
    ``extra`` on top."""
    import oar

    oar_parent = os.path.dirname(os.path.dirname(os.path.abspath(oar.__file__)))
    path = [oar_parent] + [os.path.abspath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(dict.fromkeys(path)))
    if env.get("OAR_BUILD_DIR"):
        env["OAR_BUILD_DIR"] = os.path.abspath(env["OAR_BUILD_DIR"])
    env.update(extra)
    return env
