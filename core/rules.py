"""`trainrec.rules`, the path the README and spec name: an alias of `trainrec.conversion.rules`
(the same module object, so attributes set on one are set on the other)."""

import sys

from .conversion import rules as _module
from .conversion.rules import *  # noqa: F403  (the names, for type checkers)

sys.modules[__name__] = _module
