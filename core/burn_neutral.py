"""`trainrec.burn_neutral`, the path the README and spec name: an alias of `trainrec.conversion.burn_neutral`
(the same module object, so attributes set on one are set on the other)."""

import sys

from .conversion import burn_neutral as _module
from .conversion.burn_neutral import *  # noqa: F403  (the names, for type checkers)

sys.modules[__name__] = _module
