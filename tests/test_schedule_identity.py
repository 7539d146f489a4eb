"""Schedules and hyperparameters are never swapped unseen (issue 31, item 3).

A torch scheduler record keeps what identifies its schedule (constructor arguments, a
`LambdaLR`'s functions by qualified name, a `functools.partial`'s keywords: the HF
schedule factories) and a restore refuses a live scheduler or optimizer that differs,
naming the field and both values, with every live object unchanged; `allow_changes`
names a change made on purpose, which then keeps its live value. Before this, every one
of these restored silently with the record's values (or the live functions)."""

from __future__ import annotations

import copy
import functools
import warnings

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402
from torch.optim import lr_scheduler as L  # noqa: E402, N812

import trainrec  # noqa: E402
import trainrec.adapters.torch as trt  # noqa: E402
from trainrec import (  # noqa: E402
    GradientsAccumulator,
    NamedMpkBytesRecorder,
    NativePrecisionSettings,
    RecordMismatchError,
    StateRecord,
    TrainingRecord,
    UncheckedIdentityWarning,
)


@trainrec.record
class Step:
    step: int = 0


def _model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def _run(make_opt, make_sched, steps=3, seed=0):
    """A model, optimizer and scheduler after `steps` steps, a gradient pending."""
    model = _model(seed)
    opt = make_opt(model.parameters())
    sched = None if make_sched is None else make_sched(opt)
    for i in range(steps):
        model(torch.full((2, 4), float(i + 1))).sum().backward()
        opt.step()
        opt.zero_grad()
        if isinstance(sched, L.ReduceLROnPlateau):
            sched.step(1.0)
        elif sched is not None:
            sched.step()
    model(torch.ones(2, 4)).sum().backward()
    return model, opt, sched


def _fresh(make_opt, make_sched, seed=1):
    model = _model(seed)
    opt = make_opt(model.parameters())
    return model, opt, None if make_sched is None else make_sched(opt)


def _record(model, opt, sched, recorder=None):
    rec = TrainingRecord.capture(model, opt, sched, GradientsAccumulator(), Step(3))
    r = recorder or NamedMpkBytesRecorder(NativePrecisionSettings())
    return TrainingRecord.load(r, rec.save(r), "cpu", state_type=Step)


