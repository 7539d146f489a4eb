"""The one walker over item trees (`trainrec.items.tree`: `walk`, `walk_pairs`, `map_tree` and
what is built on them): order, key paths, depth, tensors as leaves, and the limits
`check_item` enforces through it."""

from __future__ import annotations

import numpy as np
import pytest

from trainrec import CorruptRecordError, TensorData
from trainrec.items.tree import (
    check_item,
    compare_items,
    iter_tensors,
    map_leaves,
    map_tensors,
    map_tree,
    path_of,
    walk,
    walk_pairs,
)


def _t(*values: float) -> TensorData:
    return TensorData.from_array(np.asarray(values, np.float32))


def _tree() -> dict:
    return {"b": {"w": _t(1, 2), "n": 3}, "a": [_t(4), [], {"x": None, "y": b"\x00"}], "e": {}}


def test_walk_visits_every_node_depth_first_containers_first_in_insertion_order() -> None:
    tree = _tree()
    got = [(path, depth, type(v).__name__) for path, v, depth in walk(tree)]
    assert got == [
        ("", 0, "dict"),
        ("b", 1, "dict"), ("b.w", 2, "TensorData"), ("b.n", 2, "int"),
        ("a", 1, "list"), ("a.0", 2, "TensorData"), ("a.1", 2, "list"),
        ("a.2", 2, "dict"), ("a.2.x", 3, "NoneType"), ("a.2.y", 3, "bytes"),
        ("e", 1, "dict"),
    ]
    assert [path for path, _, _ in walk(tree, "state")][:3] == ["state", "state.b", "state.b.w"]


def test_tensors_are_leaves_and_the_nodes_are_the_tree_s_own_objects() -> None:
    tree = _tree()
    nodes = {path: v for path, v, _ in walk(tree)}
    assert nodes["b"] is tree["b"] and nodes["b.w"] is tree["b"]["w"]
    assert [p for p, _ in iter_tensors(tree)] == ["b.w", "a.0"]


def test_walk_reads_a_container_s_contents_after_yielding_it() -> None:
    tree = {"a": {"old": 1}}
    seen = []
    for path, node, _ in walk(tree):
        seen.append(path)
        if path == "a":
            node["new"] = 2  # a caller may change what it was just given
    assert seen == ["", "a", "a.old", "a.new"]


def test_walk_has_no_recursion_limit_and_check_item_bounds_the_depth() -> None:
    deep: list = []
    node = deep
    for _ in range(5000):
        node.append([])
        node = node[0]
    assert sum(1 for _ in walk(deep)) == 5001
    with pytest.raises(CorruptRecordError, match="nested too deeply") as e:
        check_item(deep)
    assert e.value.key == ".".join(["0"] * 257)


def test_check_item_rejects_a_cycle_with_an_error_not_a_recursion_error() -> None:
    cyclic: dict = {"a": [1]}
    cyclic["a"].append(cyclic)
    with pytest.raises(CorruptRecordError, match="nested too deeply"):
        check_item(cyclic)


@pytest.mark.parametrize(("bad", "key", "says"), [
    ({"a": {"b": (1, 2)}}, "a.b", "tuple is not an item"),
    ({"a": [0, 2**64]}, "a.1", "does not fit in 64 bits"),
    ({"a": {1: 2}}, "a", "keys must be str"),
    ({"a": {"__tensor__": 2}}, "a", "reserved"),
])
def test_check_item_names_the_first_offending_key(bad: dict, key: str, says: str) -> None:
    with pytest.raises(CorruptRecordError, match=says) as e:
        check_item(bad, source="f.mpk")
    assert e.value.key == key
    assert check_item(_tree()) is not None


