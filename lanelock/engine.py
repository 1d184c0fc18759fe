"""What the engine says it is computing: one look at its own account, for the witness and `status`.

Only requests that cost the engine nothing: plain GETs of its account endpoints,
never a generation, never a redirect followed, never `/upstream/MODEL/...` for a model llama-swap
does not list as running (that would LOAD it).

Kinds, and what each is asked (detected once, in this order, by what answers):
  llama-swap  GET /running (models loaded now), then GET /upstream/MODEL/slots of each running one
  llama.cpp   GET /slots: one object per slot, `is_processing` (older builds: `state`, `id_task`)
              and `next_token[0].n_decoded`; started with --no-slots it answers 501, and then
              GET /metrics (needs --metrics): llamacpp:requests_processing
  vLLM        GET /metrics: vllm:num_requests_running
  SGLang      GET /metrics: sglang:num_running_reqs
  Ollama      GET /api/ps lists loaded models, nothing about work in flight: cannot be witnessed

A finished task's tokens: llama.cpp's /slots (so llama-swap's too) names each slot's last task
after it ends (final_count); vLLM's and SGLang's /metrics count requests, not their tokens.
"""

from __future__ import annotations

import json

TIMEOUT = 1.0            # seconds one GET may take; a slower engine is "not answering"
MAX_BYTES = 1 << 20      # an account larger than this is not one

LLAMA_CPP, LLAMA_SWAP, VLLM, SGLANG, OLLAMA = "llama.cpp", "llama-swap", "vLLM", "SGLang", "Ollama"
# The gauge of requests running now, per kind that reports it on /metrics.
RUNNING_METRIC = {LLAMA_CPP: "llamacpp:requests_processing", VLLM: "vllm:num_requests_running",
                  SGLANG: "sglang:num_running_reqs"}


# What each way of reading the engine asks first, by the source it reads: the endpoint a witness
# names when the engine it saw before does not answer now.
ENDPOINTS = ("/running", "/slots", "/metrics")


class Unreadable(Exception):
    """The engine could not be asked or its answer not read (down, slow, garbage): for now."""


class CannotWitness(Exception):
    """The engine answers, but says nothing of work in flight (Ollama, slots disabled with no
    metrics): a witness has nothing to compare, and says so instead of guessing."""

    def __init__(self, reason: str, kind: str | None = None):
        super().__init__(reason)
        self.kind = kind


class Account:
    """One sample: how many requests the engine is computing now, of how many slots (None: it
    does not say), the tokens decoded by each task in flight (where it says), and each slot's
    account of the task it names, running or finished (llama.cpp's /slots: SlotTask). by_model:
    llama-swap's, each running model's own account ({} for an engine of one model)."""

    __slots__ = ("generating", "slots", "tasks", "named", "by_model")

    def __init__(self, generating: int, slots: int | None = None, tasks: dict | None = None,
                 named: dict | None = None, by_model: dict | None = None):
        self.generating, self.slots, self.tasks = generating, slots, tasks or {}
        self.named = named or {}
        self.by_model = by_model or {}


class SlotTask:
    """What a llama.cpp slot says of the task it names (the one it runs, or its last one):
    decoded (next_token n_decoded), context (n_prompt_tokens: the tokens in the slot's
    context), prompt (n_prompt_tokens_processed + n_prompt_tokens_cache: the task's prompt once
    processed) and remain (n_remain, -1: no limit); None where the build does not say."""

    __slots__ = ("busy", "decoded", "context", "prompt", "remain")

    def __init__(self, busy: bool, decoded: int | None, context: int | None,
                 prompt: int | None, remain: int | None):
        self.busy, self.decoded, self.context, self.remain = busy, decoded, context, remain
        self.prompt = prompt


