"""A contention-detecting stand-in for a local model server, and a tiny client for it.

    python -m lanelock.testing serve --port 0 --delay 0.2 --port-file PORTFILE
    python -m lanelock.testing serve --port 0 --kind vllm --parallel 2 --port-file PORTFILE
    python -m lanelock.testing client http://127.0.0.1:PORT

The server speaks just enough of the OpenAI API (/v1/chat/completions, /v1/completions, /health,
/v1/models) and llama.cpp's /completion for a client to get an answer. A completion takes --delay
seconds; with "stream": true it streams --tokens server-sent events (OpenAI chunk shapes, then
[DONE]) one every --token-interval seconds, and stops when the client hangs up, as llama-server
does. The server records how many generations were in flight at once: GET /stats gives
{"max_in_flight", "total", "in_flight", "hangups", "paths"}, and besides them "generations" (the
last 200: {"id", "path", "started", "ended", "decoded", "slot", "id_slot"}, wall-clock seconds,
"ended" null while in flight, "decoded" the tokens it decoded, "slot" the slot that served it
(null: it was never given one), "id_slot" the slot its request named, or null),
"account_gets" (how many GETs reached the engine's account endpoints below) and "loads" (models a
llama-swap stand-in was asked to load). POST /stats/reset clears them. Loopback only, by design.

The engine's own account of its work
------------------------------------
Every generation in flight takes one of --parallel slots while one is free (the first free one);
the ones beyond are queued (the stand-in still serves them at once, for its contention record, but
its account shows them waiting, as an engine that queues them would). A request whose body names
a slot ("id_slot": N, 0 <= N < --parallel; any other value lets the engine choose, as
llama-server does) takes that slot, and while it is busy waits for it, as llama-server defers it;
a slot freed goes to the first queued request that named it or named none. Each has a task id (counting up, shared with
llama-server's own account requests, as there), a start and a count of decoded tokens (a stream's
events sent so far). --kind says in which engine's words the account is given:

  llama.cpp         GET /slots: a list of --parallel slot objects, as llama-server's
                    server_slot::to_json (tools/server/server-context.cpp): "id", "n_ctx",
                    "speculative", "is_processing" always; once the slot has had a task also
                    "id_task", "n_prompt_tokens", "n_prompt_tokens_processed",
                    "n_prompt_tokens_cache", "params" and "next_token" (a list of one object:
                    "has_next_token", "has_new_line", "n_remain", "n_decoded"). n_prompt_tokens
                    is the slot's context: the prompt, then the tokens generated but the last
                    one. An idle slot keeps its last task's id_task (llama-server reports its
                    task_prev) and context, with n_decoded 0 and n_remain -1: only
                    is_processing tells a busy slot (as a real llama-server answered: 165
                    context tokens after a 38-token prompt and 128 generated).
                    ?fail_on_no_slot=1 answers 503 when none is idle. GET /props: the
                    fields of llama-server's that matter here, "total_slots" its --parallel,
                    "default_generation_settings" {"params", "n_ctx"}, "model_alias",
                    "endpoint_slots", "endpoint_metrics", "build_info". POST /completion's
                    answer says "id_slot", the slot that served it. --no-slots: 501
                    {"error": {"code": 501, "message": ..., "type": "not_supported_error"}}. GET /metrics only with --metrics (else 501 the same
                    way): Prometheus text, llamacpp:prompt_tokens_total, ...,
                    llamacpp:requests_processing and llamacpp:requests_deferred (gauges).
  llama.cpp-legacy  the same, in the shape older llama-server builds gave (before task_prev):
                    every slot has "id_task" (-1 until its first task, then the last one's: those
                    builds never reset it), "params", "prompt" and "next_token" as one object with
                    "stopping_word" too.
  llama-swap        GET /running: {"running": [{"model": NAME, "state": "ready", "cmd", "proxy",
                    "ttl", "name", "description"}]}; GET /upstream/NAME/slots and
                    /upstream/NAME/metrics: the llama.cpp answers above (--no-slots, --metrics
                    apply). /upstream/OTHER/... for any model not running is a load in the real
                    llama-swap (it would swap the running model out): recorded in /stats "loads",
                    answered 502. MODEL is read from the decoded path, as llama-swap's router
                    does (tiny%2Fmodel is tiny/model); /upstream/MODEL without the slash: 301 to
                    /upstream/MODEL/, as there. GET /slots and /metrics on the proxy itself: 404
                    "404 page not found". POSTs under /upstream/NAME/ generate as the plain paths.
  vllm              GET /metrics: vllm:num_requests_running and vllm:num_requests_waiting
                    {model_name="NAME",engine="0"} (vLLM V1's labels), with
                    vllm:kv_cache_usage_perc and the token counters; /slots: 404 {"detail": "Not
                    Found"}; /server_info 404 too, as vLLM serves it only with
                    VLLM_SERVER_DEV_MODE=1 (--vllm-dev-mode: its config, with
                    scheduler_config.max_num_seqs = --parallel under ?config_format=json).
  sglang            GET /metrics: sglang:num_running_reqs and sglang:num_queue_reqs
                    {model_name="NAME",engine_type="unified",tp_rank="0",pp_rank="0"}, with
                    sglang:token_usage, sglang:gen_throughput and the token counters; GET
                    /server_info and /get_server_info: its server arguments with
                    "max_running_requests" = --parallel; /slots: 404 {"detail": "Not Found"}.
  ollama            GET /api/ps: {"models": [{"name", "model", "size", "digest", "details",
                    "expires_at", "size_vram", "context_length"}]}: the loaded model, nothing of
                    the work in flight. GET /: "Ollama is running". /slots, /metrics: 404 "404 page
                    not found" (Go's default).
  garbage           every account endpoint answers 200 with bytes that are no JSON (/metrics:
                    random bytes).
  odd               200 JSON of the wrong shape ({"slots": "many"}, {"running": ["NAME"]},
                    {"models": [1, 2]}); /metrics: text that names no known metric.
  redirect          every account endpoint answers 302 to http://127.0.0.1:1/elsewhere.
  plain             no account at all: /slots and /metrics answer 404, as before these kinds.

llama-swap, vLLM, SGLang and Ollama do not run here: those kinds are their documented shapes (from
their source and documentation), served by this stand-in, not the real servers; only llama.cpp's
can be checked against a real llama-server (scripts/real-backend). --api-key KEY: every account
GET without "Authorization: Bearer KEY" answers 401 {"error": {"code": 401, "message": "Invalid
API Key", "type": "authentication_error"}}, as llama-server --api-key; --loading: every GET
but /stats answers 503 {"error": {"code": 503, "message": "Loading model", "type":
"unavailable_error"}}, as llama-server while it loads its model. --slow SECONDS makes every
account GET (/slots, /props, /metrics, /running, /upstream/..., /api/ps, /server_info) wait that
long before it answers.
GET /health stays {"status": "ok"} for every kind (but --loading).
"""

