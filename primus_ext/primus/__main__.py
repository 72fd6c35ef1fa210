"""``python -m primus_ext.primus <Primus's own command line>``: run Primus with primus_ext's patch.

Primus finds patches only inside its own package, so every rank must import ours before
Primus runs its before_train patches.  This launcher refuses a patch filter (``PRIMUS_PATCHES``,
from the shell or the experiment's ``env:`` block, which Primus applies after this) that would
drop the patch, a key the plans read that the experiment writes where Primus ignores it, and a
``use_turbo_flex_attention`` that a Primus with its own flex path would claim too (`primus_ext.settings.primus_owner`), registers the patch, installs the check of the built model (`layer_check`), then runs
the rest of the command line as Python would: ``-m <module> [args]`` or ``<script.py> [args]``, with
``sys.argv`` as that program expects it.  Use it where the Primus command would start Python,
e.g. ``torchrun ... -m primus_ext.primus primus/cli/main.py train pretrain --config exp.yaml``.
"""

from __future__ import annotations

import os
import runpy
import sys

from .. import refusals as R
from ..errors import PrimusExtError
from ..settings import TurboAttentionSettings
from ..settings.primus_config import primus_settings, read_experiment
from ..settings.primus_launch import PATCH_ID, config_argument, patch_environment, patch_filter_reasons
from ..settings.primus_owner import owner_reasons, primus_flex_path, wants_primus_ext
from ..settings.primus_placement import placement_reasons
from . import layer_check
from .patch import register


def _experiment_settings(config: str, environ: dict[str, str]) -> TurboAttentionSettings:
    """The experiment's settings, merged as Primus merges it (with the environment Primus substitutes
    ``${VAR}`` from: the launcher's, before the ``env:`` block)."""
    return primus_settings(read_experiment(config, environ=environ).params)


def _experiment_flag(config: str | None, environ: dict[str, str]) -> bool:
    """Whether the experiment asks for primus_ext's layers (for the check of the built model)."""
    if config is None:
        raise R.refuse_all([layer_check.unknown_flag_reason()], context="Primus run, model built")
    return wants_primus_ext(_experiment_settings(config, environ), primus_flex_path())


def _experiment_reasons(config: str | None, environ: dict[str, str]) -> list:
    """A key the plans read written where Primus does not apply it (`primus_ext.settings.primus_placement`:
    the patch's condition sees only the merged args, never where a key was written), and a key two owners
    claim or given to a Primus without a flex path (`primus_ext.settings.primus_owner`), where the experiment
    can be read here (otherwise the patch's condition refuses what it can)."""
    if config is None:
        return []
    try:
        experiment = read_experiment(config, environ=environ)
        settings = primus_settings(experiment.params)
    except PrimusExtError:  # not readable here (no configs folder, a key of its own): the condition decides
        return []
    return placement_reasons(experiment) + owner_reasons(settings, primus_flex_path())


def main(argv: list[str]) -> None:
    if not argv or argv == ["-m"]:
        raise SystemExit("usage: python -m primus_ext.primus (-m MODULE | SCRIPT) [ARGS...]")
    if argv[0] != "-m" and not os.path.isfile(argv[0]):
        raise SystemExit(f"primus_ext.primus: no script {argv[0]!r} (from {os.getcwd()}); run it from Primus's root "
                         "directory, e.g. primus/cli/main.py train pretrain --config exp.yaml.")
    config = config_argument(argv)
    shell = dict(os.environ)
    reasons = patch_filter_reasons(*patch_environment(config, shell), ids=(PATCH_ID,))
    reasons += _experiment_reasons(config, shell)
    if reasons:  # Primus would drop the patch before its condition runs, a key would not apply, or has two owners
        raise SystemExit(f"primus_ext.primus: {R.refuse_all(reasons, context='Primus launch')}")
    if not register():
        raise SystemExit("primus_ext.primus: `import primus.core.patches` failed; run this inside Primus's "
                         "environment (docs/primus.md).")
    layer_check.install(lambda: _experiment_flag(config, shell))
    if argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(argv)
        runpy.run_path(argv[0], run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
