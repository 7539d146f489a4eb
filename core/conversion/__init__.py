"""Converting a `TrainingRecord` between adapters through neutral forms (`convert`), the conversion
rules and their presets (`rules`) and Burn's records as a neutral form (`burn_neutral`). A tool on
top of the data path: it may import `workload`, `recorders`, `training` and every layer below,
never another tool or `cli`."""