def test_walk_pairs_descends_where_both_trees_have_the_same_shape() -> None:
    a = {"k": [1, {"x": 2}], "m": {"p": 1}, "l": [1, 2], "t": _t(1)}
    b = {"k": [1, {"x": 3}], "m": {"q": 1}, "l": [1], "t": 5}
    got = [(path, x, y) for path, x, y in walk_pairs(a, b)]
    assert got == [("k.0", 1, 1), ("k.1.x", 2, 3), ("m", {"p": 1}, {"q": 1}), ("l", [1, 2], [1]),
                   ("t", a["t"], 5)]
    assert [p for p, _, _ in walk_pairs({"a": 1}, [1])] == [""]


def test_map_tree_rebuilds_contents_first_and_never_changes_the_input() -> None:
    tree = _tree()
    order: list[str] = []

    def fn(path: str, node: object) -> object:
        order.append(path)
        return {"map": node} if isinstance(node, dict) else node

    out = map_tree(tree, fn)
    assert order == ["b.w", "b.n", "b", "a.0", "a.1", "a.2.x", "a.2.y", "a.2", "a", "e", ""]
    assert out["map"]["b"]["map"]["n"] == 3 and out["map"]["a"][2]["map"]["y"] == b"\x00"
    assert compare_items(tree, _tree())[0] and out["map"]["a"] is not tree["a"]  # input unchanged


def test_map_leaves_and_map_tensors_keep_the_shape_and_share_other_leaves() -> None:
    tree = _tree()
    paths = map_leaves(tree, lambda path, _: path)
    assert paths == {"b": {"w": "b.w", "n": "b.n"}, "a": ["a.0", [], {"x": "a.2.x", "y": "a.2.y"}], "e": {}}
    doubled = map_tensors(tree, lambda _, t: TensorData.from_array(t.array * 2))
    assert doubled["b"]["w"].array.tolist() == [2, 4] and tree["b"]["w"].array.tolist() == [1, 2]
    assert doubled["a"][2]["y"] is tree["a"][2]["y"]


def test_compare_items_reports_every_differing_path() -> None:
    a = {"w": _t(1, 2), "s": 1, "l": [1, 2], "m": {"k": 1}}
    assert compare_items(a, map_tree(a, lambda _, n: n)) == (True, 0.0, [])
    b = {"w": _t(1, 2.5), "s": 2, "l": [1], "m": {"k": 1}}
    same, diff, paths = compare_items(a, b)
    assert not same and paths == ["w", "s", "l"] and diff == float("inf")
    assert compare_items({"w": _t(1, 2)}, {"w": _t(1, 2.5)}) == (False, 0.5, ["w"])
    assert compare_items({"w": _t(1)}, {"w": TensorData.from_array(np.ones(1, np.float64))})[2] == ["w"]


def test_a_walk_without_paths_meets_the_same_nodes_and_path_of_finds_their_paths() -> None:
    tree = _tree()
    with_paths = list(walk(tree, "s"))
    without = list(walk(tree, "s", paths=False))
    assert [(n, d) for _, n, d in without] == [(n, d) for _, n, d in with_paths]
    assert {p for p, _, _ in without} == {"s", ""}
    shared = [1, 2]
    twice = {"a": {"x": shared}, "b": {"x": shared}, "c": shared}
    assert path_of(twice, shared, 2) == "a.x" and path_of(twice, shared, 1) == "c"
    assert path_of(tree, tree["a"][2], 2, "s") == "s.a.2"


def test_check_limits_names_the_key_it_refuses() -> None:
    from trainrec.format.limits import Limits, check_limits

    long = "x" * 100
    with pytest.raises(CorruptRecordError, match="longer than readers accept") as e:
        check_limits({"a": [1, {"b": long}]}, Limits(max_str_bytes=50))
    assert e.value.key == "a.1.b"
    with pytest.raises(CorruptRecordError, match="longer than readers accept") as e:
        check_limits({"a": {"ok": 1, long: 2}}, Limits(max_str_bytes=50))
    assert e.value.key == "a"
    with pytest.raises(CorruptRecordError, match="dimensions") as e:
        check_limits({"a": [TensorData.from_array(np.zeros((1,) * 5))]}, Limits(max_dims=4))
    assert e.value.key == "a.0"