def _snapshot(model, opt, sched):
    return ([p.detach().clone() for p in model.parameters()],
            [None if p.grad is None else p.grad.clone() for p in model.parameters()],
            copy.deepcopy(opt.state_dict()), None if sched is None else copy.deepcopy(sched.state_dict()),
            copy.deepcopy([{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]))


def _same(a, b) -> bool:
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    return a == b


def _unchanged(before, model, opt, sched) -> bool:
    return _same(before, _snapshot(model, opt, sched))


def _adamw(**kw):
    return lambda ps: torch.optim.AdamW(ps, lr=0.1, **kw)


def _sgd(**kw):
    return lambda ps: torch.optim.SGD(ps, lr=0.1, **kw)


# -- schedules ------------------------------------------------------------------------------

def _hf(name, **kw):
    transformers = pytest.importorskip("transformers")
    factory = getattr(transformers, name)
    return lambda opt: factory(opt, **kw)


def _cosine(warmup=2, total=20):
    return _hf("get_cosine_schedule_with_warmup", num_warmup_steps=warmup, num_training_steps=total)


def _const_lambda(opt):
    return L.LambdaLR(opt, lambda s: 0.9 ** s)


def _other_const_lambda(opt):
    return L.LambdaLR(opt, lambda s: 0.5 ** s)


def _warmup(total):
    return lambda s: min(1.0, (s + 1) / total)


def _closure_lambda(total):
    return lambda opt: L.LambdaLR(opt, _warmup(total))


def _seq(second):
    return lambda opt: L.SequentialLR(opt, [L.LinearLR(opt, 0.5, total_iters=2), second(opt)], [2])


REFUSED = {
    # a live CosineAnnealingLR(T_max=60) restored from a T_max=6 record silently ran with 6
    "T_max": (lambda o: L.CosineAnnealingLR(o, T_max=6), lambda o: L.CosineAnnealingLR(o, T_max=60),
              r"scheduler\.T_max: 6 in the record, 60 live"),
    "eta_min": (lambda o: L.CosineAnnealingLR(o, 6), lambda o: L.CosineAnnealingLR(o, 6, eta_min=0.01),
                r"scheduler\.eta_min: 0\.0 in the record, 0\.01 live"),
    "StepLR": (lambda o: L.StepLR(o, 2, gamma=0.5), lambda o: L.StepLR(o, 3, gamma=0.1),
               r"scheduler\.gamma: 0\.5 in the record, 0\.1 live; scheduler\.step_size: 2 in the record, 3 live"),
    "OneCycleLR": (lambda o: L.OneCycleLR(o, 0.1, total_steps=10), lambda o: L.OneCycleLR(o, 0.1, total_steps=20),
                   r"scheduler\.total_steps: 10 in the record, 20 live"),
    # HF's factories: LambdaLR over functools.partial of module-level functions
    "hf-linear-for-cosine": (_cosine(), _hf("get_linear_schedule_with_warmup", num_warmup_steps=2,
                                            num_training_steps=20),
                             r"scheduler\.lr_lambdas\.0\.fn: 'transformers\.optimization\."
                             r"_get_cosine_schedule_with_warmup_lr_lambda' in the record, "
                             r"'transformers\.optimization\._get_linear_schedule_with_warmup_lr_lambda' live"),
    "hf-cosine-warmup": (_cosine(warmup=2), _cosine(warmup=5),
                         r"scheduler\.lr_lambdas\.0\.keywords\.num_warmup_steps: 2 in the record, 5 live"),
    "hf-cosine-length": (_cosine(total=20), _cosine(total=200),
                         r"scheduler\.lr_lambdas\.0\.keywords\.num_training_steps: 20 in the record, 200 live"),
    "lambda-literal": (_const_lambda, _other_const_lambda, r"scheduler\.lr_lambdas\.0\.consts: \[0\.9\] in the "
                                                           r"record, \[0\.5\] live"),
    "lambda-closure": (_closure_lambda(4), _closure_lambda(8),
                       r"scheduler\.lr_lambdas\.0\.closure\.total: 4 in the record, 8 live"),
    "sequential-child-arg": (_seq(lambda o: L.StepLR(o, 2)), _seq(lambda o: L.StepLR(o, 4)),
                             r"scheduler\._schedulers\.1\.step_size: 2 in the record, 4 live"),
    "sequential-child-class": (_seq(lambda o: L.ExponentialLR(o, 0.5)), _seq(lambda o: L.StepLR(o, 1, gamma=0.5)),
                               r"child scheduler 1's state keys differ"),
    "chained-child-class": (lambda o: L.ChainedScheduler([L.ConstantLR(o, 0.5, total_iters=10),
                                                          L.ExponentialLR(o, 0.9)]),
                            lambda o: L.ChainedScheduler([L.LinearLR(o, 0.5, 0.5, total_iters=10),
                                                          L.ExponentialLR(o, 0.9)]),
                            r"scheduler\._schedulers\.0"),
    "base-lrs": (lambda o: L.StepLR(o, 2), lambda o: (o.param_groups[0].update(lr=0.2), L.StepLR(o, 2))[1],
                 r"scheduler\.base_lrs: \[0\.1\] in the record, \[0\.2\] live"),
}


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_another_schedule_is_refused_naming_the_field_and_nothing_changes(name):
    recorded, live, said = REFUSED[name]
    rec = _record(*_run(_adamw(), recorded))
    model, opt, sched = _fresh(_adamw(), live)
    model(torch.ones(2, 4)).sum().backward()
    opt.step()  # live state to keep
    before = _snapshot(model, opt, sched)
    with pytest.raises(RecordMismatchError, match=said):
        rec.restore(model, opt, sched, "cpu")
    assert _unchanged(before, model, opt, sched)
    with pytest.raises(RecordMismatchError, match=said):
        trt.TorchLrScheduler(sched).check_record(rec.scheduler)


ACCEPTED = {
    "T_max": lambda o: L.CosineAnnealingLR(o, T_max=6),
    "hf-cosine": _cosine(),
    "hf-linear": _hf("get_linear_schedule_with_warmup", num_warmup_steps=2, num_training_steps=20),
    "lambda": _const_lambda,
    "closure": _closure_lambda(4),
    "sequential": _seq(lambda o: L.StepLR(o, 2)),
    "chained": lambda o: L.ChainedScheduler([L.ConstantLR(o, 0.5, total_iters=10), L.ExponentialLR(o, 0.9)]),
    "multistep": lambda o: L.MultiStepLR(o, [2, 5]),
    "warm-restarts": lambda o: L.CosineAnnealingWarmRestarts(o, 2),
    "plateau": lambda o: L.ReduceLROnPlateau(o),
}


@pytest.mark.parametrize("name", sorted(ACCEPTED))
def test_the_same_schedule_rebuilt_resumes_exactly(name):
    make = ACCEPTED[name]
    src = _run(_adamw(), make)
    rec = _record(*src)
    model, opt, sched = _fresh(_adamw(), make)
    rec.restore(model, opt, sched, "cpu")
    for (_, o, s) in (src, (model, opt, sched)):
        o.step()
        if isinstance(s, L.ReduceLROnPlateau):
            s.step(1.0)
        else:
            s.step()
    assert _same(src[1].state_dict(), opt.state_dict())
    assert src[2].get_last_lr() == sched.get_last_lr()


@pytest.mark.parametrize("make_opt", [_sgd(momentum=0.9), _adamw()], ids=["sgd-momentum", "adamw-betas"])
@pytest.mark.parametrize("make_sched", [lambda o: L.OneCycleLR(o, 0.1, total_steps=10),
                                        lambda o: L.CyclicLR(o, 0.01, 0.1, step_size_up=3)],
                         ids=["OneCycleLR", "CyclicLR"])
def test_a_momentum_the_scheduler_cycles_is_its_position_not_refused(make_opt, make_sched):
    src = _run(make_opt, make_sched, steps=4)
    rec = _record(*src)
    model, opt, sched = _fresh(make_opt, make_sched)
    assert not _same(opt.param_groups[0].get("momentum", opt.param_groups[0].get("betas")),
                     src[1].param_groups[0].get("momentum", src[1].param_groups[0].get("betas")))
    rec.restore(model, opt, sched, "cpu")
    assert _same(opt.state_dict(), src[1].state_dict())


def test_an_allowed_schedule_change_keeps_the_live_value_and_the_recorded_position():
    rec = _record(*_run(_adamw(), lambda o: L.CosineAnnealingLR(o, T_max=6)))
    model, opt, sched = _fresh(_adamw(), lambda o: L.CosineAnnealingLR(o, T_max=60))
    out = rec.restore(model, opt, sched, "cpu", allow_changes={"scheduler.T_max"})
    assert out.scheduler is sched and sched.T_max == 60 and sched.last_epoch == 3
    assert sched.get_last_lr() == rec.scheduler.item["_last_lr"]


def test_an_allowed_function_change_runs_the_live_function_from_the_recorded_position():
    lengths = _hf("get_cosine_schedule_with_warmup", num_warmup_steps=2, num_training_steps=20)
    rec = _record(*_run(_adamw(), lengths))
    longer = _hf("get_cosine_schedule_with_warmup", num_warmup_steps=2, num_training_steps=200)
    model, opt, sched = _fresh(_adamw(), longer)
    rec.restore(model, opt, sched, "cpu", allow_changes={"scheduler.num_training_steps"})
    assert sched.last_epoch == 3 and sched.lr_lambdas[0].keywords["num_training_steps"] == 200


def _at_lr(lr):
    return lambda ps: torch.optim.AdamW(ps, lr=lr)


# a scheduler that computes each lr from the last one (the recorded position) would keep a
# new base_lrs and never use it: allowing it is refused, saying what to do instead
FROM_THE_LAST = {
    "StepLR": lambda o: L.StepLR(o, 2, gamma=0.5),
    "CosineAnnealingLR": lambda o: L.CosineAnnealingLR(o, T_max=6),
    "ExponentialLR": lambda o: L.ExponentialLR(o, 0.9),
    "OneCycleLR": lambda o: L.OneCycleLR(o, max_lr=o.param_groups[0]["lr"], total_steps=10),
    "sequential-child": _seq(lambda o: L.StepLR(o, 2)),
}


@pytest.mark.parametrize("name", sorted(FROM_THE_LAST))
def test_a_new_base_lr_that_would_not_take_effect_is_refused_even_when_allowed(name):
    make = FROM_THE_LAST[name]
    rec = _record(*_run(_at_lr(0.01), make))
    model, opt, sched = _fresh(_at_lr(0.1), make)
    before = _snapshot(model, opt, sched)
    with pytest.raises(RecordMismatchError) as plain:
        rec.restore(model, opt, sched, "cpu")
    said = str(plain.value)
    assert "base_lrs cannot be allowed" in said and "recorded position" in said
    refused = said.split(" cannot be allowed")[0].split()[-1]
    suggested = said.split("allow_changes={")[1].split("}")[0] if "allow_changes={" in said else ""
    assert refused.endswith(".base_lrs") and repr(refused) not in suggested, \
        "suggests an allow_changes that would not take effect"
    with pytest.raises(RecordMismatchError, match="base_lrs cannot be allowed: a [A-Za-z]+LR computes"):
        rec.restore(model, opt, sched, "cpu", allow_changes={"scheduler.base_lrs"})
    assert _unchanged(before, model, opt, sched)


def test_what_the_refusal_says_to_do_continues_the_schedule_at_the_new_lr():
    rec = _record(*_run(_at_lr(0.01), FROM_THE_LAST["CosineAnnealingLR"]))
    model, opt, sched = _fresh(_at_lr(0.01), FROM_THE_LAST["CosineAnnealingLR"])
    rec.restore(model, opt, sched, "cpu")
    for g in opt.param_groups:
        g["lr"], g["initial_lr"] = g["lr"] * 10, g["initial_lr"] * 10
    sched.base_lrs = [b * 10 for b in sched.base_lrs]
    _, fresh_opt, fresh = _run(_at_lr(0.1), FROM_THE_LAST["CosineAnnealingLR"])
    for _ in range(8):  # across the restart at T_max, where base_lrs is read
        opt.step(), sched.step(), fresh_opt.step(), fresh.step()
        assert sched.get_last_lr() == pytest.approx(fresh.get_last_lr(), rel=1e-12, abs=1e-15)


# schedulers that compute each lr from base_lrs: an allowed new base lr takes effect
FROM_THE_BASE = {
    "LambdaLR": lambda o: L.LambdaLR(o, lambda s: 0.9 ** s),
    "CosineAnnealingWarmRestarts": lambda o: L.CosineAnnealingWarmRestarts(o, 4),
    "CyclicLR": lambda o: L.CyclicLR(o, base_lr=o.param_groups[0]["lr"], max_lr=1.0, step_size_up=4,
                                     cycle_momentum=False),
}


def _resumed_at_a_new_base_lr(make):
    """The scheduler `make` builds, run at lr 0.01, restored into one built at lr 0.1 with
    `scheduler.base_lrs` allowed, and a run at lr 0.1 that never stopped: (restored
    optimizer, restored scheduler, fresh optimizer, fresh scheduler)."""
    rec = _record(*_run(_at_lr(0.01), make))
    _, opt, sched = model_opt_sched = _fresh(_at_lr(0.1), make)
    rec.restore(*model_opt_sched, "cpu", allow_changes={"scheduler.base_lrs"})
    _, fresh_opt, fresh = _run(_at_lr(0.1), make)
    return opt, sched, fresh_opt, fresh


def _steps_alike(opt, sched, fresh_opt, fresh, steps):
    for _ in range(steps):
        opt.step(), sched.step(), fresh_opt.step(), fresh.step()
        assert sched.get_last_lr() == pytest.approx(fresh.get_last_lr(), rel=1e-12)


@pytest.mark.parametrize("name", sorted(FROM_THE_BASE))
def test_an_allowed_new_base_lr_takes_effect_where_each_lr_is_computed_from_it(name):
    opt, sched, fresh_opt, fresh = _resumed_at_a_new_base_lr(FROM_THE_BASE[name])
    assert sched.base_lrs == [0.1] and sched.last_epoch == 3
    _steps_alike(opt, sched, fresh_opt, fresh, 1)


def _nested(step_size):
    return lambda o: L.ChainedScheduler([L.SequentialLR(o, [L.LambdaLR(o, lambda s: 1.0),
                                                          L.StepLR(o, step_size, 0.5)], milestones=[1])])


def test_a_grandchild_schedule_is_compared_too():
    rec = _record(*_run(_adamw(), _nested(2)))
    model, opt, sched = _fresh(_adamw(), _nested(7))
    before = _snapshot(model, opt, sched)
    with pytest.raises(RecordMismatchError, match=r"scheduler\._schedulers\.0\._schedulers\.1\.step_size: 2 "
                                                  r"in the record, 7 live"):
        rec.restore(model, opt, sched, "cpu")
    assert _unchanged(before, model, opt, sched)


class _HalvingLambda(L.LambdaLR):
    def get_lr(self):
        return [g["lr"] * 0.5 for g in self.optimizer.param_groups]


# a SequentialLR's child that has finished is never used again, and one that starts later
# starts from base_lrs: a new base lr takes effect as in a fresh run
SEQUENTIAL_NEW_BASE = {
    "upcoming-cosine": lambda o: L.SequentialLR(o, [L.LambdaLR(o, lambda s: 1.0), L.CosineAnnealingLR(o, T_max=10)],
                                                milestones=[5]),
    "finished-exponential": lambda o: L.SequentialLR(o, [L.ExponentialLR(o, 0.5), L.LambdaLR(o, lambda s: 0.9 ** s)],
                                                     milestones=[2]),
}


@pytest.mark.parametrize("name", sorted(SEQUENTIAL_NEW_BASE))
def test_a_new_base_lr_of_a_sequential_child_not_running_now_takes_effect(name):
    _steps_alike(*_resumed_at_a_new_base_lr(SEQUENTIAL_NEW_BASE[name]), 5)


def test_a_get_lr_of_your_own_is_refused_a_new_base_lr_and_the_message_says_what_is_left():
    make = lambda o: _HalvingLambda(o, lambda s: 1.0)  # noqa: E731
    rec = _record(*_run(_at_lr(0.01), make))
    model, opt, sched = _fresh(_at_lr(0.1), make)
    with pytest.raises(RecordMismatchError, match="_HalvingLambda computes each learning rate with a get_lr of its own"):
        rec.restore(model, opt, sched, "cpu", allow_changes={"scheduler.base_lrs"})
    mixed = lambda o: L.SequentialLR(o, [L.ExponentialLR(o, 0.5), L.StepLR(o, 2)], milestones=[2])  # noqa: E731
    rec = _record(*_run(_at_lr(0.01), mixed))
    model, opt, sched = _fresh(_at_lr(0.1), mixed)
    with pytest.raises(RecordMismatchError, match=r"_schedulers\.1\.base_lrs cannot be allowed: a StepLR .* Once "
                                                  r"those are as recorded, .* allow_changes=\{'scheduler\._schedulers\.0"
                                                  r"\.base_lrs'\}"):
        rec.restore(model, opt, sched, "cpu")


# -- optimizer hyperparameters -------------------------------------------------------------

HYPER = {
    "betas": (_adamw(), _adamw(betas=(0.8, 0.99)), r"optimizer\.param_groups\.0\.betas: \[0\.9, 0\.999\] in the "
                                                   r"record, \[0\.8, 0\.99\] live"),
    "eps": (_adamw(), _adamw(eps=1e-6), r"optimizer\.param_groups\.0\.eps: 1e-08 in the record, 1e-06 live"),
    "weight_decay": (_adamw(), _adamw(weight_decay=0.1),
                     r"optimizer\.param_groups\.0\.weight_decay: 0\.01 in the record, 0\.1 live"),
    "amsgrad": (_adamw(), _adamw(amsgrad=True), r"optimizer\.param_groups\.0\.amsgrad: False in the record, True live"),
    "maximize": (_adamw(), _adamw(maximize=True), r"maximize: False in the record, True live"),
    "momentum": (_sgd(momentum=0.9), _sgd(momentum=0.5), r"momentum: 0\.9 in the record, 0\.5 live"),
    "dampening": (_sgd(momentum=0.9), _sgd(momentum=0.9, dampening=0.1), r"dampening: 0 in the record, 0\.1 live"),
    "nesterov": (_sgd(momentum=0.9), _sgd(momentum=0.9, nesterov=True), r"nesterov: False in the record, True live"),
}


@pytest.mark.parametrize("name", sorted(HYPER))
def test_another_hyperparameter_is_refused_naming_it_and_nothing_changes(name):
    recorded, live, said = HYPER[name]
    rec = _record(*_run(recorded, lambda o: L.StepLR(o, 2)))
    model, opt, sched = _fresh(live, lambda o: L.StepLR(o, 2))
    before = _snapshot(model, opt, sched)
    with pytest.raises(RecordMismatchError, match=said):
        rec.restore(model, opt, sched, "cpu")
    assert _unchanged(before, model, opt, sched)


def test_the_lr_is_the_schedule_s_position_and_comes_from_the_record():
    """Not compared: a schedule (or the caller's own code) moves it during the run."""
    src = _run(_adamw(), lambda o: L.StepLR(o, 1, gamma=0.5))
    rec = _record(*src)
    model, opt, sched = _fresh(lambda ps: torch.optim.AdamW(ps, lr=0.1), lambda o: L.StepLR(o, 1, gamma=0.5))
    rec.restore(model, opt, sched, "cpu")
    assert opt.param_groups[0]["lr"] == src[1].param_groups[0]["lr"] == 0.1 * 0.5 ** 3
    manual = _run(_sgd(momentum=0.9), None)
    manual[1].param_groups[0]["lr"] = 0.01  # a schedule of the caller's own
    model, opt, _ = _fresh(_sgd(momentum=0.9), None)
    _record(*manual).restore(model, opt, None, "cpu")
    assert opt.param_groups[0]["lr"] == 0.01


def test_an_allowed_hyperparameter_change_keeps_the_live_value_in_every_group():
    def make(wd):
        def opt(ps):
            ps = list(ps)
            return torch.optim.AdamW([{"params": ps[:2]}, {"params": ps[2:], "weight_decay": wd * 2}],
                                     lr=0.1, weight_decay=wd)
        return opt

    src = _run(make(0.01), None)
    rec = _record(*src)
    model, opt, _ = _fresh(make(0.5), None)
    with pytest.raises(RecordMismatchError, match=r"allow_changes=\{'optimizer\.weight_decay'\}"):
        rec.restore(model, opt, None, "cpu")
    rec.restore(model, opt, None, "cpu", allow_changes={"optimizer.weight_decay"})
    assert [g["weight_decay"] for g in opt.param_groups] == [0.5, 1.0]
    assert _same(opt.state_dict()["state"], src[1].state_dict()["state"])  # the moments are the record's


def test_allow_changes_takes_several_fields_at_once():
    rec = _record(*_run(_adamw(), lambda o: L.CosineAnnealingLR(o, T_max=6)))
    model, opt, sched = _fresh(_adamw(weight_decay=0.2, eps=1e-6), lambda o: L.CosineAnnealingLR(o, T_max=60))
    with pytest.raises(RecordMismatchError) as e:
        rec.restore(model, opt, sched, "cpu", allow_changes={"scheduler.T_max", "optimizer.eps"})
    assert "weight_decay" in str(e.value) and "eps" not in str(e.value).split("allow_changes=")[1]
    rec.restore(model, opt, sched, "cpu",
                allow_changes={"scheduler.T_max", "optimizer.eps", "optimizer.weight_decay"})
    group = opt.param_groups[0]
    assert (sched.T_max, group["eps"], group["weight_decay"], sched.last_epoch) == (60, 1e-6, 0.2, 3)


@pytest.mark.parametrize("allow, error, said", [
    ({"scheduler.Tmax"}, ValueError, r"'scheduler\.Tmax' names no field compared.*scheduler\.T_max"),
    ({"optimizer.weight_dacay"}, ValueError, r"'optimizer\.weight_dacay' names no field"),
    ({"T_max"}, ValueError, r"'T_max' is not COMPONENT\.FIELD"),
    ({"model.weight"}, ValueError, r"'model\.weight' is not COMPONENT\.FIELD"),
    ("scheduler.T_max", TypeError, r"a set of field names"),
    ({3}, TypeError, r"entries are strings"),
])
def test_a_wrong_allow_changes_is_refused_and_nothing_changes(allow, error, said):
    rec = _record(*_run(_adamw(), lambda o: L.CosineAnnealingLR(o, T_max=6)))
    model, opt, sched = _fresh(_adamw(), lambda o: L.CosineAnnealingLR(o, T_max=60))
    before = _snapshot(model, opt, sched)
    with pytest.raises(error, match=said):
        rec.restore(model, opt, sched, "cpu", allow_changes=allow)
    assert _unchanged(before, model, opt, sched)


def test_a_scheduler_the_record_holds_and_restore_is_not_given_is_named_with_initial_lr():
    rec = _record(*_run(_adamw(), lambda o: L.CosineAnnealingLR(o, T_max=6)))
    model, opt, _ = _fresh(_adamw(), None)  # the optimizer never had a scheduler
    before = _snapshot(model, opt, None)
    with pytest.raises(RecordMismatchError, match=r"torch\.optim\.lr_scheduler\.CosineAnnealingLR.*"
                                                  r"scheduler=None.*initial_lr") as e:
        rec.restore(model, opt, None, "cpu")
    assert "['amsgrad'" not in str(e.value)  # not the two key lists
    assert _unchanged(before, model, opt, None)


def test_the_identity_survives_the_torch_file_recorder(tmp_path):
    rec = TrainingRecord.capture(*_run(_adamw(), _cosine()), GradientsAccumulator(), Step(3))
    path = rec.save(trt.TorchFileRecorder(NativePrecisionSettings()), tmp_path / "r")
    back = TrainingRecord.load(trt.TorchFileRecorder(NativePrecisionSettings()), path, "cpu", state_type=Step)
    model, opt, sched = _fresh(_adamw(), _cosine(warmup=3))
    with pytest.raises(RecordMismatchError, match="num_warmup_steps: 2 in the record, 3 live"):
        back.restore(model, opt, sched, "cpu")


# -- records from before the identity --------------------------------------------------------

def _old(rec):
    """`rec` as trainrec wrote it before the identity: the scheduler's state dict only."""
    item = {k: v for k, v in rec.scheduler.item.items() if k != "#identity"}
    return TrainingRecord(rec.model, rec.optimizer, StateRecord(rec.scheduler.kind, item), rec.grads,
                          rec._state_item, Step)


def test_an_old_record_loads_saying_what_it_could_not_compare():
    old = _old(_record(*_run(_adamw(), _cosine())))
    model, opt, sched = _fresh(_adamw(), _hf("get_linear_schedule_with_warmup", num_warmup_steps=2,
                                             num_training_steps=20))
    with pytest.warns(UncheckedIdentityWarning, match=r"scheduler\.lr_lambdas could not be compared.*"
                                                      r"allow_changes=\{'scheduler\.lr_lambdas'\}"):
        old.restore(model, opt, sched, "cpu")
    assert sched.last_epoch == 3
    model, opt, sched = _fresh(_adamw(), _cosine())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        old.restore(model, opt, sched, "cpu", allow_changes={"scheduler.lr_lambdas"})  # vouched: no warning


def test_an_old_record_s_constructor_arguments_are_still_compared():
    old = _old(_record(*_run(_adamw(), lambda o: L.CosineAnnealingLR(o, T_max=6))))
    model, opt, sched = _fresh(_adamw(), lambda o: L.CosineAnnealingLR(o, T_max=60))
    before = _snapshot(model, opt, sched)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing unchecked: its state dict holds all
        with pytest.raises(RecordMismatchError, match=r"scheduler\.T_max: 6 in the record, 60 live"):
            old.restore(model, opt, sched, "cpu")
    assert _unchanged(before, model, opt, sched)


# -- DCPRecorder -------------------------------------------------------------------------------

@pytest.fixture
def dcp_saved(tmp_path):
    pytest.importorskip("torch.distributed.checkpoint")
    run = _run(_adamw(), lambda o: L.CosineAnnealingLR(o, T_max=6))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # DCP: "assuming ... a single process"
        return run, trt.DCPRecorder().save(tmp_path / "step", *run)


@pytest.mark.parametrize("live_opt, live_sched, said", [
    (_adamw(), lambda o: L.CosineAnnealingLR(o, T_max=60), r"scheduler\.T_max: 6 in the record, 60 live"),
    (_adamw(weight_decay=0.3), lambda o: L.CosineAnnealingLR(o, T_max=6),
     r"optimizer\.param_groups\.0\.weight_decay: 0\.01 in the record, 0\.3 live"),
    (_adamw(betas=(0.5, 0.9)), lambda o: L.CosineAnnealingLR(o, T_max=6), r"betas: \[0\.9, 0\.999\] in the record"),
])
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_dcp_load_refuses_another_schedule_or_hyperparameter_before_any_change(dcp_saved, live_opt, live_sched,
                                                                                 said):
    _, path = dcp_saved
    model, opt, sched = _fresh(live_opt, live_sched)
    before = _snapshot(model, opt, sched)
    with pytest.raises(RecordMismatchError, match=said):
        trt.DCPRecorder().load(path, model, opt, sched)
    assert _unchanged(before, model, opt, sched)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_dcp_load_with_allow_changes_keeps_the_live_values(dcp_saved):
    (smodel, sopt, ssched), path = dcp_saved
    model, opt, sched = _fresh(_adamw(weight_decay=0.3), lambda o: L.CosineAnnealingLR(o, T_max=60))
    trt.DCPRecorder().load(path, model, opt, sched, allow_changes={"scheduler.T_max", "optimizer.weight_decay"})
    assert (sched.T_max, opt.param_groups[0]["weight_decay"], sched.last_epoch) == (60, 0.3, 3)
    assert _same(opt.state_dict()["state"], sopt.state_dict()["state"])
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), smodel.parameters()))


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_dcp_load_refuses_a_new_base_lr_that_would_not_take_effect_even_when_allowed(dcp_saved):
    _, path = dcp_saved
    model, opt, sched = _fresh(_at_lr(1.0), lambda o: L.CosineAnnealingLR(o, T_max=6))
    before = _snapshot(model, opt, sched)
    with pytest.raises(RecordMismatchError, match="base_lrs cannot be allowed: a CosineAnnealingLR"):
        trt.DCPRecorder().load(path, model, opt, sched, allow_changes={"scheduler.base_lrs"})
    assert _unchanged(before, model, opt, sched)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_dcp_load_names_the_scheduler_it_was_not_given(dcp_saved):
    _, path = dcp_saved
    model, opt, _ = _fresh(_adamw(), None)
    with pytest.raises(RecordMismatchError, match=r"CosineAnnealingLR.*scheduler=None.*initial_lr"):
        trt.DCPRecorder().load(path, model, opt, None)