from __future__ import annotations

import argparse
import collections
import datetime
import hashlib
import json
import os
import sys
import threading
import time
import urllib.parse
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Generation:
    """One generation as the engine's account sees it."""

    __slots__ = ("id", "path", "started", "ended", "t0", "stream", "n_predict", "events",
                 "final", "slot", "wanted")

    def __init__(self, task_id: int, path: str, stream: bool, n_predict: int,
                 wanted: int | None = None):
        self.id = task_id
        self.path = path
        self.started = time.time()
        self.ended: float | None = None
        self.t0 = time.monotonic()
        self.stream = stream
        self.n_predict = n_predict     # -1: no limit asked
        self.events = 0                # a stream's events sent so far
        self.final: int | None = None  # the decoded count, frozen when it ends
        self.slot: int | None = None   # None: queued (deferred)
        self.wanted = wanted           # the slot its request named (id_slot), None: any

    def decoded(self, delay: float) -> int:
        """Tokens decoded so far: a stream's events sent; a plain answer 3 over its delay."""
        if self.final is not None:
            return self.final
        if self.stream:
            return self.events
        if delay <= 0:
            return 3
        return min(3, int((time.monotonic() - self.t0) / delay * 3))

    def record(self) -> dict:
        return {"id": self.id, "path": self.path, "started": self.started, "ended": self.ended,
                "decoded": self.final if self.final is not None else self.events,
                "slot": self.slot, "id_slot": self.wanted}


PROMPT_TOKENS = 12     # what every request's prompt counts in the account