def final_count(last: SlotTask, after: SlotTask | None) -> int | None:
    """The tokens a finished task decoded, from its slot's account once it ended (after: the
    slot, idle, still naming it), or None where the account cannot tell (the slot went on to
    another task, or the numbers disagree). last: the task's last sample while it generated.

    Builds before task_prev keep n_decoded after the release. Today's builds reset it to 0 but
    keep the task's tokens in the slot's context: its prompt, then every token generated but
    the last one sampled. So the final count is the context less the prompt, plus one
    (checked on a real llama-server: 128 of max_tokens 128; 42 and 19 ended by the model).
    The prompt is read while it generated (n_decoded >= 1: the prompt is processed); the
    release resets those counters too."""
    if after is None or after.busy or last.decoded is None:
        return None
    if after.context is None:
        count = after.decoded
    elif last.prompt is None or last.decoded < 1:
        return None
    else:
        count = after.context - last.prompt + 1
    if count is None or count < last.decoded:
        return None
    if last.remain is not None and last.remain >= 0 and count > last.decoded + last.remain:
        return None   # more than the task was allowed: the slot's context changed under it
    return count


def _opener():
    """No redirects followed (a witness asks the engine it was given, nowhere else) and no
    proxy from the environment (the engine is on this machine or its LAN)."""
    import urllib.request

    class Refuse(urllib.request.HTTPRedirectHandler):
        def redirect_request(self, req, fp, code, msg, headers, newurl):
            raise Unreadable(f"{req.full_url} redirects ({code}) to {newurl[:200]}: not followed")

    return urllib.request.build_opener(Refuse, urllib.request.ProxyHandler({}))


