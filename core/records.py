"""`trainrec.records`, the path the README and spec name: an alias of `trainrec.training.records`
(the same module object, so attributes set on one are set on the other)."""

import sys

from .training import records as _module
from .training.records import *  # noqa: F403  (the names, for type checkers)

sys.modules[__name__] = _module
