"""A module that ends the process when imported, as a script without a ``__main__`` guard
does; `tests/test_config_security.py` names it as a hook, which must be refused, not exit."""

import sys

sys.exit("tests.hook_modules_exit: importing this module ends the process")