class Engine:
    """An engine at url (scheme://HOST:PORT). detect() finds its kind; sample() reads one Account.
    Both raise Unreadable (try again later) or CannotWitness (nothing to witness here)."""

    def __init__(self, url: str, timeout: float = TIMEOUT, known: str | None = None):
        self.url = url.rstrip("/")
        self.timeout = timeout
        self.kind: str | None = None
        self.source = ""       # what is read each sample, for people: "/slots", "/metrics"
        # The source a witness read here before (the lane's counts say it), or None: until the
        # kind is found again, an engine that does not answer is named by that endpoint --
        # never by the first one detection happens to try (/running is llama-swap's).
        self.known = known
        self._opener = _opener()

    def _named(self) -> str:
        """The endpoint named for an engine that does not answer before its kind is found."""
        endpoint = (self.source or self.known or "").partition(" ")[0]
        return endpoint if endpoint in ENDPOINTS else ""

    # -- one GET ---------------------------------------------------------------------------------
    def get(self, path: str, named: str | None = None) -> tuple[int, bytes, str]:
        """(status, body, content type) of GET url+path; Unreadable when nothing usable came.
        named: the path said when no answer comes at all (refused, reset, too slow)."""
        import socket
        import urllib.error

        where = self.url + (path if named is None else named)

        try:
            with self._opener.open(self.url + path, timeout=self.timeout) as response:
                return response.status, response.read(MAX_BYTES + 1), \
                    response.headers.get_content_type()
        except urllib.error.HTTPError as error:
            try:
                body = error.read(MAX_BYTES + 1)
            except (OSError, ValueError):
                body = b""
            finally:
                error.close()
            return error.code, body, error.headers.get_content_type() if error.headers else ""
        except Unreadable:
            raise
        except (socket.timeout, TimeoutError):
            raise Unreadable(f"{where} did not answer within {self.timeout:g} s") from None
        except urllib.error.URLError as error:
            reason = error.reason
            why = getattr(reason, "strerror", None) or str(reason)
            raise Unreadable(f"{where}: {why}") from None
        except (OSError, ValueError) as error:   # reset, bad status line, InvalidURL
            raise Unreadable(f"{where}: {error.__class__.__name__}: {error}") from None

    def _json(self, path: str, named: str | None = None):
        status, body, _ = self.get(path, named)
        if status != 200:
            return status, None
        return status, _parse_json(body, self.url + path)

    # -- which engine ------------------------------------------------------------------------------
    def detect(self) -> str:
        """The kind, found by what answers; sets self.kind and self.source. An engine that
        does not answer at all is named by the endpoint of the kind seen before, if any."""
        named = self._named()
        status, running = self._json("/running", named)
        if status == 200 and isinstance(running, dict) and isinstance(running.get("running"), list):
            self._found(LLAMA_SWAP, "/running and /upstream/MODEL/slots")
            try:
                self._swap()   # its answer read whole once: an odd one is said now
            except Unreadable:
                self.kind = None
                raise
            return LLAMA_SWAP
        status, body, _ = self.get("/slots", named)
        if status == 200:
            slots = _parse_json(body, self.url + "/slots")
            if _slot_list(slots) is None:
                raise Unreadable(f"{self.url}/slots answered JSON that is not a list of slots")
            return self._found(LLAMA_CPP, "/slots")
        slots_disabled = status == 501
        status, body, _ = self.get("/metrics", named)
        if status == 200:
            text = body.decode("utf-8", "replace")
            for kind, metric in RUNNING_METRIC.items():
                if _metric(text, metric) is not None:
                    return self._found(kind, f"/metrics {metric}")
        if slots_disabled:
            raise CannotWitness("slots disabled (501) and no /metrics: start llama-server "
                                "without --no-slots, or with --metrics", LLAMA_CPP)
        status, models = self._json("/api/ps", named)
        if status == 200 and isinstance(models, dict) and "models" in models:
            raise CannotWitness("Ollama reports no work in flight (/api/ps lists loaded models "
                                "only)", OLLAMA)
        raise CannotWitness("answers none of /running, /slots, /metrics, /api/ps: not an engine "
                            "lanelock can witness (llama.cpp, llama-swap, vLLM, SGLang)")

    def _found(self, kind: str, source: str) -> str:
        self.kind, self.source = kind, source
        return kind

    # -- one sample ------------------------------------------------------------------------------
    def sample(self) -> Account:
        if self.kind is None:
            self.detect()
        if self.kind == LLAMA_SWAP:
            return self._swap()
        if self.source == "/slots":
            return self._slots("")
        return self._metrics()

    def _slots(self, prefix: str) -> Account:
        status, body, _ = self.get(prefix + "/slots")
        if status == 501:
            raise CannotWitness("slots disabled (501)", LLAMA_CPP)
        if status != 200:
            raise Unreadable(f"{self.url}{prefix}/slots answered {status}")
        slots = _slot_list(_parse_json(body, self.url + prefix + "/slots"))
        if slots is None:
            raise Unreadable(f"{self.url}{prefix}/slots answered JSON that is not a list of slots")
        tasks, named = {}, {}
        for slot in slots:
            key = f"{prefix}#{slot.get('id_task', slot.get('id'))}"
            busy = _processing(slot)
            if busy:
                tasks[key] = _decoded(slot)
            if _counted(slot.get("id_task")) is not None:   # a task it runs, or its last one
                named[key] = SlotTask(busy, _decoded(slot), _counted(slot.get("n_prompt_tokens")),
                                      _prompt(slot), _remain(slot))
        return Account(len(tasks), len(slots), tasks, named)

    def _metrics(self) -> Account:
        status, body, _ = self.get("/metrics")
        if status != 200:
            raise Unreadable(f"{self.url}/metrics answered {status}")
        metric = RUNNING_METRIC[self.kind]
        value = _metric(body.decode("utf-8", "replace"), metric)
        if value is None:
            raise Unreadable(f"{self.url}/metrics has no {metric}")
        return Account(int(round(value)))

    def _swap(self) -> Account:
        from urllib.parse import quote

        status, running = self._json("/running")
        if status != 200 or not isinstance(running, dict) \
                or not isinstance(running.get("running"), list):
            raise Unreadable(f"{self.url}/running answered {status} without a list of models")
        total, slots, tasks, named, by_model = 0, 0, {}, {}, {}
        for model in running["running"]:
            name = model.get("model") or model.get("name") if isinstance(model, dict) else None
            if not isinstance(name, str) or not name:
                raise Unreadable(f"{self.url}/running lists something that is not a model: "
                                 f"{json.dumps(model)[:80]}")
            # Only a model that is up: asking one that is starting or stopping could load it.
            if model.get("state", "ready") != "ready":
                continue
            account = self._slots(f"/upstream/{quote(name, safe='')}")
            total += account.generating
            slots += account.slots or 0
            own = Account(account.generating, account.slots,
                          {f"{name}{key}": value for key, value in account.tasks.items()},
                          {f"{name}{key}": value for key, value in account.named.items()})
            tasks.update(own.tasks)
            named.update(own.named)
            by_model[name] = own
        return Account(total, slots, tasks, named, by_model)


