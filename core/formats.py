"""`trainrec.formats`, the path the README and spec name: an alias of `trainrec.recorders.formats`
(the same module object, so attributes set on one are set on the other)."""

import sys

from .recorders import formats as _module
from .recorders.formats import *  # noqa: F403  (the names, for type checkers)

sys.modules[__name__] = _module
