"""Framework adapters: `trainrec.adapters.numpy` (reference), `.torch`, `.jax`.

Each is imported only when the caller asks for it (or `trainrec.adapt` meets an object
of a framework the caller has already imported).
"""
