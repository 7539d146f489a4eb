"""`trainrec.fingerprint`, the path the README and spec name: an alias of `trainrec.workload.fingerprint`
(the same module object, so attributes set on one are set on the other)."""

import sys

from .workload import fingerprint as _module
from .workload.fingerprint import *  # noqa: F403  (the names, for type checkers)

sys.modules[__name__] = _module
