"""The typed launchpad form and the config reference: both generated from the core's config
dataclasses, so every field is there with its type, default and description."""

import dataclasses
import typing
from pathlib import Path

import dagster as dg
import pytest

from diloco_core.config import ExperimentConfig
from diloco_core.config_section import field_docs
from pipelines.config_schema import form_model, reference, reference_markdown
from pipelines.definitions import defs as load_defs
from resources.store.resource import ArtifactStoreResource

DOC = Path(__file__).parent.parent / "docs" / "config.md"


def _leaf_paths(cls=ExperimentConfig, prefix="") -> list[str]:
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            out += _leaf_paths(hints[f.name], f"{prefix}{f.name}.")
        else:
            out.append(f"{prefix}{f.name}")
    return out


def test_the_reference_page_is_generated_from_the_code():
    assert DOC.read_text() == reference_markdown(), (
        "docs/config.md is stale: python -m pipelines.config_schema > docs/config.md")


def test_every_field_is_documented_in_the_reference_and_the_form():
    rows = {row.path: row for row in reference()}
    assert sorted(rows) == sorted(_leaf_paths())
    undocumented = [p for p, row in rows.items() if not row.doc.strip()]
    assert not undocumented, f"fields without documentation in config.py: {undocumented}"
    form = form_model()
    for path, row in rows.items():
        model = form
        *sections, leaf = path.split(".")
        for section in sections:
            model = model.model_fields[section].annotation
        field = model.model_fields[leaf]
        assert field.default is None and "(default: " in field.description, path
        assert row.orchestrated in field.description, (path, field.description)


def test_each_fields_documentation_is_the_string_under_it_on_one_line():
    from diloco_core.config import OrchestrationConfig, SyncConfig

    assert field_docs(SyncConfig)["min_quorum"] == "K"
    syncer = field_docs(OrchestrationConfig)["syncer"]
    assert syncer.startswith("Who decides and merges") and "\n" not in syncer


def _defs(store_uri: str) -> dg.Definitions:
    loaded = load_defs()
    return dg.Definitions(
        assets=loaded.assets, asset_checks=loaded.asset_checks, jobs=loaded.jobs,
        resources={**loaded.resources, "store": ArtifactStoreResource(base_uri=store_uri)})


def _start(tmp_path, config: dict, **kw):
    with dg.instance_for_test() as instance:
        return _defs(str(tmp_path / "store")).resolve_job_def("train").execute_in_process(
            instance=instance, run_config={"ops": {"start_experiment": {"config": config}}},
            **kw)


def test_the_launchpad_schema_is_typed():
    job = load_defs().resolve_job_def("train")
    config = job.run_config_schema.config_type.fields["ops"].config_type \
        .fields["start_experiment"].config_type.fields["config"].config_type
    sync = config.fields["experiment"].config_type.fields["sync"].config_type
    # (Dagster types an int as "IntSource": an int or an environment variable's value.)
    assert sync.fields["min_quorum"].config_type.inner_type.key == "IntSourceType"
    assert sync.fields["grace_gamma"].config_type.inner_type.key == "Float"
    learners = config.fields["experiment"].config_type.fields["learners"].config_type
    assert learners.fields["speeds"].config_type.inner_type.kind.name == "ARRAY"
    assert "K" in sync.fields["min_quorum"].description


def test_the_form_starts_an_experiment_and_overrides_still_win(tmp_path):
    result = _start(tmp_path, {
        "experiment": {"name": "typed", "model": {"preset": "tiny"},
                       "learners": {"num_learners": 2, "speeds": [1.0, 0.5]},
                       "sync": {"min_quorum": 1, "grace_gamma": 0.5}},
        "overrides": ["sync.grace_gamma=0.25"]})
    assert result.success
    cfg = ArtifactStoreResource(base_uri=str(tmp_path / "store")).store("typed").get_config()
    assert cfg["model"]["preset"] == "tiny"
    assert cfg["learners"]["speeds"] == [1.0, 0.5] and cfg["sync"]["min_quorum"] == 1
    assert cfg["sync"]["grace_gamma"] == 0.25                     # --set beats the form
    assert cfg["sync"]["sync_period"] == 16                       # orchestrated default kept


def test_a_mistyped_field_or_a_bad_value_is_refused_before_the_run_naming_its_field(tmp_path):
    with pytest.raises(dg.DagsterInvalidConfigError, match="min_quorum"):
        _start(tmp_path, {"experiment": {"sync": {"min_quorum": "many"}}})
    # Well typed, refused by the sections' checks across fields (K <= M) at launch.
    with pytest.raises(dg.DagsterInvalidConfigError, match=r"sync\.min_quorum: must be <="):
        _start(tmp_path, {"experiment": {"sync": {"min_quorum": 9}}})
