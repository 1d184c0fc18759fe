"""Connecting to the PostgreSQL lane store: the session every lanelock connection gets, and the
tables, set up once per database without racing.

- The server's keepalives, not only libpq's: libpq's parameters let the *client* notice a dead
  link; the *server* keeps the session -- and the advisory lock -- until its own socket gives up,
  hours with the defaults. tcp_keepalives_idle/interval/count and tcp_user_timeout
  are set per session through the connection's options.
- Concurrent CREATE TABLE IF NOT EXISTS is not safe (a unique violation on
  pg_type_typname_nsp_index): the first turns on a fresh database serialise the setup
  behind a transaction-level advisory lock, and once the tables exist nobody takes it. A column
  added later (the holders' generation) is added the same way: a database made by an earlier
  lanelock upgrades under that lock at its first turn, and once it has the column nobody takes it.
"""

from __future__ import annotations

import os

from ...errors import GateUnavailable, ServerCrowded

NAMESPACE = 0x4C4E4C4B
SCHEMA_LOCK = NAMESPACE << 32   # one-bigint advisory key space: never a lane's two-int key
CONNECT_TIMEOUT = 2
CLIENT_KEEPALIVES = {"keepalives": 1, "keepalives_idle": 5, "keepalives_interval": 2,
                     "keepalives_count": 3, "tcp_user_timeout": 10000}
SERVER_KEEPALIVES = {"tcp_keepalives_idle": 5, "tcp_keepalives_interval": 2,
                     "tcp_keepalives_count": 3, "tcp_user_timeout": 10000}
CLIENT_CHECK_MS = 1000   # how soon a waiting backend notices its client is gone
BOUND_SECONDS = SERVER_KEEPALIVES["tcp_keepalives_idle"] + \
    SERVER_KEEPALIVES["tcp_keepalives_interval"] * SERVER_KEEPALIVES["tcp_keepalives_count"]
BOUND = (f"a holder's lane frees when its session ends; a holder whose host vanishes loses it "
         f"within about {BOUND_SECONDS} s (server keepalives: idle "
         f"{SERVER_KEEPALIVES['tcp_keepalives_idle']} s, then "
         f"{SERVER_KEEPALIVES['tcp_keepalives_count']} probes "
         f"{SERVER_KEEPALIVES['tcp_keepalives_interval']} s apart)")
SCHEMA_SQL = """
CREATE TABLE IF NOT EXISTS lanelock_holders (
    key2 integer PRIMARY KEY, lane text NOT NULL, record jsonb NOT NULL,
    backend_pid integer NOT NULL, updated_at timestamptz NOT NULL DEFAULT now());
ALTER TABLE lanelock_holders ADD COLUMN IF NOT EXISTS generation bigint NOT NULL DEFAULT 0;
CREATE TABLE IF NOT EXISTS lanelock_events (
    id bigserial PRIMARY KEY, lane text NOT NULL, ts double precision NOT NULL, event jsonb NOT NULL);
CREATE INDEX IF NOT EXISTS lanelock_events_lane_ts ON lanelock_events (lane, ts);
CREATE TABLE IF NOT EXISTS lanelock_counts (lane text PRIMARY KEY, counts jsonb NOT NULL);
CREATE TABLE IF NOT EXISTS lanelock_queue (
    ticket bigserial PRIMARY KEY, lane text NOT NULL, rank integer NOT NULL,
    arrival timestamptz NOT NULL DEFAULT clock_timestamp(), facts jsonb NOT NULL);
CREATE INDEX IF NOT EXISTS lanelock_queue_lane ON lanelock_queue (lane);
CREATE TABLE IF NOT EXISTS lanelock_kept (name text PRIMARY KEY, value jsonb NOT NULL);
"""
# A connection refused for load, not for absence: 53300 too_many_connections
# ("sorry, too many clients already", "remaining connection slots are reserved ...", "too many
# connections for role"), 53400 configuration_limit_exceeded, and pgbouncer's "no more
# connections allowed". libpq gives a refused connection no SQLSTATE, only the server's words,
# so the words are matched too. Not 57P03 cannot_connect_now (starting up, shutting down): that
# is an outage, and its turns fail open as for a server that cannot be reached.
CROWDED_STATES = frozenset({"53300", "53400"})
CROWDED_WORDS = ("too many clients", "too many connections", "connection slots are reserved",
                 "no more connections allowed")
