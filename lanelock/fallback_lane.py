"""One rule for a fallback that names a local engine (`run -f '@HOST:PORT CMD'`, `proxy
--fallback @HOST:PORT`): which lane it runs on and when it is skipped, said in the same words by
`run` and by the proxy. Taking the lane is the caller's (a blocking turn, an asyncio one)."""

from __future__ import annotations


def fallback_gate(primary, backend: str, model: str | None = None) -> tuple:
    """(the Gate to take the fallback's turn on, or None: it runs ungated; why it is skipped, or
    None). primary: the busy lane's Gate. A fallback on the busy lane itself is skipped: it
    would deflect from the lane to the same lane."""
    from .errors import UsageProblem
    from .lanes import BackendError

    try:
        # The primary said already when lanes keyed by model had no model to key on.
        gate = primary.sibling(backend, model=model, no_model_said=True)
    except (BackendError, UsageProblem) as error:   # parsed already; a config chain may slip by
        return None, str(error)
    if not gate.gated:
        return None, None
    if gate.lock_path == primary.lock_path:
        return None, f"@{backend} is the busy lane itself"
    return gate, None


def busy_fallback(backend: str, holder: dict | None) -> str:
    """Why a fallback whose own local lane is busy is skipped."""
    from .holder import words

    return f"@{backend} is a busy local lane ({words(holder)})"
