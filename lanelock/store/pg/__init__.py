"""The PostgreSQL lane store: advisory locks and tables on one server, for several hosts.

- store.py     PgStore: the lane's advisory lock taken, waited for, released and lost;
- handle.py    a turn's handle on a lane: its session, the lane's key, its fence, lease and seat;
- records.py   what a turn writes: the holder row and its fence, events, the lane's counts;
- survey.py    what status and a deflection read: pg_locks, the holder row, the queue;
- taken.py     is a lock just taken the lane's to use: our session, no claim, a killed turn;
- line.py      its medium for the order (store/order.py): queue rows and ticket locks;
- queue.py     the queue's SQL: one query answers who is ahead and this turn's next step;
- session.py   the connection: autocommit, keepalives, the schema, a pooler detected;
- outage.py    a restart is an outage: the holder's claim, its retake, waiters reconnecting;
- lease.py     a lost link is not a restart: a watched holder's lease, renewed on the server;
- hostqueue.py waiters share their host's connection: a host's queue (flock) before the server's;
- seats.py     the medium for store/seating.py: the lane's own lock, or its seats' rows, tries in
               one statement, the sleep;
- kept.py      values kept with the lanes (lanelock_kept): one value every host reads;
- witness_lock.py  the lane's one witness across every host: a session advisory lock.
"""
