"""Learner compute per region: local subprocesses, or GKE TPU slices, behind one resource."""

from resources.compute.resource import LearnerCompute

__all__ = ["LearnerCompute"]
