"""A command line split into words the way bash quotes them, without running a shell.

A --fallback and a chain's `command` string come here. It reads everything shlex.split (POSIX)
read, the same way -- blanks separate words, '…' is literal, "…" lets a backslash escape only " and
\\, a bare backslash escapes any character -- and one thing shlex cannot: bash's ANSI-C quoting
$'…'. That is what bash's `printf %q` writes for any text with a newline, a tab or another control
character, so README's recipe `--fallback "llm $(printf %q "$PROMPT")"` hands us $'…' for most real
prompts, and shlex reads $'a\\nb' as "$a\\nb" and fails on $'it\\'s'.

Nothing is expanded ($VAR, globs, ~): the text is the words. A word is assembled as bytes and
decoded as argv is (os.fsdecode), so $'\\377' -- a byte that is not UTF-8, which `printf %q` writes
for one -- reaches the command byte-exact. Only `re`-free stdlib: this is on `run`'s path.
"""

from __future__ import annotations

import os

BLANKS = " \t\r\n"
# shlex.quote's safe characters: a word made only of these is shown bare.
SAFE = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_@%+=:,./-")
# $'…' escapes of one character -> the byte (bash's ansicstr(); \e and \E are ESC).
NAMED = {ord(k): v for k, v in {"a": 7, "b": 8, "e": 27, "E": 27, "f": 12, "n": 10, "r": 13,
                                "t": 9, "v": 11, "\\": 92, "'": 39, '"': 34, "?": 63}.items()}
SHOWN = {7: "a", 8: "b", 27: "E", 12: "f", 10: "n", 13: "r", 9: "t", 11: "v"}   # for quote()
OCTAL = b"01234567"
HEX = b"0123456789abcdefABCDEF"
BACKSLASH = 92


def split(text: str) -> list[str]:
    """The words of text. ValueError (shlex's messages) for an unclosed quote or a final \\."""
    words: list[str] = []
    parts: list | None = None   # the word being read: str and bytes pieces; None between words
    index, end = 0, len(text)
    while index < end:
        char = text[index]
        if char in BLANKS:
            if parts is not None:
                words.append(_word(parts))
                parts = None
            index += 1
            continue
        if parts is None:
            parts = []   # a word has begun, even if it turns out empty ('' is a word)
        if char == "\\":
            if index + 1 == end:
                raise ValueError("No escaped character")
            parts.append(text[index + 1])
            index += 2
        elif char == "'":
            close = text.find("'", index + 1)
            if close < 0:
                raise ValueError("No closing quotation")
            parts.append(text[index + 1:close])
            index = close + 1
        elif char == '"':
            index = _double_quoted(text, index + 1, parts)
        elif char == "$" and text.startswith("'", index + 1):
            index = _ansi_c_quoted(text, index + 2, parts)
        else:
            parts.append(char)
            index += 1
    if parts is not None:
        words.append(_word(parts))
    return words


def _word(parts: list) -> str:
    return os.fsdecode(b"".join(p if isinstance(p, bytes) else os.fsencode(p) for p in parts))


def _double_quoted(text: str, index: int, parts: list) -> int:
    """"…" from index (after the quote) as shlex reads it: \\" and \\\\ escape, any other backslash
    stays. Returns the index after the closing quote."""
    end = len(text)
    while index < end:
        char = text[index]
        if char == '"':
            return index + 1
        if char == "\\":
            if index + 1 == end:
                break
            following = text[index + 1]
            parts.append(following if following in '"\\' else char + following)
            index += 2
        else:
            parts.append(char)
            index += 1
    raise ValueError("No closing quotation")


def _ansi_c_quoted(text: str, index: int, parts: list) -> int:
    """$'…' from index (after $'): the body runs to the first quote no backslash escapes."""
    start, end = index, len(text)
    while True:
        quote_at = text.find("'", index)
        escape_at = text.find("\\", index, quote_at)
        if quote_at < 0:
            raise ValueError("No closing quotation")
        if escape_at < 0:
            index = quote_at
            break
        index = escape_at + 2   # \' and \\ do not end the body
    parts.append(ansi_c(os.fsencode(text[start:index])))
    return index + 1


