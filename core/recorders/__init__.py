"""Item trees to files of every format and back: the NamedMpk recorders (`namedmpk`), the registry of
record file formats (`formats`), `read_file` for a file of any of them (`read`) and sniffing a file's format from its first bytes (`sniff`), the
other formats core reads and writes without a framework (`flaxmsgpack`, `ptfile`, `burn`) and
reading record files at store URLs (`remote`). It may import `trainrec.training` and every layer
below it; never `workload` or a tool above."""

from . import builtin_formats as _builtin_formats  # noqa: F401,E402  (gives core's formats to the registry)