# -- the same argument on JAX ------------------------------------------------------------------

def test_jax_takes_the_same_argument_and_says_it_the_same_way():
    pytest.importorskip("optax")
    import jax
    import jax.numpy as jnp
    import optax

    import trainrec.adapters.jax as trj

    params = {"w": jnp.arange(3.0)}
    tx = optax.adamw(1e-2, weight_decay=0.01)
    opt = trj.JaxOptimizer(tx, tx.init(params))
    _, opt.opt_state = tx.update({"w": jnp.ones(3)}, opt.opt_state, params)
    rec = _record(trj.JaxModule(params), opt, trj.JaxLrScheduler(optax.cosine_decay_schedule(1e-2, 100), 4))
    tx2 = optax.adamw(1e-2, weight_decay=0.1)
    live_opt = trj.JaxOptimizer(tx2, tx2.init(params))
    live_sched = trj.JaxLrScheduler(optax.cosine_decay_schedule(1e-2, 200))
    module = trj.JaxModule({"w": jnp.zeros(3)})
    with pytest.raises(RecordMismatchError, match=r"weight_decay: 0\.01 in the record, 0\.1 live.*"
                                                  r"allow_changes=\{'optimizer\.weight_decay'\}"):
        rec.restore(module, live_opt, live_sched, "cpu")
    with pytest.raises(RecordMismatchError, match=r"decay_steps: 100 in the record, 200 live.*"
                                                  r"allow_changes=\{'scheduler\.decay_steps'\}"):
        rec.restore(module, live_opt, live_sched, "cpu", allow_changes={"optimizer.weight_decay"})
    assert live_sched.count == 0 and float(module.params["w"][0]) == 0.0  # nothing changed
    rec.restore(module, live_opt, live_sched, "cpu",
                allow_changes={"optimizer.weight_decay", "scheduler.decay_steps"})
    assert live_sched.count == 4 and live_opt.tx is tx2
    assert all(bool(jnp.array_equal(a, b)) for a, b in zip(jax.tree.leaves(live_opt.opt_state),
                                                              jax.tree.leaves(opt.opt_state)))