def ansi_c(body: bytes) -> bytes:
    """The bytes bash makes of a $'…' body (lib/sh/strtrans.c ansicstr(), as the parser calls it,
    in a UTF-8 locale). An unknown escape stays as written (\\q is backslash, q)."""
    out = bytearray()
    index, end = 0, len(body)
    while index < end:
        escape_at = body.find(b"\\", index)
        if escape_at < 0 or escape_at + 1 == end:   # the rest is plain (a final \ is itself)
            out += body[index:]
            break
        out += body[index:escape_at]
        index = escape_at + 1
        kind = body[index]
        index += 1
        if kind in NAMED:
            out.append(NAMED[kind])
        elif kind in OCTAL:                        # \N, \NN, \NNN: the low 8 bits
            value, index = _digits(body, index, OCTAL, 2, kind - 48, 8)
            out.append(value & 0xFF)
        elif kind == ord("x"):                     # \xH, \xHH, and ksh's \x{H…}
            braced = body[index:index + 1] == b"{"
            value, after = _digits(body, index + braced, HEX, end if braced else 2, 0, 16)
            if braced:
                index = after + (body[after:after + 1] == b"}")
                out.append(value & 0xFF)
            elif after == index:                   # \x without a digit is itself
                out += b"\\x"
            else:
                index = after
                out.append(value & 0xFF)
        elif kind in b"uU":                        # \uHHHH, \UHHHHHHHH: a character, UTF-8
            value, after = _digits(body, index, HEX, 4 if kind == ord("u") else 8, 0, 16)
            if after == index:
                out += bytes((BACKSLASH, kind))
            else:
                index = after
                out += _utf8(value)
        elif kind == ord("c") and index < end:     # \cX: control-X; \c? is DEL; \c\\ is one \
            target = body[index]
            index += 1
            if target == BACKSLASH and body[index:index + 1] == b"\\":
                index += 1
            out.append(0x7F if target == ord("?") else target & 0x1F)
        else:
            out += bytes((BACKSLASH, kind))
    # bash's result is a C string: a NUL (\0, \x00, \c@) ends this quoted part there.
    return bytes(out).split(b"\0", 1)[0]


def _digits(body: bytes, index: int, digits: bytes, most: int, value: int, base: int):
    """Up to `most` digits from index, accumulated onto value: (value, index after them)."""
    while most and index < len(body) and body[index] in digits:
        value = value * base + int(chr(body[index]), base)
        index += 1
        most -= 1
    return value, index


def _utf8(value: int) -> bytes:
    """A code point as glibc's wctomb() writes it in a UTF-8 locale: surrogates and values past
    U+10FFFF included (the original UTF-8's 5- and 6-byte forms), nothing past 0x7FFFFFFF."""
    if value < 0x80:
        return bytes((value,))
    if value > 0x7FFFFFFF:
        return b""
    follow = 1
    while value >= 1 << (5 * follow + 6):   # room in a lead byte and `follow` 6-bit bytes
        follow += 1
    lead = (0xFF00 >> (follow + 1)) & 0xFF | value >> (6 * follow)
    return bytes([lead] + [0x80 | (value >> (6 * shift)) & 0x3F for shift in range(follow - 1, -1, -1)])


def quote(word: str) -> str:
    """One word as split() reads it back, on one printable line: bare when safe, '…' when
    printable, else $'…' with escapes (a prompt's newline must not break lanelock's one line)."""
    if not word:
        return "''"
    if all(char in SAFE for char in word):
        return word
    if word.isprintable():
        return "'" + word.replace("'", "'\"'\"'") + "'"
    return "$'" + "".join(_escaped(char) for char in word) + "'"


def _escaped(char: str) -> str:
    if char in "\\'":
        return "\\" + char
    if char.isprintable():
        return char
    if len(encoded := os.fsencode(char)) == 1 and encoded[0] in SHOWN:
        return "\\" + SHOWN[encoded[0]]
    return "".join(f"\\{byte:03o}" for byte in encoded)


def join(argv) -> str:
    return " ".join(quote(word) for word in argv)
