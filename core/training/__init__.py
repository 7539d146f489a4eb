"""The training API: the protocols adapters implement (`protocols`), the registry that finds the
adapter for a native object (`registry`), records of model, optimizer, scheduler and caller state
(`records`), gradients and their accumulator (`gradients`, `accumulator`), what identifies a
schedule (`changes`), the `TrainingRecord` that captures them all (`record`) and the array-API
backend (`array_api`). It captures state into item trees; it may import the layers below it
(`format`, `precision`, `storage`, `items`, `errors`), never a recorder or a tool above."""