def test_jax_schedule_records_from_before_the_identity_load_with_a_warning():
    pytest.importorskip("optax")
    import optax

    import trainrec.adapters.jax as trj

    sched = trj.JaxLrScheduler(optax.cosine_decay_schedule(1e-2, 200))
    with pytest.warns(UncheckedIdentityWarning, match=r"scheduler\.#identity"):
        sched.check_record(StateRecord("optax.schedule", {"count": 4}))
    sched.load_record(StateRecord("optax.schedule", {"count": 4}))
    assert sched.count == 4


def test_an_adapter_without_allow_changes_refuses_the_argument_it_cannot_honour():
    class Plain:
        """A third-party binding whose methods take no allow_changes."""

        kind = "plain.optimizer"

    from trainrec.training.record import _changes_kw

    def check_record(record, module):
        return None

    assert _changes_kw(check_record, frozenset(), "optimizer", Plain()) == {}
    with pytest.raises(ValueError, match=r"optimizer adapter of plain\.optimizer compares none"):
        _changes_kw(check_record, frozenset({"optimizer.lr"}), "optimizer", Plain())


def test_functools_partial_identity_names_the_function_and_keywords():
    from trainrec.adapters.torch.identity import function_identity

    def f(step, *, a, b=2):
        return step

    ident = function_identity(functools.partial(f, a=1))
    assert ident == {"fn": f"{__name__}.{f.__qualname__}", "args": [], "keywords": {"a": 1}}


