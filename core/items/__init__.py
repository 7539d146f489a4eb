"""The values every layer passes: element types (`dtypes`), framework-free host tensors (`tensor`),
CRC-32 of buffers (`checksum`) and item trees, the serializable form of every record, with the one
walker over them (`tree`). This is the bottom of the data path; it may import only
`trainrec.errors`.

`trainrec.items` (the path spec/FORMAT.md names) is `trainrec.items.tree`'s names."""


from .tree import (
    TENSOR_KEY,
    Item,
    check_item,
    compare_items,
    iter_tensors,
    join_key,
    map_leaves,
    map_tensors,
    map_tree,
    path_of,
    walk,
    walk_pairs,
)

__all__ = [
    "Item",
    "TENSOR_KEY",
    "check_item",
    "compare_items",
    "iter_tensors",
    "join_key",
    "map_leaves",
    "map_tensors",
    "map_tree",
    "path_of",
    "walk",
    "walk_pairs",
]
