"""A real PostgreSQL server on loopback, from the distribution's server binaries (Debian's
`postgresql` package: /usr/lib/postgresql/<version>/bin), started and stopped by tests.

`postgres_server()` runs `initdb` into a fresh temporary directory, starts the server with
`pg_ctl` on a free 127.0.0.1 port (its unix socket inside that directory, so it never touches
/var/run/postgresql or a system cluster), creates one database and yields its
`postgresql://` URL; on exit it stops the server (`pg_ctl stop -m fast`) and removes the
directory. PostgreSQL refuses to run as root, so under euid 0 the server commands run as the
`postgres` system user that the package creates (`runuser -u postgres --`), in a directory
owned by it. Authentication is `trust` on loopback only: this is a throwaway test server.
"""

import glob
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

SUPERUSER = "postgres"  # the database superuser initdb creates (-U)
SYSTEM_USER = "postgres"  # the OS account to run the server as when we are root


class PostgresUnavailable(RuntimeError):
    """No PostgreSQL server binaries on this machine, or no way to run them."""


def _version_key(path: str) -> tuple:
    return tuple(int(p) if p.isdigit() else 0 for p in re.split(r"[./]", path) if p)


def find_bin_dir() -> Path:
    """The newest /usr/lib/postgresql/*/bin with initdb and pg_ctl; else a PATH that has
    both (other distributions); else PostgresUnavailable."""
    found = [d for d in glob.glob("/usr/lib/postgresql/*/bin")
             if os.access(os.path.join(d, "initdb"), os.X_OK)
             and os.access(os.path.join(d, "pg_ctl"), os.X_OK)]
    if found:
        return Path(max(found, key=_version_key))
    initdb, pg_ctl = shutil.which("initdb"), shutil.which("pg_ctl")
    if initdb and pg_ctl and Path(initdb).parent == Path(pg_ctl).parent:
        return Path(initdb).parent
    raise PostgresUnavailable(
        "no PostgreSQL server binaries (initdb, pg_ctl) in /usr/lib/postgresql/*/bin or on "
        "PATH; install them with `apt-get install postgresql` (Debian/Ubuntu)")


def _as_server_user() -> list[str]:
    if os.geteuid() != 0:
        return []
    runuser = shutil.which("runuser")
    if runuser is None:
        raise PostgresUnavailable("running as root, and no `runuser` to run PostgreSQL as "
                                  f"the {SYSTEM_USER!r} user")
    try:
        import pwd

        pwd.getpwnam(SYSTEM_USER)
    except KeyError:
        raise PostgresUnavailable(f"running as root, and no {SYSTEM_USER!r} system user to "
                                  "run PostgreSQL as (the postgresql package creates it)"
                                  ) from None
    return [runuser, "-u", SYSTEM_USER, "--"]


def check_available() -> Path:
    """The server binaries' directory, if this machine can run a server; else
    PostgresUnavailable saying why."""
    bin_dir = find_bin_dir()
    _as_server_user()
    return bin_dir


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _run(argv: list[str], cwd: Path, timeout: float = 120) -> None:
    result = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=timeout,
                            stdin=subprocess.DEVNULL)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} exited with {result.returncode}:\n"
                           f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}")


def create_database(url: str, name: str) -> str:
    """Create database `name` on the server at `url` (a superuser URL); return its URL."""
    import psycopg2

    connection = psycopg2.connect(url)
    try:
        connection.autocommit = True  # CREATE DATABASE cannot run in a transaction
        with connection.cursor() as cursor:
            cursor.execute(f'CREATE DATABASE "{name}"')
    finally:
        connection.close()
    return url.rsplit("/", 1)[0] + f"/{name}"


@contextmanager
def postgres_server(database: str = "diloco") -> Iterator[str]:
    """Start a throwaway PostgreSQL server; yield the URL of a fresh database on it."""
    bin_dir = check_available()
    prefix = _as_server_user()
    root = Path(tempfile.mkdtemp(prefix="diloco-pg-"))
    data, sockets, log = root / "data", root / "run", root / "server.log"
    pg_ctl = [*prefix, str(bin_dir / "pg_ctl"), "-D", str(data)]
    started = False
    try:
        sockets.mkdir()
        if prefix:
            shutil.chown(root, SYSTEM_USER, SYSTEM_USER)
            shutil.chown(sockets, SYSTEM_USER, SYSTEM_USER)
        _run([*prefix, str(bin_dir / "initdb"), "-D", str(data), "-U", SUPERUSER,
              "-A", "trust", "-E", "UTF8", "--locale=C", "--no-sync"], cwd=root)
        for attempt in range(3):  # the free port may be taken before the server binds it
            port = _free_port()
            options = (f"-c listen_addresses=127.0.0.1 -p {port} -k {sockets} -F "
                       "-c max_connections=200 -c shared_buffers=32MB")
            try:
                _run([*pg_ctl, "-l", str(log), "-o", options, "-w", "-t", "60", "start"],
                     cwd=root)
            except RuntimeError as err:
                server_log = log.read_text(errors="replace")[-2000:] if log.exists() else ""
                if attempt == 2 or "could not bind" not in server_log:
                    raise RuntimeError(f"{err}\nserver log:\n{server_log}") from None
                continue
            started = True
            break
        url = create_database(f"postgresql://{SUPERUSER}@127.0.0.1:{port}/postgres", database)
        yield url
    finally:
        if started:
            _stop(pg_ctl, data, root)
        shutil.rmtree(root, ignore_errors=True)


def _stop(pg_ctl: list[str], data: Path, root: Path) -> None:
    """`pg_ctl stop -m fast` (disconnects clients, shuts down cleanly); if that fails, SIGKILL
    the postmaster named in postmaster.pid (this server's own, never any other)."""
    try:
        _run([*pg_ctl, "-m", "fast", "-w", "-t", "60", "stop"], cwd=root, timeout=90)
        return
    except (RuntimeError, subprocess.TimeoutExpired):
        pass
    pid_file = data / "postmaster.pid"
    if pid_file.exists():
        pid = int(pid_file.read_text().split()[0])
        with suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def fresh_database_name() -> str:
    return f"diloco_{uuid.uuid4().hex[:12]}"


def materialize_one_run(instance) -> str:
    """Materialize a one-line asset on `instance` and return its (successful) run's id: the
    smallest real run to find again in an instance's storage."""
    import dagster as dg

    @dg.asset
    def one() -> int:
        return 1

    result = dg.materialize([one], instance=instance)
    assert result.success
    return result.run_id
