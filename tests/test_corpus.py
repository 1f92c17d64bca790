"""The local corpus: the real stdlib split, glob corpora and clear errors."""

import pytest

from resources.corpus import list_corpus_files, load_corpus, stdlib_root


@pytest.fixture(scope="module")
def stdlib_split():
    return load_corpus("stdlib", 4, 0.05)


def test_stdlib_listing_is_sorted_python_source_without_third_party():
    files = list_corpus_files("stdlib")
    rels = [rel for rel, _ in files]
    assert rels == sorted(rels) and len(rels) > 500
    assert all(rel.endswith(".py") and "\\" not in rel for rel in rels)
    assert not any(part in ("site-packages", "dist-packages", "__pycache__")
                   for rel in rels for part in rel.split("/"))
    assert "os.py" in rels and all(p.is_relative_to(stdlib_root()) for _, p in files)


def test_stdlib_split_is_a_partition_of_the_listed_files(stdlib_split):
    shards = [set(f) for f in stdlib_split.learner_files]
    heldout = set(stdlib_split.heldout_files)
    assert all(shards) and heldout
    for i, a in enumerate(shards):
        assert not a & heldout
        for b in shards[i + 1:]:
            assert not a & b
    assert set().union(*shards, heldout) == {rel for rel, _ in list_corpus_files("stdlib")}
    assert all(s.size > 0 and s.dtype.name == "uint8" for s in stdlib_split.learner_streams)
    summary = stdlib_split.summary()
    assert summary["heldout_files"] == len(heldout)
    assert summary["learner_bytes"] == [s.size for s in stdlib_split.learner_streams]


def test_load_corpus_is_cached_and_truncates(stdlib_split):
    assert load_corpus("stdlib", 4, 0.05) is stdlib_split
    small = load_corpus("stdlib", 4, 0.05, max_bytes_per_split=1000)
    assert [s.size for s in small.learner_streams] == [1000] * 4
    assert small.heldout_stream.size == 1000
    assert (small.learner_streams[0] == stdlib_split.learner_streams[0][:1000]).all()
    assert not small.heldout_stream.flags.writeable  # the cached copy is shared


def test_glob_corpus_over_local_text_files(tmp_path):
    for i in range(40):
        sub = tmp_path / f"dir{i % 3}"
        sub.mkdir(exist_ok=True)
        (sub / f"note{i}.txt").write_text(f"document number {i}\n")
    (tmp_path / "ignored.md").write_text("not matched")
    pattern = str(tmp_path / "**" / "*.txt")
    rels = [rel for rel, _ in list_corpus_files(pattern)]
    assert len(rels) == 40 and "dir1/note1.txt" in rels
    split = load_corpus(pattern, 2, 0.2)
    assert sorted(sum(split.learner_files, split.heldout_files)) == sorted(rels)
    assert b"not matched" not in b"".join(s.tobytes() for s in split.learner_streams)


def test_glob_matching_nothing_names_the_pattern(tmp_path):
    pattern = str(tmp_path / "*.nothing")
    with pytest.raises(ValueError, match="nothing"):
        load_corpus(pattern, 2, 0.1)


def test_too_many_learners_for_the_files(tmp_path):
    for i in range(4):
        (tmp_path / f"f{i}.txt").write_text("x" * 100)
    with pytest.raises(ValueError, match="too few files"):
        load_corpus(str(tmp_path / "*.txt"), 64, 0.1)


def test_remote_corpora_are_not_supported_yet():
    with pytest.raises(NotImplementedError, match="gs://"):
        list_corpus_files("gs://bucket/corpus/*.txt")


def test_empty_heldout_set_raises(tmp_path):
    for i in range(4):
        (tmp_path / f"f{i}.txt").write_text("x" * 100)
    with pytest.raises(ValueError, match="held-out"):
        load_corpus(str(tmp_path / "*.txt"), 1, 0.01)