MISSING_DRIVER = ("the PostgreSQL store needs psycopg: pip install '.[postgres]' in lanelock's "
                  "checkout (or pip install 'psycopg[binary]')")


def driver():
    try:
        import psycopg
    except ImportError:
        raise GateUnavailable(MISSING_DRIVER) from None
    return psycopg


def redact(dsn: str) -> str:
    """The DSN without its password, for messages and `where`."""
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(dsn)
    if parts.password is None:
        return dsn
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@")
    return urlunsplit(parts._replace(netloc=netloc))


def connect(dsn: str, application_name: str):
    """An autocommit connection with lanelock's session settings. GateUnavailable when the
    server cannot be reached within the connect timeout."""
    psycopg = driver()
    from psycopg.conninfo import conninfo_to_dict

    try:
        given = conninfo_to_dict(dsn).get("options") or ""
    except psycopg.Error:
        given = ""
    server = " ".join(f"-c {name}={value}" for name, value in SERVER_KEEPALIVES.items())
    # Read committed whatever the database's default: statements sent together (handoff.py)
    # each take a snapshot of their own as they start, so each reads what the one before did.
    server += " -c default_transaction_isolation=read\\ committed"
    try:
        conn = psycopg.connect(dsn, autocommit=True, connect_timeout=CONNECT_TIMEOUT,
                               application_name=application_name[:63],
                               options=f"{given} {server}".strip(), **CLIENT_KEEPALIVES)
    except psycopg.Error as error:
        if refused_for_load(error):
            raise ServerCrowded(f"the lane store {redact(dsn)} is crowded: "
                                f"{first_line(error)}") from None
        raise GateUnavailable(f"cannot reach the lane store {redact(dsn)}: "
                              f"{first_line(error)}") from None
    try:
        # A backend blocked in a lock wait (a queued turn) does not read its socket: without
        # this check (PostgreSQL 14+) a waiter killed with kill -9 stays queued, its lock held,
        # until the wait ends. Older servers refuse the name: they keep today's behaviour.
        conn.execute(f"SET client_connection_check_interval = {CLIENT_CHECK_MS}")
    except psycopg.Error:
        pass
    return conn


def refused_for_load(error) -> bool:
    """Did the server refuse the connection because its slots are taken (crowded, not broken)?"""
    if getattr(error, "sqlstate", None) in CROWDED_STATES:
        return True
    text = str(error)
    return any(words in text for words in CROWDED_WORDS)


# The holders' generation column, asked with the tables (ensure_schema).
_FENCED = ("EXISTS (SELECT 1 FROM pg_attribute WHERE attrelid = to_regclass('lanelock_holders') "
           "AND attname = 'generation' AND NOT attisdropped)")
NOT_FENCED = ("lanelock_holders has no generation column and this role may not add it: turns "
              "here have no fence until a turn of the table's owner adds it")