class Counter:
    def __init__(self, parallel: int = 1):
        self.lock = threading.Lock()
        self.seated = threading.Condition(self.lock)   # a queued generation got its slot
        self.in_flight = self.max_in_flight = self.total = 0
        self.hangups = 0          # generations the client abandoned mid-way
        self.paths: list[str] = []   # the paths generations were asked on, in order
        # The engine's account: slots, the queue behind them, and its own running totals.
        self.parallel = max(1, int(parallel))
        self.slots: list[Generation | None] = [None] * self.parallel
        self.previous: list[Generation | None] = [None] * self.parallel   # each slot's last task
        self.waiting: collections.deque[Generation] = collections.deque()
        self.generations: collections.deque[Generation] = collections.deque(maxlen=200)
        self.last_task = -1
        self.account_gets = 0
        self.loads: list[str] = []
        self.prompt_tokens = self.predicted_tokens = 0
        self.born, self.born_wall = time.monotonic(), time.time()

    def enter(self) -> None:
        with self.lock:
            self.in_flight += 1
            self.total += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)

    def leave(self) -> None:
        with self.lock:
            self.in_flight -= 1

    def hung_up(self) -> None:
        with self.lock:
            self.hangups += 1

    # -- the engine's account ------------------------------------------------------------------
    def task_id(self) -> int:
        with self.lock:
            self.last_task += 1
            return self.last_task

    def begin(self, path: str, stream: bool = False, n_predict: int = -1,
              id_slot=None) -> Generation:
        """A generation arrives (after enter()): the slot it names (id_slot, as llama-server
        reads it: an int in range, anything else lets the engine choose) if free, else the
        first free slot, else the queue."""
        with self.lock:
            self.last_task += 1
            wanted = id_slot if isinstance(id_slot, int) and not isinstance(id_slot, bool) \
                and 0 <= id_slot < self.parallel else None
            generation = Generation(self.last_task, path, stream, n_predict, wanted)
            self.generations.append(generation)
            if wanted is not None:
                if self.slots[wanted] is None:
                    self._seat(generation, wanted)
                else:
                    self.waiting.append(generation)
            elif None in self.slots:
                self._seat(generation, self.slots.index(None))
            else:
                self.waiting.append(generation)
            return generation

    def wait_seated(self, generation: Generation, timeout: float = 600.0) -> bool:
        """Until a generation pinned to a busy slot has it, as llama-server defers a request
        whose id_slot is busy until that slot is free (a real llama-server started the second
        of two requests naming slot 0 when the first ended). Unpinned queued generations are
        served at once (the contention record), their account still showing them deferred."""
        with self.lock:
            if generation.wanted is None:
                return True
            return self.seated.wait_for(lambda: generation.slot is not None, timeout)

    def _seat(self, generation: Generation, slot: int) -> None:
        generation.slot = slot
        self.slots[slot] = generation
        self.prompt_tokens += PROMPT_TOKENS

    def end(self, generation: Generation, delay: float) -> None:
        """A generation is over (before leave()): its slot goes to the first in the queue."""
        with self.lock:
            generation.final = generation.decoded(delay)
            generation.ended = time.time()
            self.predicted_tokens += generation.final
            slot = generation.slot
            if slot is None:
                try:
                    self.waiting.remove(generation)
                except ValueError:
                    pass
                return
            self.slots[slot] = None
            self.previous[slot] = generation
            # The first in the queue that may take this slot: any, or one that named it.
            for waiter in self.waiting:
                if waiter.wanted in (None, slot):
                    self.waiting.remove(waiter)
                    self._seat(waiter, slot)
                    self.seated.notify_all()
                    break

    def account_get(self) -> None:
        with self.lock:
            self.account_gets += 1

    def load(self, model: str) -> None:
        with self.lock:
            self.loads.append(model)
            del self.loads[:-100]

    def account(self, delay: float) -> dict:
        """What the engine would say now: per slot (current, previous), the queue, the totals."""
        with self.lock:
            running = [g for g in self.slots if g is not None]
            in_flight = sum(g.decoded(delay) for g in running) + \
                sum(g.decoded(delay) for g in self.waiting)
            return {"slots": [(index, current, self.previous[index],
                               current.decoded(delay) if current else
                               (self.previous[index].final if self.previous[index] else 0))
                              for index, current in enumerate(self.slots)],
                    "processing": len(running), "deferred": len(self.waiting),
                    "prompt_tokens": self.prompt_tokens,
                    "predicted_tokens": self.predicted_tokens + in_flight,
                    "seconds": max(time.monotonic() - self.born, 0.0),
                    "created": self.born_wall}

    def snapshot(self) -> dict:
        with self.lock:
            return {"max_in_flight": self.max_in_flight, "total": self.total,
                    "in_flight": self.in_flight, "hangups": self.hangups,
                    "paths": list(self.paths[-100:]),
                    "generations": [g.record() for g in self.generations],
                    "account_gets": self.account_gets, "loads": list(self.loads)}

    def reset(self) -> None:
        with self.lock:
            self.max_in_flight = self.in_flight
            self.total = self.hangups = 0
            self.paths.clear()
            kept = [g for g in self.generations if g.ended is None]   # still in flight
            self.generations.clear()
            self.generations.extend(kept)
            self.account_gets = 0
            self.loads.clear()


GENERATING = ("/v1/chat/completions", "/v1/completions", "/completion", "/completions")


# What even the strictest stand-in answers at once: the cheap endpoints (proxy/routes.py).
CHEAP = ("/tokenize", "/detokenize", "/apply-template", "/v1/messages/count_tokens",
         "/v1/responses/input_tokens", "/api/show")

KINDS = ("llama.cpp", "llama.cpp-legacy", "llama-swap", "vllm", "sglang", "ollama", "garbage",
         "odd", "redirect", "plain")

# The engine's account of its work: the GETs a witness asks (and /upstream/...).
ACCOUNT = ("/slots", "/metrics", "/running", "/api/ps", "/props", "/server_info",
           "/get_server_info")

N_CTX = 4096
ELSEWHERE = "http://127.0.0.1:1/elsewhere"
GO_404 = b"404 page not found"                          # Go's net/http and gin
FASTAPI_404 = {"detail": "Not Found"}                   # vLLM's and SGLang's FastAPI
LLAMA_404 = {"error": {"message": "File Not Found", "type": "not_found_error", "code": 404}}
JSON_UTF8 = "application/json; charset=utf-8"
PROMETHEUS = "text/plain; version=0.0.4; charset=utf-8"


def not_supported(what: str, flag: str) -> dict:
    """llama-server's answer for an endpoint it was not started with (format_error_response)."""
    return {"error": {"code": 501, "type": "not_supported_error",
                      "message": f"This server does not support {what} endpoint. "
                                 f"Start it with `{flag}`"}}


