"""Looking at lanes without taking them: judge.py turns any store's facts into one verdict,
status.py gathers them, history.py reads the events, render.py prints both views."""
