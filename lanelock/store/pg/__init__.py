"""The PostgreSQL lane store: advisory locks and tables on one server, for several hosts.

- store.py     PgStore: the lane's advisory lock, the holder row, events and counts;
- line.py      its medium for the order (store/order.py): queue rows and ticket locks;
- queue.py     the queue's SQL: one query answers who is ahead and this turn's next step;
- session.py   the connection: autocommit, keepalives, the schema, a pooler detected;
- outage.py    a restart is an outage: the holder's claim, its retake, waiters reconnecting;
- lease.py     a lost link is not a restart: a watched holder's lease, renewed on the server;
- hostqueue.py waiters share their host's connection: a host's queue (flock) before the server's;
- seats.py     the medium for store/seating.py: the lane's rows, tries in one statement, the sleep.
"""
