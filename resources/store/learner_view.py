"""What a learner process does with the store: the one place that answers "what may a learner
read and write?" in code (`access.py` holds the same rules as key predicates and IAM
conditions, which the store enforces on a bucket).

It writes only its own records: its heartbeat, its attempt records, its contributions, and its
checkpoints (under `checkpoint_uri`, by Orbax). It reads the control plane's records (config,
the OPEN round, STOP, capacity), the global fragments and their metadata, its own heartbeat
(to fence itself off a newer attempt) and its peers' (to pick a peer checkpoint to restore).
`ArtifactStore` provides all of it; the learner's code is typed against this view, and
`tests/test_architecture.py` checks it calls nothing else.
"""

from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from diloco_core.budget_forecast import BudgetForecast
from diloco_core.capacity import Capacity
from diloco_core.contribution import Contribution
from diloco_core.offer_manifest import OfferManifest
from diloco_core.round_records import Heartbeat, RoundOpen
from diloco_core.stored_merge import StoredMerge
from resources.store.global_versions import GlobalFragment


@runtime_checkable
class LearnerView(Protocol):
    experiment: str

    # ---- writes: its own records only ---------------------------------------------------------
    def put_contribution(self, c: Contribution, extra: Mapping[str, Any] | None = None
                         ) -> int: ...

    def put_heartbeat(self, learner: str, beat: Heartbeat | Mapping[str, Any],
                      if_generation: int | None = None) -> None: ...

    def put_attempt_record(self, learner: str, attempt: int,
                           record: Mapping[str, Any]) -> None: ...

    def checkpoint_uri(self, learner: str) -> str: ...

    # ---- reads ---------------------------------------------------------------------------------
    def get_config(self) -> dict | None: ...

    def latest_open_round(self) -> RoundOpen | None: ...

    def stop_requested(self) -> dict | None: ...

    def budget_forecast(self) -> BudgetForecast | None: ...

    def capacity(self, standby: Sequence[str] = ()) -> tuple[Capacity, int]: ...

    def current_version(self, fragment: int) -> int | None: ...

    def version_meta(self, fragment: int,
                     version: int | None = None) -> StoredMerge | None: ...

    def load_global(self, fragment: int, version: int | None = None,
                    outer_template: Any = None) -> GlobalFragment: ...

    def contribution_manifest(self, round_index: int,
                              learner: str) -> OfferManifest | None: ...

    def get_heartbeat(self, learner: str) -> Heartbeat | None: ...

    def read_heartbeat(self, learner: str) -> tuple[Heartbeat | None, str | None]: ...

    def heartbeat_generation(self, learner: str) -> tuple[Heartbeat | None, int]: ...
