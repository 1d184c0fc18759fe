"""Where a request names its model, read as the engine reads it -- never as another reader would.

The lane a request holds must be the model the engine runs, so the proxy reads the model from the
place the engine reads it, and refuses (Disagree: a 400 in the family's shape) a body that two
readers read differently:

- a JSON body is read once, by Python's json, with the keys of its object checked -- and of every
  object inside its fields, but not of the objects in its lists (`messages`, `tools`: most of a
  long conversation's bytes, and nothing there names a model, a session or a slot; checking them
  all made reading a 115 KB body 2-3 times slower): a repeated key is refused (llama-swap's gjson
  takes the first `model`, Python's json the last: `{"model": "A", ..., "model": "B"}` would hold
  B's lane while the engine runs A), as is one repeated in another case (Go's encoding/json,
  Ollama's, reads `Model` as `model`); so is a body with a `{` that is no JSON object to json
  (gjson still reads a `model` out of `{"model": "A",}`), and a model that is no UTF-8 text (a
  lone surrogate: gjson reads U+FFFD there);
- a multipart form (llama-swap's /v1/audio/transcriptions and /v1/images/edits): the first field
  named `model` that is not a file, else the query's -- Go's FormValue;
- `?model=` on a path llama-swap routes by its query (GET /v1/audio/voices, GET /sdapi/v1/loras:
  a model load for any model named): the first `model` value.

The /upstream/MODEL/... path is the engine's own list's business (engine_names.py).
"""

from __future__ import annotations

import json
import re
from json.decoder import scanstring
from urllib.parse import parse_qs

# Paths whose multipart form names the model (llama-swap's proxyOAIPostFormHandler).
FORM_PATHS = frozenset({"/v1/audio/transcriptions", "/v1/images/edits"})
# Paths routed by ?model= for a GET (llama-swap's proxyGETModelHandler): any method is gated.
QUERY_PATHS = frozenset({"/v1/audio/voices", "/sdapi/v1/loras"})
MAX_PARTS = 64       # form parts looked at before the model is given up on
MAX_PART_HEAD = 4096  # bytes of one part's headers
MAX_MODEL = 1024     # bytes of a model field's value read


class Disagree(ValueError):
    """The body is read differently by two readers: which model it names cannot be told."""


def json_fields(body: bytes) -> dict:
    """The body's JSON object ({} when it is no JSON object and has no '{' either); Disagree
    for one two JSON readers would read differently."""
    if not body.strip():
        return {}
    try:
        data = _read(body.decode(json.detect_encoding(body), "surrogatepass"))
    except Disagree:
        raise
    except (ValueError, RecursionError):
        if b"{" in body:
            raise Disagree("the body is not one JSON object (another reader could still find "
                           "a model in it)") from None
        return {}
    if not isinstance(data, dict):
        return {}
    model = data.get("model")
    if isinstance(model, str):
        try:
            model.encode("utf-8")
        except UnicodeEncodeError:
            raise Disagree("the model is not UTF-8 text (a lone surrogate escape)") from None
    return data


_PLAIN = json.JSONDecoder()                          # a value whose objects go unchecked
_SPACE = re.compile(r"[ \t\n\r]*")                  # json's own whitespace


def _read(text: str):
    """json.loads(text), its top-level object's keys checked (_unique) and the objects inside its
    fields, but those inside its lists read by json's C scanner alone (ValueError as json's)."""
    space = _SPACE.match
    at = space(text).end()
    if text[at:at + 1] != "{":
        return json.loads(text)   # no object: nothing to check
    pairs = []
    at = space(text, at + 1).end()
    if text[at:at + 1] == "}":
        at += 1
    else:
        checked, plain = _CHECKED.scan_once, _PLAIN.scan_once
        while True:
            if text[at:at + 1] != '"':
                raise ValueError(f"a key expected at {at}")
            name, at = scanstring(text, at + 1, True)
            if text[at:at + 1] != ":":
                at = space(text, at).end()
                if text[at:at + 1] != ":":
                    raise ValueError(f"':' expected at {at}")
            at = space(text, at + 1).end()
            try:
                value, at = (checked if text[at:at + 1] == "{" else plain)(text, at)
            except StopIteration:
                raise ValueError(f"a value expected at {at}") from None
            pairs.append((name, value))
            follows = text[at:at + 1]
            if follows not in (",", "}"):
                at = space(text, at).end()
                follows = text[at:at + 1]
            if follows == ",":
                at = space(text, at + 1).end()
                continue
            if follows != "}":
                raise ValueError(f"',' or '}}' expected at {at}")
            at += 1
            break
    if at != len(text) and space(text, at).end() != len(text):
        raise ValueError(f"more after the object at {at}")
    return _unique(pairs)


def _unique(pairs: list) -> dict:
    """An object whose keys are all different, in any case: Go's encoding/json (Ollama) reads
    `Model` as `model`, and the last of them; gjson the first exact one; Python the last."""
    seen, folded = {}, set()
    for name, value in pairs:
        if name.lower() in folded:
            raise Disagree(f"the key {name[:100]!r} is repeated in one JSON object (in some "
                           "case: readers differ on which one counts)")
        folded.add(name.lower())
        seen[name] = value
    return seen


def is_form(content_type: str) -> bool:
    return content_type.split(";", 1)[0].strip().lower() == "multipart/form-data"


def form_model(body: bytes, content_type: str) -> str | None:
    """The first non-file `model` field of a multipart/form-data body (None: none, or no form).
    Parts are walked by their delimiters, at most MAX_PARTS of them; no part is copied but the
    model's value (at most MAX_MODEL bytes)."""
    boundary = _param(content_type, "boundary")
    if not boundary:
        return None
    delimiter = b"--" + boundary.encode("latin-1", "replace")
    at = body.find(delimiter)
    for _ in range(MAX_PARTS):
        if at < 0:
            return None
        start = at + len(delimiter)
        if body[start:start + 2] == b"--":   # the closing delimiter
            return None
        head_end = body.find(b"\r\n\r\n", start, start + MAX_PART_HEAD)
        if head_end < 0:
            return None
        following = body.find(b"\r\n" + delimiter, head_end + 4)
        if following < 0:
            return None
        disposition = _disposition(body[start:head_end])
        if _param(disposition, "name") == "model" and _param(disposition, "filename") is None:
            value = body[head_end + 4:min(following, head_end + 4 + MAX_MODEL)]
            return value.decode("utf-8", "replace")
        at = following + 2
    return None


def query_model(target: str) -> str | None:
    """The first `model` of the request target's query (None: none)."""
    query = target.partition("?")[2]
    if not query:
        return None
    found = parse_qs(query, keep_blank_values=True).get("model")
    return found[0] if found else None


def _disposition(head: bytes) -> str:
    for line in head.decode("utf-8", "replace").split("\r\n"):
        name, _, value = line.partition(":")
        if name.strip().lower() == "content-disposition":
            return value
    return ""


def _param(header: str, name: str) -> str | None:
    from email.message import Message

    message = Message()
    message["content-type"] = header or "x/x"
    value = message.get_param(name, header="content-type")
    if isinstance(value, tuple):   # RFC 2231 form
        value = value[2]
    return value


_CHECKED = json.JSONDecoder(object_pairs_hook=_unique)
