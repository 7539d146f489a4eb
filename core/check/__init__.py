"""`trainrec check`: prove that a training loop resumes exactly and say what broke it (`resume`),
what it reports (`report`), what it compares (`state`), why a resume diverged (`causes`), its plot
(`plot`) and its processes (`run`, `python -m trainrec.check.run`). A tool on top of the data path:
it may import `workload`, `recorders`, `training` and every layer below, never another tool or `cli`.

`trainrec.check` is `trainrec.check.resume`'s names."""


from .resume import (
    Divergence,
    ResumeCheck,
    ResumeReport,
    WorkloadError,
    check_resume,
    default_ats,
    workload_ref,
)

__all__ = [
    "Divergence",
    "ResumeCheck",
    "ResumeReport",
    "WorkloadError",
    "check_resume",
    "default_ats",
    "workload_ref",
]