# -- Accelerate: its scheduler.bin and optimizer.bin, checked before it loads them ------------

def test_accelerate_load_state_refuses_another_schedule_before_it_loads_anything(tmp_path):
    accelerate = pytest.importorskip("accelerate")
    from trainrec.adapters.torch.accelerate import ExactResume

    def build(total, weight_decay=0.01, allow=None):
        accelerator = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=2)
        model = _model()
        opt = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=weight_decay)
        sched = _cosine(total=total)(opt)
        model, opt, sched = accelerator.prepare(model, opt, sched)
        accelerator.register_for_checkpointing(ExactResume(accelerator, model, allow_changes=allow))
        return accelerator, model, opt, sched

    accelerator, model, opt, sched = build(20)
    for _ in range(3):
        with accelerator.accumulate(model):
            accelerator.backward(model(torch.ones(2, 4)).sum())
            opt.step()
            sched.step()
            opt.zero_grad()
    accelerator.save_state(str(tmp_path / "ckpt"))
    saved_epoch = sched.scheduler.last_epoch

    accelerator, model, opt, sched = build(200, weight_decay=0.3)
    before = _snapshot(model, opt.optimizer, sched.scheduler)
    with pytest.raises(RecordMismatchError, match=r"weight_decay: 0\.01 in the record, 0\.3 live.*"
                                                  r"num_training_steps: 20 in the record, 200 live"):
        accelerator.load_state(str(tmp_path / "ckpt"))
    assert _unchanged(before, model, opt.optimizer, sched.scheduler)

    accelerator, model, opt, sched = build(200, weight_decay=0.3,
                                           allow={"optimizer.weight_decay", "scheduler.num_training_steps"})
    accelerator.load_state(str(tmp_path / "ckpt"))
    assert opt.optimizer.param_groups[0]["weight_decay"] == 0.3
    assert sched.scheduler.last_epoch == saved_epoch
    assert sched.scheduler.lr_lambdas[0].keywords["num_training_steps"] == 200


