"""How many generations an engine serves at once, by its own account: the seat count it asks for.

The same rules as engine.py's witness: plain GETs of account endpoints only, each within
engine.TIMEOUT and engine.MAX_BYTES, no redirect followed, never `/upstream/MODEL/...` for a model
llama-swap does not list as running (that would load it), never a generation.

What each kind answers (asked in this order, by what answers):
  llama-swap  GET /running, then the running model's GET /upstream/MODEL/props (total_slots),
              else its /upstream/MODEL/slots (one object per slot). No model running: cannot
              tell (its slots are the model's, and asking would load one); several running:
              the model must be named.
  llama.cpp   GET /props: total_slots (the --parallel it resolved, auto included); a build
              without it: GET /slots, one object per slot (501 with --no-slots).
  vLLM        max_num_seqs is a scheduler setting, not on /metrics (vllm:cache_config_info
              carries the KV cache's settings only); GET /server_info?config_format=json gives
              vllm_config.scheduler_config.max_num_seqs, and vLLM serves that route only with
              VLLM_SERVER_DEV_MODE=1 (entrypoints/serve/instrumentator/__init__.py). Otherwise:
              cannot tell. (Its default, 256 or more, is a batch size, not a GPU's sweet spot.)
  SGLang      GET /server_info (older builds, and a deprecated alias since: /get_server_info;
              entrypoints/http_server.py, 0.5.23): the server arguments, max_running_requests
              among them (null when it was not given and the build does not report the value it
              chose: cannot tell). It asks the scheduler for its internal state: no generation.
  Ollama      cannot tell: OLLAMA_NUM_PARALLEL lives in the server's environment; /api/ps lists
              the loaded models (context_length, size_vram), nothing about parallel requests.
"""

from __future__ import annotations

import json

from lanelock import engine as engine_account

MAX_SLOTS = 4096     # more than this is not a slot count an engine means


class CannotTell(Exception):
    """The engine does not say how many generations it serves at once; str() says why, kind is
    the engine's kind where it was recognised."""

    def __init__(self, reason: str, kind: str | None = None):
        super().__init__(reason)
        self.kind = kind


def slot_count(url: str, timeout: float = engine_account.TIMEOUT, model: str | None = None) -> int:
    """The number of generations the engine at url (scheme://HOST:PORT) serves at once, from its
    own account; model: which of llama-swap's running models (needed when several run).
    Raises CannotTell (down, a kind that does not say, an odd answer)."""
    return slot_answer(url, timeout, model)[0]


def slot_answer(url: str, timeout: float = engine_account.TIMEOUT,
                model: str | None = None) -> tuple[int, str]:
    """slot_count and, in words, what answered it: the URL read and the kind of engine it
    says it is ("http://127.0.0.1:8080/props (llama.cpp): 3 slots"). Anything may answer on a
    port: the words let whoever sets a count from it see what it believed."""
    asker = _Asker(url, timeout)
    try:
        count = _ask(asker, model)
    except engine_account.Unreadable as error:
        raise CannotTell(str(error)) from None   # down, too slow, a redirect
    path = asker.answered
    if path.startswith("/upstream/"):
        kind = "llama-swap"
    elif path in ("/props", "/slots"):
        kind = "llama.cpp"
    else:
        kind = asker.kind or "an engine"
    return count, f"{asker.url}{path} ({kind}): {count} slot{'s' if count != 1 else ''}"


def auto_count(place) -> tuple[int, str]:
    """`lanelock seats auto`: the slot count of the engine a lane's backend names, as a seat
    count. GateUnavailable (exit 69), in one line, when the engine cannot tell or says more than
    a lane can seat; the lane's kept count is then left as it was. Returns the count and what
    answered (slot_answer's words), said before the count is set."""
    from .errors import GateUnavailable
    from .store.seating import MOST
    from .witness import engine_url

    lane = place.lane
    url = engine_url(lane)
    if url is None:
        raise GateUnavailable(f"cannot tell the seats of {lane.name} from its engine: it is on "
                              "another machine; set a count")
    try:
        count, answered = slot_answer(url, model=lane.model)
    except CannotTell as error:
        raise GateUnavailable(f"cannot tell the seats of {lane.name} from its engine: "
                              f"{error}") from None
    if count > MOST:
        raise GateUnavailable(f"the engine of {lane.name} serves {count} at once, more than the "
                              f"{MOST} seats a lane has; set a count")
    return count, answered