def ensure_schema(conn) -> str | None:
    """The tables exist afterwards, or the reason they could not be made (never raises). Tables
    of an earlier lanelock that this role does not own are left as they are (an ALTER would fail,
    an ERROR line in the server's log at every turn): their database is remembered as not
    fenced (fenced()). The table of kept values is made by any role that may create one; a
    database where this role can read it is remembered (keeps())."""
    psycopg = driver()
    try:
        with conn.cursor() as cursor:
            cursor.execute("SELECT to_regclass('lanelock_holders') IS NOT NULL AND "
                           "to_regclass('lanelock_events') IS NOT NULL AND "
                           "to_regclass('lanelock_counts') IS NOT NULL AND "
                           f"to_regclass('lanelock_queue') IS NOT NULL, {_FENCED}, "
                           "pg_has_role((SELECT relowner FROM pg_class WHERE oid = "
                           "to_regclass('lanelock_holders')), 'USAGE'), "
                           # lanelock_kept: None missing, False there but not readable
                           "CASE WHEN to_regclass('lanelock_kept') IS NOT NULL THEN "
                           "has_table_privilege('lanelock_kept', 'SELECT') END, "
                           "has_schema_privilege(current_schema(), 'CREATE')")
            tables, fenced, owner, kept, create = cursor.fetchone()
            if tables and (fenced or not owner):   # the tables stand (another's are left so)
                if kept is None and create:   # a table of its own: any role that may create
                    with conn.transaction():
                        cursor.execute("SELECT pg_advisory_xact_lock(%s)", (SCHEMA_LOCK,))
                        cursor.execute(_KEPT_SQL)
                    kept = True
                if kept:
                    _KEPT.add(_database(conn))
                return None if fenced else _not_fenced(conn)
            with conn.transaction():
                cursor.execute("SELECT pg_advisory_xact_lock(%s)", (SCHEMA_LOCK,))
                cursor.execute(SCHEMA_SQL)
            if kept is not False:
                _KEPT.add(_database(conn))
        return None
    except psycopg.Error as error:
        return f"lane store tables: {first_line(error)}"


_NOT_FENCED: set = set()   # databases whose tables ensure_schema found without the column
# Databases where ensure_schema found (or made) lanelock_kept: the values kept with the lanes (a
# lane's seat count) are read in statements a turn runs anyway, never in one that would fail
# (an ERROR line in the server's log) on a database without the table.
_KEPT: set = set()
_KEPT_SQL = ("CREATE TABLE IF NOT EXISTS lanelock_kept (name text PRIMARY KEY, "
             "value jsonb NOT NULL)")
NOT_KEPT = ("the lane store has no lanelock_kept table and this role may not create it: "
            "nothing is kept with the lanes (every lane one seat) until a turn of a role that "
            "may runs")


def _database(conn) -> tuple:
    info = conn.info
    return (info.host, info.port, info.dbname, info.user)


def _not_fenced(conn) -> str:
    _NOT_FENCED.add(_database(conn))
    return NOT_FENCED


def keeps(conn) -> bool:
    """Does this connection's database have the table of kept values (ensure_schema saw it)?"""
    return _database(conn) in _KEPT


def fenced(conn) -> bool:
    """May this connection's turns count a fence (write the generation column)?"""
    return _database(conn) not in _NOT_FENCED


def ended(conn) -> bool:
    """Has the connection's session ended (the server closed it, a restart, a broken link)?"""
    try:
        return bool(conn.closed or conn.broken)
    except Exception:  # noqa: BLE001 - psycopg internals: a connection we cannot ask is gone
        return True


def first_line(error: Exception) -> str:
    text = str(error).strip() or type(error).__name__
    return text.splitlines()[0][:300]


def timed_out(fd: int | None) -> bool:
    """Did the session's socket fail because the link gave up (ETIMEDOUT: keepalives or
    tcp_user_timeout; no route or network on the way), rather than being closed by the server?"""
    import errno
    import socket

    given_up = (errno.ETIMEDOUT, errno.EHOSTUNREACH, errno.ENETUNREACH, errno.EHOSTDOWN,
                errno.ENETDOWN)

    if fd is None:
        return False
    try:
        sock = socket.socket(fileno=os.dup(fd))
    except OSError:
        return False
    try:
        return sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) in given_up
    except OSError:
        return False
    finally:
        sock.close()


def socket_of(conn) -> int | None:
    try:
        return conn.pgconn.socket
    except Exception:  # psycopg internals: without the socket we only cannot watch for loss
        return None
