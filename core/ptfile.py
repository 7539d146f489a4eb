"""`trainrec.ptfile`, the path the README and spec name: an alias of `trainrec.recorders.ptfile`
(the same module object, so attributes set on one are set on the other)."""

import sys

from .recorders import ptfile as _module
from .recorders.ptfile import *  # noqa: F403  (the names, for type checkers)

sys.modules[__name__] = _module
