"""primus_ext inside AMD Primus, with no edit to Primus.

`patch` registers one patch with Primus's own registry (`register`); every rank imports it
through the launcher (``python -m primus_ext.primus <Primus's command line>``, `__main__`).
"""

from .patch import PATCH_ID, PRIORITY, register

__all__ = ["PATCH_ID", "PRIORITY", "register"]
