"""The artifact store: everything learners and the syncer exchange, on a local directory or GCS."""