def label_value(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def slot_params(generation: Generation) -> dict:
    """A small part of llama-server's task_params::to_json(only_metrics=true)."""
    return {"seed": 4294967295, "temperature": 0.800000011920929, "dynatemp_range": 0.0,
            "dynatemp_exponent": 1.0, "top_k": 40, "top_p": 0.949999988079071,
            "min_p": 0.05000000074505806, "typical_p": 1.0, "repeat_last_n": 64,
            "repeat_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
            "max_tokens": generation.n_predict, "n_predict": generation.n_predict, "n_keep": 0,
            "n_discard": 0, "ignore_eos": False, "stream": generation.stream, "n_probs": 0,
            "min_keep": 0, "chat_format": "Content-only", "reasoning_format": "none",
            "samplers": ["penalties", "dry", "top_n_sigma", "top_k", "typ_p", "top_p", "min_p",
                         "xtc", "temperature"],
            "timings_per_token": False, "post_sampling_probs": False, "lora": []}


def llama_slots(account: dict, legacy: bool) -> list:
    """GET /slots as llama-server gives it (server_slot::to_json; legacy: before task_prev)."""
    answer = []
    for index, current, previous, decoded in account["slots"]:
        task = current or previous
        busy = current is not None
        remain = -1 if task is None or task.n_predict < 0 else max(task.n_predict - decoded, 0)
        next_token = {"has_next_token": busy or task is None, "has_new_line": False,
                      "n_remain": remain, "n_decoded": decoded}
        if legacy:
            params = slot_params(task or Generation(-1, "", False, -1))
            answer.append({"id": index, "id_task": task.id if task else -1, "n_ctx": N_CTX,
                           "speculative": False, "is_processing": busy, "params": params,
                           "prompt": "", "next_token": dict(next_token, stopping_word="")})
            continue
        slot = {"id": index, "n_ctx": N_CTX, "speculative": False, "is_processing": busy}
        if task is not None:
            # The slot's context: the prompt, then every token generated but the last one
            # sampled (it is fed back with the next decode), as llama-server keeps it.
            prompt, processed = PROMPT_TOKENS + max(decoded - 1, 0), PROMPT_TOKENS
            if not busy:   # released: n_decoded and the stats reset, the context stays
                processed = 0
                next_token.update(n_remain=-1, n_decoded=0)
            slot.update(id_task=task.id, n_prompt_tokens=prompt,
                        n_prompt_tokens_processed=processed, n_prompt_tokens_cache=0,
                        params=slot_params(task), next_token=[next_token])
        answer.append(slot)
    return answer


def number(value: float) -> str:
    """A double as llama-server's stringstream prints it (6 significant digits)."""
    return f"{value:g}"


def llama_metrics(account: dict) -> bytes:
    """GET /metrics as llama-server prints it (server_task_result_metrics::to_metrics)."""
    seconds = account["seconds"] or 1.0
    predicted = account["predicted_tokens"]
    counters = [
        ("prompt_tokens_total", "Number of prompt tokens processed, excluding cached tokens",
         account["prompt_tokens"]),
        ("prompt_tokens_cached_total", "Number of prompt tokens reused from the cache", 0),
        ("prompt_seconds_total", "Total time spent processing prompts",
         account["prompt_tokens"] / 1000.0),
        ("tokens_predicted_total", "Number of generation tokens processed", predicted),
        ("tokens_predicted_seconds_total", "Total time spent generating tokens", predicted / 50.0),
        ("n_decode_total", "Total number of llama_decode() calls, excluding speculative decoding "
         "and multimodal decoding", predicted + account["prompt_tokens"] // PROMPT_TOKENS),
        ("n_tokens_max", "Largest observed sequence length (prompt + generation)",
         PROMPT_TOKENS + max([d for _, _, _, d in account["slots"]] or [0])),
        ("spec_decode_num_draft_tokens_total", "Speculative: Total draft tokens generated", 0),
        ("spec_decode_num_accepted_tokens_total",
         "Speculative: Total draft tokens accepted by the target model", 0),
        ("spec_decode_num_drafts_total",
         "Speculative: Total speculative decoding verification steps", 0)]
    gauges = [
        ("prompt_tokens_seconds", "Average prompt throughput in tokens/s",
         account["prompt_tokens"] / seconds),
        ("predicted_tokens_seconds", "Average generation throughput in tokens/s",
         predicted / seconds),
        ("requests_processing", "Number of requests processing", account["processing"]),
        ("requests_deferred", "Number of requests deferred", account["deferred"]),
        ("n_busy_slots_per_decode", "Average number of busy slots per llama_decode() call",
         account["processing"] / max(len(account["slots"]), 1))]
    lines = []
    for kind, items in (("counter", counters), ("gauge", gauges)):
        for name, description, value in items:
            lines += [f"# HELP llamacpp:{name} {description}", f"# TYPE llamacpp:{name} {kind}",
                      f"llamacpp:{name} {number(value)}"]
    return ("\n".join(lines) + "\n").encode()


def prometheus(prefix: str, labels: str, items: list, created: float) -> bytes:
    """Prometheus text as prometheus_client writes it (floats, a _created line per counter)."""
    lines = []
    for name, kind, description, value in items:
        lines += [f"# HELP {prefix}{name} {description}", f"# TYPE {prefix}{name} {kind}",
                  f"{prefix}{name}{{{labels}}} {float(value)!r}"]
        if kind == "counter":
            stem = name[: -len("_total")]
            lines.append(f"{prefix}{stem}_created{{{labels}}} {created!r}")
    return ("\n".join(lines) + "\n").encode()


def vllm_metrics(account: dict, name: str) -> bytes:
    """GET /metrics as vLLM (V1 engine) serves it: a model_name and an engine label."""
    labels = f'model_name="{label_value(name)}",engine="0"'
    head = (b"# HELP python_gc_objects_collected_total Objects collected during gc\n"
            b"# TYPE python_gc_objects_collected_total counter\n"
            b'python_gc_objects_collected_total{generation="0"} 12345.0\n')
    return head + prometheus("vllm:", labels, [
        ("num_requests_running", "gauge", "Number of requests in model execution batches.",
         account["processing"]),
        ("num_requests_waiting", "gauge", "Number of requests waiting to be processed.",
         account["deferred"]),
        ("kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.",
         account["processing"] / max(len(account["slots"]), 1) * 0.1),
        ("prompt_tokens_total", "counter", "Number of prefill tokens processed.",
         account["prompt_tokens"]),
        ("generation_tokens_total", "counter", "Number of generation tokens processed.",
         account["predicted_tokens"])], account["created"])


def sglang_metrics(account: dict, name: str) -> bytes:
    """GET /metrics as SGLang (--enable-metrics) serves it."""
    labels = (f'model_name="{label_value(name)}",engine_type="unified",tp_rank="0",'
              f'pp_rank="0"')
    seconds = account["seconds"] or 1.0
    return prometheus("sglang:", labels, [
        ("num_running_reqs", "gauge", "The number of running requests.", account["processing"]),
        ("num_used_tokens", "gauge", "The number of used tokens.",
         account["processing"] * PROMPT_TOKENS),
        ("token_usage", "gauge", "The token usage.",
         account["processing"] / max(len(account["slots"]), 1) * 0.1),
        ("gen_throughput", "gauge", "The generation throughput (token/s).",
         account["predicted_tokens"] / seconds),
        ("num_queue_reqs", "gauge", "The number of requests in the waiting queue.",
         account["deferred"]),
        ("prompt_tokens_total", "counter", "Number of prefill tokens processed.",
         account["prompt_tokens"]),
        ("generation_tokens_total", "counter", "Number of generation tokens processed.",
         account["predicted_tokens"])], account["created"])


def ollama_ps(name: str) -> dict:
    """GET /api/ps as Ollama gives it: the models loaded, nothing of the work in flight."""
    expires = datetime.datetime.now().astimezone() + datetime.timedelta(minutes=5)
    size = 4_920_753_328
    return {"models": [{
        "name": name, "model": name, "size": size,
        "digest": hashlib.sha256(name.encode()).hexdigest(),
        "details": {"parent_model": "", "format": "gguf", "family": "llama",
                    "families": ["llama"], "parameter_size": "8.0B",
                    "quantization_level": "Q4_K_M"},
        "expires_at": expires.isoformat(), "size_vram": size, "context_length": N_CTX}]}


def llama_props(name: str, parallel: int, slots: bool, metrics: bool) -> dict:
    """GET /props as llama-server gives it (the fields that matter; a real one has more):
    total_slots is its --parallel, n_ctx each slot's context."""
    params = slot_params(Generation(-1, "", False, -1))
    return {"default_generation_settings": {"params": params, "n_ctx": N_CTX},
            "total_slots": parallel, "model_alias": name, "model_path": f"{name}.gguf",
            "modalities": {"vision": False, "video": False, "audio": False},
            "endpoint_slots": slots, "endpoint_props": False, "endpoint_metrics": metrics,
            "chat_template": "{% for message in messages %}{{ message['content'] }}{% endfor %}",
            "bos_token": "<s>", "eos_token": "</s>", "build_info": "b0-stand-in",
            "is_sleeping": False}


def vllm_server_info(name: str, parallel: int, query: str) -> dict:
    """GET /server_info as vLLM serves it with VLLM_SERVER_DEV_MODE=1: its config (a few fields
    of many), as JSON with ?config_format=json, else as one string."""
    config = {"model_config": {"model": name, "max_model_len": N_CTX},
              "cache_config": {"block_size": 16, "gpu_memory_utilization": 0.9},
              "scheduler_config": {"max_num_seqs": parallel, "max_num_batched_tokens": 8192,
                                   "policy": "fcfs"}}
    if "config_format=json" not in query:
        config = f"model={name!r}, max_num_seqs={parallel}"
    return {"vllm_config": config, "vllm_env": {"VLLM_SERVER_DEV_MODE": True},
            "system_env": {"os": "Linux"}}


def sglang_server_info(name: str, parallel: int) -> dict:
    """GET /server_info (and the deprecated /get_server_info) as SGLang gives it: its server
    arguments, resolved, with the scheduler's figures and internal states (a few of many)."""
    return {"model_path": name, "served_model_name": name, "max_running_requests": parallel,
            "max_total_tokens": None, "context_length": N_CTX, "schedule_policy": "fcfs",
            "max_total_num_tokens": N_CTX * parallel, "max_req_input_len": N_CTX - 1,
            "internal_states": [{"last_gen_throughput": 0.0, "memory_usage": {}}],
            "version": "0.5.23", "frontend": "python"}


def llama_swap_running(name: str, port: int) -> dict:
    """GET /running as llama-swap gives it (listRunningProcessesHandler: ready processes)."""
    return {"running": [{"model": name, "state": "ready",
                         "cmd": f"llama-server --port ${{PORT}} -m {name}.gguf",
                         "proxy": f"http://127.0.0.1:{port}", "ttl": 0, "name": "",
                         "description": ""}]}


def make_server(port: int = 0, delay: float = 0.1, name: str = "stand-in", tokens: int = 8,
                token_interval: float | None = None, strict: bool = False, *,
                kind: str = "llama.cpp", parallel: int = 1, slots: bool = True,
                metrics: bool = False, slow: float = 0.0,
                dev_mode: bool = False, api_key: str | None = None,
                loading: bool = False) -> ThreadingHTTPServer:
    """delay: seconds a non-streaming answer takes; a streaming one ("stream": true) sends
    `tokens` server-sent events, one every token_interval seconds (default delay / tokens).
    strict: generate on every request but GET/HEAD and the cheap endpoints, whatever its path
    or method (the strictest engine: a proxy must let no second one in).
    kind: in which engine's words the account of the work in flight is given (KINDS, the module
    docstring); parallel: the slots it reports; slots=False: llama-server's --no-slots;
    metrics: llama-server's --metrics; slow: seconds every account GET waits before answering;
    dev_mode: vLLM's VLLM_SERVER_DEV_MODE=1 (GET /server_info); api_key: every account GET
    without "Authorization: Bearer KEY" answers 401, as llama-server --api-key does; loading:
    every GET but /stats answers 503 "Loading model", as llama-server while it loads."""
    if kind not in KINDS:
        raise ValueError(f"unknown kind {kind!r} (one of {', '.join(KINDS)})")
    counter = Counter(parallel)
    interval = delay / max(tokens, 1) if token_interval is None else token_interval

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):  # quiet: tests read stats, not logs
            pass

        def _send(self, code: int, body, content_type: str = "application/json",
                  headers: tuple = ()) -> None:
            data = body if isinstance(body, bytes) else json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(data)))
            for header, value in headers:
                self.send_header(header, value)
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            if self.path == "/stats":
                return self._send(200, counter.snapshot())
            if loading:
                return self._send(503, {"error": {"code": 503, "message": "Loading model",
                                                  "type": "unavailable_error"}}, JSON_UTF8)
            if self.path == "/health":
                return self._send(200, {"status": "ok"})
            if self.path == "/v1/models":
                return self._send(200, {"object": "list", "data": [{"id": name, "object": "model"}]})
            path, _, query = self.path.partition("?")
            if path in ACCOUNT or path == "/upstream" or path.startswith("/upstream/"):
                counter.account_get()
                if slow > 0:
                    time.sleep(slow)
                if api_key and self.headers.get("Authorization") != f"Bearer {api_key}":
                    return self._send(401, {"error": {"code": 401, "message": "Invalid API Key",
                                                      "type": "authentication_error"}},
                                      JSON_UTF8)
                return self._account(path, query)
            if kind == "ollama" and path == "/":
                return self._send(200, b"Ollama is running", "text/plain; charset=utf-8")
            return self._send(404, {"error": "not found"})

        # -- the engine's account ----------------------------------------------------------------
        def _account(self, path: str, query: str) -> None:
            if kind == "plain":
                return self._send(404, {"error": "not found"})
            if kind == "redirect":
                return self._send(302, b"", "text/html; charset=utf-8",
                                  (("Location", ELSEWHERE),))
            if kind == "garbage":
                if path.endswith("/metrics"):
                    return self._send(200, os.urandom(96), PROMETHEUS)
                return self._send(200, b"\x00\xffnot json {", JSON_UTF8)
            if kind == "odd":
                if path.endswith("/metrics"):
                    return self._send(200, b"# HELP engine_uptime_seconds Uptime.\n"
                                           b"# TYPE engine_uptime_seconds gauge\n"
                                           b"engine_uptime_seconds 12.5\n", PROMETHEUS)
                if path == "/running":
                    return self._send(200, {"running": [name]}, JSON_UTF8)
                if path == "/api/ps":
                    return self._send(200, {"models": [1, 2]}, JSON_UTF8)
                return self._send(200, {"slots": "many"}, JSON_UTF8)
            if kind in ("llama.cpp", "llama.cpp-legacy"):
                return self._llama(path, query)
            if kind == "llama-swap":
                return self._llama_swap(path, query)
            if kind in ("vllm", "sglang"):
                if kind == "sglang" and path in ("/server_info", "/get_server_info"):
                    return self._send(200, sglang_server_info(name, counter.parallel))
                if kind == "vllm" and dev_mode and path == "/server_info":
                    return self._send(200, vllm_server_info(name, counter.parallel, query))
                if path != "/metrics":   # vLLM's /server_info: only with VLLM_SERVER_DEV_MODE=1
                    return self._send(404, FASTAPI_404)
                account = counter.account(delay)
                text = (vllm_metrics if kind == "vllm" else sglang_metrics)(account, name)
                return self._send(200, text, PROMETHEUS)
            # ollama
            if path == "/api/ps":
                return self._send(200, ollama_ps(name))
            return self._send(404, GO_404, "text/plain")

        def _llama(self, path: str, query: str) -> None:
            """A GET llama-server answers (also behind llama-swap's /upstream/NAME/)."""
            if path == "/slots":
                if not slots:
                    return self._send(501, not_supported("slots", "--slots"), JSON_UTF8)
                counter.task_id()          # llama-server's own request takes a task id too
                account = counter.account(delay)
                if "fail_on_no_slot" in urllib.parse.parse_qs(query) and \
                        account["processing"] >= len(account["slots"]):
                    return self._send(503, {"error": {"code": 503, "message": "no slot available",
                                                      "type": "unavailable_error"}}, JSON_UTF8)
                return self._send(200, llama_slots(account, kind == "llama.cpp-legacy"),
                                  JSON_UTF8)
            if path == "/metrics":
                if not metrics:
                    return self._send(501, not_supported("metrics", "--metrics"), JSON_UTF8)
                counter.task_id()
                return self._send(200, llama_metrics(counter.account(delay)),
                                  "text/plain; version=0.0.4")
            if path == "/props":
                return self._send(200, llama_props(name, counter.parallel, slots, metrics),
                                  JSON_UTF8)
            if path in ("/health", "/v1/health"):
                return self._send(200, {"status": "ok"}, JSON_UTF8)
            if path in ("/v1/models", "/models"):
                return self._send(200, {"object": "list",
                                        "data": [{"id": name, "object": "model"}]}, JSON_UTF8)
            return self._send(404, LLAMA_404, JSON_UTF8)

        def _upstream(self, path: str) -> tuple[str, str | None]:
            """(/upstream/MODEL/REST) -> (MODEL, /REST), REST None without the slash. The path
            is taken decoded, as llama-swap's router does (MODEL may be quoted, / as %2F)."""
            rest = urllib.parse.unquote(path[len("/upstream/"):])
            if rest == name or rest.startswith(name + "/"):
                model, tail = name, rest[len(name):]
            else:
                model, slash, tail = rest.partition("/")
                tail = slash + tail
            return model, (tail or None)

        def _llama_swap(self, path: str, query: str) -> None:
            if path == "/running":
                return self._send(200, llama_swap_running(name, self.server.server_address[1]))
            if path in ("/upstream", "/upstream/"):
                return self._send(200, f"<!doctype HTML>\n<html><body><h1>Available Models</h1>"
                                       f"<ul><li><a href=\"/upstream/{name}\">{name}</a></li>"
                                       f"</ul></body></html>".encode(), "text/html")
            if not path.startswith("/upstream/"):
                return self._send(404, GO_404, "text/plain")
            model, tail = self._upstream(path)
            if tail is None:               # llama-swap's canonical form: a trailing slash
                location = f"/upstream/{model}/" + (f"?{query}" if query else "")
                return self._send(301, b"", "text/html; charset=utf-8",
                                  (("Location", location),))
            if model != name:
                return self._load(model)
            return self._llama(tail, query)

        def _load(self, model: str) -> None:
            """llama-swap would load this model here, swapping out the one that works."""
            counter.load(model)
            return self._send(502, f"stand-in llama-swap: model {model} is not running; the real "
                                   f"llama-swap would load it here (recorded in /stats "
                                   f"loads)".encode(), "text/plain; charset=utf-8")

        # -- generations ---------------------------------------------------------------------
        def _generate(self, seconds: float) -> bool:
            """'Generate' for `seconds`, stopping early when the client hangs up, as llama-server
            does: a killed turn must not keep counting as a generation in flight."""
            import select
            import socket

            deadline = time.monotonic() + seconds
            while True:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return True
                readable, _, _ = select.select([self.connection], [], [], min(remaining, 0.002))
                if readable:
                    try:
                        if self.connection.recv(1, socket.MSG_PEEK) == b"":
                            self.close_connection = True
                            return False
                        time.sleep(remaining)   # a pipelined request, not a hang-up
                        return True
                    except OSError:
                        self.close_connection = True
                        return False

        def do_POST(self):
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(min(length, 32 << 20))
            if self.path == "/stats/reset":
                counter.reset()
                return self._send(200, counter.snapshot())
            path = self.path.split("?", 1)[0]
            if kind == "llama-swap" and path.startswith("/upstream/"):
                model, tail = self._upstream(path)
                if model != name and tail is not None:
                    return self._load(model)
                path = tail or "/"
            if strict and path in CHEAP:
                return self._send(200, {"tokens": [1, 2, 3]})
            if path not in GENERATING and not strict:
                return self._send(404, {"error": "not found"})
            try:
                request = json.loads(raw or b"{}")
            except ValueError:
                if not strict:
                    return self._send(400, {"error": "body is not JSON"})
                request = {}
            if not isinstance(request, dict):
                request = {}
            counter.enter()
            with counter.lock:
                counter.paths.append(path)
            stream = bool(request.get("stream"))
            count = request.get("max_tokens") or request.get("n_predict")
            generation = counter.begin(path, stream,
                                       count if isinstance(count, int) and count > 0 else -1,
                                       request.get("id_slot"))
            try:
                counter.wait_seated(generation)
                if stream:
                    return self._stream(path, request, generation)
                finished = self._generate(delay)
            finally:
                counter.end(generation, delay)
                counter.leave()
            if not finished:
                counter.hung_up()
                return None
            text = f"answer from {name}"
            usage = {"prompt_tokens": 1, "completion_tokens": 3, "total_tokens": 4}
            if path == "/completion":   # llama.cpp's native shape, with the slot that served it
                return self._send(200, {"content": text, "stop": True, "model": name,
                                        "id_slot": generation.slot})
            if path in ("/v1/completions", "/completions"):
                return self._send(200, {"object": "text_completion", "model": name, "usage": usage,
                                        "choices": [{"index": 0, "text": text,
                                                     "finish_reason": "stop"}]})
            return self._send(200, {
                "object": "chat.completion", "model": name, "usage": usage,
                "choices": [{"index": 0, "finish_reason": "stop",
                             "message": {"role": "assistant", "content": text}}]})

        def _stream(self, path: str, request: dict, generation: Generation | None = None) -> None:
            """Server-sent events, one token every interval; stops when the client hangs up."""
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-cache")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            count = int(request.get("max_tokens") or tokens)
            for index in range(count):
                last = index == count - 1
                word = f"tok{index} "
                if path == "/completion":
                    event = {"content": word, "stop": last}
                elif path in ("/v1/completions", "/completions"):
                    event = {"object": "text_completion", "model": name, "choices": [
                        {"index": 0, "text": word, "finish_reason": "stop" if last else None}]}
                else:
                    event = {"object": "chat.completion.chunk", "model": name, "choices": [
                        {"index": 0, "delta": {"content": word},
                         "finish_reason": "stop" if last else None}]}
                if generation is not None:      # decoded before it is sent, as an engine does
                    with counter.lock:
                        generation.events += 1
                if not self._chunk(f"data: {json.dumps(event)}\n\n".encode()):
                    counter.hung_up()
                    return
                if not last and not self._generate(interval):
                    counter.hung_up()
                    return
            if path != "/completion":
                self._chunk(b"data: [DONE]\n\n")
            self._chunk(b"")

        def _chunk(self, data: bytes) -> bool:
            try:
                self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
                self.wfile.flush()
                return True
            except OSError:
                self.close_connection = True
                return False

        do_PUT = do_PATCH = do_DELETE = do_POST   # the strict stand-in generates on these too

    server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    server.daemon_threads = True
    server.counter = counter
    server.kind = kind
    return server


