"""The syncer killed by hand, measured: from `kill -9` to the next published round.

Runs `diloco demo` (its own process group, its own workdir) and, once the syncer service has
merged a few rounds, SIGKILLs the process that holds the syncer's lease, as an operator would;
waits until rounds are published again and a live syncer holds the lease, lets it merge a few
rounds, and kills it again (`--kills` times). Then it stops the demo (SIGINT to its group, the
demo's own Ctrl-C path) and reads the Dagster instance for the syncer runs' timestamps.

Per kill it reports, in seconds after the kill:

- `run_failed`: the killed syncer's Dagster run ended (Pipes saw its process die);
- `relaunch_requested`: the supervisor sensor created the next syncer run;
- `run_started`: the run worker started that run (dequeue and launch);
- `process_started`: the new syncer process appeared (`pipelines.syncer.entry`);
- `lease_taken`: a new holder wrote the lease (a new epoch);
- `first_publish`: the first global version published after the kill, and by whom
  (`syncer-a<n>`: a syncer, `syncer-a<n>-standby` its standby; `run`: a merge run of the
  quorum sensor's fallback);
- for that version's round (from its decision record): `round_opened`, `round_quorum` (K
  offers in) and `round_decided`, and `quorum_to_publish`: what the failover added to the
  round beyond its own cadence (a live syncer publishes about 0.7 s after quorum; rounds
  come every few seconds, so kill -> next publish also holds up to a round's wait for offers).

    python benchmarks/syncer_failover.py                       # 3 kills, ~6 min on 2 cores
    DILOCO_SYNCER_STANDBY=0 python benchmarks/syncer_failover.py --no-standby   # without one
    python benchmarks/syncer_failover.py --kills 5 --set model.preset=tiny
"""

import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "benchmarks" / "results" / "syncer_failover.json"
sys.path.insert(0, str(REPO))


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True).stdout.strip()


def _syncer_pids() -> dict[int, float]:
    """pid -> start time (seconds since the epoch) of every `pipelines.syncer.entry` process."""
    found = {}
    boot = next(float(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                if line.startswith("btime"))
    ticks = os.sysconf("SC_CLK_TCK")
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ")
            if b"pipelines.syncer.entry" not in cmd:
                continue
            stat = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            found[int(entry)] = boot + int(stat[19]) / ticks
        except OSError:
            continue
    return found


def _standby_ready(syncer_pid: int) -> bool:
    """Whether the syncer `syncer_pid` has a warm standby standing by: a
    `pipelines.syncer.entry --standby-for <pid>` process whose main thread is blocked reading
    its stdin (the pipe from the syncer), i.e. past its compilation."""
    for pid in _syncer_pids():
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            if f"{syncer_pid}".encode() not in cmd or b"--standby-for" not in cmd:
                continue
            syscall = Path(f"/proc/{pid}/syscall").read_text().split()
        except OSError:
            continue
        if syscall[:2] == ["0", "0x0"]:       # read(0, ...)
            return True
    return False


def _published(store, fragments: int) -> dict[tuple[int, int], object]:
    """(fragment, version) -> the version's metadata, for every current version."""
    out = {}
    for p in range(fragments):
        v = store.current_version(p)
        if v:
            meta = store.version_meta(p, v)
            if meta is not None:
                out[(p, v)] = meta
    return out


def run(args) -> dict:
    from pipelines.run_address import AddressError, choose_experiment
    from resources.store.backends import open_blob_store
    from resources.store.lease_record import LeaseRecord

    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="syncer-failover-"))
    cmd = [sys.executable, "-m", "pipelines.commands.cli", "demo", "--workdir", str(workdir)]
    for override in args.set:
        cmd += ["--set", override]
    log = open(workdir.parent / f"{workdir.name}.log", "w")  # noqa: SIM115 - the demo's log
    started, load = time.time(), os.getloadavg()[0]
    demo = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    kills: list[dict] = []
    try:
        store_dir = workdir / "store"
        while not (store_dir.exists() and any(store_dir.iterdir())):
            time.sleep(1)
            if demo.poll() is not None:
                raise RuntimeError("the demo ended before its store appeared")
        blobs = open_blob_store(str(store_dir))
        store = None
        while store is None:
            if demo.poll() is not None:
                raise RuntimeError("the demo ended before its experiment had a config")
            try:
                store = choose_experiment(blobs, str(store_dir), None)
            except AddressError:
                time.sleep(1)
        fragments = int(store.get_config()["sync"]["num_fragments"])
        while len(kills) < args.kills:
            if demo.poll() is not None:
                raise RuntimeError("the demo ended before every kill was made")
            lease = store.get_syncer_lease() or LeaseRecord()
            merged_by_holder = [m for m in _published(store, fragments).values()
                                if m.merged_by.startswith(f"syncer-a{lease.attempt}")]
            if (lease.status != "syncing" or lease.pid is None
                    or len(merged_by_holder) < min(args.settle_merges, fragments)
                    or (args.standby and not _standby_ready(lease.pid))):
                time.sleep(0.5)
                continue
            before = _published(store, fragments)
            known = set(_syncer_pids())
            kill_at = time.time()
            try:
                os.kill(lease.pid, signal.SIGKILL)
            except ProcessLookupError:
                continue
            print(f"killed the syncer (attempt {lease.attempt}, pid {lease.pid})", flush=True)
            record = {"attempt": lease.attempt, "pid": lease.pid, "at": kill_at,
                      "epoch": lease.epoch}
            deadline = kill_at + args.wait
            while time.time() < deadline:
                now = time.time()
                if "process_started" not in record:
                    new = {pid: t for pid, t in _syncer_pids().items() if pid not in known}
                    if new:
                        record["process_started"] = round(min(new.values()) - kill_at, 2)
                current = store.get_syncer_lease() or LeaseRecord()
                if "lease_taken" not in record and current.epoch != lease.epoch:
                    record["lease_taken"] = round(now - kill_at, 2)
                    record["new_attempt"] = current.attempt
                if "first_publish" not in record:
                    fresh = [(m.published_at or now, m.merged_by, m.round)
                             for key, m in _published(store, fragments).items()
                             if key not in before]
                    if fresh:
                        when, by, rnd = min(fresh, key=lambda f: f[0])
                        record.update(first_publish=round(when - kill_at, 2),
                                      first_publish_by=by, first_publish_round=rnd)
                if "lease_taken" in record and "first_publish" in record:
                    break
                time.sleep(0.1)
            kills.append(record)
            print(json.dumps(record), flush=True)
    finally:
        if demo.poll() is None:
            os.killpg(demo.pid, signal.SIGINT)
            try:
                demo.wait(timeout=120)
            except subprocess.TimeoutExpired:
                os.killpg(demo.pid, signal.SIGKILL)
                demo.wait()
        log.close()
    add_round_times(store, kills)
    _add_run_times(workdir / "dagster_home", kills)
    return {"workdir": str(workdir), "wall_seconds": round(time.time() - started, 1),
            "load_average_at_start": round(load, 1), "kills": kills}


