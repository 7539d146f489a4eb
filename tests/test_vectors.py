"""The spec test vectors (spec/vectors), in every recorder format installed here."""

import os
import subprocess
import sys

import pytest

from trainrec.conformance import vectors
from trainrec.conformance.vectors import check_vectors, vector_dir


def test_every_vector_loads_bit_exactly_and_rewrites_to_the_same_bytes():
    assert (vector_dir() / "manifest.json").exists()
    assert check_vectors() == []


def test_the_check_never_rebuilds_a_vector(monkeypatch):
    def rebuilt():
        raise AssertionError("the check rebuilt a vector: its bytes would depend on the CPU")

    monkeypatch.setattr(vectors, "VECTORS",
                        {n: (*v[:2], rebuilt, *v[3:]) for n, v in vectors.VECTORS.items()})
    assert check_vectors(core_only=True) == []


@pytest.mark.parametrize("coretype", ["Haswell", "Zen", "SkylakeX"])
def test_vectors_check_under_every_openblas_kernel(coretype):
    # OpenBLAS kernels round differently (6e-8 in Adam moments); a vector must not notice
    env = {**os.environ, "OPENBLAS_CORETYPE": coretype}
    code = "from trainrec.conformance.vectors import check_vectors; print(check_vectors(core_only=True))"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_core_alone_checks_the_flax_vectors(monkeypatch):
    """The flax msgpack recorder is core's: the core-only check reads and rewrites the
    .msgpack vectors too (only the .pt ones need torch, to write)."""
    from trainrec.conformance import vectors

    seen = []
    real = vectors._recorder
    monkeypatch.setattr(vectors, "_recorder", lambda kind, settings: seen.append(kind) or real(kind, settings))
    assert check_vectors(core_only=True) == []
    assert seen.count("flax") == 2 and "torch" not in seen
