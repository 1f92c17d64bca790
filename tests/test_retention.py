"""Retention's own bookkeeping: where it resumes, what a bad record does, what the policy
refuses. (What it deletes, on a real syncer run: tests/test_syncer_service.py.)"""

import pytest

from diloco_core.config import ConfigError
from diloco_core.config_loading import config_from_mapping
from pipelines.retention import Retention
from resources.store import layout
from resources.store.artifact_store import ArtifactStore
from resources.store.backends import open_blob_store


@pytest.fixture
def store(tmp_path):
    return ArtifactStore(open_blob_store(str(tmp_path)), "e1")


def _cfg(*overrides: str):
    return config_from_mapping({}, ["sync.num_fragments=2", *overrides])


def test_it_resumes_where_the_record_says(store):
    store.put_retention({"versions_from": [3, 5], "rounds_from": 9})
    r = Retention.resume(store, _cfg())
    assert (r.versions_from, r.rounds_from) == ([3, 5], 9)


@pytest.mark.parametrize(("record", "versions", "rounds"), [
    ({"versions_from": [3], "rounds_from": 9}, [1, 1], 9),          # wrong fragment count
    ({"versions_from": ["x", 2], "rounds_from": -1}, [1, 1], 0),
    ({"versions_from": [True, 2], "rounds_from": 2.5}, [1, 1], 0),
    ({"versions_from": [0, 4], "rounds_from": 3}, [1, 4], 3),       # version 0 is never pruned
])
def test_a_malformed_record_only_makes_it_start_over(store, record, versions, rounds):
    store.put_retention(record)
    r = Retention.resume(store, _cfg())
    assert (r.versions_from, r.rounds_from) == (versions, rounds)


def test_an_unreadable_record_reads_as_none(store):
    store.blobs.write(layout.retention("e1"), b"{not json")
    assert store.get_retention() is None
    assert Retention.resume(store, _cfg()).versions_from == [1, 1]


def test_keeping_everything_deletes_nothing_and_writes_no_record(store):
    cfg = _cfg("orchestration.keep_global_versions=0", "orchestration.keep_contribution_rounds=0")
    assert Retention.resume(store, cfg).after_merge(0, 500, 900) == 0
    assert store.get_retention() is None


def test_keeping_one_version_is_refused_with_the_field():
    with pytest.raises(ConfigError, match="keep_global_versions"):
        _cfg("orchestration.keep_global_versions=1")