def _add_run_times(home: Path, kills: list[dict]) -> None:
    """The syncer runs' create/start/end times from the demo's Dagster instance."""
    os.environ["DAGSTER_HOME"] = str(home)
    import dagster as dg

    with dg.DagsterInstance.get() as instance:
        records = instance.get_run_records(filters=dg.RunsFilter(job_name="syncer"))
        runs = []
        for rec in records:
            attempt = (rec.dagster_run.run_config.get("ops", {}).get("run_syncer", {})
                       .get("config", {}).get("attempt"))
            runs.append({"attempt": attempt, "created": rec.create_timestamp.timestamp(),
                         "started": rec.start_time, "ended": rec.end_time})
    for kill in kills:
        at = kill["at"]
        killed = next((r for r in runs if r["attempt"] == kill["attempt"]), None)
        after = sorted((r for r in runs if r["created"] > at), key=lambda r: r["created"])
        if killed and killed["ended"]:
            kill["run_failed"] = round(killed["ended"] - at, 2)
        if after:
            kill["relaunch_requested"] = round(after[0]["created"] - at, 2)
            if after[0]["started"]:
                kill["run_started"] = round(after[0]["started"] - at, 2)


def add_round_times(store, kills: list[dict]) -> None:
    """For each kill, the first published round's open, quorum and decision times (seconds
    after the kill) and its quorum -> published, from the store's decision records."""
    for kill in kills:
        if not isinstance(kill.get("first_publish_round"), int):
            continue
        decision = store.get_decision(kill["first_publish_round"])
        if decision is None:
            continue
        at, published = kill["at"], kill["at"] + kill["first_publish"]
        kill["round_opened"] = round(decision.opened_at - at, 2)
        kill["round_quorum"] = round(decision.quorum_at - at, 2)
        kill["round_decided"] = round(decision.decided_at - at, 2)
        kill["quorum_to_publish"] = round(published - decision.quorum_at, 2)
        kill["round_decided_by"] = decision.decided_by


def summarize(kills: list[dict]) -> dict:
    out = {}
    for key in ("run_failed", "relaunch_requested", "run_started", "process_started",
                "lease_taken", "first_publish", "quorum_to_publish"):
        values = [k[key] for k in kills if isinstance(k.get(key), int | float)]
        if values:
            out[key] = {"median": round(statistics.median(values), 2),
                        "min": min(values), "max": max(values), "n": len(values)}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=3)
    parser.add_argument("--set", action="append", default=[],
                        help="a config override for the demo (repeatable)")
    parser.add_argument("--settle-merges", type=int, default=3,
                        help="rounds the new syncer merges before the next kill")
    parser.add_argument("--wait", type=float, default=90.0,
                        help="give up on one kill's recovery after this many seconds")
    parser.add_argument("--workdir", help="the demo's workdir (default: a new temporary one)")
    parser.add_argument("--standby", action=argparse.BooleanOptionalAction, default=True,
                        help="kill only once the syncer's warm standby stands by (off for a "
                             "run with DILOCO_SYNCER_STANDBY=0 or code without a standby)")
    parser.add_argument("--label", default="", help="a note stored with the result")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()
    result = run(args)
    entry = {
        "commit": _git("rev-parse", "--short", "HEAD"),
        "dirty": bool(_git("status", "--porcelain", "--untracked-files=no")),
        "command": "python benchmarks/syncer_failover.py " + " ".join(sys.argv[1:]),
        "label": args.label,
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                    "shared": "yes: other engineers' test runs and a soak benchmark ran "
                              "beside it (see load_average_at_start)"},
        "summary": summarize(result["kills"]), **result}
    previous = json.loads(args.out.read_text()) if args.out.exists() else {"runs": []}
    previous.setdefault("runs", []).append(entry)
    args.out.write_text(json.dumps(previous, indent=1) + "\n")
    print(json.dumps(entry["summary"], indent=1))


if __name__ == "__main__":
    main()
