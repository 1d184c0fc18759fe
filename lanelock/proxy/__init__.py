"""`lanelock proxy`: a loopback reverse proxy that takes the lane per generation request.

Long-lived HTTP clients (agent gateways, chat front ends, coding agents) talk to the proxy as their
base URL. Each generation request takes the same lane as `lanelock run` and Gate.turn() (same lock,
same store, same records) while the engine answers; a busy lane sends it to the fallback or answers
503. Needs `pip install 'lanelock[proxy]'` (aiohttp); nothing here is imported by `lanelock run`.

- routes.py   which requests hold the lane, and where a fallback may take them;
- relay.py    forwarding a request and streaming the answer back, byte for byte;
- app.py      the per-request decision: lane, linger, fallback chain, 503;
- serve.py    listening, security checks, signals and shutdown.
"""
