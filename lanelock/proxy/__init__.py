"""`lanelock proxy`: a loopback reverse proxy that takes the lane per generation request.

Long-lived HTTP clients (agent gateways, chat front ends, coding agents) talk to the proxy as their
base URL. Each generation request takes the same lane as `lanelock run` and Gate.turn() (same lock,
same store, same records) while the engine answers; a busy lane sends it to the fallback or answers
503. Needs `pip install 'lanelock[proxy]'` (aiohttp); nothing here is imported by `lanelock run`.

- routes.py   which requests hold the lane, and where a fallback may take them;
- dialects.py the API families: where session and model live, busy and error answers;
- asks.py     a request's class and wait (its headers, capped; a malformed one is a 400);
- peer.py     the client process behind a connection (a request from inside a turn);
- relay.py    forwarding a request and streaming the answer back, byte for byte;
- chain.py    the fallback chain, for a busy lane or an engine that does not answer;
- retry.py    Retry-After: when the lane likely comes to a busy request's place;
- app.py      the per-request decision: lane, linger, chain, busy answer, 502;
- serve.py    listening, security checks, signals and shutdown.
"""
