"""The spec test vectors (spec/vectors), in every recorder format installed here."""

from trainrec.conformance.vectors import check_vectors, vector_dir


def test_every_vector_loads_bit_exactly_and_rewrites_to_the_same_bytes():
    assert (vector_dir() / "manifest.json").exists()
    assert check_vectors() == []
