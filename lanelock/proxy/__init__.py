"""`lanelock proxy`: a loopback reverse proxy that takes the lane per generation request.

Long-lived HTTP clients (agent gateways, chat front ends, coding agents) talk to the proxy as their
base URL. Each generation request takes the same lane as `lanelock run` and Gate.turn() (same lock,
same store, same records) while the engine answers; a busy lane sends it to the fallback or answers
503. Needs aiohttp (`pip install '.[proxy]'` in lanelock's checkout); nothing here is imported by
`lanelock run`.

- routes.py          which requests hold the lane;
- dialects.py        the API families: where session and model live, busy and error answers;
- proxied.py         one request's state, passed from step to step (what it asked, the lane's
                     answer, what was relayed);
- class_and_wait.py  a request's class and wait (its headers, capped; a malformed one is a 400);
- client_process.py  the process behind a client's connection (a request from inside a turn);
- socket_owner.py    which process holds a client's end of a connection (sockdiag.py: the
                     kernel's answer for its socket);
- relay.py           forwarding a request and streaming the answer back, byte for byte;
- spare.py           the next engine connection, opened ahead (a fresh one, not a reused one);
- fallbacks.py       the --fallback entries and their chain, for a busy lane or an engine that
                     does not answer;
- retry.py           Retry-After: when the lane likely comes to a busy request's place;
- linger.py          a held turn kept for the same session between its requests (one per
                     session, each on its seat);
- pinning.py         --pin-slots: a llama.cpp engine's slot is the request's seat (id_slot);
- finishing.py       a session's next request waits for its ending turn to let its seat go;
- lost.py            a held request whose lane the store takes away;
- per_lane.py        the lanes it serves (with lanes keyed by model, one per model a request
                     names), each with its gate, linger, Retry-After and fallback chain;
- request_model.py   where a request names its model, read as the engine reads it;
- engine_names.py    models as the engine names them (llama-swap's paths, Ollama's spellings);
- app.py             the routes' handlers: lane, linger, fallbacks, busy answer, 502;
- recording.py       a request forwarded on a free lane before its turn is recorded: the record
                     and journal (and its client's name) written once it has gone;
- traffic.py         the in-flight count and the -v line (middleware);
- listener.py        the listening socket: connections capped, slow and idle ones closed;
- logs.py            trouble said once per incident (aiohttp's and asyncio's lines too);
- serve.py           listening, security checks, the app, signals and shutdown;
- configured.py      its options from the settings table (proxy_OPTION in a config file);
- reload.py          SIGHUP: the config files read again, for the next request;
- clients.py         waits and classes per client ([[proxy_clients]]);
- own.py             its own routes: status (state.py), health (health.py), metrics, the page
                     (page.py and page/: HTML, script and style served by the proxy itself).
"""
