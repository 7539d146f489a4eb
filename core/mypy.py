"""A mypy plugin: `@trainrec.record` classes have `into_item` and `from_item`.

mypy reads a class decorator's `dataclass_transform` (fields, constructor) but never the
methods a decorator adds, so without this plugin `state.into_item(...)`,
`State.from_item(...)` and `recorder.record(state, path)` (a `Record` is expected) fail
to type-check. Enable it in the project's mypy configuration:

    [tool.mypy]
    plugins = ["trainrec.mypy"]

Only mypy imports this module (trainrec itself never does).
"""

from __future__ import annotations

from collections.abc import Callable

from mypy.nodes import (
    ARG_OPT,
    ARG_POS,
    MDEF,
    Argument,
    Decorator,
    FuncDef,
    SymbolTableNode,
    TypeAlias,
    Var,
)
from mypy.plugin import ClassDefContext, Plugin
from mypy.plugins.common import add_method_to_class
from mypy.types import AnyType, Type, TypeAliasType, TypeOfAny
from mypy.typevars import fill_typevars

__all__ = ["plugin"]

_RECORD = {"trainrec.training.records.record", "trainrec.record"}


class TrainrecPlugin(Plugin):
    """Adds the two methods `trainrec.record` adds at run time."""

    def get_class_decorator_hook(self, fullname: str) -> Callable[[ClassDefContext], None] | None:
        return _add_record_methods if fullname in _RECORD else None


def _add_record_methods(ctx: ClassDefContext) -> None:
    info = ctx.cls.info
    anything = AnyType(TypeOfAny.special_form)
    settings = ctx.api.named_type_or_none("trainrec.precision.PrecisionSettings") or anything
    item = _alias(ctx, "trainrec.items.tree.Item") or anything
    if "into_item" not in info.names:
        add_method_to_class(
            ctx.api, ctx.cls, "into_item",
            [Argument(Var("settings", settings), settings, None, ARG_POS)], item,
        )
    if "from_item" not in info.names:
        add_method_to_class(
            ctx.api, ctx.cls, "from_item",
            [Argument(Var("item", item), item, None, ARG_POS),
             Argument(Var("device", anything), anything, None, ARG_OPT)],
            fill_typevars(info), is_classmethod=True,
        )
        _as_decorated_classmethod(ctx, "from_item")


def _as_decorated_classmethod(ctx: ClassDefContext, name: str) -> None:
    """What `@classmethod` makes of a method (`add_method_to_class` leaves a bare
    function, which does not satisfy the `Record` protocol's classmethod)."""
    func = ctx.cls.info.names[name].node
    if not isinstance(func, FuncDef):
        return
    func.is_decorated = True
    var = Var(name, func.type)
    var.info = ctx.cls.info
    var._fullname = func.fullname
    var.is_classmethod = True
    var.is_initialized_in_class = True
    dec = Decorator(func, [], var)
    dec.line = func.line
    ctx.cls.info.names[name] = SymbolTableNode(MDEF, dec, plugin_generated=True)


def _alias(ctx: ClassDefContext, fullname: str) -> Type | None:
    node = ctx.api.lookup_fully_qualified_or_none(fullname)
    if node is None or not isinstance(node.node, TypeAlias):
        return None
    return TypeAliasType(node.node, [])


def plugin(version: str) -> type[Plugin]:
    """mypy's entry point."""
    return TrainrecPlugin
