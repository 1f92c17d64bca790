"""The learner process: continuous inner training against the artifact store (the data plane)."""