def _parse_json(body: bytes, where: str):
    if len(body) > MAX_BYTES:
        raise Unreadable(f"{where} answered more than {MAX_BYTES} bytes")
    try:
        return json.loads(body)
    except (ValueError, RecursionError):
        raise Unreadable(f"{where} answered something that is not JSON") from None


def _slot_list(data) -> list | None:
    if isinstance(data, list) and all(isinstance(slot, dict) for slot in data):
        return data
    return None


def _processing(slot: dict) -> bool:
    """Is this slot computing (a prompt or tokens)? is_processing where the build says it; older
    builds have state (0 idle) or only id_task (-1 idle)."""
    if isinstance(slot.get("is_processing"), bool):
        return slot["is_processing"]
    if isinstance(slot.get("state"), int):
        return slot["state"] != 0
    task = slot.get("id_task")
    return isinstance(task, int) and not isinstance(task, bool) and task >= 0


def _next_token(slot: dict) -> dict:
    tokens = slot.get("next_token")
    if isinstance(tokens, list) and tokens and isinstance(tokens[0], dict):
        tokens = tokens[0]
    return tokens if isinstance(tokens, dict) else slot


def _counted(value) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def _decoded(slot: dict) -> int | None:
    return _counted(_next_token(slot).get("n_decoded"))


def _prompt(slot: dict) -> int | None:
    processed = _counted(slot.get("n_prompt_tokens_processed"))
    cached = _counted(slot.get("n_prompt_tokens_cache"))
    return None if processed is None or cached is None else processed + cached


def _remain(slot: dict) -> int | None:
    value = _next_token(slot).get("n_remain")
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _metric(text: str, name: str) -> float | None:
    """The sum of a metric's samples over its label sets in Prometheus text, or None if absent."""
    total, found = 0.0, False
    for line in text.splitlines():
        if not line.startswith(name):
            continue
        rest = line[len(name):]
        if rest[:1] == "{":
            rest = rest.partition("}")[2]
        elif rest[:1] not in (" ", "\t"):
            continue   # another metric whose name starts with this one
        try:
            value = float(rest.split()[0])
        except (ValueError, IndexError):
            continue
        if value == value:   # NaN says nothing
            total += value
            found = True
    return total if found else None


def look(url: str, timeout: float = TIMEOUT, known: str | None = None) -> dict:
    """One look, for `status`: {url, kind, generating, slots, problem} (problem: None, or why
    there is nothing to read). known: the source its witness read (Engine.known)."""
    engine = Engine(url, timeout, known)
    result = {"url": engine.url, "kind": None, "generating": None, "slots": None,
              "problem": None, "answers": True}
    try:
        account = engine.sample()
        result.update(kind=engine.kind, generating=account.generating, slots=account.slots)
    except CannotWitness as error:
        result.update(kind=error.kind or engine.kind, problem=f"cannot witness: {error}")
    except Unreadable as error:
        result.update(kind=engine.kind, problem=f"not answering: {error}", answers=False)
    return result
