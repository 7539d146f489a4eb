"""A training loop described in five methods (`loop`) and fingerprints that tell two values
apart (`fingerprint`). It may import `recorders`, `training` and every layer below."""
