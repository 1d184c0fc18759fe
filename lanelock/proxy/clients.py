"""Waits and classes per client, from the config file -- for the clients that cannot send a header
(the openai SDK's users, `llm`), which otherwise all get the proxy's --wait and --priority:

  [[proxy_clients]]
  program = "llm"            # the client's process, as ps names it (/proc/PID/comm), a glob
  wait = "30s"
  priority = "interactive"

  [[proxy_clients]]
  session = "cron-*"         # the request's session (header, body, or its process's), a glob
  wait = "5m"
  priority = "batch"
  max_priority = "batch"     # and what its own X-Lanelock-Priority may claim

Two keys, not one `match`: a session named like a program (a session "llm") must not catch the
program, nor the other way round, and a rule naming both matches a request that is both. The
first rule that matches applies; a request that matches none gets the proxy's own. A rule gives
the defaults of a request that sends no header (wait, priority) and may set its caps (max_wait,
max_priority); a header is still read and capped as ever (class_and_wait.py). A rule's wait
longer than --max-wait raises that client's cap to it, as --wait raises the proxy's.

The program is looked up only when a rule names one, and only for the request's loopback
client (client_process.py: the socket's owner in /proc), off the event loop.
"""

from __future__ import annotations

import asyncio
from fnmatch import fnmatchcase

from . import class_and_wait


class Rule:
    __slots__ = ("session", "program", "settings")

    def __init__(self, table: dict):
        self.session, self.program = table.get("session"), table.get("program")
        self.settings = {key: table[key] for key in ("wait", "priority", "max_wait",
                                                      "max_priority") if key in table}

    def matches(self, session: str, program) -> bool:
        """program: a callable giving the client's program name (None: not found)."""
        if self.session is not None and not fnmatchcase(session, self.session):
            return False
        if self.program is not None:
            name = program()
            return name is not None and fnmatchcase(name, self.program)
        return True


class Rules:
    def __init__(self, tables=None):
        self.rules = [Rule(table) for table in tables or () if isinstance(table, dict)]

    def __bool__(self) -> bool:
        return bool(self.rules)

    async def applied(self, options, headers, session: str, client,
                      asked: class_and_wait.Asked) -> class_and_wait.Asked:
        """The class and wait of a request of session from client (client_process.py), by the
        first rule that matches; asked (the proxy's own) when none does."""
        programs = []   # the client's program, looked up once, at the first rule that needs it

        async def program():
            if not programs:
                programs.append(await asyncio.to_thread(client.program))
            return programs[0]

        for rule in self.rules:
            name = await program() if rule.program is not None and (
                rule.session is None or fnmatchcase(session, rule.session)) else None
            if rule.matches(session, lambda: name):
                return self._asked(rule.settings, options, headers)
        return asked

    @staticmethod
    def _asked(rule: dict, options, headers) -> class_and_wait.Asked:
        wait = rule.get("wait", options.wait)
        most = class_and_wait.cap_of(wait, rule.get("max_wait", options.max_wait))
        return class_and_wait.read(headers, default_priority=rule.get("priority",
                                                                      options.priority),
                                   max_priority=rule.get("max_priority", options.max_priority),
                                   default_wait=wait, max_wait=most)
