"""`trainrec.protocols`, the path the README and spec name: an alias of `trainrec.training.protocols`
(the same module object, so attributes set on one are set on the other)."""

import sys

from .training import protocols as _module
from .training.protocols import *  # noqa: F403  (the names, for type checkers)

sys.modules[__name__] = _module
