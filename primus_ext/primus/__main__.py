"""``python -m primus_ext.primus <Primus's own command line>``: run Primus with primus_ext's patch.

Primus finds patches only inside its own package, so every rank must import ours before
Primus runs its before_train patches.  This launcher registers the patch, then runs the rest
of the command line as Python would: ``-m <module> [args]`` or ``<script.py> [args]``, with
``sys.argv`` as that program expects it.  Use it where the Primus command would start Python,
e.g. ``torchrun ... -m primus_ext.primus primus/cli/main.py train pretrain --config exp.yaml``.
"""

from __future__ import annotations

import os
import runpy
import sys

from ..settings.primus_config import PATCH_ID, enabled_patch_ids
from .patch import register


def main(argv: list[str]) -> None:
    if not argv or argv == ["-m"]:
        raise SystemExit("usage: python -m primus_ext.primus (-m MODULE | SCRIPT) [ARGS...]")
    if argv[0] != "-m" and not os.path.isfile(argv[0]):
        raise SystemExit(f"primus_ext.primus: no script {argv[0]!r} (from {os.getcwd()}); run it from Primus's root "
                         "directory, e.g. primus/cli/main.py train pretrain --config exp.yaml.")
    enabled = enabled_patch_ids()
    if enabled is not None and PATCH_ID not in enabled:  # Primus would drop the patch before its condition runs
        raise SystemExit(f"primus_ext.primus: PRIMUS_PATCHES={os.environ.get('PRIMUS_PATCHES')!r} leaves out "
                         f"{PATCH_ID}: Primus would not run it, and the layers would be Primus's own. Add "
                         f"{PATCH_ID} to PRIMUS_PATCHES, or unset it (primus-enable).")
    if not register():
        raise SystemExit("primus_ext.primus: `import primus.core.patches` failed; run this inside Primus's "
                         "environment (docs/primus.md).")
    if argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(argv)
        runpy.run_path(argv[0], run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
