"""`trainrec.convert`, the path the README and spec name: an alias of `trainrec.conversion.convert`
(the same module object, so attributes set on one are set on the other)."""

import sys

from .conversion import convert as _module
from .conversion.convert import *  # noqa: F403  (the names, for type checkers)

sys.modules[__name__] = _module