def complete(url: str, prompt: str = "hello", timeout: float = 60.0) -> str:
    """POST one chat completion; return the answer's text."""
    return ask(url, prompt, timeout=timeout)["content"]


def ask(url: str, prompt: str = "hello", *, max_tokens: int | None = None,
        timeout: float = 300.0) -> dict:
    """One chat completion with its facts: content, the server's timings (llama-server sends
    them), and this process's monotonic start and end (one clock for every process)."""
    payload = {"messages": [{"role": "user", "content": prompt}]}
    if max_tokens:
        payload.update(max_tokens=max_tokens, temperature=0, seed=1)
    request = urllib.request.Request(url.rstrip("/") + "/v1/chat/completions",
                                     data=json.dumps(payload).encode(),
                                     headers={"Content-Type": "application/json"})
    started = time.monotonic()
    with urllib.request.urlopen(request, timeout=timeout) as response:
        answer = json.load(response)
    ended = time.monotonic()
    return {"content": answer["choices"][0]["message"]["content"], "started": started,
            "ended": ended, "timings": answer.get("timings"), "usage": answer.get("usage"),
            "url": url}


def stats(url: str) -> dict:
    with urllib.request.urlopen(url.rstrip("/") + "/stats", timeout=10) as response:
        return json.load(response)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lanelock.testing")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="run the contention-detecting server")
    serve.add_argument("--port", type=int, default=0)
    serve.add_argument("--delay", type=float, default=0.1)
    serve.add_argument("--name", default="stand-in")
    serve.add_argument("--tokens", type=int, default=8, help="events in a streamed answer")
    serve.add_argument("--token-interval", type=float, help="seconds between streamed events")
    serve.add_argument("--port-file", help="write the bound port here once listening")
    serve.add_argument("--kind", choices=KINDS, default="llama.cpp",
                       help="whose account of the work in flight to give (see the module's doc)")
    serve.add_argument("--parallel", type=int, default=1, help="slots the engine reports")
    serve.add_argument("--no-slots", dest="slots", action="store_false",
                       help="GET /slots answers 501, as llama-server --no-slots")
    serve.add_argument("--metrics", action="store_true",
                       help="serve llama.cpp's GET /metrics, as llama-server --metrics")
    serve.add_argument("--loading", action="store_true",
                       help="every GET answers 503 Loading model, as llama-server while it loads")
    serve.add_argument("--api-key", help="account GETs need this key, as llama-server --api-key")
    serve.add_argument("--vllm-dev-mode", dest="dev_mode", action="store_true",
                       help="--kind vllm: serve GET /server_info, as VLLM_SERVER_DEV_MODE=1")
    serve.add_argument("--slow", type=float, default=0.0, metavar="SECONDS",
                       help="every account GET waits this long before it answers")
    client = commands.add_parser("client", help="ask the server for one completion")
    client.add_argument("url")
    client.add_argument("--prompt", default="hello")
    client.add_argument("--max-tokens", type=int)
    client.add_argument("--json", action="store_true", help="print the answer with its timings")
    args = parser.parse_args(argv)
    if args.command == "client":
        try:
            answer = ask(args.url, args.prompt, max_tokens=args.max_tokens)
            print(json.dumps(answer) if args.json else answer["content"])
        except (OSError, ValueError, KeyError) as error:
            print(f"lanelock.testing client: {error}", file=sys.stderr)
            return 1
        return 0
    server = make_server(args.port, args.delay, args.name, args.tokens, args.token_interval,
                         kind=args.kind, parallel=args.parallel, slots=args.slots,
                         metrics=args.metrics, slow=args.slow, dev_mode=args.dev_mode,
                         api_key=args.api_key, loading=args.loading)
    return serve_until_interrupted(server, args.port_file)


def serve_until_interrupted(server, port_file: str | None) -> int:
    """Write the bound port to port_file (whole, by rename: a reader never sees half of it),
    then serve until interrupted."""
    if port_file:
        temp = port_file + ".tmp"
        with open(temp, "w") as handle:
            handle.write(str(server.server_address[1]))
        os.replace(temp, port_file)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