def _ask(asker: "_Asker", model: str | None) -> int:
    status, running = asker.json("/running")
    if status == 200 and isinstance(running, dict) and isinstance(running.get("running"), list):
        return _llama_swap(asker, running["running"], model)
    status, props = asker.json("/props")
    if status == 200:
        count = _count(props.get("total_slots") if isinstance(props, dict) else None)
        if count is not None:
            return count
    props_said = status == 200
    status, slots = asker.json("/slots")
    if status == 200:
        if isinstance(slots, list) and slots and all(isinstance(slot, dict) for slot in slots):
            return _bounded(len(slots), f"{asker.url}/slots")
        raise CannotTell(f"{asker.url}/slots answered JSON that is not a list of slots",
                         engine_account.LLAMA_CPP)
    if status == 501:
        raise CannotTell("llama.cpp: /props has no total_slots and /slots is disabled (501): "
                         "start llama-server without --no-slots", engine_account.LLAMA_CPP)
    if props_said:
        raise CannotTell(f"{asker.url}/props has no total_slots and /slots answered {status}",
                         engine_account.LLAMA_CPP)
    status, info = asker.json("/server_info?config_format=json")
    if status == 200 and isinstance(info, dict):
        return _server_info(asker, info)
    status, info = asker.json("/get_server_info")
    if status == 200 and isinstance(info, dict):
        return _server_info(asker, info)
    metrics = asker.text("/metrics")
    if metrics is not None and "vllm:" in metrics:
        raise CannotTell("vLLM says its max_num_seqs only at /server_info, which it serves with "
                         "VLLM_SERVER_DEV_MODE=1", engine_account.VLLM)
    if metrics is not None and "sglang:" in metrics:
        raise CannotTell("SGLang answers neither /server_info nor /get_server_info",
                         engine_account.SGLANG)
    status, models = asker.json("/api/ps")
    if status == 200 and isinstance(models, dict) and "models" in models:
        raise CannotTell("Ollama does not say how many requests it serves at once "
                         "(OLLAMA_NUM_PARALLEL is in its environment only)", engine_account.OLLAMA)
    raise CannotTell(f"{asker.url} answers none of /running, /props, /slots, /server_info, "
                     f"/api/ps: not an engine whose slot count lanelock can read (llama.cpp, "
                     f"llama-swap, SGLang)")


def _llama_swap(asker: "_Asker", running: list, model: str | None) -> int:
    from urllib.parse import quote

    ready = []
    for entry in running:
        name = (entry.get("model") or entry.get("name")) if isinstance(entry, dict) else None
        if not isinstance(name, str) or not name:
            raise CannotTell(f"{asker.url}/running lists something that is not a model: "
                             f"{json.dumps(entry)[:80]}", engine_account.LLAMA_SWAP)
        if entry.get("state", "ready") == "ready":   # one starting or stopping: asking could load
            ready.append(name)
    if model is None:
        if not ready:
            raise CannotTell("llama-swap runs no model now: the slots are the running model's "
                             "(asking one that is not running would load it)",
                             engine_account.LLAMA_SWAP)
        if len(ready) > 1:
            raise CannotTell(f"llama-swap runs {len(ready)} models ({', '.join(ready)[:200]}): "
                             f"name the model", engine_account.LLAMA_SWAP)
        model = ready[0]
    elif model not in ready:
        raise CannotTell(f"llama-swap does not run {model} now (asking it would load it)",
                         engine_account.LLAMA_SWAP)
    prefix = f"/upstream/{quote(model, safe='')}"
    status, props = asker.json(prefix + "/props")
    if status == 200 and isinstance(props, dict):
        count = _count(props.get("total_slots"))
        if count is not None:
            return count
    status, slots = asker.json(prefix + "/slots")
    if status == 200 and isinstance(slots, list) and slots \
            and all(isinstance(slot, dict) for slot in slots):
        return _bounded(len(slots), f"{asker.url}{prefix}/slots")
    raise CannotTell(f"llama-swap's {model} says no total_slots on /props and no slots on /slots",
                     engine_account.LLAMA_SWAP)


