"""Check a manifest against the Kubernetes object model, with no cluster.

The official `kubernetes` client's models carry the API's schema: each model's `openapi_types`
(field -> type) and `attribute_map` (field -> JSON key), and constructors that refuse a missing
required field. `validate` walks a plain manifest dict against them and reports every unknown
key (a typo such as `nodeSelecter` would be silently dropped by the API server), every value of
the wrong type, and every missing required field, each with its path in the manifest.

JobSet is a custom resource the client does not model; `validate_jobset` checks its own few
fields by hand and everything below them (the Job template, hence the pod) with the models.
"""

import re
from typing import Any

from kubernetes import client as k8s

_LIST = re.compile(r"list\[(.+)\]")
_DICT = re.compile(r"dict\[(.+?), (.+)\]")
_SCALARS = {"str": str, "int": int, "bool": bool, "float": (int, float)}


class ManifestError(ValueError):
    """A manifest does not match the object model; lists every problem found."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("; ".join(problems))


def validate(obj: Any, model: str, path: str = "") -> None:
    """Raise `ManifestError` unless `obj` (plain dicts and lists) is a valid `model`
    (a kubernetes client model name such as "V1PodSpec")."""
    problems: list[str] = []
    _check(obj, model, path or model, problems)
    if problems:
        raise ManifestError(problems)


def _check(value: Any, type_name: str, path: str, problems: list[str]) -> None:
    if m := _LIST.fullmatch(type_name):
        if not isinstance(value, list):
            problems.append(f"{path}: must be a list, got {type(value).__name__}")
            return
        for i, item in enumerate(value):
            _check(item, m.group(1), f"{path}[{i}]", problems)
        return
    if m := _DICT.fullmatch(type_name):
        if not isinstance(value, dict):
            problems.append(f"{path}: must be a mapping, got {type(value).__name__}")
            return
        for key, item in value.items():
            _check(item, m.group(2), f"{path}.{key}", problems)
        return
    if type_name in _SCALARS:
        ok = isinstance(value, _SCALARS[type_name]) and not (
            type_name != "bool" and isinstance(value, bool))
        if not ok:
            problems.append(f"{path}: must be {type_name}, got {value!r}")
        return
    if type_name == "object":
        return        # free-form in the API (e.g. int-or-string)
    cls = getattr(k8s, type_name, None)
    if cls is None:
        problems.append(f"{path}: unknown model {type_name}")
        return
    if not isinstance(value, dict):
        problems.append(f"{path}: must be a mapping ({type_name}), got {type(value).__name__}")
        return
    by_key = {key: attr for attr, key in cls.attribute_map.items()}
    for key, item in value.items():
        attr = by_key.get(key)
        if attr is None:
            problems.append(f"{path}.{key}: unknown field of {type_name}")
            continue
        _check(item, cls.openapi_types[attr], f"{path}.{key}", problems)
    # Required fields: the model's constructor refuses None for them.
    try:
        cls(**{by_key[k]: v for k, v in value.items() if k in by_key})
    except ValueError as err:
        problems.append(f"{path}: {err}")


def validate_workload(manifest: dict) -> None:
    """A learner's Pod (checked as V1Pod) or JobSet (`validate_jobset`)."""
    if manifest.get("kind") == "JobSet":
        validate_jobset(manifest)
    elif manifest.get("kind") == "Pod" and manifest.get("apiVersion") == "v1":
        validate(manifest, "V1Pod")
    else:
        raise ManifestError([f"kind: expected a v1 Pod or a JobSet, got "
                             f"{manifest.get('apiVersion')}/{manifest.get('kind')}"])


def validate_jobset(manifest: dict) -> None:
    """A JobSet (jobset.x-k8s.io/v1alpha2): its own fields, then each Job template's spec."""
    problems: list[str] = []
    if manifest.get("apiVersion") != "jobset.x-k8s.io/v1alpha2":
        problems.append(f"apiVersion: must be jobset.x-k8s.io/v1alpha2, got "
                        f"{manifest.get('apiVersion')!r}")
    if manifest.get("kind") != "JobSet":
        problems.append(f"kind: must be JobSet, got {manifest.get('kind')!r}")
    unknown = sorted(set(manifest) - {"apiVersion", "kind", "metadata", "spec"})
    problems += [f"{key}: unknown field of JobSet" for key in unknown]
    _check(manifest.get("metadata"), "V1ObjectMeta", "metadata", problems)
    spec = manifest.get("spec")
    if not isinstance(spec, dict):
        raise ManifestError([*problems, "spec: must be a mapping"])
    known = {"replicatedJobs", "failurePolicy", "successPolicy", "network", "suspend",
             "startupPolicy", "coordinator", "managedBy", "ttlSecondsAfterFinished"}
    problems += [f"spec.{key}: unknown field of JobSetSpec" for key in sorted(set(spec) - known)]
    restarts = (spec.get("failurePolicy") or {}).get("maxRestarts", 0)
    if not isinstance(restarts, int) or restarts < 0:
        problems.append(f"spec.failurePolicy.maxRestarts: must be an int >= 0, got {restarts!r}")
    jobs = spec.get("replicatedJobs")
    if not isinstance(jobs, list) or not jobs:
        problems.append("spec.replicatedJobs: must be a non-empty list")
        jobs = []
    for i, job in enumerate(jobs):
        where = f"spec.replicatedJobs[{i}]"
        if not isinstance(job, dict):
            problems.append(f"{where}: must be a mapping")
            continue
        problems += [f"{where}.{key}: unknown field of ReplicatedJob"
                     for key in sorted(set(job) - {"name", "replicas", "template",
                                                   "dependsOn", "groupName"})]
        if not isinstance(job.get("name"), str) or not job["name"]:
            problems.append(f"{where}.name: required")
        replicas = job.get("replicas", 1)
        if not isinstance(replicas, int) or isinstance(replicas, bool) or replicas < 1:
            problems.append(f"{where}.replicas: must be an int >= 1, got {replicas!r}")
        _check(job.get("template"), "V1JobTemplateSpec", f"{where}.template", problems)
    if problems:
        raise ManifestError(problems)
