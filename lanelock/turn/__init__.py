"""A turn's parts, each with one reason to change (the Turn itself, its states and public face,
is lanelock.gate's): the acquisition's steps both drivers follow (acquisition.py), the record and
journal a turn leaves (record.py), same-process nesting (nesting.py), and the named steps where a
process can be asked to stop (stops.py)."""