# -- Lightning: its optimizer_states and lr_schedulers, checked before it loads them -----------

def test_lightning_refuses_another_schedule_with_the_weights_put_back(tmp_path):
    pl = pytest.importorskip("lightning.pytorch")
    from trainrec.adapters.torch.lightning import ExactResume

    class Net(pl.LightningModule):
        def __init__(self, seed, total, weight_decay=0.01):
            super().__init__()
            self.net, self.total, self.weight_decay = _model(seed), total, weight_decay

        def training_step(self, batch, batch_idx):
            return self.net(batch[0]).pow(2).mean()

        def configure_optimizers(self):
            opt = torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=self.weight_decay)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": _cosine(total=self.total)(opt),
                                                       "interval": "step"}}

    class SaveAndStop(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if batch_idx == 3:
                trainer.save_checkpoint(tmp_path / "mid.ckpt")
                trainer.should_stop = True

    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(32, 4)), batch_size=4)

    def trainer(*callbacks, allow=None):
        return pl.Trainer(max_epochs=1, accelerator="cpu", logger=False, enable_checkpointing=False,
                          enable_progress_bar=False, enable_model_summary=False,
                          callbacks=[ExactResume(rng=False, allow_replay=True, allow_changes=allow), *callbacks])

    trainer(SaveAndStop()).fit(Net(0, 20), data)
    module = Net(1, 200, weight_decay=0.3)
    before = {k: v.clone() for k, v in module.state_dict().items()}
    with pytest.raises(RecordMismatchError, match=r"weight_decay: 0\.01 in the record, 0\.3 live.*"
                                                  r"num_training_steps: 20 in the record, 200 live"):
        trainer().fit(module, data, ckpt_path=tmp_path / "mid.ckpt")
    assert all(torch.equal(before[k], v) for k, v in module.state_dict().items())

    class Look(pl.Callback):
        def on_train_start(self, trainer, pl_module):
            self.seen = (trainer.optimizers[0].param_groups[0]["weight_decay"],
                         trainer.lr_scheduler_configs[0].scheduler.lr_lambdas[0].keywords["num_training_steps"],
                         trainer.lr_scheduler_configs[0].scheduler.last_epoch)
            trainer.should_stop = True

    look = Look()
    trainer(look, allow={"optimizer.weight_decay", "scheduler.num_training_steps"}).fit(
        Net(1, 200, weight_decay=0.3), data, ckpt_path=tmp_path / "mid.ckpt")
    assert look.seen == (0.3, 200, 4)
