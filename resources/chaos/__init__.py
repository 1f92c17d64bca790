"""Chaos tooling: the fault tape's injectors and the hostile learner's records, selected by
the chaos harness (a chaos run's fault tape; the hostile soak)."""
