"""The syncer: its service process, the round-control driver it shares with the quorum
sensor, the merge from the store, its status and its trace."""
