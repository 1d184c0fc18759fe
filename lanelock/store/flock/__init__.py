"""The flock(2) lane store: everything here is about files under the lock root.

- store.py       FlockStore: the lane's lock taken, waited for, recorded and surveyed;
- handle.py, lock_file.py, taken.py   a turn's handle; opening the lock files (a planted one
                 refused); checking a lock just taken (a replaced file is two gates);
- seats.py, taking.py   the seats' files, and the medium for store/seating.py (the lane's own
                 lock, or any of its seats);
- line.py        its medium for the order (store/order.py): the queue's entries and kernel waits;
- queue.py       the queue directory, one locked file per waiting turn;
- waiting.py     a blocking flock with a timeout, without polling (a thread, an asyncio task);
- sidecar.py, journal.py, witness_file.py   the holder record, the events, the one witness;
- survey.py      what `status` sees (/proc/locks read once, where people inspect).
"""