def _server_info(asker: "_Asker", info: dict) -> int:
    """vLLM's /server_info (dev mode) or SGLang's /server_info and /get_server_info."""
    config = info.get("vllm_config")
    if config is not None:
        scheduler = config.get("scheduler_config") if isinstance(config, dict) else None
        value = scheduler.get("max_num_seqs") if isinstance(scheduler, dict) else None
        count = _count(value)
        if count is None:
            raise CannotTell(f"vLLM's /server_info has no max_num_seqs a count can be read "
                             f"from ({json.dumps(value)[:40]})", engine_account.VLLM)
        asker.kind = "vLLM"
        return count
    for where in (info, *(value for value in info.values() if isinstance(value, dict))):
        if "max_running_requests" in where:
            value = where["max_running_requests"]
            count = _count(value)
            if count is None:
                raise CannotTell(f"SGLang's server info has max_running_requests "
                                 f"{json.dumps(value)[:40]} (start it with "
                                 f"--max-running-requests N)", engine_account.SGLANG)
            asker.kind = "SGLang"
            return count
    raise CannotTell(f"{asker.url} answers /server_info without max_num_seqs or "
                     f"max_running_requests")


def _said(body: bytes) -> str:
    """', MESSAGE' from an OpenAI-style error body, or nothing."""
    try:
        message = json.loads(body)["error"]["message"]
    except (ValueError, RecursionError, KeyError, TypeError):
        return ""
    return f", {' '.join(str(message).split())[:80]}" if message else ""


def _count(value) -> int | None:
    if isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= MAX_SLOTS:
        return value
    return None


def _bounded(count: int, where: str) -> int:
    if count > MAX_SLOTS:
        raise CannotTell(f"{where} lists {count} slots: not a count an engine means")
    return count


class _Asker:
    """GETs through engine.py's reader (timeouts, size cap, redirects refused)."""

    def __init__(self, url: str, timeout: float):
        self.engine = engine_account.Engine(url, timeout)
        self.url = self.engine.url
        self.kind: str | None = None   # said by a server-info answer (vLLM, SGLang)
        self.answered = ""   # the last path that answered 200 (what `seats auto` says it read)

    def json(self, path: str):
        status, body, _ = self.engine.get(path, named="")   # down: the engine is named, no path
        if status in (401, 403):    # every later question would be refused the same way
            raise CannotTell(f"{self.url} refuses lanelock's questions ({status} to "
                             f"{path.partition('?')[0]}): it wants an API key, and lanelock "
                             f"asks without one")
        if status == 503:           # as llama-server answers every path while it loads
            raise CannotTell(f"{self.url} is not ready (503 to {path.partition('?')[0]}"
                             f"{_said(body)}): try again once it is up")
        if status != 200:
            return status, None
        self.answered = path.partition("?")[0]
        if len(body) > engine_account.MAX_BYTES:
            raise CannotTell(f"{self.url}{path} answered more than {engine_account.MAX_BYTES} "
                             f"bytes")
        try:
            return status, json.loads(body)
        except (ValueError, RecursionError):
            raise CannotTell(f"{self.url}{path} answered something that is not JSON") from None

    def text(self, path: str) -> str | None:
        status, body, _ = self.engine.get(path, named="")
        return body[:engine_account.MAX_BYTES].decode("utf-8", "replace") if status == 200 \
            else None
